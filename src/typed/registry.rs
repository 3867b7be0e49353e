//! The schema registry: compiles the built-in and the user's `.proto` files and registers every
//! message that declares a block with `option (structuredsink.v1.block)`.
//!
//! Owns file discovery, in-process compilation (protox, no `protoc`), tag and subject
//! validation, and the schema errors that stop start-up. It does not know how payloads are
//! parsed, converted (that is [`super::BlockType`]) or published, nor how prompts are worded.
//!
//! # Loading
//! 1. The embedded sources of [`super::builtin::SOURCES`] are compiled first; they can be
//!    imported by their names (`import "structuredsink/v1/options.proto";`).
//! 2. Every file ending in `.proto` under each configured directory, recursively, in sorted
//!    order, directory by directory. Each directory is also an include path, so files import one
//!    another by their path relative to it. Symbolic links to files are followed, links to
//!    directories are not (no cycles). At most [`MAX_PROTO_FILES`] files are loaded.
//! 3. A user file with the same relative name as a built-in (a vendored copy of
//!    `structuredsink/v1/options.proto`, say) is skipped when its content is identical, and is an
//!    error otherwise: the built-in copy is the one the service uses.
//!
//! The well-known types (`google/protobuf/*.proto`) are always available. Comments are kept
//! (source info) for the prompt text.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, ExtensionDescriptor, MessageDescriptor, Value};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver, IncludeFileResolver};

use super::{builtin, comments, BlockType};

/// At most this many `.proto` files are loaded from the configured directories together; a
/// directory with more (a misconfigured `/`, say) is a [`SchemaError::TooManyFiles`].
pub const MAX_PROTO_FILES: usize = 10_000;

/// Why the block schemas could not be loaded, or a prompt not rendered. Loading errors stop
/// start-up; each names the file and, where it has one, the line.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// A configured directory or a file in it could not be read.
    #[error("reading {}: {source}", path.display())]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The compiler rejected a file: a syntax error, an unresolved type or import, a duplicate
    /// name. The message starts with `path:line:column:` when the compiler knows the position.
    #[error("{message}")]
    Compile {
        /// The file at fault, when the compiler names one.
        file: Option<PathBuf>,
        /// `path:line:column: problem`.
        message: String,
    },
    /// A user file has the name of a built-in file but different content.
    #[error("{}: has the name of the built-in {name} but different content; remove it (the built-in is always loaded)", path.display())]
    ShadowsBuiltin {
        /// The user's file.
        path: PathBuf,
        /// The built-in file's name.
        name: String,
    },
    /// More than [`MAX_PROTO_FILES`] files under the configured directories.
    #[error("more than {MAX_PROTO_FILES} .proto files under {}", dir.display())]
    TooManyFiles {
        /// The directory being walked when the limit was reached.
        dir: PathBuf,
    },
    /// A block option's tag is not `package:type:version`.
    #[error("{location}: message {message}: block tag {tag:?} must be package:type:version, three non-empty parts of [A-Za-z0-9_.-]")]
    InvalidTag {
        /// `path:line` of the message.
        location: String,
        /// The message's full name.
        message: String,
        /// The tag as written.
        tag: String,
    },
    /// A block option's subject is not a literal NATS subject.
    #[error("{location}: message {message}: block subject {subject:?} must be dot-separated non-empty tokens without spaces or wildcards")]
    InvalidSubject {
        /// `path:line` of the message.
        location: String,
        /// The message's full name.
        message: String,
        /// The subject as written.
        subject: String,
    },
    /// Two messages declare the same tag.
    #[error("block tag {tag:?} is declared twice: by {first} and by {second}")]
    DuplicateTag {
        /// The tag.
        tag: String,
        /// `full.Name (path:line)` of the first declaration.
        first: String,
        /// `full.Name (path:line)` of the second declaration.
        second: String,
    },
    /// A prompt was asked for a tag no block type declares.
    #[error("unknown block tag {tag:?}; registered: {}", known.join(", "))]
    UnknownTag {
        /// The tag asked for.
        tag: String,
        /// Every registered tag.
        known: Vec<String>,
    },
}

/// Every registered block type, by tag, and the descriptor pool that defines them.
///
/// Cheap to clone (descriptors are reference-counted) and `Send + Sync`, so one registry can be
/// shared by every shard.
#[derive(Debug, Clone)]
pub struct SchemaRegistry {
    pool: DescriptorPool,
    types: BTreeMap<String, BlockType>,
}

