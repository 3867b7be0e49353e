//! Incremental partial JSON: the best value of a JSON document that is still being written.
//!
//! Owns [`PartialJson`], a byte-level state machine with an explicit stack of open containers.
//! Each byte is examined once (string bodies are skipped with `memchr`), so the total work of
//! feeding a document is linear in its size whatever the chunking. It does not know about
//! fences beyond skipping text before the value, about YAML, or about when snapshots are
//! published (see [`super::snapshot`]).
//!
//! # What a snapshot holds
//! * Every complete value.
//! * An unfinished string value, as far as it decodes: a dangling `\` or a half `\u00e` escape
//!   (or a high surrogate still waiting for its low half) is left out until it completes.
//! * Not an unfinished key, number (`12` may become `123`, `-` is nothing yet) or literal (`tru`),
//!   nor a key whose value has not started.
//!
//! Hence **a value's type never changes between snapshots**: a key (or array element) appears
//! only once its value's first byte fixes the type (`"` string, `{` object, `[` array) or once a
//! number or literal is complete, and from then on only grows (a string gets longer, a container
//! gains members). Earlier snapshots are "prefixes" of later ones. The one exception is a
//! duplicate key: as in `serde_json`, the last occurrence wins, so `{"a": 1, "a": {}}` replaces
//! the number when the second value starts.
//!
//! # What is read
//! * Everything before the first `{` or `[` is skipped (prose, a "```json" fence line), and
//!   everything after the top-level value closes is ignored (a closing fence, more prose). A
//!   top-level scalar is therefore never reported.
//! * Where a lenient reading is obvious it is taken, so live snapshots survive common model
//!   mistakes: raw control characters inside strings are kept, an invalid escape `\R` keeps its
//!   backslash (the value holds `\R`, as the repair pass of [`super::json`] does), a lone
//!   surrogate becomes U+FFFD, and a trailing comma before `]` or `}` is accepted.
//! * Any other syntax error stops the parser: later bytes are ignored, the snapshot stays at the
//!   last good state and [`PartialJson::error`] says what happened. The final value of a block is
//!   decided by the extraction chain, not by this parser. (So prose with a bracket before the
//!   value, `see [1]: {...}`, ends the live snapshots of that block; its final value is fine.)
//!
//! Feeding a complete valid document whose top level is an object or array, in any chunking,
//! gives exactly `serde_json::from_str` of it (numbers are converted by `serde_json` itself,
//! object keys are ordered the same way, the last of duplicate keys wins).
//!
//! # Cost
//! [`PartialJson::feed`] is O(bytes fed). [`PartialJson::snapshot`] builds an owned `Value` and
//! costs O(size of the value so far): call it at growing spacing (as
//! [`super::Snapshotter`] does) to keep the total linear.

use memchr::memchr2;
use serde_json::{Map, Value};

/// Deepest nesting accepted: `serde_json`'s own limit (it refuses 128 levels), so that a complete
/// document reads here exactly as `serde_json` reads it.
pub const MAX_DEPTH: usize = 127;

/// Why a [`PartialJson`] stopped reading.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartialJsonError {
    /// A byte that cannot appear where it did.
    #[error("unexpected byte 0x{byte:02x} at byte {offset}, expected {expected}")]
    Unexpected {
        /// The byte found.
        byte: u8,
        /// Its offset in everything fed.
        offset: usize,
        /// What the parser was waiting for.
        expected: &'static str,
    },
    /// A number token that `serde_json` rejects (`-`, `01`, `1e999`).
    #[error("invalid number ending at byte {offset}")]
    InvalidNumber {
        /// Offset of the byte after the number.
        offset: usize,
    },
    /// More than [`MAX_DEPTH`] open containers.
    #[error("nesting deeper than {MAX_DEPTH} at byte {offset}")]
    TooDeep {
        /// Offset of the bracket that went too deep.
        offset: usize,
    },
}

