//! Conversion of a parsed payload ([`serde_json::Value`], from YAML or JSON) into a protobuf
//! message of a declared block type ([`prost_reflect::DynamicMessage`]).
//!
//! Owns the mapping rules and the conversion error. It does not know where the value came from
//! (fences, YAML repair, partial JSON), how block types are found, or how results are published.
//!
//! # Rules
//! The mapping follows proto3 JSON, with a few allowances for what YAML and models produce:
//! * **Field names**: the name as declared (`new_mode`) or its lowerCamelCase JSON name
//!   (`newMode`). Giving the same field under both names is an error. An unknown name is an error.
//! * **`null`** leaves a field unset (as in proto3 JSON), except for a singular
//!   `google.protobuf.Value` field, where it is the null value (a list or map of them is left
//!   unset, like any other). A `null` inside a list or as a map value is an error, except where
//!   the items are `google.protobuf.Value`s.
//! * **Integers** (`int32`, `uint64`, `sint32`, `fixed64`, ...): a number without a fractional
//!   part (`3` or `3.0`) or a string holding a decimal integer (`"3"`, as proto3 JSON allows for
//!   64-bit values). Fractions and values outside the field's range are errors.
//! * **Floats** (`float`, `double`): a number, a numeric string, or `"NaN"`, `"Infinity"`,
//!   `"-Infinity"`. A finite value beyond `float`'s range is an error, and so is a numeric string
//!   beyond `double`'s (`"1e400"`, which a YAML payload keeps as a string): only those names
//!   stand for infinity.
//! * **Strings**: a string. A number or a boolean is also accepted and written in its JSON form,
//!   because YAML types an unquoted `1984` or `true` as a number or a boolean.
//! * **Booleans**: `true` or `false` only.
//! * **Bytes**: a base64 string, standard or URL-safe alphabet, padding optional.
//! * **Enums**: a value name exactly as declared (case-sensitive), or the number of a declared
//!   value.
//! * **Repeated fields**: a list. **Maps**: a mapping; keys are converted to the key type (`"7"`
//!   for an integer key, `"true"` for a boolean key).
//! * **Messages**: a mapping, converted recursively, at most `max_depth` messages deep (default
//!   [`MAX_NESTING_DEPTH`], configured by `schemas.max_depth`).
//! * **Oneofs**: at most one member may be given.
//! * **Well-known types**: wrappers (`google.protobuf.Int32Value`, ...) take the plain scalar;
//!   `Timestamp`, `Duration`, `FieldMask`, `Struct`, `Value`, `ListValue`, `Empty` and `Any` take
//!   their proto3 JSON form.
//!
//! # Errors
//! A [`ConversionError`] names the field path (`citations[0].year`) and the problem. It quotes
//! at most [`QUOTE_LIMIT`] characters of any value or key from the payload, so error text never
//! carries payload text beyond that.
//!
//! # Partial conversion
//! For live snapshots, [`BlockType::convert_partial`](super::BlockType::convert_partial) applies
//! the same rules but drops what does not convert instead of failing: a field whose value does
//! not convert (or whose name is unknown) is left unset, a list element or map entry that does
//! not convert is left out, a nested message keeps the fields that do convert, the second member
//! of a oneof and the second spelling of a field are ignored (in the parsed mapping's key order,
//! which is sorted: serde_json's maps keep keys sorted, not as written; a key written twice has
//! already kept its last value),
//! and messages beyond the depth limit are left unset. Only a root value that is not
//! a mapping (or `null`) gives no message.

use std::collections::HashMap;
use std::fmt::{self, Write as _};

use prost_reflect::{DynamicMessage, FieldDescriptor, Kind, MapKey, MessageDescriptor, ReflectMessage, Value};
use serde_json::Value as Json;

/// How deep messages may nest in a converted payload by default (`schemas.max_depth`); the root message is at depth 1. Deeper
/// input is rejected (or, in a partial conversion, left out) so that a hostile payload against a
/// recursive message type cannot recurse without bound.
pub const MAX_NESTING_DEPTH: usize = 64;

/// At most this many characters of a payload value or key are quoted in an error.
pub const QUOTE_LIMIT: usize = 32;

/// At most this many names are listed when an error suggests the expected field or enum names.
const SUGGESTION_LIMIT: usize = 12;

