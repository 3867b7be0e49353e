//! The per-stream pipeline: escape decoding, tag scanning, captures, sequence numbers and finals.
//!
//! A [`Pipeline`] holds what all streams share (the registered tags, the limits, scratch buffers,
//! counters); a [`StreamState`] holds one stream's progress and stays small (well under 1 KiB plus
//! its captured payload, held bytes and the visible text it retains for the cumulative `text`
//! (up to `max_text_bytes`, none with [`CumulativeText::Never`]). Feeding a delta or finishing a
//! stream writes [`Output`]s, in stream order, into an [`Emit`] sink the caller passes in.
//!
//! This module knows nothing of tokio, NATS, protobuf or wall-clock time, nor of stream ids and
//! metadata: the caller attaches those when it encodes an output.

pub mod unescape;

use serde::{Deserialize, Serialize};

use crate::payload::{PayloadFormat, Snapshotter};
use crate::scanner::{CloseRule, ScanSink, TagId, TagScanner, TagSet, TagSetError};
use unescape::Unescaper;

/// What the pipeline does with a registered tag's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TagKind {
    /// `<package:type:version>…</package:type:version>`: captured, published as block events.
    Block,
    /// `<thinking>…</thinking>`: streamed as thinking text, never shown.
    Channel,
    /// `<tool>{json}</tool>`: parsed into a tool call when it closes.
    ToolCall,
}

/// What happens to an unclosed block at the end of its stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MalformedPolicy {
    /// Its text is removed from the visible text.
    #[default]
    Drop,
    /// The open tag and the captured bytes are put back into the visible text.
    Restore,
}

/// When the whole visible text accompanies a text output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CumulativeText {
    /// On the final output only (linear bandwidth).
    #[default]
    Final,
    /// On every text output (quadratic bandwidth; for consumers that only read `text`).
    Every,
    /// Never; the visible text is not retained at all.
    Never,
}

/// One registered tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagSpec {
    /// The text between `<` and `>`: `package:type:version` for blocks, a plain word otherwise.
    pub name: String,
    /// What its content becomes.
    pub kind: TagKind,
    /// The capture limit for this tag; `None` uses [`PipelineLimits::max_capture_bytes`].
    pub max_capture_bytes: Option<usize>,
    /// How a block's payload is decoded into a value (blocks only).
    pub payload: PayloadFormat,
    /// Whether a block publishes live snapshots of its value while it streams (blocks only).
    pub snapshots: bool,
}

impl TagSpec {
    /// A tag with the default payload handling (YAML, with snapshots).
    pub fn new(name: impl Into<String>, kind: TagKind) -> Self {
        TagSpec { name: name.into(), kind, max_capture_bytes: None, payload: PayloadFormat::Yaml, snapshots: true }
    }
}

/// Why a tag specification was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TagSpecError {
    /// The scanner refused the name.
    #[error(transparent)]
    Scan(#[from] TagSetError),
    /// A block name is not `package:type:version` with three non-empty parts.
    #[error("block tag {0:?} must be package:type:version, three non-empty parts of [A-Za-z0-9_.-]")]
    NotATriple(String),
    /// A channel or tool-call name contains `:`.
    #[error("tag {0:?}: only block tags may contain ':'")]
    ColonOutsideBlock(String),
}

/// The `package`, `type` and `version` parts of a block tag name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagTriple {
    /// The first part, naming the application or package.
    pub package: String,
    /// The second part, naming the block type.
    pub kind: String,
    /// The third part, the schema version.
    pub version: String,
}

impl TagTriple {
    /// Splits `p:t:v` into its parts; `None` unless there are exactly three non-empty parts.
    pub fn parse(name: &str) -> Option<TagTriple> {
        let mut parts = name.split(':');
        let (p, t, v) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || p.is_empty() || t.is_empty() || v.is_empty() {
            return None;
        }
        Some(TagTriple { package: p.to_owned(), kind: t.to_owned(), version: v.to_owned() })
    }
}