/// An incremental, string-aware partial JSON parser; see the module doc for the rules.
#[derive(Debug, Clone, Default)]
pub struct PartialJson {
    state: State,
    /// Open containers, outermost first.
    stack: Vec<Frame>,
    /// Decoded text of the string being read (key or value).
    text: String,
    /// Raw text of the escape being read, from its backslash; written out literally if the
    /// escape turns out invalid.
    escape_raw: String,
    /// Characters of the number or literal being read.
    token: String,
    /// The top-level value, once it is complete.
    root: Option<Value>,
    fed: usize,
    /// Whether the visible value differs from the last one returned by
    /// [`PartialJson::snapshot_if_changed`].
    changed: bool,
    /// How many values [`PartialJson::snapshot_if_changed`] has returned.
    epoch: u64,
    error: Option<PartialJsonError>,
}

/// What the parser waits for. Each state's exit is the byte that leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum State {
    /// Before the top-level value: skips to the first `{` or `[`.
    #[default]
    SeekingStart,
    /// After `[`, a `,` in an array, or a `:`. A `]` here closes the array (empty, or after a
    /// trailing comma).
    AwaitingValue,
    /// After `{` or a `,` in an object. A `}` here closes the object.
    AwaitingKey,
    /// Inside a string; `role` says whether it is a key.
    InString { role: Role, escape: Escape },
    /// After a key.
    AwaitingColon,
    /// After a value inside a container.
    AwaitingCommaOrClose,
    /// Inside a number; the first byte that cannot continue it ends it and is read again.
    InNumber,
    /// Inside `true`, `false` or `null`; ends when the literal is complete.
    InLiteral,
    /// The top-level value is complete; the rest is ignored. Terminal.
    Done,
    /// A syntax error; the rest is ignored. Terminal.
    Failed,
}

/// Whether the string being read is an object key or a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Key,
    Value,
}

/// Progress through an escape sequence inside a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    /// Plain text.
    None,
    /// After `\`.
    Backslash,
    /// After `\u` and `digits` hex digits worth `code`.
    Unicode { digits: u8, code: u32 },
    /// After a high surrogate escape, waiting for the `\` of its low half.
    LowBackslash { high: u32 },
    /// After the `\` of the low half, waiting for `u`.
    LowU { high: u32 },
    /// Reading the low half's hex digits.
    LowUnicode { high: u32, digits: u8, code: u32 },
}

/// An open container with its members so far.
#[derive(Debug, Clone)]
enum Frame {
    Array(Vec<Value>),
    /// `key` is the completed key whose value is being read (or about to be); `duplicate` is set
    /// when that key is already in `map`.
    Object {
        map: Map<String, Value>,
        key: Option<String>,
        duplicate: Option<Duplicate>,
    },
}

/// A key read a second time. Its new value replaces the old one (as in `serde_json`); if the
/// new value turns out equal and no snapshot was returned meanwhile, the visible value is back
/// to what it was, so the change flag is restored.
#[derive(Debug, Clone, Copy)]
struct Duplicate {
    changed_before: bool,
    epoch: u64,
}

