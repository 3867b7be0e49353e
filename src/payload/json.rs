//! JSON payloads: an extraction chain that finds the JSON value a model meant to write.
//!
//! Owns the chain and its repair pass. It does not know about streaming (see
//! [`super::partial_json`]) or about YAML.
//!
//! The chain, first success wins:
//! 1. **direct**: the whole text parsed by `serde_json`;
//! 2. **fenced**: the body of the first code fence ([`super::find_fence`]);
//! 3. **balanced**: the first `{…}` or `[…]` whose brackets balance, matched string-aware
//!    (brackets inside JSON strings and escaped quotes do not count), that parses. Candidates are
//!    tried in order of their opening bracket, at most [`MAX_CANDIDATES`] of them, so the work
//!    stays a small multiple of the text;
//! 4. **repaired**: the text from the first `{` or `[` (inside the fence when the fence body has
//!    one, else in the whole text) through the [`repair`] pass, then parsed.
//!
//! When every step fails, [`JsonChainError`] says what each one reported.

use memchr::memchr2;
use serde_json::Value;

use super::fence::find_fence;

/// How many opening brackets step 3 tries before giving up.
pub const MAX_CANDIDATES: usize = 16;

/// Every step of the JSON extraction chain failed; each field is what that step reported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no JSON value found: direct: {direct}; fenced: {fenced}; balanced: {balanced}; repaired: {repaired}")]
pub struct JsonChainError {
    /// The parse error of the whole text.
    pub direct: String,
    /// `no fence`, or the parse error of the fence body.
    pub fenced: String,
    /// Why no balanced candidate parsed (no bracket, unbalanced, or the first parse error).
    pub balanced: String,
    /// `no '{' or '['`, or the parse error after repair.
    pub repaired: String,
}

/// Extracts a JSON value from a payload with the chain in the module doc.
pub fn extract_json(body: &str) -> Result<Value, JsonChainError> {
    let direct = match serde_json::from_str(body) {
        Ok(value) => return Ok(value),
        Err(err) => err.to_string(),
    };
    let fence = find_fence(body);
    let fenced = match fence {
        None => "no fence".to_owned(),
        Some(fence) => match serde_json::from_str(fence.body) {
            Ok(value) => return Ok(value),
            Err(err) => err.to_string(),
        },
    };
    let balanced = match first_balanced(body) {
        Ok(value) => return Ok(value),
        Err(report) => report,
    };
    // The fence body when it holds a bracket; otherwise the whole text (a "fence" may be a
    // stray closing fence after unfenced JSON).
    let source =
        fence.map(|fence| fence.body).filter(|body| memchr2(b'{', b'[', body.as_bytes()).is_some()).unwrap_or(body);
    let repaired = match memchr2(b'{', b'[', source.as_bytes()) {
        None => "no '{' or '['".to_owned(),
        Some(start) => match serde_json::from_str(&repair(&source[start..])) {
            Ok(value) => return Ok(value),
            Err(err) => err.to_string(),
        },
    };
    Err(JsonChainError { direct, fenced, balanced, repaired })
}

/// Step 3: the first balanced bracket span that parses, or a report of why none did.
fn first_balanced(text: &str) -> Result<Value, String> {
    let bytes = text.as_bytes();
    let mut from = 0;
    let mut first_failure: Option<String> = None;
    let mut tried = 0;
    while let Some(offset) = memchr2(b'{', b'[', &bytes[from..]) {
        if tried == MAX_CANDIDATES {
            break;
        }
        tried += 1;
        let start = from + offset;
        let failure = match balanced_end(bytes, start) {
            Ok(end) => match serde_json::from_str(&text[start..end]) {
                Ok(value) => return Ok(value),
                Err(err) => format!("span at byte {start}: {err}"),
            },
            Err(failure) => failure,
        };
        first_failure.get_or_insert(failure);
        from = start + 1;
    }
    Err(match first_failure {
        None => "no '{' or '['".to_owned(),
        Some(first) if tried == 1 => first,
        Some(first) => format!("{first} (and {} more candidates)", tried - 1),
    })
}

/// String-aware bracket matching from the opening bracket at `start`: the offset just past its
/// matching closer, or why there is none.
fn balanced_end(bytes: &[u8], start: usize) -> Result<usize, String> {
    let mut stack: Vec<u8> = Vec::new();
    let mut in_string = false;
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' => stack.push(b'}'),
            b'[' => stack.push(b']'),
            b'}' | b']' => {
                if stack.pop() != Some(b) {
                    return Err(format!(
                        "'{}' at byte {i} does not close the bracket opened at byte {start}",
                        char::from(b)
                    ));
                }
                if stack.is_empty() {
                    return Ok(i + 1);
                }
            }
            _ => {}
        }
    }
    Err(format!("the bracket opened at byte {start} is not closed ({} open at the end)", stack.len()))
}