/// What went wrong, by category; [`ConversionError`]'s text has the details.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConversionErrorKind {
    /// A key names no field of the message.
    UnknownField,
    /// The value has the wrong JSON type for the field (a string for an integer, a list for a
    /// message, `null` in a list, a fraction for an integer, bad base64, ...).
    WrongType,
    /// A number that does not fit the field's type.
    OutOfRange,
    /// An enum value name or number the enum does not declare.
    BadEnumValue,
    /// Two members of one oneof, or one field under both of its names.
    Conflict,
    /// Messages nested deeper than the limit ([`MAX_NESTING_DEPTH`] unless configured).
    TooDeep,
}

/// A payload that does not fit its block type: the field path and the problem.
///
/// Displays as `path: problem`, for example `citations[0].year: expected an integer, got string
/// "x"`; the root is shown as `payload`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", if path.is_empty() { "payload" } else { path.as_str() })]
pub struct ConversionError {
    path: String,
    kind: ConversionErrorKind,
    detail: String,
}

impl ConversionError {
    /// The field path, such as `citations[0].year` or `labels["k"]`; empty for the root.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The category of the problem.
    pub fn kind(&self) -> ConversionErrorKind {
        self.kind
    }

    /// The problem, without the path.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

/// Whether a conversion fails on the first problem or drops what does not convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The first problem is the result.
    Strict,
    /// Problems drop the offending field, element or entry (module doc, "Partial conversion").
    Partial,
}

/// Converts `value` into a message of type `desc` (the module doc has the rules).
pub(crate) fn convert(
    desc: &MessageDescriptor,
    value: &Json,
    mode: Mode,
    max_depth: usize,
) -> Result<DynamicMessage, ConversionError> {
    let mut converter = Converter { mode, max_depth, path: Vec::new() };
    converter.message(desc, value, 1)
}

/// One step of the path to the value being converted.
#[derive(Debug, Clone)]
enum Segment {
    /// A field, by its declared name.
    Field(String),
    /// A list element.
    Index(usize),
    /// A map entry, by its key as written (quoted and truncated when rendered).
    Key(String),
}

/// The state of one conversion: the mode and the path to the current value.
struct Converter {
    mode: Mode,
    /// Messages deeper than this fail ([`ConversionErrorKind::TooDeep`]).
    max_depth: usize,
    path: Vec<Segment>,
}

/// A problem found at the current path, before the path is attached.
#[derive(Debug)]
struct Problem {
    kind: ConversionErrorKind,
    detail: String,
}

impl Problem {
    fn new(kind: ConversionErrorKind, detail: impl Into<String>) -> Self {
        Problem { kind, detail: detail.into() }
    }

    fn wrong_type(expected: &str, got: &Json) -> Self {
        Problem::new(ConversionErrorKind::WrongType, format!("expected {expected}, got {}", Describe(got)))
    }
}

impl Converter {
    /// Attaches the current path to `problem`.
    fn error(&self, problem: Problem) -> ConversionError {
        ConversionError { path: render_path(&self.path), kind: problem.kind, detail: problem.detail }
    }

    fn partial(&self) -> bool {
        self.mode == Mode::Partial
    }

    /// Runs `f` with `segment` pushed on the path.
    fn at<T>(&mut self, segment: Segment, f: impl FnOnce(&mut Self) -> T) -> T {
        self.path.push(segment);
        let result = f(self);
        self.path.pop();
        result
    }