/// Stream-wide limits and policies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineLimits {
    /// Payload bytes kept per capture. At the limit the capture completes with `success=false`
    /// ("payload exceeds N bytes") and the rest of it, up to its close tag, is dropped.
    pub max_capture_bytes: usize,
    /// Visible text retained per stream for the cumulative `text`. Beyond it the text is no longer
    /// retained and the final reports it as omitted.
    pub max_text_bytes: usize,
    /// What happens to an unclosed block or tool call at the end of a stream.
    pub malformed: MalformedPolicy,
    /// Whether deltas are escape-decoded before scanning.
    pub unescape_text: bool,
    /// When the whole visible text accompanies a text output.
    pub cumulative_text: CumulativeText,
    /// Live-snapshot work allowed per payload byte received (see [`crate::payload::snapshot`]);
    /// an attempt over it is skipped and counted in [`PipelineStats::snapshot_budget_skips`].
    pub snapshot_budget: usize,
}

impl Default for PipelineLimits {
    fn default() -> Self {
        PipelineLimits {
            max_capture_bytes: 1024 * 1024,
            max_text_bytes: 4 * 1024 * 1024,
            malformed: MalformedPolicy::Drop,
            unescape_text: false,
            cumulative_text: CumulativeText::Final,
            snapshot_budget: crate::payload::snapshot::BUDGET_FACTOR,
        }
    }
}

/// A registered tag as the pipeline uses it.
#[derive(Debug, Clone)]
pub struct RegisteredTag {
    /// Its specification.
    pub spec: TagSpec,
    /// The name's parts, for blocks.
    pub triple: Option<TagTriple>,
    /// The effective capture limit.
    pub max_capture_bytes: usize,
}

/// Counters of notable events, for the caller to export. Plain numbers: the pipeline is owned by
/// one task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Finals whose text did not extend the deltas already seen (the deltas won).
    pub diverged_finals: u64,
    /// Captures that hit their byte limit.
    pub capture_overflows: u64,
    /// Captures still open at the end of their stream.
    pub unclosed_captures: u64,
    /// Streams whose visible text outgrew `max_text_bytes`.
    pub text_overflows: u64,
    /// Upstream error texts longer than [`MAX_ERROR_BYTES`], cut on a final.
    pub error_texts_cut: u64,
    /// Blocks whose payload could not be decoded (YAML or JSON errors).
    pub invalid_payloads: u64,
    /// Live-snapshot attempts skipped for exceeding the snapshot budget.
    pub snapshot_budget_skips: u64,
}

/// A captured region's number within its stream (from 1) and its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    /// The tag that opened it.
    pub tag: TagId,
    /// Counts registered tags in the stream from 1; the item id is `<stream key>:<number>`.
    pub number: u32,
}

/// A tool call parsed from `<tool>{json}</tool>`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolInvocation {
    /// The `tool_name` field.
    pub tool_name: String,
    /// The `server_name` field, `local` when absent.
    pub server_name: String,
    /// The `arguments` field (an object, or null when absent).
    pub arguments: serde_json::Value,
}

/// How a stream ended, as the final output reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finish<'a> {
    /// The upstream finish reason, or the service's own (`interrupt`, `error`, `expired`, ...).
    pub reason: &'a str,
    /// True when the visible text outgrew its limit and `text` is absent for that reason.
    pub text_omitted: bool,
    /// Present when an upstream error ended the stream: its text (possibly empty), cut to its
    /// first [`MAX_ERROR_BYTES`] (whole characters).
    pub error: Option<&'a str>,
}

/// How the caller ends a stream ([`Pipeline::finish`]): the reason, and the upstream's error text
/// when an error ended it. A reason alone converts into one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ending<'a> {
    /// The upstream finish reason, or the caller's own (`expired`, `shutdown`, ...).
    pub reason: &'a str,
    /// Present when an upstream error ended the stream: its text (possibly empty).
    pub error: Option<&'a str>,
}

