//! Prompt instructions generated from the block schemas: what an agent puts in its system prompt
//! so that the model writes blocks the service can type.
//!
//! Owns the wording and the YAML example generated from a message's fields, types and `.proto`
//! comments. It does not know how the text is delivered (the `prompt` command, a NATS request
//! subject) or how payloads are converted; but every example it writes converts with
//! [`super::BlockType::convert`] (a test checks this for the built-ins).
//!
//! # The example
//! Every field appears once, in declaration order, with the comment written above it in the
//! `.proto` as YAML `#` lines, and a placeholder of its type:
//! * strings `"<field_name>"`, numbers `0` or `0.0`, booleans `false`, bytes `""` (base64);
//! * enums the first declared value that is not `*_UNSPECIFIED`, with the declared names listed
//!   in a trailing comment;
//! * repeated fields a one-element list, maps a one-entry mapping, messages expanded in place;
//! * of a oneof only the first member, after the oneof's comment and one naming the others;
//! * well-known types their proto3 JSON form (`"2024-01-31T12:00:00Z"` for a timestamp, ...); a
//!   `google.protobuf.Any` field is left out, with a comment;
//! * a message already being expanded (a recursive type), or one nested deeper than
//!   [`MAX_EXAMPLE_DEPTH`], as `{}`.
//!
//! The output depends only on the schemas and the tags asked for, so it is deterministic.

use std::fmt::Write as _;

use prost_reflect::{FieldDescriptor, Kind, MessageDescriptor};

use super::{comments, BlockType, SchemaError, SchemaRegistry};

/// Messages nested deeper than this in an example are written as `{}`.
pub const MAX_EXAMPLE_DEPTH: usize = 16;

/// Renders the instructions for the block types `tags`, in the order given (duplicates once), or
/// for every registered type, sorted by tag, when `tags` is empty.
///
/// The text is Markdown: a short introduction, the rules every block follows (exact close tag,
/// one fenced YAML payload per block, no nesting), and for each type its description (the
/// message's `.proto` comment), its open and close tags, and a complete example block.
pub fn render_prompt(registry: &SchemaRegistry, tags: &[String]) -> Result<String, SchemaError> {
    let mut selected: Vec<&BlockType> = Vec::new();
    if tags.is_empty() {
        selected.extend(registry.block_types());
    }
    for tag in tags {
        let block = registry.block_type(tag).ok_or_else(|| SchemaError::UnknownTag {
            tag: tag.clone(),
            known: registry.tags().map(str::to_owned).collect(),
        })?;
        if !selected.iter().any(|b| b.tag() == block.tag()) {
            selected.push(block);
        }
    }

    let example_close = selected.first().map_or("</package:type:version>".to_owned(), |b| close_tag(b.tag()));
    let mut out = String::new();
    out.push_str("# Structured blocks\n\n");
    out.push_str(
        "Part of what you write is read by a program. When a situation described below applies, write the \
         block for it: the open tag, one fenced YAML payload, and the close tag, each on its own line. The \
         user does not see blocks; text outside them is shown as usual.\n\n",
    );
    out.push_str("Rules for every block:\n");
    let _ = writeln!(
        out,
        "- End the block with its exact close tag, such as `{example_close}`: same spelling, never omitted."
    );
    out.push_str("- Put exactly one fenced YAML payload (```yaml ... ```) inside the block, and nothing else.\n");
    out.push_str("- Do not nest blocks: close one block before opening another.\n");
    out.push_str(
        "- Use only the fields shown. Replace every placeholder with a real value, leave out a field you have \
         no value for, and write enum fields as one of the listed names.\n",
    );
    for block in selected {
        out.push('\n');
        out.push_str(&render_block(block));
    }
    Ok(out)
}

/// The section of one block type: heading, description, tags and example block.
pub fn render_block(block: &BlockType) -> String {
    let tag = block.tag();
    let desc = block.descriptor();
    let mut out = format!("## Block `{tag}`\n\n");
    if let Some(comment) = comments::comment(&desc.parent_file(), desc.path()) {
        out.push_str(&comment);
        out.push_str("\n\n");
    }
    let _ = writeln!(out, "Open tag: `<{tag}>`");
    let _ = writeln!(out, "Close tag: `{}`\n", close_tag(tag));
    out.push_str("Example:\n\n");
    let _ = writeln!(out, "<{tag}>\n```yaml");
    out.push_str(&example_yaml(block));
    let _ = writeln!(out, "```\n{}", close_tag(tag));
    out
}