    fn message(
        &mut self,
        desc: &MessageDescriptor,
        value: &Json,
        depth: usize,
    ) -> Result<DynamicMessage, ConversionError> {
        if depth > self.max_depth {
            let limit = self.max_depth;
            return Err(self.error(Problem::new(
                ConversionErrorKind::TooDeep,
                format!("messages nested deeper than {limit} levels (this one is at depth {depth})"),
            )));
        }
        if let Some(result) = self.well_known(desc, value) {
            return result;
        }
        let Json::Object(object) = value else {
            return Err(self.error(Problem::wrong_type(&format!("a mapping ({})", desc.name()), value)));
        };
        let mut message = DynamicMessage::new(desc.clone());
        // Field number -> the key that set it; oneof name -> the member that set it.
        let mut set_by: HashMap<u32, &str> = HashMap::new();
        let mut oneof_set: HashMap<String, String> = HashMap::new();
        for (key, item) in object {
            let Some(field) = desc.get_field_by_name(key).or_else(|| desc.get_field_by_json_name(key)) else {
                if self.partial() {
                    continue;
                }
                let problem = Problem::new(
                    ConversionErrorKind::UnknownField,
                    format!("unknown field {} (expected one of: {})", Quoted(key), field_names(desc)),
                );
                return Err(self.error(problem));
            };
            if let Some(first) = set_by.get(&field.number()) {
                if self.partial() {
                    continue;
                }
                let problem = Problem::new(
                    ConversionErrorKind::Conflict,
                    format!("given twice, as {} and {}", Quoted(first), Quoted(key)),
                );
                return Err(self.at(Segment::Field(field.name().to_owned()), |c| c.error(problem)));
            }
            let oneof = field.containing_oneof().filter(|o| !o.is_synthetic());
            if let Some(oneof) = &oneof {
                if let Some(other) = oneof_set.get(oneof.name()) {
                    if self.partial() {
                        continue;
                    }
                    let problem = Problem::new(
                        ConversionErrorKind::Conflict,
                        format!(
                            "`{other}` and `{}` are both members of oneof `{}`; give only one",
                            field.name(),
                            oneof.name()
                        ),
                    );
                    return Err(self.at(Segment::Field(field.name().to_owned()), |c| c.error(problem)));
                }
            }
            let converted = self.at(Segment::Field(field.name().to_owned()), |c| c.field(&field, item, depth));
            match converted {
                Ok(Some(v)) => {
                    message.set_field(&field, v);
                    set_by.insert(field.number(), key);
                    if let Some(oneof) = oneof {
                        oneof_set.insert(oneof.name().to_owned(), field.name().to_owned());
                    }
                }
                Ok(None) => {}
                Err(_) if self.partial() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(message)
    }

    /// The value of one field; `None` for a `null` that leaves the field unset.
    fn field(&mut self, field: &FieldDescriptor, value: &Json, depth: usize) -> Result<Option<Value>, ConversionError> {
        // A `google.protobuf.Value` field takes `null` as a value; a list or map of them, like
        // any list or map, is left unset (empty) by it.
        if value.is_null() && (field.is_list() || field.is_map() || !is_value_message(&field.kind())) {
            return Ok(None);
        }
        if field.is_map() {
            return self.map(field, value, depth).map(Some);
        }
        if field.is_list() {
            let Json::Array(items) = value else {
                return Err(self.error(Problem::wrong_type("a list", value)));
            };
            let kind = field.kind();
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match self.at(Segment::Index(i), |c| c.single(&kind, item, depth)) {
                    Ok(v) => out.push(v),
                    Err(_) if self.partial() => {}
                    Err(e) => return Err(e),
                }
            }
            return Ok(Some(Value::List(out)));
        }
        self.single(&field.kind(), value, depth).map(Some)
    }

    fn map(&mut self, field: &FieldDescriptor, value: &Json, depth: usize) -> Result<Value, ConversionError> {
        let Json::Object(object) = value else {
            return Err(self.error(Problem::wrong_type("a mapping", value)));
        };
        let Kind::Message(entry) = field.kind() else {
            unreachable!("a map field's kind is its entry message");
        };
        let key_kind = entry.map_entry_key_field().kind();
        let value_kind = entry.map_entry_value_field().kind();
        let mut out = HashMap::with_capacity(object.len());
        for (key, item) in object {
            let converted = self.at(Segment::Key(key.clone()), |c| {
                let key = map_key(&key_kind, key).map_err(|p| c.error(p))?;
                let item = c.single(&value_kind, item, depth)?;
                Ok((key, item))
            });
            match converted {
                Ok((k, v)) => {
                    out.insert(k, v);
                }
                Err(_) if self.partial() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Value::Map(out))
    }

    /// One value of `kind`: a singular field, a list element or a map value.
    fn single(&mut self, kind: &Kind, value: &Json, depth: usize) -> Result<Value, ConversionError> {
        match kind {
            Kind::Message(desc) => self.message(desc, value, depth + 1).map(Value::Message),
            _ => scalar(kind, value).map_err(|p| self.error(p)),
        }
    }

    /// Well-known types with a proto3 JSON form of their own; `None` for any other message.
    fn well_known(
        &mut self,
        desc: &MessageDescriptor,
        value: &Json,
    ) -> Option<Result<DynamicMessage, ConversionError>> {
        let name = desc.full_name().strip_prefix("google.protobuf.")?;
        let hint = match name {
            "DoubleValue" | "FloatValue" | "Int64Value" | "UInt64Value" | "Int32Value" | "UInt32Value"
            | "BoolValue" | "StringValue" | "BytesValue" => {
                let inner = desc.get_field_by_name("value")?;
                return Some(scalar(&inner.kind(), value).map_err(|p| self.error(p)).map(|v| {
                    let mut message = DynamicMessage::new(desc.clone());
                    message.set_field(&inner, v);
                    message
                }));
            }
            "Timestamp" => "an RFC 3339 timestamp string such as \"2024-01-31T12:00:00Z\"",
            "Duration" => "a duration string such as \"1.5s\"",
            "FieldMask" => "a comma-separated string of field paths",
            "Struct" => "a mapping",
            "ListValue" => "a list",
            "Value" => "any value",
            "Empty" => "an empty mapping",
            "Any" => "a mapping with an \"@type\" key naming a known message",
            _ => return None,
        };
        Some(DynamicMessage::deserialize(desc.clone(), value).map_err(|_| self.error(Problem::wrong_type(hint, value))))
    }
}

/// Whether `kind` is `google.protobuf.Value`, the one message that takes `null` as a value.
fn is_value_message(kind: &Kind) -> bool {
    matches!(kind, Kind::Message(m) if m.full_name() == "google.protobuf.Value")
}

/// Converts a scalar or enum value.
fn scalar(kind: &Kind, value: &Json) -> Result<Value, Problem> {
    Ok(match kind {
        Kind::Double => Value::F64(float(value)?),
        Kind::Float => {
            let v = float(value)?;
            if v.is_finite() && v.abs() > f64::from(f32::MAX) {
                return Err(out_of_range(value, "float"));
            }
            // The range check above makes the narrowing exact up to rounding.
            Value::F32(v as f32)
        }
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            Value::I32(i32::try_from(integer(value)?).map_err(|_| out_of_range(value, "int32"))?)
        }
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
            Value::I64(i64::try_from(integer(value)?).map_err(|_| out_of_range(value, "int64"))?)
        }
        Kind::Uint32 | Kind::Fixed32 => {
            Value::U32(u32::try_from(integer(value)?).map_err(|_| out_of_range(value, "uint32"))?)
        }
        Kind::Uint64 | Kind::Fixed64 => {
            Value::U64(u64::try_from(integer(value)?).map_err(|_| out_of_range(value, "uint64"))?)
        }
        Kind::Bool => match value {
            Json::Bool(b) => Value::Bool(*b),
            other => return Err(Problem::wrong_type("a boolean", other)),
        },
        Kind::String => match value {
            Json::String(s) => Value::String(s.clone()),
            Json::Number(n) => Value::String(n.to_string()),
            Json::Bool(b) => Value::String(b.to_string()),
            other => return Err(Problem::wrong_type("a string", other)),
        },
        Kind::Bytes => match value {
            Json::String(s) => Value::Bytes(
                decode_base64(s)
                    .ok_or_else(|| {
                        Problem::new(
                            ConversionErrorKind::WrongType,
                            "expected base64 bytes, got a string that is not base64",
                        )
                    })?
                    .into(),
            ),
            other => return Err(Problem::wrong_type("base64 bytes (a string)", other)),
        },
        Kind::Enum(desc) => {
            let found = match value {
                Json::String(s) => desc.get_value_by_name(s),
                Json::Number(_) => i32::try_from(integer(value)?).ok().and_then(|n| desc.get_value(n)),
                other => return Err(Problem::wrong_type(&format!("a value of enum {}", desc.name()), other)),
            };
            let Some(found) = found else {
                let names: Vec<String> = desc.values().map(|v| v.name().to_owned()).collect();
                return Err(Problem::new(
                    ConversionErrorKind::BadEnumValue,
                    format!(
                        "{} is not a value of enum {} (expected one of: {})",
                        Describe(value),
                        desc.name(),
                        suggestions(names.iter().map(String::as_str))
                    ),
                ));
            };
            Value::EnumNumber(found.number())
        }
        Kind::Message(_) => unreachable!("messages are converted by Converter::message"),
    })
}