impl<'a> From<&'a str> for Ending<'a> {
    fn from(reason: &'a str) -> Self {
        Ending { reason, error: None }
    }
}

/// The bound on the error text a final output carries. Error texts are a line or a few (a
/// provider's message); the bound keeps one that quotes a whole request from making the final
/// too large to publish, beside a visible text that may be up to `max_text_bytes`.
pub const MAX_ERROR_BYTES: usize = 4096;

/// The largest character boundary of `text` at or below `at` (which must be at most its length):
/// where to cut it so that no character is split.
fn char_floor(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// What an output says.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputKind<'a> {
    /// Visible text.
    Text {
        /// The new visible text; never empty except on the final output.
        delta: &'a str,
        /// The whole visible text so far, when the [`CumulativeText`] policy attaches it.
        text: Option<&'a str>,
        /// Present on the stream's final output only.
        finish: Option<Finish<'a>>,
        /// Which text output of the stream this is, from 1 (unlike `seq`, which counts every
        /// output: geppetto's `sequence` numbers text events only).
        number: u64,
    },
    /// A block's open tag was seen.
    BlockStarted {
        /// The block.
        item: Item,
    },
    /// Raw payload bytes of a block that are certain (no part of the close tag).
    BlockDelta {
        /// The block.
        item: Item,
        /// The new payload bytes.
        raw: &'a str,
    },
    /// The best value parsed so far while a block streams; only when it changed.
    BlockSnapshot {
        /// The block.
        item: Item,
        /// The value.
        value: &'a serde_json::Value,
    },
    /// A block ended. Every started block completes exactly once.
    BlockCompleted {
        /// The block.
        item: Item,
        /// The whole raw payload as captured (at most the capture limit).
        raw: &'a str,
        /// The decoded payload, when the block closed and its payload decoded.
        value: Option<&'a serde_json::Value>,
        /// Why it failed, when it did (missing close tag, capture limit, payload error).
        error: Option<&'a str>,
    },
    /// A thinking section began.
    ThinkingStarted {
        /// The section.
        item: Item,
    },
    /// Thinking text.
    ThinkingDelta {
        /// The section.
        item: Item,
        /// The new thinking text.
        text: &'a str,
    },
    /// A thinking section ended.
    ThinkingEnded {
        /// The section.
        item: Item,
        /// False when the stream ended inside it.
        closed: bool,
    },
    /// A tool call, parsed or failed.
    ToolCall {
        /// The call.
        item: Item,
        /// The raw payload between the tags.
        raw: &'a str,
        /// The parsed call, or why it could not be parsed.
        call: Result<&'a ToolInvocation, &'a str>,
    },
}

/// One output of a stream, numbered from 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Output<'a> {
    /// Per-stream sequence number, from 1, deterministic for a given input.
    pub seq: u64,
    /// What it says.
    pub kind: OutputKind<'a>,
}

/// Receives outputs in stream order.
pub trait Emit {
    /// Takes one output. Borrowed data lives only for the call.
    fn emit(&mut self, output: Output<'_>);
}

impl<F: FnMut(Output<'_>)> Emit for F {
    fn emit(&mut self, output: Output<'_>) {
        self(output)
    }
}

/// What [`Pipeline::finish`] noticed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FinishReport {
    /// The final's text did not extend the deltas already seen; the deltas won.
    pub diverged: bool,
}

/// The open capture of a stream.
#[derive(Debug, Clone)]
struct Capture {
    item: Item,
    kind: TagKind,
    /// The payload kept so far (blocks and tool calls; empty for channels).
    payload: String,
    /// The capture hit its limit and has already completed with a failure.
    overflowed: bool,
    /// Live snapshots of a block's value, when enabled for its tag.
    snapshots: Option<Snapshotter>,
}

/// One stream's progress.
#[derive(Debug, Clone, Default)]
pub struct StreamState {
    scanner: TagScanner,
    unescaper: Unescaper,
    utf8: Utf8Carry,
    progress: Progress,
}

