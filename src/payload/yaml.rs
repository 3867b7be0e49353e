//! YAML payloads: a strict parse with `serde_norway`, and one retry after a small repair.
//!
//! Owns the YAML parse of a payload body into a [`serde_json::Value`] and the repair rules.
//! It does not know about fences (the caller passes [`super::fenced_body`]) or about snapshots.
//!
//! `serde_norway` is the maintained fork of the deprecated `serde_yaml`. Parsing into
//! `serde_json::Value` means YAML keys become strings (`1: a` gives `{"1": "a"}`), `.nan` and
//! `.inf` become `null`, integers beyond 64 bits become floats (as JSON numbers that size do), and
//! custom tags (`!foo`) are rejected.
//!
//! # Aliases
//! An alias (`*a`) copies its anchor's whole value, so a short body can name a huge document (a
//! list of ten thousand items, aliased ten thousand times, is 10⁸ values from 50 KB). The parse
//! counts the values it builds and fails once they exceed `value_budget`: one per byte of the
//! body, which a body without aliases never reaches, plus `ALIAS_ALLOWANCE`. Aliases may repeat
//! values, within that allowance, but never make the parse's work and memory more than a constant
//! beyond what a body of that size could ask for without them.
//!
//! # Repair
//! Runs only after the strict parse failed, so valid YAML is never altered. It changes, line by
//! line:
//! 1. **Tab indentation**: each tab in a line's leading whitespace becomes two spaces (YAML
//!    forbids tabs there; models still write them). In a block scalar, only its indentation is
//!    whitespace to repair (the run of spaces or of tabs its first line begins with): a tab after
//!    it is the scalar's text, code say, and stays.
//! 2. **Missing space after a key's colon**: at the start of a line (after indentation and any
//!    `- ` sequence markers), `key:value` becomes `key: value` when `key` is a plain identifier
//!    (`[A-Za-z_][A-Za-z0-9_-]*`) and the colon is not followed by `//` (a URL such as
//!    `http://x`) or another colon. Quoted keys, flow collections, comments and everything after
//!    the first colon are untouched, and so are the content lines of block scalars (`|`, `>`).
//!
//! If the repair changes nothing there is no retry, and the strict error is reported.

use std::cell::Cell;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::PayloadError;

/// Parses a YAML body into a JSON value: strictly first, then once more after the repair in the
/// module doc. An empty or blank body is `null`.
///
/// The error carries the strict parser's message and position (they refer to the text as
/// written) and, when a retry ran, the retry's message.
pub fn parse_yaml(body: &str) -> Result<Value, PayloadError> {
    let strict = match parse_strict(body) {
        Ok(value) => return Ok(value),
        Err(err) => err,
    };
    let Some(repaired) = repair(body) else {
        return Err(yaml_error(&strict, None));
    };
    parse_strict(&repaired).map_err(|retry| yaml_error(&strict, Some(retry.to_string())))
}

/// Only the strict parse, without repair.
pub(crate) fn parse_strict(body: &str) -> Result<Value, serde_norway::Error> {
    let budget = Cell::new(value_budget(body));
    Counted(&budget).deserialize(serde_norway::Deserializer::from_str(body))
}

/// How many values (scalars, lists and maps, each counted once; map keys are not) the parse of
/// `body` may build. A body without aliases builds at most one per byte, plus one (an empty
/// document is `null`; `-` is a list holding `null`).
fn value_budget(body: &str) -> usize {
    body.len() + 1 + ALIAS_ALLOWANCE
}

/// The values aliases may add beyond a body's own size: generous for anchors that share a few
/// settings, and small enough (well under a millisecond of work and a megabyte) that a body
/// re-parsed for every snapshot cannot turn it into a cost.
const ALIAS_ALLOWANCE: usize = 10_000;

/// Builds a [`Value`] as `serde_json`'s own visitor does, taking one from the budget per value.
#[derive(Clone, Copy)]
struct Counted<'b>(&'b Cell<usize>);