/// An integer from a number without a fraction or a string holding a decimal integer.
fn integer(value: &Json) -> Result<i128, Problem> {
    match value {
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                return Ok(i128::from(i));
            }
            if let Some(u) = n.as_u64() {
                return Ok(i128::from(u));
            }
            let f = n.as_f64().unwrap_or(f64::NAN);
            if f.fract() != 0.0 {
                return Err(Problem::wrong_type("an integer", value));
            }
            // Beyond ±2^64 no integer field can hold it; inside, the cast is exact.
            if f.abs() >= 18_446_744_073_709_551_616.0 {
                return Err(Problem::new(
                    ConversionErrorKind::OutOfRange,
                    format!("{} is out of range", Describe(value)),
                ));
            }
            Ok(f as i128)
        }
        Json::String(s) => s.parse::<i128>().map_err(|_| Problem::wrong_type("an integer", value)),
        other => Err(Problem::wrong_type("an integer", other)),
    }
}

/// A float from a number, a numeric string or one of the proto3 JSON names of special values.
fn float(value: &Json) -> Result<f64, Problem> {
    match value {
        Json::Number(n) => n.as_f64().ok_or_else(|| Problem::wrong_type("a number", value)),
        Json::String(s) => match s.as_str() {
            "NaN" => Ok(f64::NAN),
            "Infinity" => Ok(f64::INFINITY),
            "-Infinity" => Ok(f64::NEG_INFINITY),
            // Rust's parser also takes "inf" and "nan"; proto3 JSON does not.
            other if other.bytes().any(|b| b.is_ascii_alphabetic() && b != b'e' && b != b'E') => {
                Err(Problem::wrong_type("a number", value))
            }
            other => match other.parse::<f64>() {
                // Beyond double's range ("1e400", which YAML keeps as a string): only the names
                // above stand for infinity.
                Ok(v) if v.is_infinite() => Err(out_of_range(value, "double")),
                parsed => parsed.map_err(|_| Problem::wrong_type("a number", value)),
            },
        },
        other => Err(Problem::wrong_type("a number", other)),
    }
}