/// The start of a UTF-8 character cut off at the end of a byte delta (at most 3 bytes).
#[derive(Debug, Clone, Copy, Default)]
struct Utf8Carry {
    bytes: [u8; 4],
    len: u8,
}

/// The part of a stream's state that the scanner's sink updates.
#[derive(Debug, Clone, Default)]
struct Progress {
    seq: u64,
    /// Text outputs emitted so far.
    texts: u64,
    items: u32,
    capture: Option<Box<Capture>>,
    visible: String,
    visible_omitted: bool,
    /// Length and checksum of the raw input seen, to tell whether a final's text extends it.
    raw_len: usize,
    raw_crc: crc32fast::Hasher,
}

impl StreamState {
    /// A stream at its start.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held back by the UTF-8 joiner, the escape decoder and the scanner.
    pub fn held_len(&self) -> usize {
        usize::from(self.utf8.len) + self.unescaper.held_len() + self.scanner.held_len()
    }

    /// Outputs emitted so far (the last sequence number).
    pub fn seq(&self) -> u64 {
        self.progress.seq
    }

    /// Heap bytes owned by this stream: captured payload, retained text and held bytes.
    pub fn heap_bytes(&self) -> usize {
        let p = &self.progress;
        p.visible.capacity()
            + p.capture.as_ref().map_or(0, |c| std::mem::size_of::<Capture>() + c.payload.capacity())
            + self.held_len()
    }
}

/// The shared, per-owner part of the pipeline: tags, limits, scratch buffers and counters.
#[derive(Debug, Clone)]
pub struct Pipeline {
    tags: TagSet,
    registered: Vec<RegisteredTag>,
    limits: PipelineLimits,
    stats: PipelineStats,
    /// Escape-decoded input of the current delta.
    decoded: String,
    /// Text or payload gathered during one call, emitted as one piece (coalescing).
    pending: String,
}

impl Pipeline {
    /// Empties the scratch buffers shared by every stream after a call that did not return (a
    /// panic the caller caught): the text it held belongs to the stream that failed, and the next
    /// call, for any stream, would emit it as its own.
    pub fn clear_scratch(&mut self) {
        self.pending.clear();
        self.decoded.clear();
    }

    /// Registers `tags` under `limits`.
    pub fn new(tags: Vec<TagSpec>, limits: PipelineLimits) -> Result<Self, TagSpecError> {
        let mut registered = Vec::with_capacity(tags.len());
        for spec in tags {
            let triple = match spec.kind {
                TagKind::Block => {
                    Some(TagTriple::parse(&spec.name).ok_or_else(|| TagSpecError::NotATriple(spec.name.clone()))?)
                }
                TagKind::Channel | TagKind::ToolCall if spec.name.contains(':') => {
                    return Err(TagSpecError::ColonOutsideBlock(spec.name.clone()));
                }
                TagKind::Channel | TagKind::ToolCall => None,
            };
            let max_capture_bytes = spec.max_capture_bytes.unwrap_or(limits.max_capture_bytes);
            registered.push(RegisteredTag { spec, triple, max_capture_bytes });
        }
        let tags = TagSet::new(registered.iter().map(|r| {
            let rule = match r.spec.kind {
                TagKind::ToolCall => CloseRule::OutsideJsonStrings,
                TagKind::Block | TagKind::Channel => CloseRule::Exact,
            };
            (r.spec.name.as_str(), rule)
        }))?;
        Ok(Pipeline {
            tags,
            registered,
            limits,
            stats: PipelineStats::default(),
            decoded: String::new(),
            pending: String::new(),
        })
    }

    /// The registered tags, indexed by [`TagId`].
    pub fn tags(&self) -> &[RegisteredTag] {
        &self.registered
    }

    /// The registered tag `id`.
    pub fn tag(&self, id: TagId) -> &RegisteredTag {
        &self.registered[usize::from(id.0)]
    }

    /// The matcher, for callers that need the exact open and close tags.
    pub fn tag_set(&self) -> &TagSet {
        &self.tags
    }

