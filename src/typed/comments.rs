//! Lookups in a file's `SourceCodeInfo`: the comments written above a declaration and the line it
//! starts on.
//!
//! Owns only the reading of source locations that protox records while compiling; it does not
//! know what the comments are used for (prompt text) or which declarations matter.

use prost_reflect::FileDescriptor;
use prost_types::source_code_info::Location;

/// The location recorded for the declaration at `path` (see `Location::path`) in `file`.
fn location<'a>(file: &'a FileDescriptor, path: &[i32]) -> Option<&'a Location> {
    file.file_descriptor_proto().source_code_info.as_ref()?.location.iter().find(|l| l.path == path)
}

/// The comment of the declaration at `path`: its leading comment (the `//` or `/* */` lines
/// directly above it), else its trailing comment (on the same line or the line below). Each line
/// is trimmed, surrounding blank lines are dropped; `None` when there is no comment.
pub(crate) fn comment(file: &FileDescriptor, path: &[i32]) -> Option<String> {
    let location = location(file, path)?;
    let raw = location
        .leading_comments
        .as_deref()
        .filter(|c| !c.trim().is_empty())
        .or(location.trailing_comments.as_deref())?;
    let lines: Vec<&str> = raw.lines().map(str::trim).collect();
    let start = lines.iter().position(|l| !l.is_empty())?;
    let end = lines.iter().rposition(|l| !l.is_empty())? + 1;
    Some(lines[start..end].join("\n"))
}

/// The 1-based line on which the declaration at `path` starts.
pub(crate) fn line(file: &FileDescriptor, path: &[i32]) -> Option<usize> {
    let start = *location(file, path)?.span.first()?;
    usize::try_from(start).ok().map(|l| l + 1)
}
