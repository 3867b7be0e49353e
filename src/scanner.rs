//! The incremental tag scanner: splits one stream's text into visible text and captured regions.
//!
//! It owns the byte-level state of one stream between deltas: which capture (if any) is open, the
//! few bytes held back because they may still become an open tag, and how much of a close tag the
//! previous delta ended with. It knows nothing of payload formats, sequence numbers, item ids, NATS
//! or protobuf: it reports [`ScanSink`] calls in stream order and the [`crate::pipeline`] turns them
//! into outputs.
//!
//! Matching rules (the geppetto FilteringSink convention, made split-proof):
//! * an open tag is the exact byte string `<name>` of a registered tag; anything else starting with
//!   `<` is text (`a < b`, `<b>`, `x<3`, an unregistered `<p:t:v>`);
//! * inside a capture everything is payload until the first exact `</name>` of that capture (no
//!   nesting; near misses such as `</name!>` stay payload). Tool-call captures ignore a close tag
//!   that stands inside a JSON string;
//! * only bytes that can still begin a registered open tag are held back (never more than the
//!   longest open tag minus one byte); a held `<` that turns out not to start a tag is released as
//!   text and scanning resumes right after it, so `<<tag>` and `a<b<tag>` capture the block.
//!
//! Work is proportional to the new bytes: `memchr` jumps between interesting bytes, a held prefix
//! is at most one tag long, and a partial close tag is remembered as a count, not re-read.

use std::collections::HashMap;

/// The index of a registered tag in its [`TagSet`], in registration order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TagId(pub u16);

/// How the end of a capture is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseRule {
    /// The first exact close tag ends the capture.
    Exact,
    /// The first exact close tag outside a JSON string (`"…"`, with `\` escapes) ends the capture.
    /// A `</tool>` inside an argument string is payload.
    OutsideJsonStrings,
}

/// Why a tag set could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TagSetError {
    /// A name contains a byte outside `[A-Za-z0-9_.:-]` or is empty.
    #[error("tag name {0:?} is invalid: use 1 to {MAX_TAG_NAME_LEN} characters of [A-Za-z0-9_.:-]")]
    InvalidName(String),
    /// The same name was registered twice.
    #[error("tag {0:?} is registered twice")]
    Duplicate(String),
    /// More tags than a [`TagId`] can number.
    #[error("too many tags: at most {} may be registered", usize::from(u16::MAX) + 1)]
    TooMany,
}

/// The longest tag name accepted, which bounds the bytes a stream ever holds back.
pub const MAX_TAG_NAME_LEN: usize = 128;

/// One registered tag as the scanner sees it: its open and close byte strings.
#[derive(Debug, Clone)]
struct ScanTag {
    open: Box<[u8]>,
    close: Box<[u8]>,
    rule: CloseRule,
}

/// The registered tags of a pipeline, prepared for matching. Shared read-only by all streams.
#[derive(Debug, Clone)]
pub struct TagSet {
    tags: Vec<ScanTag>,
    by_open: HashMap<Box<[u8]>, TagId>,
    /// Open tags sorted bytewise, for the "is this a prefix of some tag" question.
    sorted_open: Vec<Box<[u8]>>,
    /// `can_follow_lt[b]` is true when some open tag has `b` right after its `<`: a cheap first
    /// filter that lets prose such as `a < b` through without any lookup.
    can_follow_lt: [bool; 256],
    max_open_len: usize,
}

/// Whether `b` may appear in a tag name.
pub fn is_tag_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-')
}