    /// The limits in force.
    pub fn limits(&self) -> &PipelineLimits {
        &self.limits
    }

    /// Counters since creation.
    pub fn stats(&self) -> PipelineStats {
        self.stats
    }

    /// The most bytes a stream of this pipeline ever holds back between deltas: an incomplete
    /// UTF-8 character (3), an incomplete escape (12, with `unescape_text`) and a prefix of the
    /// longest open tag. Structural: it follows from the registered tags, so no input can
    /// exceed it.
    pub fn max_held_len(&self) -> usize {
        3 + unescape::MAX_ESCAPE_LEN + self.tags.max_open_len()
    }

    /// Feeds one delta of `stream`; everything that became certain is emitted.
    pub fn feed(&mut self, stream: &mut StreamState, delta: &str, sink: &mut impl Emit) {
        self.scan(stream, delta, sink);
        Driver::new(self, &mut stream.progress, sink).flush();
    }

    /// Feeds one delta of raw bytes, for upstreams that may cut a UTF-8 character between deltas:
    /// an incomplete character at the end is held until the next delta completes it, and bytes
    /// that are not UTF-8 become U+FFFD. Outputs never split a character.
    pub fn feed_bytes(&mut self, stream: &mut StreamState, delta: &[u8], sink: &mut impl Emit) {
        let mut text = String::new();
        let mut rest = delta;
        let carried = usize::from(stream.utf8.len);
        if carried > 0 {
            // Complete the carried character with up to three new bytes.
            let mut joined = stream.utf8.bytes;
            let take = rest.len().min(4 - carried);
            joined[carried..carried + take].copy_from_slice(&rest[..take]);
            match std::str::from_utf8(&joined[..carried + take]) {
                Ok(s) => {
                    text.push_str(s);
                    rest = &rest[take..];
                    stream.utf8.len = 0;
                }
                Err(e) if e.error_len().is_none() && e.valid_up_to() == 0 => {
                    // Still incomplete: all new bytes belong to it.
                    stream.utf8.bytes = joined;
                    stream.utf8.len = u8::try_from(carried + take).unwrap_or(4);
                    rest = &[];
                }
                Err(e) => {
                    let used = e.valid_up_to() + e.error_len().unwrap_or(0);
                    text.push_str(&String::from_utf8_lossy(&joined[..used.max(1)]));
                    rest = &rest[used.max(1).saturating_sub(carried)..];
                    stream.utf8.len = 0;
                }
            }
        }
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    text.push_str(s);
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    text.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        None => {
                            stream.utf8.bytes[..after.len()].copy_from_slice(after);
                            stream.utf8.len = u8::try_from(after.len()).unwrap_or(0);
                            break;
                        }
                    }
                }
            }
        }
        self.feed(stream, &text, sink);
    }

    /// Ends `stream`: `final_text` (the upstream's whole text, when it sent one) supplies the part
    /// not yet seen as deltas; held bytes are released, an open capture is closed as unclosed, and
    /// a final text output carries the filtered tail, the whole visible text and the `ending`
    /// (a reason, or a reason and an error text). When the final's text does not extend the deltas
    /// seen, the deltas win and the divergence is reported.
    pub fn finish<'e>(
        &mut self,
        stream: &mut StreamState,
        final_text: Option<&str>,
        ending: impl Into<Ending<'e>>,
        sink: &mut impl Emit,
    ) -> FinishReport {
        let ending = ending.into();
        let mut report = FinishReport::default();
        if stream.utf8.len > 0 {
            // A character cut off for good.
            stream.utf8.len = 0;
            self.scan(stream, "\u{FFFD}", sink);
        }
        if let Some(text) = final_text {
            match extension(&stream.progress, text) {
                Some(tail) => self.scan(stream, tail, sink),
                None => {
                    report.diverged = true;
                    self.stats.diverged_finals += 1;
                }
            }
        }
        // An incomplete escape is released literally, then held bytes and open captures end.
        let mut decoded = std::mem::take(&mut self.decoded);
        decoded.clear();
        stream.unescaper.finish(&mut decoded);
        let StreamState { scanner, progress, .. } = stream;
        let mut driver = Driver::new(self, progress, sink);
        scanner.feed(driver.tags, &decoded, &mut driver);
        scanner.finish(driver.tags, &mut driver);
        driver.finish(ending);
        self.decoded = decoded;
        report
    }

    /// Scans `delta` without flushing the coalesced text (so that a final can carry it).
    fn scan(&mut self, stream: &mut StreamState, delta: &str, sink: &mut impl Emit) {
        stream.progress.raw_len += delta.len();
        stream.progress.raw_crc.update(delta.as_bytes());
        let StreamState { scanner, unescaper, progress, .. } = stream;
        if self.limits.unescape_text {
            let mut decoded = std::mem::take(&mut self.decoded);
            decoded.clear();
            unescaper.feed(delta, &mut decoded);
            let mut driver = Driver::new(self, progress, sink);
            scanner.feed(driver.tags, &decoded, &mut driver);
            self.decoded = decoded;
        } else {
            let mut driver = Driver::new(self, progress, sink);
            scanner.feed(driver.tags, delta, &mut driver);
        }
    }
}