impl SchemaRegistry {
    /// Compiles the built-in schemas and every `.proto` file under `dirs` (module doc,
    /// "Loading"), and registers every message with a `(structuredsink.v1.block)` option.
    pub fn load(dirs: &[PathBuf]) -> Result<SchemaRegistry, SchemaError> {
        let files = discover(dirs)?;
        let mut resolver = ChainFileResolver::new();
        resolver.add(BuiltinResolver);
        for dir in dirs {
            resolver.add(IncludeFileResolver::new(dir.clone()));
        }
        resolver.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        // The pool keeps every file's source info (comments, lines) whatever these say; they only
        // shape `file_descriptor_set()`, which is not used here.
        compiler.include_imports(true).include_source_info(true);

        // Proto name (as imported) -> path on disk, to name files in errors.
        let mut paths: HashMap<String, PathBuf> = HashMap::new();
        for (name, path) in &files {
            paths.entry(name.clone()).or_insert_with(|| path.clone());
        }
        let to_schema_error = |err: protox::Error| compile_error(&err, &paths);
        for (name, _) in builtin::SOURCES {
            compiler.open_file(name).map_err(to_schema_error)?;
        }
        for (_, path) in &files {
            compiler.open_file(path).map_err(to_schema_error)?;
        }
        let pool = compiler.descriptor_pool();
        let types = register(&pool, &paths)?;
        Ok(SchemaRegistry { pool, types })
    }

    /// The built-in block types only (no directories). Compiled once per process; the built-in
    /// sources are also compiled by `build.rs`, so this cannot fail in a binary that built.
    pub fn builtin() -> SchemaRegistry {
        static BUILTIN: OnceLock<SchemaRegistry> = OnceLock::new();
        BUILTIN.get_or_init(|| SchemaRegistry::load(&[]).expect("the built-in schemas compile")).clone()
    }

    /// Sets the nesting limit of every block type's conversions (`schemas.max_depth`).
    pub fn with_max_depth(mut self, depth: usize) -> Self {
        for block in self.types.values_mut() {
            block.set_max_depth(depth);
        }
        self
    }

    /// The block type declared for `tag`, if any.
    pub fn block_type(&self, tag: &str) -> Option<&BlockType> {
        self.types.get(tag)
    }

    /// Every registered tag, in sorted order.
    pub fn tags(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.types.keys().map(String::as_str)
    }

    /// Every registered block type, sorted by tag.
    pub fn block_types(&self) -> impl ExactSizeIterator<Item = &BlockType> + '_ {
        self.types.values()
    }

    /// The pool of every compiled file, for resolving `Any` type URLs (proto3 JSON output).
    pub fn descriptor_pool(&self) -> &DescriptorPool {
        &self.pool
    }
}

/// Serves the embedded built-in sources by name.
struct BuiltinResolver;

impl FileResolver for BuiltinResolver {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        match builtin::source(name) {
            Some(text) => File::from_source(name, text),
            None => Err(protox::Error::file_not_found(name)),
        }
    }
}

/// Finds the user's files: `(name relative to its include directory, path)`, in load order.
fn discover(dirs: &[PathBuf]) -> Result<Vec<(String, PathBuf)>, SchemaError> {
    let mut found = Vec::new();
    for dir in dirs {
        walk(dir, dir, &mut found)?;
    }
    let mut files = Vec::with_capacity(found.len());
    for path in found {
        // protox names a file after the first include directory that contains it; so do we.
        let Some(name) = dirs.iter().find_map(|d| relative_name(d, &path)) else {
            continue;
        };
        if let Some(builtin) = builtin::source(&name) {
            let text =
                std::fs::read_to_string(&path).map_err(|source| SchemaError::Io { path: path.clone(), source })?;
            if text == builtin {
                continue;
            }
            return Err(SchemaError::ShadowsBuiltin { path, name });
        }
        files.push((name, path));
    }
    Ok(files)
}