/// The repair pass of step 4, over text that starts at an opening bracket. Returns text that
/// `serde_json` is more likely to accept. In one string-aware pass it:
/// * drops a comma directly before `}`, `]` or the end (trailing commas);
/// * keeps an invalid escape's backslash as a literal character: `\R` becomes `\\R`, so the value
///   holds `\R` as written (a Windows path survives); `\u` without four hex digits likewise;
/// * escapes raw control characters inside strings (`\n`, `\t`, `\r`, `\u00XX`);
/// * when a closer does not match the innermost open bracket but an outer one, closes the inner
///   ones first; a closer that matches nothing is dropped;
/// * stops after the top-level value closes (trailing prose is ignored);
/// * at the end of the text: drops a dangling `\`, closes an unfinished string, completes a
///   partial `true`/`false`/`null`, trims a number that ends in `-`, `+`, `.`, `e` or `E`, gives
///   a key without a value `null`, drops a trailing comma, and closes every open bracket and
///   brace, innermost first.
///
/// Single quotes, unquoted keys and comments are not repaired.
pub fn repair(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    // Expected closers of the open brackets, innermost last, with whether the bracket is an
    // object whose next string is a key.
    let mut stack: Vec<Open> = Vec::new();
    let mut chars = text.char_indices().peekable();
    let mut in_string = false;
    // Whether the string being written is an object key.
    let mut string_is_key = false;
    // Whether the last significant thing written is a key without its colon yet (needs
    // `: null` if the object closes now).
    let mut after_key = false;
    while let Some((_, c)) = chars.next() {
        if in_string {
            match c {
                '\\' => match chars.next() {
                    None => {}
                    Some((_, e @ ('"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't'))) => {
                        out.push('\\');
                        out.push(e);
                    }
                    Some((j, 'u')) if is_hex4(text.get(j + 1..j + 5)) => out.push_str("\\u"),
                    Some((_, other)) => {
                        out.push_str("\\\\");
                        push_string_char(&mut out, other);
                    }
                },
                '"' => {
                    out.push('"');
                    in_string = false;
                    after_key = string_is_key;
                }
                _ => push_string_char(&mut out, c),
            }
            continue;
        }
        match c {
            '"' => {
                string_is_key =
                    matches!(stack.last(), Some(Open::Object)) && matches!(last_significant(&out), Some('{' | ','));
                in_string = true;
                out.push('"');
            }
            '{' => {
                after_key = false;
                stack.push(Open::Object);
                out.push('{');
            }
            '[' => {
                after_key = false;
                stack.push(Open::Array);
                out.push('[');
            }
            '}' | ']' => {
                let wanted = if c == '}' { Open::Object } else { Open::Array };
                let Some(depth) = stack.iter().rposition(|open| *open == wanted) else {
                    continue;
                };
                while stack.len() > depth {
                    let open = stack.pop().unwrap_or(wanted);
                    close(&mut out, open, after_key);
                    after_key = false;
                }
                if stack.is_empty() {
                    return out;
                }
            }
            c if c.is_whitespace() => out.push(c),
            _ => {
                after_key = false;
                out.push(c);
            }
        }
    }
    if in_string {
        out.push('"');
        after_key = string_is_key;
    } else {
        finish_token(&mut out);
    }
    while let Some(open) = stack.pop() {
        close(&mut out, open, after_key);
        after_key = false;
    }
    out
}

/// An open bracket in [`repair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Object,
    Array,
}

/// Closes `open` in `out`, first fixing what precedes the closer: a trailing comma is dropped,
/// and a dangling `:` or a key without its colon (`after_key`) gets `null`.
fn close(out: &mut String, open: Open, after_key: bool) {
    let trimmed = out.trim_end().len();
    match out[..trimmed].chars().next_back() {
        Some(',') => out.truncate(trimmed - 1),
        Some(':') => out.push_str(" null"),
        Some('"') if after_key => out.push_str(": null"),
        _ => {}
    }
    out.push(if open == Open::Object { '}' } else { ']' });
}

/// At the end of the text outside a string: completes a partial literal and trims a number
/// that cannot end where it does.
fn finish_token(out: &mut String) {
    let trimmed = out.trim_end().len();
    out.truncate(trimmed);
    // The token is ASCII; the character before it may not be, so step over it whole.
    let token_start = out
        .char_indices()
        .rev()
        .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '-')))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let token = &out[token_start..];
    if token.is_empty() {
        return;
    }
    let literal = ["true", "false", "null"].into_iter().find(|lit| lit.starts_with(token));
    if let Some(literal) = literal {
        out.truncate(token_start);
        out.push_str(literal);
    } else {
        let kept = token.trim_end_matches(['-', '+', '.', 'e', 'E']).len();
        out.truncate(token_start + kept);
    }
}