/// The tail of `text` after the raw input already seen, when `text` extends it.
fn extension<'t>(progress: &Progress, text: &'t str) -> Option<&'t str> {
    let seen = progress.raw_len;
    if text.len() < seen || !text.is_char_boundary(seen) {
        return None;
    }
    let mut crc = crc32fast::Hasher::new();
    crc.update(&text.as_bytes()[..seen]);
    (crc.finalize() == progress.raw_crc.clone().finalize()).then(|| &text[seen..])
}

/// Turns scanner findings into outputs during one call. Borrows the pipeline's parts disjointly
/// so that the scanner can read the tag set while the driver updates the rest.
struct Driver<'a, S> {
    tags: &'a TagSet,
    registered: &'a [RegisteredTag],
    limits: &'a PipelineLimits,
    stats: &'a mut PipelineStats,
    pending: &'a mut String,
    progress: &'a mut Progress,
    sink: &'a mut S,
}

impl<'a, S: Emit> Driver<'a, S> {
    fn new(pipeline: &'a mut Pipeline, progress: &'a mut Progress, sink: &'a mut S) -> Self {
        Driver {
            tags: &pipeline.tags,
            registered: &pipeline.registered,
            limits: &pipeline.limits,
            stats: &mut pipeline.stats,
            pending: &mut pipeline.pending,
            progress,
            sink,
        }
    }

    fn output(&mut self, kind: OutputKind<'_>) {
        self.progress.seq += 1;
        self.sink.emit(Output { seq: self.progress.seq, kind });
    }