impl PartialJson {
    /// A parser that has read nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the next chunk of the document. Work is O(`chunk.len()`).
    pub fn feed(&mut self, chunk: &str) {
        let base = self.fed;
        self.fed += chunk.len();
        let bytes = chunk.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match self.state {
                State::Done | State::Failed => return,
                State::SeekingStart => match memchr2(b'{', b'[', &bytes[i..]) {
                    Some(offset) => {
                        i += offset;
                        self.state = State::AwaitingValue;
                    }
                    None => return,
                },
                State::InString { role, escape: Escape::None } => match memchr2(b'"', b'\\', &bytes[i..]) {
                    // The run before the quote or backslash is plain text; both are ASCII, so
                    // the slice ends on a char boundary.
                    Some(offset) => {
                        self.push_text(&chunk[i..i + offset], role);
                        i += offset;
                    }
                    None => {
                        self.push_text(&chunk[i..], role);
                        return;
                    }
                },
                _ => {}
            }
            if self.step(bytes[i], base + i) {
                i += 1;
            }
        }
    }

    /// Bytes fed so far (the parse work done, up to a constant).
    pub fn fed_bytes(&self) -> usize {
        self.fed
    }

    /// Whether the top-level value is complete.
    pub fn is_complete(&self) -> bool {
        self.state == State::Done
    }

    /// The syntax error that stopped the parser, if any.
    pub fn error(&self) -> Option<&PartialJsonError> {
        self.error.as_ref()
    }

    /// Whether the value changed since the last one [`PartialJson::snapshot_if_changed`]
    /// returned. Exact: members only ever appear or grow, and a duplicate key whose new value
    /// equals the old one restores the flag. O(1).
    pub fn has_changed(&self) -> bool {
        self.changed
    }

    /// The value so far (see the module doc), or `None` before the first `{` or `[`.
    /// Costs O(size of the value).
    pub fn snapshot(&self) -> Option<Value> {
        if let Some(root) = &self.root {
            return Some(root.clone());
        }
        // Built from the innermost open piece outwards; each frame is cloned once.
        let mut child = match self.state {
            State::InString { role: Role::Value, .. } => Some(Value::String(self.text.clone())),
            _ => None,
        };
        for frame in self.stack.iter().rev() {
            child = Some(match frame {
                Frame::Array(items) => {
                    let mut items = items.clone();
                    items.extend(child);
                    Value::Array(items)
                }
                Frame::Object { map, key, .. } => {
                    let mut map = map.clone();
                    if let (Some(value), Some(key)) = (child, key) {
                        map.insert(key.clone(), value);
                    }
                    Value::Object(map)
                }
            });
        }
        child
    }

    /// The value so far, only if it changed since the last call that returned one.
    pub fn snapshot_if_changed(&mut self) -> Option<Value> {
        if !self.changed {
            return None;
        }
        self.changed = false;
        self.epoch += 1;
        self.snapshot()
    }

    /// Appends decoded text to the string being read.
    fn push_text(&mut self, text: &str, role: Role) {
        if !text.is_empty() {
            self.text.push_str(text);
            self.changed |= role == Role::Value;
        }
    }

    fn push_char(&mut self, c: char, role: Role) {
        self.text.push(c);
        self.changed |= role == Role::Value;
    }

    fn fail(&mut self, error: PartialJsonError) {
        self.state = State::Failed;
        self.error = Some(error);
    }

    fn unexpected(&mut self, byte: u8, offset: usize, expected: &'static str) {
        self.fail(PartialJsonError::Unexpected { byte, offset, expected });
    }

    /// Reads one byte at `offset`. Returns `false` when the byte was not consumed and must be
    /// read again in the new state (the end of a number, the byte after an invalid escape).
    fn step(&mut self, b: u8, offset: usize) -> bool {
        match self.state {
            State::AwaitingValue => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'{' => self.open(Frame::Object { map: Map::new(), key: None, duplicate: None }, offset),
                b'[' => self.open(Frame::Array(Vec::new()), offset),
                b'"' => {
                    self.text.clear();
                    self.state = State::InString { role: Role::Value, escape: Escape::None };
                    // The empty string is already a visible value.
                    self.changed = true;
                }
                b'-' | b'0'..=b'9' => {
                    self.token.clear();
                    self.token.push(char::from(b));
                    self.state = State::InNumber;
                }
                b't' | b'f' | b'n' => {
                    self.token.clear();
                    self.state = State::InLiteral;
                    return self.literal_byte(b, offset);
                }
                b']' if matches!(self.stack.last(), Some(Frame::Array(_))) => self.close(),
                _ => self.unexpected(b, offset, "a value"),
            },
            State::AwaitingKey => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'"' => {
                    self.text.clear();
                    self.state = State::InString { role: Role::Key, escape: Escape::None };
                }
                b'}' => self.close(),
                _ => self.unexpected(b, offset, "a key or '}'"),
            },
            State::AwaitingColon => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b':' => self.state = State::AwaitingValue,
                _ => self.unexpected(b, offset, "':'"),
            },
            State::AwaitingCommaOrClose => match (b, self.stack.last()) {
                (b' ' | b'\t' | b'\n' | b'\r', _) => {}
                (b',', Some(Frame::Array(_))) => self.state = State::AwaitingValue,
                (b',', Some(Frame::Object { .. })) => self.state = State::AwaitingKey,
                (b']', Some(Frame::Array(_))) | (b'}', Some(Frame::Object { .. })) => self.close(),
                _ => self.unexpected(b, offset, "',' or the matching closing bracket"),
            },
            State::InNumber => {
                if matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') {
                    self.token.push(char::from(b));
                } else {
                    self.finish_number(offset);
                    return false;
                }
            }
            State::InLiteral => return self.literal_byte(b, offset),
            State::InString { role, escape } => return self.string_byte(b, role, escape),
            State::SeekingStart | State::Done | State::Failed => {}
        }
        true
    }

    /// Opens a container as the next value.
    fn open(&mut self, frame: Frame, offset: usize) {
        if self.stack.len() == MAX_DEPTH {
            self.fail(PartialJsonError::TooDeep { offset });
            return;
        }
        self.state = match frame {
            Frame::Array(_) => State::AwaitingValue,
            Frame::Object { .. } => State::AwaitingKey,
        };
        self.stack.push(frame);
        // An empty container is already a visible value.
        self.changed = true;
    }

    /// Closes the innermost container and hands it to its parent. The snapshot already showed
    /// its contents, so nothing visible changes.
    fn close(&mut self) {
        let value = match self.stack.pop() {
            Some(Frame::Array(items)) => Value::Array(items),
            Some(Frame::Object { map, .. }) => Value::Object(map),
            None => return,
        };
        self.attach(value, false);
    }

    /// Stores a complete value in the innermost container (or as the root). `appears` says
    /// whether the value becomes visible only now (numbers and literals); strings and
    /// containers were visible from their first byte.
    fn attach(&mut self, value: Value, appears: bool) {
        self.changed |= appears;
        match self.stack.last_mut() {
            None => {
                self.root = Some(value);
                self.state = State::Done;
            }
            Some(Frame::Array(items)) => {
                items.push(value);
                self.state = State::AwaitingCommaOrClose;
            }
            Some(Frame::Object { map, key, duplicate }) => {
                if let Some(key) = key.take() {
                    if let Some(dup) = duplicate.take() {
                        let same = map.get(&key) == Some(&value);
                        if same && dup.epoch == self.epoch {
                            self.changed = dup.changed_before;
                        }
                    }
                    map.insert(key, value);
                }
                self.state = State::AwaitingCommaOrClose;
            }
        }
    }

    /// Converts the finished number token with `serde_json`, so numbers match `from_str`.
    fn finish_number(&mut self, offset: usize) {
        match serde_json::from_str::<Value>(&self.token) {
            Ok(number @ Value::Number(_)) => {
                self.attach(number, true);
            }
            _ => self.fail(PartialJsonError::InvalidNumber { offset }),
        }
    }

    /// One byte of `true`, `false` or `null`; the literal is attached as soon as it is whole.
    fn literal_byte(&mut self, b: u8, offset: usize) -> bool {
        const LITERALS: [(&str, Value); 3] =
            [("true", Value::Bool(true)), ("false", Value::Bool(false)), ("null", Value::Null)];
        self.token.push(char::from(b));
        let Some((word, value)) =
            LITERALS.iter().find(|(word, _)| b.is_ascii_lowercase() && word.starts_with(self.token.as_str()))
        else {
            self.unexpected(b, offset, "true, false or null");
            return true;
        };
        if word.len() == self.token.len() {
            self.attach(value.clone(), true);
        }
        true
    }

    /// One byte inside a string that is a quote, a backslash, or part of an escape.
    fn string_byte(&mut self, b: u8, role: Role, escape: Escape) -> bool {
        let mut next = Escape::None;
        match escape {
            Escape::None => match b {
                b'"' => {
                    self.finish_string(role);
                    return true;
                }
                b'\\' => {
                    self.escape_raw.clear();
                    self.escape_raw.push('\\');
                    next = Escape::Backslash;
                }
                // `feed` only hands quotes and backslashes here in plain text.
                _ => self.push_char(char::from(b), role),
            },
            Escape::Backslash => match b {
                b'"' | b'\\' | b'/' => self.push_char(char::from(b), role),
                b'b' => self.push_char('\u{8}', role),
                b'f' => self.push_char('\u{c}', role),
                b'n' => self.push_char('\n', role),
                b'r' => self.push_char('\r', role),
                b't' => self.push_char('\t', role),
                b'u' => {
                    self.escape_raw.push('u');
                    next = Escape::Unicode { digits: 0, code: 0 };
                }
                _ => {
                    // Invalid escape: keep the backslash, read the byte again as text.
                    self.push_char('\\', role);
                    self.set_escape(role, Escape::None);
                    return false;
                }
            },
            Escape::Unicode { digits, code } => match hex_value(b) {
                Some(v) => {
                    self.escape_raw.push(char::from(b));
                    let code = code * 16 + v;
                    next = if digits == 3 {
                        self.decoded(code, role)
                    } else {
                        Escape::Unicode { digits: digits + 1, code }
                    };
                }
                None => return self.invalid_unicode(role),
            },
            Escape::LowBackslash { high } => {
                if b == b'\\' {
                    next = Escape::LowU { high };
                } else {
                    self.push_char(char::REPLACEMENT_CHARACTER, role);
                    self.set_escape(role, Escape::None);
                    return false;
                }
            }
            Escape::LowU { high } => {
                if b == b'u' {
                    self.escape_raw.clear();
                    self.escape_raw.push_str("\\u");
                    next = Escape::LowUnicode { high, digits: 0, code: 0 };
                } else {
                    // The high half was alone; the backslash starts an ordinary escape.
                    self.push_char(char::REPLACEMENT_CHARACTER, role);
                    self.escape_raw.clear();
                    self.escape_raw.push('\\');
                    self.set_escape(role, Escape::Backslash);
                    return false;
                }
            }
            Escape::LowUnicode { high, digits, code } => match hex_value(b) {
                Some(v) => {
                    self.escape_raw.push(char::from(b));
                    let code = code * 16 + v;
                    next = if digits < 3 {
                        Escape::LowUnicode { high, digits: digits + 1, code }
                    } else if (0xDC00..0xE000).contains(&code) {
                        let combined = 0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00);
                        self.push_char(char::from_u32(combined).unwrap_or(char::REPLACEMENT_CHARACTER), role);
                        Escape::None
                    } else {
                        self.push_char(char::REPLACEMENT_CHARACTER, role);
                        self.decoded(code, role)
                    };
                }
                None => {
                    self.push_char(char::REPLACEMENT_CHARACTER, role);
                    return self.invalid_unicode(role);
                }
            },
        }
        self.set_escape(role, next);
        true
    }

    fn set_escape(&mut self, role: Role, escape: Escape) {
        self.state = State::InString { role, escape };
    }

    /// A complete `\uXXXX`: pushes its character, or waits for the low half of a surrogate.
    fn decoded(&mut self, code: u32, role: Role) -> Escape {
        if (0xD800..0xDC00).contains(&code) {
            return Escape::LowBackslash { high: code };
        }
        // A lone low surrogate has no character; U+FFFD stands in.
        self.push_char(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER), role);
        Escape::None
    }

    /// `\u` followed by a non-hex byte: the escape is kept as written, the byte is read again.
    fn invalid_unicode(&mut self, role: Role) -> bool {
        let raw = std::mem::take(&mut self.escape_raw);
        self.text.push_str(&raw);
        self.changed |= role == Role::Value;
        self.escape_raw = raw;
        self.set_escape(role, Escape::None);
        false
    }

    /// The closing quote: a key waits for its colon, a value is stored.
    fn finish_string(&mut self, role: Role) {
        let text = std::mem::take(&mut self.text);
        match role {
            Role::Key => {
                if let Some(Frame::Object { map, key, duplicate }) = self.stack.last_mut() {
                    *duplicate = map
                        .contains_key(&text)
                        .then_some(Duplicate { changed_before: self.changed, epoch: self.epoch });
                    *key = Some(text);
                }
                self.state = State::AwaitingColon;
            }
            Role::Value => self.attach(Value::String(text), false),
        }
    }
}

