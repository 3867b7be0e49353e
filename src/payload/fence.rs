//! Markdown code fences around a payload: which part of a block's text is the value.
//!
//! Owns the rules for finding the body of the first ```` ``` ```` fence, both on a complete text
//! ([`fenced_body`], [`find_fence`]) and line by line while the text streams
//! (`FenceTracker`, used by the YAML snapshots so they never rescan the head of the payload).
//! It does not know what format the body is in; YAML and JSON parsing live beside it.
//!
//! The rules, on lines (a line ends at `\n`; a `\r` before it counts as trailing whitespace):
//! * An **opening fence** is the first line whose text, after any spaces or tabs, starts with at
//!   least three backticks and whose info string (the rest of the line: `yaml`, `yml`, `json`,
//!   anything, or nothing) contains no backtick. The info line is never part of the body. A line
//!   that is the content of a YAML block scalar (`key: |` or `key: >` on an earlier line, this one
//!   indented deeper) opens nothing: an unfenced payload may hold a fenced example there.
//! * A **closing fence** is a later line of at least as many backticks as the opening, with only
//!   whitespace after them, indented no deeper than the opening fence. The depth rule is a
//!   deliberate departure from CommonMark: a YAML block scalar that itself contains a fenced
//!   example is indented, so its inner fence lines do not end the payload.
//! * **Streaming**: without a closing fence the body runs to the end of the text, except that a
//!   last, unterminated line made only of backticks (``` ` ```, ``` `` ```, with optional
//!   surrounding whitespace) is left out: it may be the start of the closing fence, and a
//!   partial fence must never leak into the value.
//! * **No fence**: the text is used as is, minus leading and trailing blank lines and minus the
//!   same partial-fence last line. The last kept line keeps its `\n`.
//!
//! Tildes (`~~~`) are not fences here: models write backticks, and a `~~~` line is valid YAML.

use memchr::memchr;

/// The first code fence of a payload, as found by [`find_fence`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence<'a> {
    /// The info string of the opening line, trimmed (`"yaml"`, `"json"`, `""`, ...).
    pub info: &'a str,
    /// The text between the opening line and the closing fence (or the end, see the module doc).
    pub body: &'a str,
    /// Whether a closing fence was seen.
    pub closed: bool,
}

/// Returns the body a payload parser should read: the content of the first fence, or the
/// whole text without surrounding blank lines when there is no fence (see the module doc).
///
/// Work is linear in `raw`.
pub fn fenced_body(raw: &str) -> &str {
    match find_fence(raw) {
        Some(fence) => fence.body,
        None => unfenced_body(raw),
    }
}

/// Finds the first code fence in `raw`, or `None` when no line opens one.
///
/// An opening line still being written (no `\n` yet) counts as a fence with an empty body, so a
/// streaming caller never mistakes the info string for content.
pub fn find_fence(raw: &str) -> Option<Fence<'_>> {
    let mut lines = Lines::new(raw);
    let mut scalar = BlockScalar::default();
    let (open, body_start) = lines.by_ref().find_map(|line| {
        if scalar.holds(line.text) {
            return None;
        }
        let open = OpeningFence::parse(line.text)?;
        Some((open, line.end_with_newline()))
    })?;
    let mut body_end = raw.len();
    let mut closed = false;
    for line in lines {
        if open.is_closed_by(line.text) {
            body_end = line.start;
            closed = true;
            break;
        }
        if !line.terminated && is_partial_fence(line.text) {
            body_end = line.start;
        }
    }
    Some(Fence { info: open.info, body: &raw[body_start..body_end], closed })
}

/// The body of a payload without any fence: blank lines around it and a partial fence at the
/// end are dropped.
fn unfenced_body(raw: &str) -> &str {
    let mut span: Option<(usize, usize)> = None;
    for line in Lines::new(raw) {
        let kept = if line.terminated {
            !line.text.trim().is_empty()
        } else {
            !line.text.trim().is_empty() && !is_partial_fence(line.text)
        };
        if kept {
            let end = line.end_with_newline();
            span = Some(span.map_or((line.start, end), |(start, _)| (start, end)));
        }
    }
    span.map_or("", |(start, end)| &raw[start..end])
}