fn out_of_range(value: &Json, ty: &str) -> Problem {
    Problem::new(ConversionErrorKind::OutOfRange, format!("{} is out of range for {ty}", Describe(value)))
}

/// Converts a mapping key (always a string in JSON and in our YAML) to the map's key type.
fn map_key(kind: &Kind, key: &str) -> Result<MapKey, Problem> {
    let as_json = Json::String(key.to_owned());
    Ok(match kind {
        Kind::String => MapKey::String(key.to_owned()),
        Kind::Bool => match key {
            "true" => MapKey::Bool(true),
            "false" => MapKey::Bool(false),
            _ => return Err(Problem::wrong_type("a boolean key", &as_json)),
        },
        _ => match scalar(kind, &as_json)? {
            Value::I32(v) => MapKey::I32(v),
            Value::I64(v) => MapKey::I64(v),
            Value::U32(v) => MapKey::U32(v),
            Value::U64(v) => MapKey::U64(v),
            _ => unreachable!("map keys are integers, strings or booleans"),
        },
    })
}

/// Decodes base64 in the standard or URL-safe alphabet, with or without `=` padding.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let mut acc: u32 = 0;
    let mut bits = 0;
    for b in text.bytes() {
        let v = match b {
            b'A'..=b'Z' => b - b'A',
            b'a'..=b'z' => b - b'a' + 26,
            b'0'..=b'9' => b - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    // One leftover sextet cannot encode a byte.
    (bits < 6).then_some(out)
}

/// The declared field names of `desc`, for an unknown-field error.
fn field_names(desc: &MessageDescriptor) -> String {
    let proto = desc.descriptor_proto();
    suggestions(proto.field.iter().map(|f| f.name()))
}

/// Lists at most [`SUGGESTION_LIMIT`] names, then how many more there are.
fn suggestions<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    if names.is_empty() {
        return "none".to_owned();
    }
    let mut out = names.iter().take(SUGGESTION_LIMIT).copied().collect::<Vec<_>>().join(", ");
    if names.len() > SUGGESTION_LIMIT {
        let _ = write!(out, ", … ({} more)", names.len() - SUGGESTION_LIMIT);
    }
    out
}