/// The value of a hex digit.
fn hex_value(b: u8) -> Option<u32> {
    char::from(b).to_digit(16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn snapshot_of(text: &str) -> Option<Value> {
        let mut parser = PartialJson::new();
        parser.feed(text);
        parser.snapshot()
    }

    #[test]
    fn table() {
        let cases: &[(&str, Option<Value>)] = &[
            ("", None),
            ("prose only", None),
            ("```json\n", None),
            ("```json\n{", Some(json!({}))),
            ("[", Some(json!([]))),
            ("{\"ke", Some(json!({}))),
            ("{\"key\"", Some(json!({}))),
            ("{\"key\":", Some(json!({}))),
            ("{\"key\": \"", Some(json!({"key": ""}))),
            ("{\"key\": \"ab", Some(json!({"key": "ab"}))),
            ("{\"key\": \"ab\\", Some(json!({"key": "ab"}))),
            ("{\"key\": \"ab\\n", Some(json!({"key": "ab\n"}))),
            ("{\"key\": \"ab\\u00", Some(json!({"key": "ab"}))),
            ("{\"key\": \"ab\\u00e9", Some(json!({"key": "abé"}))),
            ("{\"key\": \"ab\\ud83d", Some(json!({"key": "ab"}))),
            ("{\"key\": \"ab\\ud83d\\ude", Some(json!({"key": "ab"}))),
            ("{\"key\": \"ab\\ud83d\\ude00", Some(json!({"key": "ab😀"}))),
            ("{\"a\": 12", Some(json!({}))),
            ("{\"a\": 12,", Some(json!({"a": 12}))),
            ("[1, -", Some(json!([1]))),
            ("[1.5e", Some(json!([]))),
            ("[1.5e3]", Some(json!([1500.0]))),
            ("{\"a\": tru", Some(json!({}))),
            ("{\"a\": true", Some(json!({"a": true}))),
            ("[nul", Some(json!([]))),
            ("[null, fals", Some(json!([null]))),
            ("{\"a\": {\"b\": [1, {\"c\"", Some(json!({"a": {"b": [1, {}]}}))),
            ("{\"a\": [", Some(json!({"a": []}))),
            ("[[], {}, \"x\"", Some(json!([[], {}, "x"]))),
            ("Here:\n```json\n{\"a\": 1}\n```\nmore {\"b\": 2}", Some(json!({"a": 1}))),
            // Lenient readings.
            ("{\"p\": \"C:\\Users\"}", Some(json!({"p": "C:\\Users"}))),
            ("[1, 2,]", Some(json!([1, 2]))),
            ("{\"a\": 1,}", Some(json!({"a": 1}))),
            ("[\"a\nb\"]", Some(json!(["a\nb"]))),
            ("[\"\\ud83dx\"]", Some(json!(["\u{fffd}x"]))),
            ("[\"\\u12G\"]", Some(json!(["\\u12G"]))),
            ("[\"\\ud83d\\n\"]", Some(json!(["\u{fffd}\n"]))),
            // A syntax error freezes the value at the last good state.
            ("{\"a\": 1 x \"b\": 2}", Some(json!({"a": 1}))),
            ("[01]", Some(json!([]))),
        ];
        for (text, want) in cases {
            assert_eq!(snapshot_of(text), *want, "{text:?}");
        }
    }

    #[test]
    fn errors_and_completion() {
        let mut parser = PartialJson::new();
        parser.feed("{\"a\": 1 x");
        assert_eq!(
            parser.error(),
            Some(&PartialJsonError::Unexpected {
                byte: b'x',
                offset: 8,
                expected: "',' or the matching closing bracket"
            })
        );
        parser.feed("}");
        assert!(!parser.is_complete());

        let mut parser = PartialJson::new();
        parser.feed("[-]");
        assert_eq!(parser.error(), Some(&PartialJsonError::InvalidNumber { offset: 2 }));

        let mut parser = PartialJson::new();
        parser.feed(&"[".repeat(MAX_DEPTH + 1));
        assert_eq!(parser.error(), Some(&PartialJsonError::TooDeep { offset: MAX_DEPTH }));
        // The same limit as serde_json's, on either side of it.
        for depth in [MAX_DEPTH, MAX_DEPTH + 1] {
            let doc = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            let mut parser = PartialJson::new();
            parser.feed(&doc);
            let serde = serde_json::from_str::<Value>(&doc).ok();
            assert_eq!(parser.is_complete(), serde.is_some(), "depth {depth}");
            assert!(serde.is_none() || parser.snapshot() == serde, "depth {depth}");
        }

        let mut parser = PartialJson::new();
        parser.feed("{\"a\": [1]}\n```");
        assert!(parser.is_complete());
        assert_eq!(parser.error(), None);
        assert_eq!(parser.fed_bytes(), 14);
    }

    #[test]
    fn changes_are_reported_only_when_visible() {
        let mut parser = PartialJson::new();
        let mut seen = Vec::new();
        for chunk in [
            "prose ",
            "{",
            " ",
            "\"ke",
            "y\"",
            ":",
            " ",
            "1",
            "2",
            ",",
            " \"s\": \"",
            "a",
            "\\",
            "u00",
            "e9",
            "\"",
            "}",
        ] {
            parser.feed(chunk);
            seen.push(parser.snapshot_if_changed());
        }
        let want = [
            None,
            Some(json!({})),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            Some(json!({"key": 12})),
            Some(json!({"key": 12, "s": ""})),
            Some(json!({"key": 12, "s": "a"})),
            None,
            None,
            Some(json!({"key": 12, "s": "aé"})),
            None,
            None,
        ];
        assert_eq!(seen, want);
        assert!(parser.is_complete());
        assert_eq!(parser.snapshot(), Some(json!({"key": 12, "s": "aé"})));
    }

    #[test]
    fn duplicate_key_with_equal_value_is_no_change() {
        let mut parser = PartialJson::new();
        parser.feed("{\"a\": [1], \"b\": 2");
        assert_eq!(parser.snapshot_if_changed(), Some(json!({"a": [1]})));
        parser.feed(", \"a\": [1]");
        assert!(parser.has_changed(), "`b` appeared");
        assert_eq!(parser.snapshot_if_changed(), Some(json!({"a": [1], "b": 2})));
        parser.feed(", \"b\": 2, ");
        assert!(!parser.has_changed(), "`b` is the same again");
        parser.feed("\"a\": [");
        assert!(parser.has_changed(), "`a` shows as [] now");
        parser.feed("1]");
        assert!(!parser.has_changed(), "`a` is back to what was returned");
        assert_eq!(parser.snapshot_if_changed(), None);
        parser.feed(", \"a\": [");
        assert_eq!(parser.snapshot_if_changed(), Some(json!({"a": [], "b": 2})));
        parser.feed("1]");
        assert!(parser.has_changed(), "equal to an older value, not to the last returned");
        parser.feed(", \"a\": \"x\"}");
        assert_eq!(parser.snapshot_if_changed(), Some(json!({"a": "x", "b": 2})));
        assert_eq!(
            parser.snapshot(),
            serde_json::from_str("{\"a\": [1], \"b\": 2, \"a\": [1], \"b\": 2, \"a\": [], \"a\": \"x\"}").ok()
        );
    }

    /// `partial` could still grow into `full`: same types, strings are prefixes, containers
    /// hold a consistent subset.
    fn prefix_consistent(partial: &Value, full: &Value) -> bool {
        match (partial, full) {
            (Value::Object(p), Value::Object(f)) => {
                p.iter().all(|(k, v)| f.get(k).is_some_and(|fv| prefix_consistent(v, fv)))
            }
            (Value::Array(p), Value::Array(f)) => {
                p.len() <= f.len() && p.iter().zip(f).all(|(a, b)| prefix_consistent(a, b))
            }
            (Value::String(p), Value::String(f)) => f.starts_with(p.as_str()),
            _ => partial == full,
        }
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
            "\\PC{0,12}".prop_map(Value::String),
            "[a\"\\\\/\n\t\u{1}é😀]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map("\\PC{0,6}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn arb_document() -> impl Strategy<Value = Value> {
        prop_oneof![
            prop::collection::vec(arb_value(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("\\PC{0,6}", arb_value(), 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    }

    /// Writes `value` with every string character outside `[A-Za-z0-9 ]` as a `\u` escape
    /// (surrogate pairs included) and `/` as `\/`, to exercise every escape path.
    fn write_escaped(value: &Value, out: &mut String) {
        let string = |s: &str, out: &mut String| {
            out.push('"');
            for c in s.chars() {
                if c.is_ascii_alphanumeric() || c == ' ' {
                    out.push(c);
                } else if c == '/' {
                    out.push_str("\\/");
                } else {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04X}"));
                    }
                }
            }
            out.push('"');
        };
        match value {
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(" ,\n");
                    }
                    write_escaped(item, out);
                }
                out.push(']');
            }
            Value::Object(map) => {
                out.push_str("{ ");
                for (i, (k, v)) in map.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    string(k, out);
                    out.push_str(" :\t");
                    write_escaped(v, out);
                }
                out.push_str(" }");
            }
            Value::String(s) => string(s, out),
            other => out.push_str(&other.to_string()),
        }
    }

    /// Splits `text` at the given fractions, moved back to char boundaries.
    fn chunks(text: &str, cuts: &[prop::sample::Index]) -> Vec<String> {
        let mut points: Vec<usize> = cuts
            .iter()
            .map(|cut| {
                let mut p = cut.index(text.len() + 1);
                while !text.is_char_boundary(p) {
                    p -= 1;
                }
                p
            })
            .collect();
        points.push(0);
        points.push(text.len());
        points.sort_unstable();
        points.dedup();
        points.windows(2).map(|w| text[w[0]..w[1]].to_owned()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_chunking_gives_from_str_and_prefix_consistent_snapshots(
            doc in arb_document(),
            style in 0..3u8,
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..24),
        ) {
            let text = match style {
                0 => serde_json::to_string(&doc).unwrap(),
                1 => serde_json::to_string_pretty(&doc).unwrap(),
                _ => {
                    let mut out = String::new();
                    write_escaped(&doc, &mut out);
                    out
                }
            };
            let full: Value = serde_json::from_str(&text).unwrap();
            let mut parser = PartialJson::new();
            let mut previous: Option<Value> = None;
            for chunk in chunks(&text, &cuts) {
                parser.feed(&chunk);
                let snapshot = parser.snapshot();
                if let Some(snapshot) = &snapshot {
                    prop_assert!(prefix_consistent(snapshot, &full), "{snapshot} vs {full}");
                    if let Some(previous) = &previous {
                        prop_assert!(prefix_consistent(previous, snapshot), "{previous} then {snapshot}");
                    }
                }
                prop_assert!(previous.is_none() || snapshot.is_some());
                previous = snapshot;
            }
            prop_assert!(parser.is_complete());
            prop_assert_eq!(parser.error(), None);
            prop_assert_eq!(parser.snapshot(), Some(full));
        }

        #[test]
        fn every_byte_prefix_is_prefix_consistent(doc in arb_document()) {
            let text = serde_json::to_string(&doc).unwrap();
            let full: Value = serde_json::from_str(&text).unwrap();
            let mut parser = PartialJson::new();
            let mut previous = Value::Null;
            for (i, c) in text.char_indices() {
                parser.feed(&text[i..i + c.len_utf8()]);
                let snapshot = parser.snapshot().expect("a document starts with a bracket");
                prop_assert!(prefix_consistent(&snapshot, &full), "{snapshot} vs {full}");
                if previous != Value::Null {
                    prop_assert!(prefix_consistent(&previous, &snapshot), "{previous} then {snapshot}");
                }
                previous = snapshot;
            }
            prop_assert_eq!(previous, full);
        }
    }
}