/// Whether `text` (one line, without `\n`) is only backticks, i.e. may still grow into a
/// closing fence.
fn is_partial_fence(text: &str) -> bool {
    let trimmed = text.trim();
    !trimmed.is_empty() && trimmed.bytes().all(|b| b == b'`')
}

/// Number of leading spaces and tabs.
fn indent_of(text: &str) -> usize {
    text.bytes().take_while(|b| *b == b' ' || *b == b'\t').count()
}

/// Number of leading backticks.
fn ticks_of(text: &str) -> usize {
    text.bytes().take_while(|b| *b == b'`').count()
}

/// Whether the lines before an opening fence are inside a YAML block scalar, whose content
/// cannot open the fence (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct BlockScalar {
    /// The indentation of the line that opened the block scalar the text is in, if any.
    opener: Option<usize>,
}

impl BlockScalar {
    /// Takes the next line (without `\n`) before any fence; whether it is block-scalar content.
    fn holds(&mut self, text: &str) -> bool {
        let indent = indent_of(text);
        let content = text[indent..].trim_end();
        if let Some(opener) = self.opener {
            if content.is_empty() || indent > opener {
                return true;
            }
            self.opener = None;
        }
        if super::yaml::opens_block_scalar(content) {
            self.opener = Some(indent);
        }
        false
    }
}

/// An opening fence line: how deep it is indented and how many backticks close it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OpeningFence<'a> {
    indent: usize,
    ticks: usize,
    info: &'a str,
}

impl<'a> OpeningFence<'a> {
    /// Parses one line (without `\n`) as an opening fence.
    fn parse(text: &'a str) -> Option<Self> {
        let indent = indent_of(text);
        let rest = &text[indent..];
        let ticks = ticks_of(rest);
        let info = &rest[ticks..];
        // A backtick in the info string means inline code (```x```), not a fence.
        (ticks >= 3 && !info.contains('`')).then(|| OpeningFence { indent, ticks, info: info.trim() })
    }

    /// Whether `text` (one line, without `\n`) closes this fence.
    fn is_closed_by(&self, text: &str) -> bool {
        let indent = indent_of(text);
        let rest = &text[indent..];
        let ticks = ticks_of(rest);
        indent <= self.indent && ticks >= self.ticks && rest[ticks..].trim().is_empty()
    }
}

/// One line of a text: where it starts, its text without `\n`, whether a `\n` ends it.
#[derive(Debug, Clone, Copy)]
struct Line<'a> {
    start: usize,
    text: &'a str,
    terminated: bool,
}

impl Line<'_> {
    /// Offset just past the line, including its `\n` when it has one.
    fn end_with_newline(&self) -> usize {
        self.start + self.text.len() + usize::from(self.terminated)
    }
}

/// Iterator over the lines of a text; an empty text has no lines, and a text ending in `\n`
/// has no empty last line.
struct Lines<'a> {
    raw: &'a str,
    pos: usize,
}

impl<'a> Lines<'a> {
    fn new(raw: &'a str) -> Self {
        Lines { raw, pos: 0 }
    }
}

impl<'a> Iterator for Lines<'a> {
    type Item = Line<'a>;

    fn next(&mut self) -> Option<Line<'a>> {
        if self.pos >= self.raw.len() {
            return None;
        }
        let start = self.pos;
        let rest = &self.raw[start..];
        match memchr(b'\n', rest.as_bytes()) {
            Some(nl) => {
                self.pos = start + nl + 1;
                Some(Line { start, text: &rest[..nl], terminated: true })
            }
            None => {
                self.pos = self.raw.len();
                Some(Line { start, text: rest, terminated: false })
            }
        }
    }
}