impl Counted<'_> {
    fn take<E: de::Error>(self) -> Result<(), E> {
        let left = self.0.get();
        if left == 0 {
            return Err(E::custom(
                "the document expands to more values than its size allows (aliases repeat too much)",
            ));
        }
        self.0.set(left - 1);
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Counted<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Counted<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.take()?;
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.take()?;
        Ok(Value::from(v))
    }

    // Beyond 64 bits: a float, as serde_json reads such a JSON number (its own visitor refuses
    // them, which reported a valid YAML integer as invalid YAML).
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Value, E> {
        self.visit_f64(v as f64)
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        self.visit_f64(v as f64)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.take()?;
        // Not finite (`.nan`, `.inf`): null, as serde_json's visitor gives.
        Ok(Value::from(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.visit_string(v.to_owned())
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.take()?;
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.take()?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.take()?;
        let mut object = serde_json::Map::new();
        // Keys as strings, as serde_json reads them (`1: a` gives `{"1": "a"}`); a repeated key's
        // last value wins.
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// Builds the boundary error from the strict failure and the retry's message.
fn yaml_error(strict: &serde_norway::Error, repaired: Option<String>) -> PayloadError {
    let location = strict.location();
    PayloadError::Yaml {
        message: strict.to_string(),
        line: location.as_ref().map(|l| l.line()),
        column: location.as_ref().map(|l| l.column()),
        repaired,
    }
}

/// Applies the repair in the module doc; `None` when nothing would change.
///
/// Work is linear in `body`; the result is at most twice as long (tabs become two spaces).
pub(crate) fn repair(body: &str) -> Option<String> {
    let mut out = String::with_capacity(body.len() + 16);
    let mut changed = false;
    // The block scalar being read, if any: deeper or blank lines are its content.
    let mut block: Option<BlockScalar<'_>> = None;
    for line in body.split_inclusive('\n') {
        let ws = line.len() - line.trim_start_matches([' ', '\t']).len();
        let rest = &line[ws..];
        let content = rest.trim_end();
        if let Some(block) = &mut block {
            // Its first non-blank line fixes its indentation as written: a run of spaces, or of
            // tabs. A line that begins with that run is content; what follows the run, tabs
            // included, is the scalar's own text and is kept.
            if block.indentation.is_none() && !content.is_empty() {
                let first = line.as_bytes()[0];
                let run = line.bytes().take_while(|&b| b == first).count().min(ws);
                if width(&line[..run]) > block.parent {
                    block.indentation = Some(&line[..run]);
                }
            }
            if let Some(indentation) = block.indentation.filter(|i| line.starts_with(i)) {
                changed |= push_indentation(&mut out, indentation);
                out.push_str(&line[indentation.len()..]);
                continue;
            }
        }
        let start = out.len();
        changed |= push_indentation(&mut out, &line[..ws]);
        let indent = out.len() - start;
        if let Some(open) = &block {
            if content.is_empty() || indent > open.parent {
                out.push_str(rest);
                continue;
            }
            block = None;
        }
        match missing_space_at(rest) {
            Some(colon) => {
                out.push_str(&rest[..=colon]);
                out.push(' ');
                out.push_str(&rest[colon + 1..]);
                changed = true;
            }
            None => out.push_str(rest),
        }
        if opens_block_scalar(content) {
            block = Some(BlockScalar { parent: indent, indentation: None });
        }
    }
    changed.then_some(out)
}

/// A block scalar (`|`, `>`) met by [`repair`].
struct BlockScalar<'a> {
    /// The indentation, repaired, of the line that opened it.
    parent: usize,
    /// Its content's indentation as written, once a non-blank content line gave it.
    indentation: Option<&'a str>,
}

/// The width of leading whitespace once repaired (a tab is two spaces).
fn width(indentation: &str) -> usize {
    indentation.bytes().map(|b| if b == b'\t' { 2 } else { 1 }).sum()
}

/// Appends leading whitespace with each tab as two spaces; whether it held a tab.
fn push_indentation(out: &mut String, indentation: &str) -> bool {
    let mut tabs = false;
    for b in indentation.bytes() {
        if b == b'\t' {
            out.push_str("  ");
            tabs = true;
        } else {
            out.push(' ');
        }
    }
    tabs
}

/// In a line without its indentation, the offset of a key's colon that lacks the space after
/// it (rule 2 of the module doc), if any.
fn missing_space_at(rest: &str) -> Option<usize> {
    let bytes = rest.as_bytes();
    let mut i = 0;
    // Skip sequence markers: `- `, `- - `.
    while bytes.get(i) == Some(&b'-') && bytes.get(i + 1) == Some(&b' ') {
        i += 2;
        while bytes.get(i) == Some(&b' ') {
            i += 1;
        }
    }
    match bytes.get(i) {
        Some(b) if b.is_ascii_alphabetic() || *b == b'_' => i += 1,
        _ => return None,
    }
    while bytes.get(i).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-') {
        i += 1;
    }
    if bytes.get(i) != Some(&b':') {
        return None;
    }
    let after = &bytes[i + 1..];
    match after.first() {
        None | Some(b' ' | b'\t' | b'\r' | b'\n' | b':') => None,
        Some(b'/') if after.get(1) == Some(&b'/') => None,
        Some(_) => Some(i),
    }
}

/// Whether a line (trimmed) ends with a block scalar header: `key: |`, `- >-`, `|2` ...
pub(super) fn opens_block_scalar(content: &str) -> bool {
    let header = content.trim_end_matches(|c: char| c == '-' || c == '+' || c.is_ascii_digit());
    let Some(before) = header.strip_suffix('|').or_else(|| header.strip_suffix('>')) else {
        return false;
    };
    before.is_empty() || before.ends_with(' ') || before.ends_with(':')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strict_parse() {
        assert_eq!(
            parse_yaml("a: 1\nb: [x, y]\nc:\n  d: true\n"),
            Ok(json!({"a": 1, "b": ["x", "y"], "c": {"d": true}}))
        );
        assert_eq!(parse_yaml(""), Ok(Value::Null));
    }

    #[test]
    fn valid_yaml_is_never_repaired() {
        // Each parses strictly; the repair would have changed some of them.
        let cases = [
            ("url: http://x:80\n", json!({"url": "http://x:80"})),
            ("a:b\n", json!("a:b")),
            ("t: \"k:v\"\n", json!({"t": "k:v"})),
            ("s: |\n  key:value\n", json!({"s": "key:value\n"})),
            ("x: 'a\tb'\n", json!({"x": "a\tb"})),
        ];
        for (yaml, want) in cases {
            assert_eq!(parse_yaml(yaml), Ok(want), "{yaml:?}");
        }
    }

    #[test]
    fn aliases_are_expanded_within_a_bound_on_the_values_they_build() {
        let yaml = "base: &b {x: 1, y: [a, b]}\nother: *b\nlist: [*b, *b]\n";
        let base = json!({"x": 1, "y": ["a", "b"]});
        assert_eq!(parse_yaml(yaml), Ok(json!({"base": base, "other": base, "list": [base, base]})));
        // A thousand items aliased a thousand times: a million values from about 6 KB.
        let items = vec!["x"; 1000].join(",");
        let aliases = vec!["*a"; 1000].join(",");
        let bomb = format!("a: &a [{items}]\nb: [{aliases}]\n");
        let err = parse_yaml(&bomb).unwrap_err();
        assert!(err.to_string().contains("expands to more values"), "{err}");
        // Within the allowance: ten aliases of a thousand items.
        let ten = ["*a"; 10].join(",");
        let fine = parse_yaml(&format!("a: &a [{items}]\nb: [{ten}]\n")).unwrap();
        assert_eq!(fine["b"][9].as_array().map(Vec::len), Some(1000));
    }

    #[test]
    fn a_body_without_aliases_never_reaches_the_budget() {
        // The densest bodies: a value per byte or nearly.
        for body in ["", "-", "- -", "-\n-\n-\n", "[a,a,a,a]", "[[[[]]]]", "{a,b,c}", "a:\nb:\n"] {
            let built = count_values(&parse_strict(body).unwrap());
            assert!(built <= body.len() + 1, "{body:?}: {built} values");
        }
    }

    fn count_values(value: &Value) -> usize {
        1 + match value {
            Value::Array(items) => items.iter().map(count_values).sum(),
            Value::Object(map) => map.values().map(count_values).sum(),
            _ => 0,
        }
    }

    #[test]
    fn integers_beyond_64_bits_are_floats_as_in_json() {
        assert_eq!(parse_yaml("id: 123456789012345678901\n"), Ok(json!({"id": 123456789012345678901.0})));
        assert_eq!(parse_yaml("id: -123456789012345678901\n"), Ok(json!({"id": -123456789012345678901.0})));
        assert_eq!(
            parse_yaml("big: 18446744073709551615\nneg: -9223372036854775808\n"),
            Ok(json!({"big": u64::MAX, "neg": i64::MIN}))
        );
        assert_eq!(parse_yaml("n: .nan\ni: -.inf\n"), Ok(json!({"n": null, "i": null})));
        assert_eq!(parse_yaml("1: a\ntrue: b\n"), Ok(json!({"1": "a", "true": "b"})));
    }

    #[test]
    fn repairs_tab_indentation() {
        let yaml = "mode_switch:\n\tanalysis: slow\n\tnew_mode: fast\n";
        assert!(parse_strict(yaml).is_err());
        assert_eq!(parse_yaml(yaml), Ok(json!({"mode_switch": {"analysis": "slow", "new_mode": "fast"}})));
    }

    #[test]
    fn tabs_inside_a_block_scalar_are_its_text_not_indentation() {
        // `a:1` makes the strict parse fail, so the repair runs over the whole body. The block's
        // indentation (spaces in the first body, tabs in the second) is repaired; a tab after it
        // is the scalar's own text (code, say) and stays.
        for (yaml, code) in [
            ("a:1\ncode: |\n  if x {\n  \tgo()\n  }\n", "if x {\n\tgo()\n}\n"),
            ("a:1\ncode: |\n\tif x {\n\t\tgo()\n\t}\nb: 2\n", "if x {\n\tgo()\n}\n"),
        ] {
            assert!(parse_strict(yaml).is_err(), "{yaml:?}");
            let value = parse_yaml(yaml).unwrap_or_else(|e| panic!("{yaml:?}: {e}"));
            assert_eq!(value["code"], code, "{yaml:?}");
            assert_eq!(value["a"], 1, "{yaml:?}");
        }
    }

    #[test]
    fn repairs_missing_space_after_colon() {
        let yaml = "title: A\nyear:2020\nurl:http://x.org/a\nauthors:\n  - name:Bob\n";
        assert!(parse_strict(yaml).is_err());
        assert_eq!(
            parse_yaml(yaml),
            Ok(json!({
                "title": "A", "year": 2020, "url": "http://x.org/a",
                "authors": [{"name": "Bob"}],
            }))
        );
    }

    #[test]
    fn repair_leaves_urls_quotes_and_block_scalars() {
        let body = "- http://x\n\"k\":v\nnote: |\n  a:b\nc:d\n";
        assert_eq!(repair(body).as_deref(), Some("- http://x\n\"k\":v\nnote: |\n  a:b\nc: d\n"));
        assert_eq!(repair("a: 1\nb: [x]\n"), None);
    }

    #[test]
    fn failure_reports_strict_position_and_retry() {
        let err = parse_yaml("a: 1\nb:2\nc: [\n").unwrap_err();
        let PayloadError::Yaml { line, column, repaired, .. } = &err else {
            panic!("{err:?}");
        };
        assert_eq!((*line, *column), (Some(3), Some(1)));
        assert!(repaired.is_some(), "the repair changed `b:2`, so a retry ran");
        let text = err.to_string();
        assert!(text.contains("at line 3 column 1"), "{text}");
        assert!(text.contains("after repair"), "{text}");

        let err = parse_yaml("a: [1\n").unwrap_err();
        assert!(matches!(&err, PayloadError::Yaml { repaired: None, .. }), "nothing to repair, no retry: {err:?}");
    }
}
