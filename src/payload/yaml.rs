//! YAML payloads: a strict parse with `serde_norway`, and one retry after a small repair.
//!
//! Owns the YAML parse of a payload body into a [`serde_json::Value`] and the repair rules.
//! It does not know about fences (the caller passes [`super::fenced_body`]) or about snapshots.
//!
//! `serde_norway` is the maintained fork of the deprecated `serde_yaml`. Parsing into
//! `serde_json::Value` means YAML keys become strings (`1: a` gives `{"1": "a"}`), `.nan` and
//! `.inf` become `null`, and custom tags (`!foo`) are rejected.
//!
//! # Repair
//! Runs only after the strict parse failed, so valid YAML is never altered. It changes, line by
//! line:
//! 1. **Tab indentation**: each tab in a line's leading whitespace becomes two spaces (YAML
//!    forbids tabs there; models still write them).
//! 2. **Missing space after a key's colon**: at the start of a line (after indentation and any
//!    `- ` sequence markers), `key:value` becomes `key: value` when `key` is a plain identifier
//!    (`[A-Za-z_][A-Za-z0-9_-]*`) and the colon is not followed by `//` (a URL such as
//!    `http://x`) or another colon. Quoted keys, flow collections, comments and everything after
//!    the first colon are untouched, and so are the content lines of block scalars (`|`, `>`).
//!
//! If the repair changes nothing there is no retry, and the strict error is reported.

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
    serde_norway::from_str(body)
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
    // Indentation of the line that opened a block scalar; deeper or blank lines are its content.
    let mut block_scalar_indent: Option<usize> = None;
    for line in body.split_inclusive('\n') {
        let start = out.len();
        let ws = line.len() - line.trim_start_matches([' ', '\t']).len();
        for b in line[..ws].bytes() {
            if b == b'\t' {
                out.push_str("  ");
                changed = true;
            } else {
                out.push(' ');
            }
        }
        let rest = &line[ws..];
        let indent = out.len() - start;
        let content = rest.trim_end();
        if let Some(parent) = block_scalar_indent {
            if content.is_empty() || indent > parent {
                out.push_str(rest);
                continue;
            }
            block_scalar_indent = None;
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
            block_scalar_indent = Some(indent);
        }
    }
    changed.then_some(out)
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
fn opens_block_scalar(content: &str) -> bool {
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
    fn repairs_tab_indentation() {
        let yaml = "mode_switch:\n\tanalysis: slow\n\tnew_mode: fast\n";
        assert!(parse_strict(yaml).is_err());
        assert_eq!(parse_yaml(yaml), Ok(json!({"mode_switch": {"analysis": "slow", "new_mode": "fast"}})));
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