/// The example payload of `block` (the module doc, "The example"), as YAML lines without the
/// fence.
pub fn example_yaml(block: &BlockType) -> String {
    let mut example = Example { expanding: vec![block.descriptor().full_name().to_owned()] };
    let lines = example.message(block.descriptor(), 0);
    if lines.is_empty() {
        return "{}\n".to_owned();
    }
    lines.into_iter().map(|l| l + "\n").collect()
}

fn close_tag(tag: &str) -> String {
    format!("</{tag}>")
}

/// The state of one example: the messages being expanded, to stop at recursive types.
struct Example {
    expanding: Vec<String>,
}

impl Example {
    /// The lines of `desc`'s fields at `indent` spaces.
    fn message(&mut self, desc: &MessageDescriptor, indent: usize) -> Vec<String> {
        let pad = " ".repeat(indent);
        let file = desc.parent_file();
        let mut lines = Vec::new();
        for proto in &desc.descriptor_proto().field {
            let Some(field) = desc.get_field(u32::try_from(proto.number()).unwrap_or(0)) else {
                continue;
            };
            let oneof = field.containing_oneof().filter(|o| !o.is_synthetic());
            if let Some(oneof) = &oneof {
                let mut members = oneof.fields();
                if members.next().is_some_and(|first| first.number() != field.number()) {
                    continue;
                }
                if let Some(comment) = comments::comment(&file, oneof.path()) {
                    lines.extend(comment_lines(&pad, &comment));
                }
                let others: Vec<String> = members.map(|f| format!("`{}`", f.name())).collect();
                if !others.is_empty() {
                    lines.push(format!("{pad}# Give only one of: `{}`, {}.", field.name(), others.join(", ")));
                }
            }
            if let Some(comment) = comments::comment(&file, field.path()) {
                lines.extend(comment_lines(&pad, &comment));
            }
            self.field(&field, indent, &mut lines);
        }
        lines
    }

    /// The lines of one field (its comment already written).
    fn field(&mut self, field: &FieldDescriptor, indent: usize, lines: &mut Vec<String>) {
        let pad = " ".repeat(indent);
        let name = field.name();
        let kind = field.kind();
        // Any of a map too: `{}` would not convert, and an example type would be made up.
        let any_values = match &kind {
            Kind::Message(entry) if field.is_map() => is_any(&entry.map_entry_value_field().kind()),
            _ => is_any(&kind),
        };
        if any_values {
            lines.push(format!(
                "{pad}# `{name}` (any message, as {{\"@type\": \"type.googleapis.com/<message>\", ...}}) is left out of this example."
            ));
            return;
        }
        if field.is_map() {
            let Kind::Message(entry) = &kind else { return };
            let key = map_key_placeholder(&entry.map_entry_key_field().kind());
            lines.push(format!("{pad}{name}:"));
            self.value(&key, &entry.map_entry_value_field().kind(), "value", indent + 2, lines);
            return;
        }
        if field.is_list() {
            lines.push(format!("{pad}{name}:"));
            self.list_item(&kind, name, indent + 2, lines);
            return;
        }
        self.value(name, &kind, name, indent, lines);
    }

    /// `key: <placeholder>` at `indent`, or `key:` and the message's fields below it.
    fn value(&mut self, key: &str, kind: &Kind, label: &str, indent: usize, lines: &mut Vec<String>) {
        let pad = " ".repeat(indent);
        match self.nested(kind, indent + 2) {
            Some(nested) => {
                lines.push(format!("{pad}{key}:"));
                lines.extend(nested);
            }
            None => lines.push(format!("{pad}{key}: {}", placeholder(kind, label))),
        }
    }

    /// One list element `- ...` at `indent`.
    fn list_item(&mut self, kind: &Kind, label: &str, indent: usize, lines: &mut Vec<String>) {
        let pad = " ".repeat(indent);
        let Some(mut nested) = self.nested(kind, indent + 2) else {
            lines.push(format!("{pad}- {}", placeholder(kind, label)));
            return;
        };
        // The first key line carries the dash; comments above it move out to the dash's column.
        let first = nested.iter().position(|l| !l.trim_start().starts_with('#'));
        let comments_end = first.unwrap_or(nested.len());
        for line in &mut nested[..comments_end] {
            *line = format!("{pad}{}", line.trim_start());
        }
        match first {
            Some(first) => nested[first] = format!("{pad}- {}", &nested[first][indent + 2..]),
            // Only comments (fields left out of the example): an empty element.
            None => nested.push(format!("{pad}- {{}}")),
        }
        lines.extend(nested);
    }