/// Tracks the fence of a growing text one complete line at a time, so that the body of any
/// prefix ending at a `\n` is known without rescanning the head.
///
/// Invariant: after [`FenceTracker::advance`] on a text, [`FenceTracker::body`] on that text
/// equals [`fenced_body`] of the text cut after its last `\n`. Each line is examined once.
#[derive(Debug, Clone, Default)]
pub(crate) struct FenceTracker {
    state: TrackState,
    /// Offset just past the last processed `\n` (start of the first unprocessed line).
    processed: usize,
}

/// What the tracker waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrackState {
    /// No opening fence yet. `content` is the span from the first to the end of the last
    /// non-blank line seen so far (the unfenced body); `scalar`, the block scalar the lines are
    /// in. Exit: a line opens a fence.
    SeekingOpen { content: Option<(usize, usize)>, scalar: BlockScalar },
    /// Inside a fence whose body starts at `body_start`. Exit: a closing fence line.
    AwaitingClose { indent: usize, ticks: usize, body_start: usize },
    /// The fence is closed; later lines are ignored. Terminal.
    Closed { body_start: usize, body_end: usize },
}

impl Default for TrackState {
    fn default() -> Self {
        TrackState::SeekingOpen { content: None, scalar: BlockScalar::default() }
    }
}

impl FenceTracker {
    /// Processes the complete lines of `text` not seen yet. `text` must extend the text given
    /// to earlier calls. Returns the offset just past the last `\n` (the usable prefix length).
    pub(crate) fn advance(&mut self, text: &str) -> usize {
        while let Some(nl) = memchr(b'\n', &text.as_bytes()[self.processed..]) {
            let start = self.processed;
            let end = start + nl;
            self.processed = end + 1;
            self.line(start, &text[start..end]);
        }
        self.processed
    }

    /// One complete line starting at `start`, without its `\n`.
    fn line(&mut self, start: usize, line: &str) {
        self.state = match self.state {
            TrackState::SeekingOpen { content, mut scalar } => {
                let open = if scalar.holds(line) { None } else { OpeningFence::parse(line) };
                match open {
                    Some(open) => {
                        TrackState::AwaitingClose { indent: open.indent, ticks: open.ticks, body_start: self.processed }
                    }
                    None if line.trim().is_empty() => TrackState::SeekingOpen { content, scalar },
                    None => {
                        let content = Some((content.map_or(start, |(s, _)| s), self.processed));
                        TrackState::SeekingOpen { content, scalar }
                    }
                }
            }
            TrackState::AwaitingClose { indent, ticks, body_start } => {
                let open = OpeningFence { indent, ticks, info: "" };
                if open.is_closed_by(line) {
                    TrackState::Closed { body_start, body_end: start }
                } else {
                    self.state
                }
            }
            TrackState::Closed { .. } => self.state,
        };
    }