impl TagSet {
    /// Prepares `tags` (name and close rule) for matching. Names are the text between `<` and `>`.
    pub fn new<'a>(tags: impl IntoIterator<Item = (&'a str, CloseRule)>) -> Result<Self, TagSetError> {
        let mut set = TagSet {
            tags: Vec::new(),
            by_open: HashMap::new(),
            sorted_open: Vec::new(),
            can_follow_lt: [false; 256],
            max_open_len: 0,
        };
        for (name, rule) in tags {
            if name.is_empty() || name.len() > MAX_TAG_NAME_LEN || !name.bytes().all(is_tag_name_byte) {
                return Err(TagSetError::InvalidName(name.to_owned()));
            }
            let id = TagId(u16::try_from(set.tags.len()).map_err(|_| TagSetError::TooMany)?);
            let open: Box<[u8]> = format!("<{name}>").into_bytes().into();
            let close: Box<[u8]> = format!("</{name}>").into_bytes().into();
            if set.by_open.insert(open.clone(), id).is_some() {
                return Err(TagSetError::Duplicate(name.to_owned()));
            }
            set.can_follow_lt[usize::from(open[1])] = true;
            set.max_open_len = set.max_open_len.max(open.len());
            set.sorted_open.push(open.clone());
            set.tags.push(ScanTag { open, close, rule });
        }
        set.sorted_open.sort_unstable();
        Ok(set)
    }

    /// The number of registered tags.
    pub fn len(&self) -> usize {
        self.tags.len()
    }

    /// Whether no tag is registered (the scanner then passes all text through).
    pub fn is_empty(&self) -> bool {
        self.tags.is_empty()
    }

    /// The longest open tag in bytes, which bounds what a stream holds back: an open tag's prefix
    /// (at most this minus one), or a close tag's (one byte longer than its open tag, so at most
    /// this).
    pub fn max_open_len(&self) -> usize {
        self.max_open_len
    }

    /// The exact open tag of `id`, such as `<core:x:v1>`.
    pub fn open_tag(&self, id: TagId) -> &str {
        // Built from a validated ASCII name.
        std::str::from_utf8(&self.tags[usize::from(id.0)].open).unwrap_or_default()
    }

    /// The exact close tag of `id`, such as `</core:x:v1>`.
    pub fn close_tag(&self, id: TagId) -> &str {
        std::str::from_utf8(&self.tags[usize::from(id.0)].close).unwrap_or_default()
    }

    /// Classifies the bytes starting at a `<`: a whole registered open tag, a proper prefix of
    /// one (more input needed), or not a tag. Looks at most `max_open_len` bytes.
    fn classify(&self, cand: &[u8]) -> Candidate {
        debug_assert_eq!(cand.first(), Some(&b'<'));
        let Some(&second) = cand.get(1) else {
            return if self.is_empty() { Candidate::NotTag } else { Candidate::Prefix };
        };
        if !self.can_follow_lt[usize::from(second)] {
            return Candidate::NotTag;
        }
        let window = &cand[..cand.len().min(self.max_open_len)];
        // Open tags contain exactly one `>`, at their end; the first `>` decides.
        match memchr::memchr(b'>', &window[1..]) {
            Some(i) => match self.by_open.get(&window[..i + 2]) {
                Some(&id) => Candidate::Tag(id, i + 2),
                None => Candidate::NotTag,
            },
            None if cand.len() >= self.max_open_len => Candidate::NotTag,
            None => {
                let first_not_less = self.sorted_open.partition_point(|t| t.as_ref() < cand);
                match self.sorted_open.get(first_not_less) {
                    Some(t) if t.starts_with(cand) => Candidate::Prefix,
                    _ => Candidate::NotTag,
                }
            }
        }
    }
}

/// What the bytes at a `<` turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Candidate {
    /// A registered open tag of this many bytes.
    Tag(TagId, usize),
    /// A proper prefix of at least one registered open tag: wait for more input.
    Prefix,
    /// The `<` is text.
    NotTag,
}

/// Receives the scanner's findings in stream order.
pub trait ScanSink {
    /// Visible text (never empty).
    fn text(&mut self, text: &str);
    /// An open tag was matched; payload of this capture follows.
    fn open(&mut self, tag: TagId);
    /// Payload bytes of the open capture that are certain: they contain no part of its close tag.
    fn payload(&mut self, tag: TagId, raw: &str);
    /// The capture's exact close tag was matched.
    fn close(&mut self, tag: TagId);
    /// The input ended inside the capture (only from [`TagScanner::finish`]).
    fn unclosed(&mut self, tag: TagId);
}

/// Where a tool-call capture stands with respect to JSON strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JsonString {
    Outside,
    Inside,
    /// Inside a string, right after a `\`: the next byte is escaped.
    InsideEscaped,
}

/// The scanner state. Named after what it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScanState {
    /// Entered at start and after each close tag. Waits for a `<` that begins a registered open
    /// tag; bytes after a `<` that may still become one are held in `TagScanner::held`.
    AwaitingOpen,
    /// Entered when an open tag matched. Waits for the capture's close tag; `matched` bytes of it
    /// ended the previous delta (they are the close tag's own prefix, so they need no buffer).
    AwaitingClose { tag: TagId, matched: usize, json: JsonString },
}

/// The per-stream scanner. A few dozen bytes plus at most one held-back open-tag prefix.
#[derive(Debug, Clone)]
pub struct TagScanner {
    state: ScanState,
    /// A proper prefix of a registered open tag (starts with `<`, contains no other `<`), held
    /// back at the end of the previous delta. Empty unless awaiting an open tag.
    held: Vec<u8>,
}