    /// The expanded fields of a message kind, when it is expanded (not a scalar, not a
    /// well-known type, not recursive, not too deep, not empty).
    fn nested(&mut self, kind: &Kind, indent: usize) -> Option<Vec<String>> {
        let Kind::Message(desc) = kind else { return None };
        if well_known(desc).is_some()
            || self.expanding.len() >= MAX_EXAMPLE_DEPTH
            || self.expanding.iter().any(|n| n == desc.full_name())
        {
            return None;
        }
        self.expanding.push(desc.full_name().to_owned());
        let lines = self.message(desc, indent);
        self.expanding.pop();
        (!lines.is_empty()).then_some(lines)
    }
}

/// `# ` lines of a `.proto` comment at `pad`.
fn comment_lines<'a>(pad: &'a str, comment: &'a str) -> impl Iterator<Item = String> + 'a {
    comment.lines().map(move |l| if l.is_empty() { format!("{pad}#") } else { format!("{pad}# {l}") })
}

/// The placeholder of a value that is not expanded, with its trailing comment when the type
/// needs one.
fn placeholder(kind: &Kind, label: &str) -> String {
    match kind {
        Kind::String => format!("\"<{label}>\""),
        Kind::Bytes => "\"\"  # base64".to_owned(),
        Kind::Bool => "false".to_owned(),
        Kind::Float | Kind::Double => "0.0".to_owned(),
        Kind::Enum(desc) => {
            let names: Vec<String> = desc.values().map(|v| v.name().to_owned()).collect();
            let chosen = desc.values().find(|v| !v.name().ends_with("_UNSPECIFIED")).or_else(|| desc.values().next());
            let chosen = chosen.map(|v| yaml_plain(v.name())).unwrap_or_else(|| "0".to_owned());
            format!("{chosen}  # one of: {}", names.join(", "))
        }
        Kind::Message(desc) => match well_known(desc) {
            Some(text) => text.replace("<label>", label),
            // Recursive, too deep or without fields.
            None => format!("{{}}  # a {}", desc.name()),
        },
        _ => "0".to_owned(),
    }
}

/// The placeholder of a well-known type (`<label>` stands for the field's name); `None` for any
/// other message.
fn well_known(desc: &MessageDescriptor) -> Option<&'static str> {
    Some(match desc.full_name().strip_prefix("google.protobuf.")? {
        "Timestamp" => "\"2024-01-31T12:00:00Z\"  # RFC 3339 timestamp",
        "Duration" => "\"1.5s\"  # duration in seconds",
        "FieldMask" => "\"\"  # comma-separated field paths",
        "Struct" => "{}  # any mapping",
        "ListValue" => "[]  # any list",
        "Value" => "\"<label>\"  # any value",
        "Empty" => "{}",
        "StringValue" => "\"<label>\"",
        "BytesValue" => "\"\"  # base64",
        "BoolValue" => "false",
        "DoubleValue" | "FloatValue" => "0.0",
        "Int32Value" | "Int64Value" | "UInt32Value" | "UInt64Value" => "0",
        "Any" => "{}",
        _ => return None,
    })
}

fn is_any(kind: &Kind) -> bool {
    matches!(kind, Kind::Message(m) if m.full_name() == "google.protobuf.Any")
}

/// A map key placeholder, quoted: YAML keys that look like numbers or booleans must reach the
/// converter as strings.
fn map_key_placeholder(kind: &Kind) -> String {
    match kind {
        Kind::String => "\"<key>\"".to_owned(),
        Kind::Bool => "\"true\"".to_owned(),
        _ => "\"0\"".to_owned(),
    }
}

/// `name` as a plain YAML scalar, or quoted when YAML would read it as something else.
fn yaml_plain(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    let ambiguous = matches!(lower.as_str(), "true" | "false" | "null" | "yes" | "no" | "on" | "off" | "y" | "n" | "~")
        || name.parse::<f64>().is_ok();
    if ambiguous {
        format!("\"{name}\"")
    } else {
        name.to_owned()
    }
}
