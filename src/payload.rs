//! Payload decoding: turns the raw text of a block into a [`serde_json::Value`].
//!
//! This module owns everything between "here is the text a block held" and "here is the value it
//! means": code fences ([`fence`]), YAML with a one-shot repair ([`yaml`]), the JSON extraction
//! chain ([`json`]), the incremental partial JSON parser ([`partial_json`]) and the per-block live
//! snapshot policy ([`snapshot`]).
//!
//! It does not know where the text comes from (scanner, pipeline, NATS), which tag a block has,
//! what schema the value must fit (the protobuf conversion lives elsewhere), or when snapshots are
//! published. It is pure: std, memchr, serde and the two parsers; no clock, no I/O, no `unsafe`.

pub mod fence;
pub mod json;
pub mod partial_json;
pub mod snapshot;
pub mod yaml;

pub use fence::{fenced_body, find_fence, Fence};
pub use json::{extract_json, JsonChainError};
pub use partial_json::{PartialJson, PartialJsonError};
pub use snapshot::{PayloadFormat, Snapshotter};
pub use yaml::parse_yaml;

use serde_json::Value;

/// Why a block's payload could not be turned into a value.
///
/// This is the error of the payload boundary: the pipeline reports it as the reason a block
/// completed with `success = false`. Messages name what failed and where, never the payload text
/// beyond the position.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// The YAML parser rejected the payload, strictly and again after the repair pass.
    #[error("invalid YAML: {message}{}", repair_note(.repaired))]
    Yaml {
        /// The strict parser's message, with its position (it refers to the text as written).
        message: String,
        /// 1-based line of the strict failure, when the parser knows it.
        line: Option<usize>,
        /// 1-based column of the strict failure, when the parser knows it.
        column: Option<usize>,
        /// The message of the retry on the repaired text, or `None` when the repair found
        /// nothing to change (so no retry ran).
        repaired: Option<String>,
    },
    /// Every step of the JSON extraction chain failed; the inner error lists each step.
    #[error(transparent)]
    Json(#[from] JsonChainError),
}

/// Formats the "after repair" part of [`PayloadError::Yaml`]; empty when no retry ran.
fn repair_note(repaired: &Option<String>) -> String {
    match repaired {
        Some(message) => format!(" (after repair: {message})"),
        None => String::new(),
    }
}

/// Decodes a complete payload in `format`: the final value of a block.
///
/// * `Yaml`: the [`fenced_body`] parsed with [`parse_yaml`] (strict, then one repair).
/// * `Json`: the [`extract_json`] chain on the whole text (the chain looks for the fence itself).
/// * `Raw`: the text unchanged, as a JSON string (no fence stripping: raw means raw).
///
/// This never depends on snapshots; [`Snapshotter::complete`] calls it.
pub fn decode(format: PayloadFormat, raw: &str) -> Result<Value, PayloadError> {
    match format {
        PayloadFormat::Yaml => parse_yaml(fenced_body(raw)),
        PayloadFormat::Json => Ok(extract_json(raw)?),
        PayloadFormat::Raw => Ok(Value::String(raw.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decode_dispatches_on_format() {
        let raw = "Here:\n```yaml\na: 1\n```\nbye";
        assert_eq!(decode(PayloadFormat::Yaml, raw), Ok(json!({"a": 1})));
        assert_eq!(decode(PayloadFormat::Json, "```json\n{\"a\": [1]}\n```"), Ok(json!({"a": [1]})));
        assert_eq!(decode(PayloadFormat::Raw, raw), Ok(json!(raw)));
    }

    #[test]
    fn yaml_error_names_position_and_repair() {
        let err = decode(PayloadFormat::Yaml, "a: [1, 2\nb: 3\n").unwrap_err();
        let PayloadError::Yaml { line, column, .. } = &err else {
            panic!("expected a YAML error, got {err:?}");
        };
        assert!(line.is_some() && column.is_some(), "{err:?}");
        assert!(err.to_string().starts_with("invalid YAML: "), "{err}");
        assert!(err.to_string().contains("line"), "{err}");
    }
}