impl Default for TagScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl TagScanner {
    /// A scanner at the start of a stream.
    pub fn new() -> Self {
        TagScanner { state: ScanState::AwaitingOpen, held: Vec::new() }
    }

    /// Bytes currently held back (an open-tag prefix or a close-tag prefix).
    pub fn held_len(&self) -> usize {
        match self.state {
            ScanState::AwaitingOpen => self.held.len(),
            ScanState::AwaitingClose { matched, .. } => matched,
        }
    }

    /// The capture currently open, if any.
    pub fn open_capture(&self) -> Option<TagId> {
        match self.state {
            ScanState::AwaitingOpen => None,
            ScanState::AwaitingClose { tag, .. } => Some(tag),
        }
    }

    /// Scans one delta, reporting everything that became certain.
    pub fn feed<S: ScanSink>(&mut self, tags: &TagSet, input: &str, sink: &mut S) {
        let mut rest = input;
        while !rest.is_empty() {
            rest = match self.state {
                ScanState::AwaitingOpen => self.scan_text(tags, rest, sink),
                ScanState::AwaitingClose { .. } => self.scan_capture(tags, rest, sink),
            };
        }
    }

    /// Ends the stream: held bytes become text (or payload), and an open capture is reported
    /// unclosed. The scanner is then back at the start state.
    pub fn finish<S: ScanSink>(&mut self, tags: &TagSet, sink: &mut S) {
        match self.state {
            ScanState::AwaitingOpen => {
                if !self.held.is_empty() {
                    sink.text(held_str(&self.held));
                    self.held.clear();
                }
            }
            ScanState::AwaitingClose { tag, matched, .. } => {
                if matched > 0 {
                    sink.payload(tag, close_prefix(tags, tag, matched));
                }
                sink.unclosed(tag);
                self.state = ScanState::AwaitingOpen;
            }
        }
    }