/// Collects the `.proto` files under `dir` (recursively, sorted) into `out`.
fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), SchemaError> {
    let io_error = |source| SchemaError::Io { path: dir.to_owned(), source };
    let mut entries = std::fs::read_dir(dir)
        .map_err(io_error)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(io_error)?;
    entries.sort();
    for path in entries {
        // `symlink_metadata` does not follow links: a linked directory is skipped, a linked
        // file is followed below.
        let meta = std::fs::symlink_metadata(&path).map_err(|source| SchemaError::Io { path: path.clone(), source })?;
        if meta.is_dir() {
            walk(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") && path.is_file() {
            if out.len() == MAX_PROTO_FILES {
                return Err(SchemaError::TooManyFiles { dir: root.to_owned() });
            }
            out.push(path);
        }
    }
    Ok(())
}

/// `path` relative to `dir`, with `/` separators, as protox names files; `None` when `path` is
/// not under `dir`.
fn relative_name(dir: &Path, path: &Path) -> Option<String> {
    let relative = path.strip_prefix(dir).ok()?;
    let parts = relative.components().map(|c| c.as_os_str().to_str()).collect::<Option<Vec<_>>>()?;
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Renders a protox error as `path:line:column: problem`, with the file's path on disk in place
/// of its proto name when it is a user file.
fn compile_error(err: &protox::Error, paths: &HashMap<String, PathBuf>) -> SchemaError {
    // protox's `Debug` is `name:line:column: problem` (its `Display` has no position).
    let mut message = format!("{err:?}");
    let file = err.file().map(|name| match paths.get(name) {
        Some(path) => {
            if let Some(rest) = message.strip_prefix(name) {
                message = format!("{}{rest}", path.display());
            }
            path.clone()
        }
        None => PathBuf::from(name),
    });
    SchemaError::Compile { file, message }
}

/// Finds the messages with a block option and validates their tags and subjects.
fn register(
    pool: &DescriptorPool,
    paths: &HashMap<String, PathBuf>,
) -> Result<BTreeMap<String, BlockType>, SchemaError> {
    let extension = pool.get_extension_by_name(builtin::BLOCK_OPTION).expect("the options file is always compiled");
    let mut types: BTreeMap<String, BlockType> = BTreeMap::new();
    for message in pool.all_messages() {
        let Some((tag, subject)) = block_option(&message, &extension) else {
            continue;
        };
        let location = || declared_at(&message, paths);
        if !is_valid_tag(&tag) {
            return Err(SchemaError::InvalidTag { location: location(), message: message.full_name().to_owned(), tag });
        }
        if !subject.is_empty() && !is_valid_subject(&subject) {
            return Err(SchemaError::InvalidSubject {
                location: location(),
                message: message.full_name().to_owned(),
                subject,
            });
        }
        if let Some(first) = types.get(&tag) {
            return Err(SchemaError::DuplicateTag {
                first: format!("{} ({})", first.descriptor().full_name(), declared_at(first.descriptor(), paths)),
                second: format!("{} ({})", message.full_name(), location()),
                tag,
            });
        }
        let subject = (!subject.is_empty()).then_some(subject);
        types.insert(tag.clone(), BlockType::new(tag, message, subject));
    }
    Ok(types)
}

/// The `(tag, subject)` of `message`'s block option, if it has one.
fn block_option(message: &MessageDescriptor, extension: &ExtensionDescriptor) -> Option<(String, String)> {
    let options = message.options();
    if !options.has_extension(extension) {
        return None;
    }
    let value = options.get_extension(extension);
    let Value::Message(block) = value.as_ref() else {
        return None;
    };
    let text =
        |name: &str| block.get_field_by_name(name).and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    Some((text("tag"), text("subject")))
}

/// `path:line` of a message's declaration (`built-in <name>:line` for the built-ins).
fn declared_at(message: &MessageDescriptor, paths: &HashMap<String, PathBuf>) -> String {
    let file = message.parent_file();
    let name = file.name();
    let shown = paths.get(name).map_or_else(|| format!("built-in {name}"), |p| p.display().to_string());
    match comments::line(&file, message.path()) {
        Some(line) => format!("{shown}:{line}"),
        None => shown,
    }
}

/// `package:type:version`: three non-empty parts of `[A-Za-z0-9_.-]` (the pipeline's rule).
fn is_valid_tag(tag: &str) -> bool {
    let parts: Vec<&str> = tag.split(':').collect();
    parts.len() == 3
        && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)))
}

/// A literal NATS subject: non-empty `.`-separated tokens, no whitespace, no `*` or `>`.
fn is_valid_subject(subject: &str) -> bool {
    subject.split('.').all(|t| !t.is_empty() && !t.bytes().any(|b| b.is_ascii_whitespace() || b == b'*' || b == b'>'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_subjects_are_validated() {
        assert!(is_valid_tag("myapp:ModeSwitch:v1"));
        assert!(is_valid_tag("a.b:c-d:v1.2"));
        assert!(!is_valid_tag("myapp:ModeSwitch"));
        assert!(!is_valid_tag("a::v1"));
        assert!(!is_valid_tag("a:b:c:d"));
        assert!(!is_valid_tag("a b:c:d"));
        assert!(is_valid_subject("app.mode"));
        assert!(!is_valid_subject("app..mode"));
        assert!(!is_valid_subject("app.*"));
        assert!(!is_valid_subject("app.>"));
        assert!(!is_valid_subject("app mode"));
    }

    #[test]
    fn relative_names_use_slashes() {
        assert_eq!(relative_name(Path::new("/a"), Path::new("/a/b/c.proto")).as_deref(), Some("b/c.proto"));
        assert_eq!(relative_name(Path::new("/a"), Path::new("/x/c.proto")), None);
    }
}