    /// Emits the gathered text or payload as one piece.
    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        self.progress.seq += 1;
        let seq = self.progress.seq;
        if self.progress.capture.is_none() {
            self.progress.texts += 1;
        }
        let progress = &*self.progress;
        let kind = match progress.capture.as_deref() {
            None => {
                let every = self.limits.cumulative_text == CumulativeText::Every && !progress.visible_omitted;
                let text = every.then_some(progress.visible.as_str());
                OutputKind::Text { delta: self.pending, text, finish: None, number: progress.texts }
            }
            Some(Capture { item, kind: TagKind::Block, .. }) => {
                OutputKind::BlockDelta { item: *item, raw: self.pending }
            }
            Some(Capture { item, kind: TagKind::Channel, .. }) => {
                OutputKind::ThinkingDelta { item: *item, text: self.pending }
            }
            Some(Capture { kind: TagKind::ToolCall, .. }) => unreachable!("tool-call payload is not streamed"),
        };
        self.sink.emit(Output { seq, kind });
        self.snapshot();
        self.pending.clear();
    }

    /// Feeds the block delta just emitted (still in `pending`) to the block's snapshotter and
    /// emits a snapshot when the value changed.
    fn snapshot(&mut self) {
        let Some(capture) = self.progress.capture.as_deref_mut() else { return };
        let Some(snapshots) = capture.snapshots.as_mut() else { return };
        let skipped = snapshots.budget_skips();
        let snapshot = snapshots.push(self.pending);
        self.stats.snapshot_budget_skips += snapshots.budget_skips() - skipped;
        if let Some(value) = snapshot {
            let item = capture.item;
            self.progress.seq += 1;
            self.sink.emit(Output { seq: self.progress.seq, kind: OutputKind::BlockSnapshot { item, value: &value } });
        }
    }

    /// Emits the final text output: the coalesced tail, and the whole visible text.
    fn finish(&mut self, ending: Ending<'_>) {
        self.progress.seq += 1;
        self.progress.texts += 1;
        let progress = &*self.progress;
        let retained = self.limits.cumulative_text != CumulativeText::Never && !progress.visible_omitted;
        let error = ending.error.map(|error| {
            if error.len() <= MAX_ERROR_BYTES {
                return error;
            }
            self.stats.error_texts_cut += 1;
            &error[..char_floor(error, MAX_ERROR_BYTES)]
        });
        let finish = Finish { reason: ending.reason, text_omitted: progress.visible_omitted, error };
        let kind = OutputKind::Text {
            delta: self.pending,
            text: retained.then_some(progress.visible.as_str()),
            finish: Some(finish),
            number: progress.texts,
        };
        self.sink.emit(Output { seq: progress.seq, kind });
        self.pending.clear();
    }

    /// Keeps `text` for the cumulative visible text, within its limit.
    fn retain(&mut self, text: &str) {
        let progress = &mut *self.progress;
        if self.limits.cumulative_text == CumulativeText::Never || progress.visible_omitted {
            return;
        }
        if progress.visible.len() + text.len() > self.limits.max_text_bytes {
            progress.visible_omitted = true;
            progress.visible = String::new();
            self.stats.text_overflows += 1;
            return;
        }
        progress.visible.push_str(text);
    }

    /// Ends the open capture, successfully (`failure` is `None`) or not.
    fn complete(&mut self, failure: Option<&str>) {
        self.flush();
        let Some(capture) = self.progress.capture.take() else { return };
        if capture.overflowed {
            // It completed when it overflowed.
            return;
        }
        let item = capture.item;
        match capture.kind {
            TagKind::Block => {
                let format = self.registered[usize::from(item.tag.0)].spec.payload;
                let decoded = match failure {
                    Some(_) => None,
                    None => Some(crate::payload::decode(format, &capture.payload).map_err(|e| e.to_string())),
                };
                let (value, error) = match (&decoded, failure) {
                    (Some(Ok(value)), _) => (Some(value), None),
                    (Some(Err(error)), _) => {
                        self.stats.invalid_payloads += 1;
                        (None, Some(error.as_str()))
                    }
                    (None, failure) => (None, failure),
                };
                self.output(OutputKind::BlockCompleted { item, raw: &capture.payload, value, error });
            }
            TagKind::Channel => self.output(OutputKind::ThinkingEnded { item, closed: failure.is_none() }),
            TagKind::ToolCall => {
                let call = match failure {
                    Some(error) => Err(error.to_owned()),
                    None => parse_tool_call(&capture.payload),
                };
                let call = call.as_ref().map_err(String::as_str);
                self.output(OutputKind::ToolCall { item, raw: &capture.payload, call });
            }
        }
    }
}