    /// Handles input while awaiting an open tag; returns the unconsumed rest (non-empty only when
    /// a capture opened).
    fn scan_text<'i, S: ScanSink>(&mut self, tags: &TagSet, input: &'i str, sink: &mut S) -> &'i str {
        let bytes = input.as_bytes();
        if !self.held.is_empty() {
            match self.resolve_held(tags, bytes) {
                Held::Opened(tag, consumed) => {
                    self.held.clear();
                    sink.open(tag);
                    self.state = ScanState::AwaitingClose { tag, matched: 0, json: JsonString::Outside };
                    return &input[consumed..];
                }
                Held::StillPrefix => {
                    self.held.extend_from_slice(bytes);
                    return "";
                }
                Held::Released => {
                    // The held `<` begins no tag; the held bytes after it contain no `<`, so no
                    // tag can start inside them: all of them are text, and scanning resumes at
                    // the first new byte.
                    sink.text(held_str(&self.held));
                    self.held.clear();
                }
            }
        }
        // Everything before the decisive `<` is one text run: stray `<`s are skipped, not split on.
        let mut search = 0;
        while let Some(i) = memchr::memchr(b'<', &bytes[search..]) {
            let lt = search + i;
            match tags.classify(&bytes[lt..]) {
                Candidate::NotTag => search = lt + 1,
                Candidate::Prefix => {
                    emit_text(sink, &input[..lt]);
                    self.held.extend_from_slice(&bytes[lt..]);
                    return "";
                }
                Candidate::Tag(tag, len) => {
                    emit_text(sink, &input[..lt]);
                    sink.open(tag);
                    self.state = ScanState::AwaitingClose { tag, matched: 0, json: JsonString::Outside };
                    return &input[lt + len..];
                }
            }
        }
        emit_text(sink, input);
        ""
    }

    /// Decides a held open-tag prefix with the help of the new bytes.
    fn resolve_held(&self, tags: &TagSet, bytes: &[u8]) -> Held {
        // The candidate never needs more than one open tag's worth of bytes.
        let take = bytes.len().min(tags.max_open_len.saturating_sub(self.held.len()));
        let mut cand = [0u8; MAX_TAG_NAME_LEN + 2];
        let held_len = self.held.len();
        cand[..held_len].copy_from_slice(&self.held);
        cand[held_len..held_len + take].copy_from_slice(&bytes[..take]);
        match tags.classify(&cand[..held_len + take]) {
            Candidate::Tag(tag, len) => Held::Opened(tag, len - held_len),
            Candidate::Prefix => Held::StillPrefix,
            Candidate::NotTag => Held::Released,
        }
    }

    /// Handles input while awaiting a close tag; returns the unconsumed rest (non-empty only when
    /// the capture closed).
    fn scan_capture<'i, S: ScanSink>(&mut self, tags: &TagSet, input: &'i str, sink: &mut S) -> &'i str {
        let ScanState::AwaitingClose { tag, matched, mut json } = self.state else {
            unreachable!("scan_capture runs only while awaiting a close tag");
        };
        let spec = &tags.tags[usize::from(tag.0)];
        let close: &[u8] = &spec.close;
        let bytes = input.as_bytes();

        if matched > 0 {
            let want = &close[matched..];
            let n = want.len().min(bytes.len());
            let common = want.iter().zip(bytes).take_while(|(a, b)| a == b).count();
            if common == want.len() {
                sink.close(tag);
                self.state = ScanState::AwaitingOpen;
                return &input[common..];
            }
            if common == n {
                self.state = ScanState::AwaitingClose { tag, matched: matched + n, json };
                return "";
            }
            // A near miss: the remembered bytes were payload after all. The new bytes are
            // scanned from the start; they hold no `<` among the matched ones, since a close tag
            // has its only `<` first.
            sink.payload(tag, close_prefix(tags, tag, matched));
        }

        // All bytes before the decisive position are payload; they are reported in one piece.
        let mut pos = 0;
        loop {
            let next = match (spec.rule, json) {
                (CloseRule::Exact, _) => memchr::memchr(b'<', &bytes[pos..]),
                (CloseRule::OutsideJsonStrings, JsonString::Outside) => memchr::memchr2(b'<', b'"', &bytes[pos..]),
                (CloseRule::OutsideJsonStrings, JsonString::Inside) => memchr::memchr2(b'"', b'\\', &bytes[pos..]),
                (CloseRule::OutsideJsonStrings, JsonString::InsideEscaped) => Some(0),
            };
            let Some(i) = next else {
                emit_payload(sink, tag, input);
                self.state = ScanState::AwaitingClose { tag, matched: 0, json };
                return "";
            };
            let at = pos + i;
            match (bytes[at], json) {
                (_, JsonString::InsideEscaped) => {
                    json = JsonString::Inside;
                    pos = at + 1;
                }
                (b'\\', _) => {
                    json = JsonString::InsideEscaped;
                    pos = at + 1;
                }
                (b'"', JsonString::Outside) => {
                    json = JsonString::Inside;
                    pos = at + 1;
                }
                (b'"', _) => {
                    json = JsonString::Outside;
                    pos = at + 1;
                }
                _ => {
                    // A `<` outside any JSON string: maybe the close tag.
                    let tail = &bytes[at..];
                    if tail.len() >= close.len() {
                        if tail.starts_with(close) {
                            emit_payload(sink, tag, &input[..at]);
                            sink.close(tag);
                            self.state = ScanState::AwaitingOpen;
                            return &input[at + close.len()..];
                        }
                    } else if close.starts_with(tail) {
                        emit_payload(sink, tag, &input[..at]);
                        self.state = ScanState::AwaitingClose { tag, matched: tail.len(), json };
                        return "";
                    }
                    pos = at + 1;
                }
            }
            if pos >= bytes.len() {
                emit_payload(sink, tag, input);
                self.state = ScanState::AwaitingClose { tag, matched: 0, json };
                return "";
            }
        }
    }
}

/// How a held open-tag prefix was decided.
enum Held {
    /// It completed a tag; this many new bytes belonged to the tag.
    Opened(TagId, usize),
    /// All new bytes extend it and it is still a proper prefix.
    StillPrefix,
    /// It is not a tag: release it as text.
    Released,
}

fn emit_text<S: ScanSink>(sink: &mut S, text: &str) {
    if !text.is_empty() {
        sink.text(text);
    }
}

fn emit_payload<S: ScanSink>(sink: &mut S, tag: TagId, raw: &str) {
    if !raw.is_empty() {
        sink.payload(tag, raw);
    }
}

/// The first `n` bytes of `tag`'s close tag, which is ASCII.
fn close_prefix(tags: &TagSet, tag: TagId, n: usize) -> &str {
    &tags.close_tag(tag)[..n]
}

/// Held bytes are a prefix of an ASCII open tag, so always valid UTF-8.
fn held_str(held: &[u8]) -> &str {
    std::str::from_utf8(held).expect("held bytes are an ASCII tag prefix")
}

#[cfg(test)]
mod tests;