/// The last non-whitespace character of `out`.
fn last_significant(out: &str) -> Option<char> {
    out.trim_end().chars().next_back()
}

/// Pushes one character of a string body, escaping control characters JSON forbids raw.
fn push_string_char(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
        c => out.push(c),
    }
}

/// Whether `digits` is exactly four hex digits.
fn is_hex4(digits: Option<&str>) -> bool {
    digits.is_some_and(|d| d.len() == 4 && d.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn step_direct() {
        assert_eq!(extract_json(" {\"a\": 1} \n"), Ok(json!({"a": 1})));
        assert_eq!(extract_json("42"), Ok(json!(42)));
    }

    #[test]
    fn step_fenced() {
        let text = "Here you go:\n```json\n{\"a\": [1, 2]}\n```\nand {not json}";
        assert_eq!(extract_json(text), Ok(json!({"a": [1, 2]})));
    }

    #[test]
    fn step_balanced_is_string_aware() {
        let text = r#"The result {"s": "a } and \" ] here", "n": [1, {"x": 2}]} trailing"#;
        assert_eq!(extract_json(text), Ok(json!({"s": "a } and \" ] here", "n": [1, {"x": 2}]})));
        // A bracket in prose first: the next candidate wins.
        assert_eq!(extract_json("see [note] then {\"a\": 1} ok"), Ok(json!({"a": 1})));
    }

    #[test]
    fn step_repaired() {
        let cases = [
            ("{\"a\": [1, 2,], }", json!({"a": [1, 2]})),
            ("{\"a\": \"unclosed", json!({"a": "unclosed"})),
            ("{\"a\": [1, {\"b\": 2", json!({"a": [1, {"b": 2}]})),
            (r#"{"p": "C:\Users\R"}"#, json!({"p": r"C:\Users\R"})),
            ("{\"a\": \"x\ny\"}", json!({"a": "x\ny"})),
            ("{\"a\": [1, 2}", json!({"a": [1, 2]})),
            ("{\"a\": tru", json!({"a": true})),
            ("{\"a\": 1, \"b\": -", json!({"a": 1, "b": null})),
            ("{\"a\": 1, \"b\"}", json!({"a": 1, "b": null})),
            ("{\"a\": 1, \"b\"", json!({"a": 1, "b": null})),
            ("{\"a\": 1, \"b\":", json!({"a": 1, "b": null})),
            ("{\"a\": \"dangling\\", json!({"a": "dangling"})),
            ("prose first\n```json\n{\"a\": 1,}\n```", json!({"a": 1})),
            // A stray closing fence after unfenced JSON is an empty "fence": repair the text.
            ("prose ```json\n{\"a\": 1,}\n```", json!({"a": 1})),
        ];
        for (text, want) in cases {
            assert_eq!(extract_json(text), Ok(want), "{text:?}");
        }
    }

    #[test]
    fn repair_keeps_valid_escapes() {
        assert_eq!(repair(r#"{"a": "q\"\\\/\n\u00e9\uZZ"}"#), r#"{"a": "q\"\\\/\n\u00e9\\uZZ"}"#);
    }

    #[test]
    fn aggregated_error_lists_every_step() {
        let err = extract_json("hello there").unwrap_err();
        assert_eq!(err.fenced, "no fence");
        assert_eq!(err.balanced, "no '{' or '['");
        assert_eq!(err.repaired, "no '{' or '['");
        let text = err.to_string();
        assert!(
            text.starts_with(
                "no JSON value found: direct: expected value at line 1 column 1; fenced: no fence; balanced: "
            ),
            "{text}"
        );

        let err = extract_json("```json\n{\"a\" 1}\n```").unwrap_err();
        assert!(err.fenced.contains("expected `:`"), "{err}");
        assert!(err.balanced.contains("span at byte 8"), "{err}");
        assert!(err.repaired.contains("expected `:`"), "{err}");
        assert!(err.to_string().contains("; repaired: expected `:`"), "{err}");

        let err = extract_json("x [1, 2 :").unwrap_err();
        assert!(err.balanced.contains("not closed"), "{err}");
    }
}