impl<S: Emit> ScanSink for Driver<'_, S> {
    fn text(&mut self, text: &str) {
        self.retain(text);
        self.pending.push_str(text);
    }

    fn open(&mut self, tag: TagId) {
        self.flush();
        self.progress.items += 1;
        let item = Item { tag, number: self.progress.items };
        let spec = &self.registered[usize::from(tag.0)].spec;
        let kind = spec.kind;
        let budget = self.limits.snapshot_budget;
        // A budget of 0 turns snapshots off: no parser runs, and nothing is counted as skipped.
        let snapshots = (kind == TagKind::Block && spec.snapshots && budget > 0)
            .then(|| Snapshotter::new(spec.payload).with_budget(budget));
        self.progress.capture =
            Some(Box::new(Capture { item, kind, payload: String::new(), overflowed: false, snapshots }));
        match kind {
            TagKind::Block => self.output(OutputKind::BlockStarted { item }),
            TagKind::Channel => self.output(OutputKind::ThinkingStarted { item }),
            TagKind::ToolCall => {}
        }
    }

    fn payload(&mut self, tag: TagId, raw: &str) {
        let limit = self.registered[usize::from(tag.0)].max_capture_bytes;
        let Some(capture) = self.progress.capture.as_deref_mut() else { return };
        let streamed = match capture.kind {
            TagKind::Channel => {
                self.pending.push_str(raw);
                return;
            }
            _ if capture.overflowed => return,
            TagKind::Block => true,
            TagKind::ToolCall => false,
        };
        let room = limit - capture.payload.len();
        if raw.len() <= room {
            capture.payload.push_str(raw);
            if streamed {
                self.pending.push_str(raw);
            }
            return;
        }
        // The limit is hit: keep what fits (whole characters), complete with a failure, and drop
        // the rest of the capture up to its close tag.
        let fit = char_floor(raw, room);
        capture.payload.push_str(&raw[..fit]);
        if streamed {
            self.pending.push_str(&raw[..fit]);
        }
        self.stats.capture_overflows += 1;
        let error = format!("payload exceeds {limit} bytes");
        let item = capture.item;
        self.complete(Some(&error));
        // A marker capture drops the rest, and stops anything from completing twice.
        self.progress.capture = Some(Box::new(Capture {
            item,
            kind: self.registered[usize::from(tag.0)].spec.kind,
            payload: String::new(),
            overflowed: true,
            snapshots: None,
        }));
    }

    fn close(&mut self, _tag: TagId) {
        self.complete(None);
    }

    fn unclosed(&mut self, tag: TagId) {
        self.stats.unclosed_captures += 1;
        let restore = self.limits.malformed == MalformedPolicy::Restore;
        let restored = match self.progress.capture.as_deref() {
            Some(c) if restore && !c.overflowed && c.kind != TagKind::Channel => {
                Some(format!("{}{}", self.tags.open_tag(tag), c.payload))
            }
            _ => None,
        };
        let error = format!("missing close tag {}", self.tags.close_tag(tag));
        self.complete(Some(&error));
        if let Some(text) = restored {
            self.text(&text);
        }
    }
}

/// Parses a tool call payload: `{"tool_name": ..., "server_name": ..., "arguments": {...}}`.
fn parse_tool_call(raw: &str) -> Result<ToolInvocation, String> {
    #[derive(Deserialize)]
    struct Wire {
        tool_name: String,
        #[serde(default)]
        server_name: Option<String>,
        #[serde(default)]
        arguments: Option<serde_json::Value>,
    }
    // The serde message names the position, never the input.
    let wire: Wire = serde_json::from_str(raw.trim())
        .map_err(|e| format!("invalid tool call JSON at line {} column {}: {}", e.line(), e.column(), category(&e)))?;
    let arguments = match wire.arguments {
        None | Some(serde_json::Value::Null) => serde_json::Value::Object(serde_json::Map::new()),
        Some(v @ serde_json::Value::Object(_)) => v,
        Some(_) => return Err("tool call arguments must be a JSON object".to_owned()),
    };
    Ok(ToolInvocation {
        tool_name: wire.tool_name,
        server_name: wire.server_name.filter(|s| !s.is_empty()).unwrap_or_else(|| "local".to_owned()),
        arguments,
    })
}

fn category(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Data => "missing or mistyped field",
        serde_json::error::Category::Eof => "unexpected end",
        serde_json::error::Category::Syntax | serde_json::error::Category::Io => "syntax error",
    }
}

#[cfg(test)]
mod tests;