    /// The body of `text` cut after the last processed `\n`.
    pub(crate) fn body<'a>(&self, text: &'a str) -> &'a str {
        match self.state {
            TrackState::SeekingOpen { content, .. } => content.map_or("", |(s, e)| &text[s..e]),
            TrackState::AwaitingClose { body_start, .. } => &text[body_start..self.processed],
            TrackState::Closed { body_start, body_end } => &text[body_start..body_end],
        }
    }

    /// Whether a closing fence has been seen (later text can no longer change the body).
    pub(crate) fn is_closed(&self) -> bool {
        matches!(self.state, TrackState::Closed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let cases: &[(&str, &str, &str)] = &[
            ("no fence", "a: 1\nb: 2\n", "a: 1\nb: 2\n"),
            ("no fence, blank lines around", "\n  \na: 1\n\n \n", "a: 1\n"),
            ("no fence, no newline", "a: 1", "a: 1"),
            ("empty", "", ""),
            ("yaml info", "```yaml\na: 1\n```\n", "a: 1\n"),
            ("yml info", "```yml\na: 1\n```", "a: 1\n"),
            ("json info", "```json\n{\"a\":1}\n```", "{\"a\":1}\n"),
            ("no info", "```\na: 1\n```\n", "a: 1\n"),
            ("info with spaces", "``` yaml title=x \na: 1\n```\n", "a: 1\n"),
            ("prose around", "Sure! Here it is:\n\n```yaml\na: 1\n```\nHope this helps.\n```\nx\n```", "a: 1\n"),
            ("unclosed", "```yaml\na: 1\nb: 2", "a: 1\nb: 2"),
            ("unclosed, info line streaming", "text\n```yam", ""),
            ("partial close, one backtick", "```yaml\na: 1\n`", "a: 1\n"),
            ("partial close, two backticks", "```yaml\na: 1\n``", "a: 1\n"),
            ("partial close, indented", "```yaml\na: 1\n  `` ", "a: 1\n"),
            ("complete close without newline", "```yaml\na: 1\n```", "a: 1\n"),
            ("longer close", "```yaml\na: 1\n`````  \r\nz", "a: 1\n"),
            ("four-tick fence keeps three-tick line", "````\na\n```\nb\n````\n", "a\n```\nb\n"),
            ("no fence, partial fence at end", "a: 1\n``", "a: 1\n"),
            ("backtick content is kept", "```yaml\na: run `ls`", "a: run `ls`"),
            (
                "indented inner fence is content",
                "```yaml\nex: |\n  ```py\n  x\n  ```\nb: 1\n```\n",
                "ex: |\n  ```py\n  x\n  ```\nb: 1\n",
            ),
            ("inline triple backticks are not a fence", "a: ```x```\n", "a: ```x```\n"),
            (
                "a fence in an unfenced block scalar is content",
                "example: |\n  ```python\n  x = 1\n  ```\nname: demo\n",
                "example: |\n  ```python\n  x = 1\n  ```\nname: demo\n",
            ),
            ("a fence after a block scalar ends opens", "note: >\n  folded\n\n```yaml\na: 1\n```\n", "a: 1\n"),
            ("a fence as deep as the scalar's opener opens", "  s: |\n  ```\n  a\n  ```\n", "  a\n"),
            ("crlf", "```yaml\r\na: 1\r\n```\r\n", "a: 1\r\n"),
        ];
        for (name, raw, want) in cases {
            assert_eq!(fenced_body(raw), *want, "{name}: {raw:?}");
        }
    }

    #[test]
    fn find_fence_reports_info_and_closed() {
        let fence = find_fence("x\n```json \n{}\n```\n").expect("fence");
        assert_eq!(fence.info, "json");
        assert_eq!(fence.body, "{}\n");
        assert!(fence.closed);
        let open = find_fence("```\n{").expect("fence");
        assert_eq!((open.info, open.body, open.closed), ("", "{", false));
        assert_eq!(find_fence("a: 1\n``"), None);
    }

    #[test]
    fn tracker_matches_fenced_body_at_every_newline() {
        let texts = [
            "\n\nprose: x\n\n```yaml\na: 1\n\nb:\n  - 2\n```\nafter\n",
            "a: 1\n\nb: 2\n\n",
            "```\n```\n",
            "  ```yaml\n  a: 1\n    ```\n  ```\nz\n",
            "intro\n````json\n{\n```\n}\n````\n",
            "example: |\n  ```python\n\n  x = 1\n  ```\nname: demo\n```\nz\n```\n",
            "a: |\nb: >\n   ```\n  ```\n```\nc\n```\n",
        ];
        for text in texts {
            let mut tracker = FenceTracker::default();
            for (i, _) in text.match_indices('\n') {
                let prefix = &text[..=i];
                assert_eq!(tracker.advance(prefix), prefix.len());
                assert_eq!(tracker.body(prefix), fenced_body(prefix), "{prefix:?}");
            }
        }
    }

    #[test]
    fn tracker_ignores_unterminated_tail_and_closes() {
        let mut tracker = FenceTracker::default();
        let text = "```yaml\na: 1\n```\nb: 2\n";
        assert_eq!(tracker.advance(&text[..10]), 8);
        assert_eq!(tracker.body(&text[..10]), "");
        assert!(!tracker.is_closed());
        tracker.advance(text);
        assert!(tracker.is_closed());
        assert_eq!(tracker.body(text), "a: 1\n");
    }
}