/// Renders a path: fields joined with `.`, list indexes as `[0]`, map keys as `["k"]`.
fn render_path(path: &[Segment]) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Field(name) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(name);
            }
            Segment::Index(i) => {
                let _ = write!(out, "[{i}]");
            }
            Segment::Key(key) => {
                let _ = write!(out, "[{}]", Quoted(key));
            }
        }
    }
    out
}

/// A payload string, quoted, escaped and cut to [`QUOTE_LIMIT`] characters.
struct Quoted<'a>(&'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut chars = self.0.chars();
        let head: String = chars.by_ref().take(QUOTE_LIMIT).collect();
        let quoted = serde_json::to_string(&head).map_err(|_| fmt::Error)?;
        if chars.next().is_some() {
            // Close the quote after the ellipsis so the cut is visible.
            write!(f, "{}…\"", &quoted[..quoted.len() - 1])
        } else {
            f.write_str(&quoted)
        }
    }
}

/// A payload value described for an error: its type, and the value itself when it is a short
/// scalar (strings are cut by [`Quoted`]).
struct Describe<'a>(&'a Json);

impl fmt::Display for Describe<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "boolean {b}"),
            Json::Number(n) => {
                let text = n.to_string();
                if text.len() <= QUOTE_LIMIT {
                    write!(f, "number {text}")
                } else {
                    f.write_str("a long number")
                }
            }
            Json::String(s) => write!(f, "string {}", Quoted(s)),
            Json::Array(a) => write!(f, "a list of {} items", a.len()),
            Json::Object(_) => f.write_str("a mapping"),
        }
    }
}

/// Encodes `message` as `google.protobuf.Any` with the type URL of its own type.
pub(crate) fn to_any(message: &DynamicMessage) -> prost_types::Any {
    prost_types::Any { type_url: type_url(&message.descriptor()), value: prost::Message::encode_to_vec(message) }
}

/// `type.googleapis.com/<full name>`, the type URL protobuf uses for `Any`.
pub(crate) fn type_url(desc: &MessageDescriptor) -> String {
    format!("type.googleapis.com/{}", desc.full_name())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn base64_accepts_both_alphabets_and_optional_padding() {
        assert_eq!(decode_base64("aGk="), Some(b"hi".to_vec()));
        assert_eq!(decode_base64("aGk"), Some(b"hi".to_vec()));
        assert_eq!(decode_base64("-_8"), Some(vec![0xfb, 0xff]));
        assert_eq!(decode_base64("+/8="), Some(vec![0xfb, 0xff]));
        assert_eq!(decode_base64(""), Some(vec![]));
        assert_eq!(decode_base64("a"), None);
        assert_eq!(decode_base64("a*b"), None);
    }

    #[test]
    fn integers_reject_fractions_and_words() {
        assert_eq!(integer(&json!(3)).ok(), Some(3));
        assert_eq!(integer(&json!(3.0)).ok(), Some(3));
        assert_eq!(integer(&json!("-7")).ok(), Some(-7));
        assert!(integer(&json!(1.5)).is_err());
        assert!(integer(&json!("x")).is_err());
        assert!(integer(&json!(1e30)).is_err());
    }

    #[test]
    fn floats_take_proto3_json_names_only() {
        assert!(float(&json!("NaN")).unwrap().is_nan());
        assert_eq!(float(&json!("-Infinity")).ok(), Some(f64::NEG_INFINITY));
        assert_eq!(float(&json!("1e3")).ok(), Some(1000.0));
        assert!(float(&json!("inf")).is_err());
        assert!(float(&json!(true)).is_err());
        let beyond = float(&json!("-1e400")).unwrap_err();
        assert_eq!(beyond.kind, ConversionErrorKind::OutOfRange, "{beyond:?}");
    }

    #[test]
    fn quotes_are_cut_and_escaped() {
        let long = "x".repeat(100);
        let shown = Quoted(&long).to_string();
        assert_eq!(shown, format!("\"{}…\"", "x".repeat(QUOTE_LIMIT)));
        assert_eq!(Quoted("a\"b").to_string(), r#""a\"b""#);
        assert_eq!(Describe(&json!([1, 2])).to_string(), "a list of 2 items");
    }

    #[test]
    fn paths_render_fields_indexes_and_keys() {
        let path =
            [Segment::Field("a".into()), Segment::Index(2), Segment::Field("b".into()), Segment::Key("k".into())];
        assert_eq!(render_path(&path), r#"a[2].b["k"]"#);
    }
}
