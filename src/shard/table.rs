//! One shard's streams: the map from stream key (stream id and message id, see
//! [`StreamIdentity::key`](crate::codec::inbound::StreamIdentity::key)) to pipeline state, in
//! least-recently-used order.
//!
//! It owns the open streams, applies decoded events to them through the shared [`Pipeline`], and
//! encodes every output with the [`OutputEncoder`] into a caller-provided sink, in stream order.
//! Bounds: at most `max_streams` open streams (the longest idle is closed first, reason
//! `evicted`), streams idle for `idle_timeout` are closed on [`StreamTable::expire`] (reason
//! `expired`), and the last `finished_memory` finished stream keys are remembered so that a late
//! event for one of them is reported instead of starting a new stream whose sequence numbers
//! would repeat. An `error` or `interrupt` event that names no segment ends every open stream of
//! its message, and `provider-call-finished` the open segments of its call: the
//! `Segments` index finds them. It knows nothing of tokio, NATS or wire bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hashlink::linked_hash_map::RawEntryMut;
use hashlink::{LinkedHashMap, LinkedHashSet};

use crate::codec::inbound::{EventAction, InboundEvent};
use crate::codec::outbound::{EncoderStats, OutputEncoder, Publication, StreamHeader, Vocabulary};
use crate::pipeline::{Ending, Output, Pipeline, PipelineStats, StreamState};

use super::segments::{message_part, Segments};

/// Bounds of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableLimits {
    /// A stream idle this long is closed by [`StreamTable::expire`].
    pub idle_timeout: Duration,
    /// Open streams; above it the longest-idle one is closed.
    pub max_streams: usize,
    /// Finished stream keys remembered for late-event detection.
    pub finished_memory: usize,
}

/// What happened to an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// It was a text event and went through the pipeline.
    Applied,
    /// Not a text event: the caller forwards it unchanged.
    PassThrough,
    /// A text event for a stream that already finished: nothing was emitted.
    Late,
    /// An input the stream already applied (a redelivery: its input sequence is not above the
    /// last one applied): nothing was emitted.
    Duplicate,
}

/// Counters of a table since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Streams opened.
    pub opened: u64,
    /// Streams closed by their own final, interrupt or error event, or by an event that ended
    /// their message or provider call.
    pub finished: u64,
    /// Streams closed for being idle.
    pub expired: u64,
    /// Streams closed to stay under `max_streams`.
    pub evicted: u64,
    /// Streams closed by [`StreamTable::close_all`].
    pub closed_at_shutdown: u64,
    /// Events for streams that had finished.
    pub late_events: u64,
    /// Events of an open stream that arrived from another input partition than the one the stream
    /// keeps (see [`InputPosition::partition`]): the one-partition-per-stream assumption broken.
    pub partition_conflicts: u64,
    /// Streams discarded after processing one of their events failed ([`StreamTable::discard`]).
    pub failed: u64,
    /// Streams forgotten without closing them, for another replica to rebuild
    /// ([`StreamTable::abandon_all`], [`StreamTable::abandon_partition`]).
    pub handed_over: u64,
    /// Typed conversions of completed blocks that failed.
    pub typed: EncoderStats,
}

/// Where an event sits in the input, as far as the table cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InputPosition {
    /// The input partition it arrived from (0 when the input is not read per partition). A
    /// stream keeps the partition of the event that opened it, so that giving a partition up
    /// ([`StreamTable::abandon_partition`]) finds exactly its streams, whatever the mapping of
    /// message ids to partitions. That holds because every event of a stream arrives from one
    /// partition: a stream's key holds its message id, the partition key.
    pub partition: u32,
    /// The input sequence (JetStream stream sequence), when the input has one.
    pub sequence: Option<u64>,
}

#[cfg(test)]
impl InputPosition {
    /// Stream sequence `sequence` of partition 0.
    fn at(sequence: u64) -> Self {
        InputPosition { partition: 0, sequence: Some(sequence) }
    }
}

struct OpenStream {
    state: StreamState,
    header: StreamHeader,
    last_seen: Instant,
    /// One span per stream lifecycle (never per delta); it ends when the stream closes.
    span: tracing::Span,
    /// The input sequence (JetStream stream sequence) of the last event applied; 0 if none.
    last_input: u64,
    /// The input partition its events arrive from (see [`InputPosition::partition`]).
    partition: u32,
    /// The provider call it is listed under in the [`Segments`] index (empty when it named
    /// none), when it is a segment: a stream whose key holds an id of its own. Boxed, a thin
    /// pointer: it keeps this struct within 288 bytes, so that a node of the table's map (key,
    /// this, links) takes a 320-byte allocation, not 384.
    segment_of_call: Option<Box<Arc<str>>>,
}

/// One shard's streams.
pub struct StreamTable {
    pipeline: Pipeline,
    encoder: OutputEncoder,
    limits: TableLimits,
    /// Open streams, least recently used first. A key is shared with its stream's header and its
    /// place among the segments (a canonical stream's key is about 90 bytes).
    streams: LinkedHashMap<Arc<str>, OpenStream>,
    /// The open segments, for the events that end them without naming them.
    segments: Segments,
    /// Recently finished stream keys, oldest first.
    finished: LinkedHashSet<Box<str>>,
    /// Streams closed since the last [`StreamTable::take_closed`].
    closed: Vec<Box<str>>,
    /// Where [`StreamTable::apply`] writes an event's stream key, reused from event to event.
    key_scratch: String,
    /// The stream being closed, while it is: a panic that leaves it set happened while closing
    /// that stream ([`StreamTable::recover_failed_close`]).
    closing: Option<Box<str>>,
    stats: TableStats,
    /// Test hook: a delta with exactly this text panics inside [`StreamTable::apply`], after its
    /// stream is open (so after any eviction that made room for it), to test what the worker does
    /// when processing fails.
    #[cfg(test)]
    pub(crate) panic_on_delta: Option<&'static str>,
    /// Test hook: an output whose payload holds this text panics while it is emitted (in the
    /// middle of the pipeline's work, or of closing a stream).
    #[cfg(test)]
    pub(crate) panic_on_output: Option<&'static str>,
}

/// Test hook: panics when `delta` is the failure trigger (see `StreamTable::panic_on_delta`).
#[cfg(test)]
fn inject_failure(trigger: Option<&str>, delta: &str) {
    if trigger == Some(delta) {
        panic!("injected failure");
    }
}

/// Test hook: `sink`, panicking first on a publication whose payload holds the failure trigger
/// (see `StreamTable::panic_on_output`).
#[cfg(test)]
fn hooked<'a>(trigger: Option<&'static str>, sink: &'a mut impl FnMut(Publication)) -> impl FnMut(Publication) + 'a {
    move |p: Publication| {
        if trigger.is_some_and(|t| p.payload.windows(t.len()).any(|w| w == t.as_bytes())) {
            panic!("injected failure");
        }
        sink(p)
    }
}

impl StreamTable {
    /// An empty table.
    pub fn new(pipeline: Pipeline, encoder: OutputEncoder, limits: TableLimits) -> Self {
        StreamTable {
            pipeline,
            encoder,
            limits,
            streams: LinkedHashMap::new(),
            segments: Segments::default(),
            finished: LinkedHashSet::new(),
            closed: Vec::new(),
            key_scratch: String::new(),
            closing: None,
            stats: TableStats::default(),
            #[cfg(test)]
            panic_on_delta: None,
            #[cfg(test)]
            panic_on_output: None,
        }
    }

    /// Open streams.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Whether no stream is open.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// The table's counters.
    pub fn stats(&self) -> TableStats {
        TableStats { typed: self.encoder.stats(), ..self.stats }
    }

    /// The pipeline's counters.
    pub fn pipeline_stats(&self) -> PipelineStats {
        self.pipeline.stats()
    }

    /// Applies one decoded event at `now`; its outputs go to `sink` in stream order. When the
    /// event opens a stream, `opened` sees the stream's new span first (to set its parent).
    /// `input` is where the event sits in the input: an event whose input sequence (JetStream) is
    /// not above the last one its stream applied is a duplicate and is skipped.
    pub fn apply(
        &mut self,
        event: &InboundEvent<'_>,
        input: InputPosition,
        now: Instant,
        sink: &mut impl FnMut(Publication),
        opened: &mut dyn FnMut(&tracing::Span),
    ) -> Disposition {
        // Taken out while it is borrowed; a panic loses it, and it grows again.
        let mut scratch = std::mem::take(&mut self.key_scratch);
        let disposition = self.apply_keyed(event, event.stream.key(&mut scratch), input, now, sink, opened);
        self.key_scratch = scratch;
        disposition
    }

    /// [`StreamTable::apply`] for a caller that has the event's stream key at hand: `key` must be
    /// the event's [`StreamIdentity::key`](crate::codec::inbound::StreamIdentity::key).
    pub fn apply_keyed(
        &mut self,
        event: &InboundEvent<'_>,
        key: &str,
        input: InputPosition,
        now: Instant,
        sink: &mut impl FnMut(Publication),
        opened: &mut dyn FnMut(&tracing::Span),
    ) -> Disposition {
        #[cfg(test)]
        let sink = &mut hooked(self.panic_on_output, sink);
        let sequence = input.sequence;
        match &event.action {
            EventAction::PassThrough => Disposition::PassThrough,
            EventAction::CallFinished { reason } => {
                let call = Some(event.stream.provider_call_id.as_ref());
                let ids = self.segments_ended_by(message_part(key), call, sequence);
                self.end_segments(ids, Ending { reason, error: None }, sink);
                Disposition::PassThrough
            }
            EventAction::Delta(delta) => {
                // The common case, a delta of an open stream, costs one lookup of its id. (A stream
                // is never open and finished at once: a finished id is never opened again while it
                // is remembered.)
                if let RawEntryMut::Occupied(mut entry) = self.streams.raw_entry_mut().from_key(key) {
                    if sequence.is_some_and(|seq| seq <= entry.get().last_input) {
                        return Disposition::Duplicate;
                    }
                    entry.to_back();
                    #[cfg(test)]
                    inject_failure(self.panic_on_delta, delta);
                    let open = entry.into_mut();
                    if open.partition != input.partition {
                        self.stats.partition_conflicts += 1;
                    }
                    Self::feed(&mut self.pipeline, &mut self.encoder, open, delta, sequence, now, sink);
                    return Disposition::Applied;
                }
                if self.finished.contains(key) {
                    self.stats.late_events += 1;
                    return Disposition::Late;
                }
                self.ensure_open(event, key, input.partition, now, sink, opened);
                #[cfg(test)]
                inject_failure(self.panic_on_delta, delta);
                let open = self.streams.get_mut(key).expect("ensure_open opened it");
                Self::feed(&mut self.pipeline, &mut self.encoder, open, delta, sequence, now, sink);
                Disposition::Applied
            }
            EventAction::Finish { text, reason, error }
                if event.ends_message() && self.segments.has_message(message_part(key)) =>
            {
                // An `error` or `interrupt` naming no segment ends every open stream of its
                // message: segments first, call by call, oldest first.
                let ids = self.segments_ended_by(message_part(key), None, sequence);
                if ids.is_empty() {
                    // Every open segment of its message applied later input: the event ended
                    // the message before they opened, and this is its redelivery.
                    return Disposition::Duplicate;
                }
                let ending = Ending { reason, error: error.as_deref() };
                // The event's text is the whole message's, not a segment's.
                self.end_segments(ids, ending, sink);
                match self.streams.remove(key) {
                    Some(open) => {
                        self.close(key, open, text.as_deref(), ending, sink);
                        self.stats.finished += 1;
                    }
                    // Remembered, so that the event delivered again is late, not a new stream.
                    None => self.remember_finished(key.into()),
                }
                Disposition::Applied
            }
            _ if self.finished.contains(key) => {
                self.stats.late_events += 1;
                Disposition::Late
            }
            _ if sequence.is_some_and(|seq| self.streams.get(key).is_some_and(|s| seq <= s.last_input)) => {
                Disposition::Duplicate
            }
            EventAction::Finish { text, reason, error } => {
                self.ensure_open(event, key, input.partition, now, sink, opened);
                let open = self.streams.remove(key).expect("ensure_open opened it");
                let ending = Ending { reason, error: error.as_deref() };
                self.close(key, open, text.as_deref(), ending, sink);
                self.stats.finished += 1;
                Disposition::Applied
            }
        }
    }

    /// The open segments of `message` (the [`message_part`] of the event's key: those of `call`
    /// and those that named none, or every one) that an event ending them at input sequence
    /// `sequence` ends: the segments it follows in the input. A segment that applied later input
    /// opened after the event, which is then a redelivery (a first delivery comes in stream
    /// order) and must not end it.
    fn segments_ended_by(&self, message: &str, call: Option<&str>, sequence: Option<u64>) -> Vec<Arc<str>> {
        let mut ids = self.segments.of(message, call);
        if let Some(sequence) = sequence {
            ids.retain(|id| self.streams.get(id).is_some_and(|open| open.last_input < sequence));
        }
        ids
    }

    /// Ends the open segments `ids`, in that order, with `ending`. Each close delists its segment
    /// before it can fail, so that after a failure the event applied again ends the others.
    fn end_segments(&mut self, ids: Vec<Arc<str>>, ending: Ending<'_>, sink: &mut impl FnMut(Publication)) {
        for id in ids {
            let open = self.streams.remove(&id).expect("listed segments are open");
            self.close(&id, open, None, ending, sink);
            self.stats.finished += 1;
        }
    }

    /// Feeds `delta` to an open stream at `now` (its input sequence, when it has one, is
    /// `sequence`).
    fn feed(
        pipeline: &mut Pipeline,
        encoder: &mut OutputEncoder,
        open: &mut OpenStream,
        delta: &str,
        sequence: Option<u64>,
        now: Instant,
        sink: &mut impl FnMut(Publication),
    ) {
        open.last_seen = now;
        open.last_input = sequence.unwrap_or(open.last_input);
        let header = &open.header;
        pipeline.feed(&mut open.state, delta, &mut |o: Output<'_>| sink(encoder.encode(header, &o)));
    }

    /// Closes every stream idle since before `now - idle_timeout`, with reason `expired`.
    /// Returns how many were closed. Work is proportional to the streams closed.
    pub fn expire(&mut self, now: Instant, sink: &mut impl FnMut(Publication)) -> usize {
        #[cfg(test)]
        let sink = &mut hooked(self.panic_on_output, sink);
        let mut closed = 0;
        while let Some((_, oldest)) = self.streams.front() {
            if now.saturating_duration_since(oldest.last_seen) < self.limits.idle_timeout {
                break;
            }
            let (id, open) = self.streams.pop_front().expect("front exists");
            self.close(&id, open, None, "expired".into(), sink);
            self.stats.expired += 1;
            closed += 1;
        }
        closed
    }

    /// Closes every open stream with `reason` (shutdown), oldest first.
    pub fn close_all(&mut self, reason: &str, sink: &mut impl FnMut(Publication)) {
        #[cfg(test)]
        let sink = &mut hooked(self.panic_on_output, sink);
        while let Some((id, open)) = self.streams.pop_front() {
            self.close(&id, open, None, reason.into(), sink);
            self.stats.closed_at_shutdown += 1;
        }
    }

    /// The table's own copy of open stream `key`'s key: a caller that keeps the key while the
    /// stream is open shares it instead of copying the text.
    pub fn shared_key(&self, key: &str) -> Option<&Arc<str>> {
        self.streams.get_key_value(key).map(|(shared, _)| shared)
    }

    /// Whether stream `key` closed since the last [`StreamTable::take_closed`].
    pub fn has_closed(&self, key: &str) -> bool {
        self.closed.iter().any(|closed| closed.as_ref() == key)
    }

    /// The streams closed (finished, expired, evicted, shut down) since the last call, in order.
    pub fn take_closed(&mut self) -> Vec<Box<str>> {
        std::mem::take(&mut self.closed)
    }

    /// Drops the state of stream `key` without publishing anything, after processing one of its
    /// events failed (its state may be half-updated). It counts as finished: later events of it
    /// are late, and the caller is told it closed (so held input is released).
    pub fn discard(&mut self, key: &str) {
        if let Some(open) = self.streams.remove(key) {
            self.delist(key, &open);
            self.stats.failed += 1;
        }
        self.end_failed(key.into());
    }

    /// After a panic: the stream that was being closed when it happened, if any, now counted as
    /// failed, closed (so its held input is released) and finished (later events of it are
    /// late). Its state is already gone; outputs of it that were gathered are the caller's to
    /// drop.
    pub fn recover_failed_close(&mut self) -> Option<Box<str>> {
        let id = self.closing.take()?;
        self.stats.failed += 1;
        self.end_failed(id.clone());
        Some(id)
    }

    /// Ends stream `id` after a caught panic: the scratch it may have left is cleared, and it is
    /// closed (its held input released) and finished (later events of it are late).
    fn end_failed(&mut self, id: Box<str>) {
        self.pipeline.clear_scratch();
        self.closed.push(id.clone());
        self.remember_finished(id);
    }

    /// Keeps `id` among the recently finished streams, within `finished_memory`.
    fn remember_finished(&mut self, id: Box<str>) {
        if self.limits.finished_memory > 0 {
            if self.finished.len() >= self.limits.finished_memory {
                self.finished.pop_front();
            }
            self.finished.insert(id);
        }
    }

    /// Forgets every open stream without closing it (no outputs): the JetStream shutdown path,
    /// where unacknowledged input will rebuild them elsewhere. Returns how many were open.
    pub fn abandon_all(&mut self) -> usize {
        let open = self.streams.len();
        self.streams.clear();
        self.segments.clear();
        self.stats.handed_over += open as u64;
        open
    }

    /// Forgets, without closing them, the open streams of input partition `partition` (one that
    /// another replica now consumes, and rebuilds those streams from their unacknowledged input).
    /// They are not remembered as finished: if the partition comes back, their events are not
    /// late. Returns their keys.
    pub fn abandon_partition(&mut self, partition: u32) -> Vec<Box<str>> {
        let ids: Vec<Box<str>> = self
            .streams
            .iter()
            .filter(|(_, open)| open.partition == partition)
            .map(|(id, _)| Box::from(&**id))
            .collect();
        for id in &ids {
            if let Some(open) = self.streams.remove(&**id) {
                self.delist(id, &open);
            }
        }
        self.stats.handed_over += ids.len() as u64;
        ids
    }

    /// Makes sure the event's stream is open and most recently used, evicting if needed.
    fn ensure_open(
        &mut self,
        event: &InboundEvent<'_>,
        key: &str,
        partition: u32,
        now: Instant,
        sink: &mut impl FnMut(Publication),
        opened: &mut dyn FnMut(&tracing::Span),
    ) {
        if let Some(open) = self.streams.to_back(key) {
            if open.partition != partition {
                self.stats.partition_conflicts += 1;
            }
            return;
        }
        while self.streams.len() >= self.limits.max_streams {
            let Some((id, open)) = self.streams.pop_front() else { break };
            self.close(&id, open, None, "evicted".into(), sink);
            self.stats.evicted += 1;
        }
        self.stats.opened += 1;
        // Ids only: never text. Field names follow the OpenTelemetry messaging conventions.
        let span = tracing::info_span!(
            "stream",
            messaging.system = "nats",
            messaging.message.id = %event.stream.message_id,
            stream.id = %event.stream.stream_id,
            stream.outputs = tracing::field::Empty,
            stream.finish_reason = tracing::field::Empty,
        );
        opened(&span);
        let key: Arc<str> = key.into();
        let header = StreamHeader::new(&event.stream, key.clone(), Vocabulary::of(&event.kind));
        let segment_of_call =
            event.stream.own_stream_id().map(|_| Box::new(self.segments.add(&key, &event.stream.provider_call_id)));
        let open = OpenStream {
            state: StreamState::new(),
            header,
            last_seen: now,
            span,
            last_input: 0,
            partition,
            segment_of_call,
        };
        self.streams.insert(key, open);
    }

    /// Takes stream `id`, no longer open, off the list of segments.
    fn delist(&mut self, id: &str, open: &OpenStream) {
        if let Some(call) = &open.segment_of_call {
            self.segments.remove(id, call);
        }
    }

    fn close(
        &mut self,
        id: &str,
        mut open: OpenStream,
        final_text: Option<&str>,
        ending: Ending<'_>,
        sink: &mut impl FnMut(Publication),
    ) {
        self.delist(id, &open);
        // Held here while the stream closes, so that a panic leaves it behind.
        self.closing = Some(id.into());
        let (pipeline, encoder, header) = (&mut self.pipeline, &mut self.encoder, &open.header);
        pipeline.finish(&mut open.state, final_text, ending, &mut |o: Output<'_>| sink(encoder.encode(header, &o)));
        let id = self.closing.take().expect("set before the stream closed");
        open.span.record("stream.outputs", open.state.seq());
        open.span.record("stream.finish_reason", ending.reason);
        self.closed.push(id.clone());
        self.remember_finished(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::inbound::decode;
    use crate::codec::outbound::OutputSubjects;
    use crate::pipeline::{PipelineLimits, TagKind, TagSpec};
    use std::time::Duration;

    /// An input without sequences or partitions (core NATS).
    const UNSEQUENCED: InputPosition = InputPosition { partition: 0, sequence: None };

    fn table(max_streams: usize) -> StreamTable {
        let pipeline =
            Pipeline::new(vec![TagSpec::new("core:x:v1", TagKind::Block)], PipelineLimits::default()).unwrap();
        let encoder = OutputEncoder::new(&pipeline, &OutputSubjects::default());
        let limits = TableLimits { idle_timeout: Duration::from_secs(10), max_streams, finished_memory: 2 };
        StreamTable::new(pipeline, encoder, limits)
    }

    fn delta(id: &str) -> InboundEvent<'static> {
        let json = format!(r#"{{"type":"partial","meta":{{"message_id":"{id}"}},"delta":"x"}}"#);
        decode(json.as_bytes(), 1 << 20).unwrap().into_owned()
    }

    fn last_finish(outputs: &[Publication]) -> String {
        use prost::Message;
        let last = outputs.last().expect("an output");
        let text = crate::codec::proto::FilteredText::decode(last.payload.clone()).unwrap();
        format!("{} {}", last.msg_id, text.finish_reason)
    }

    #[test]
    fn the_longest_idle_stream_is_evicted_above_the_limit() {
        let mut t = table(2);
        let start = Instant::now();
        let mut out = Vec::new();
        t.apply(&delta("a"), UNSEQUENCED, start, &mut |p| out.push(p), &mut |_| {});
        t.apply(&delta("b"), UNSEQUENCED, start + Duration::from_secs(1), &mut |p| out.push(p), &mut |_| {});
        // `a` is used again, so `b` is now the longest idle.
        t.apply(&delta("a"), UNSEQUENCED, start + Duration::from_secs(2), &mut |p| out.push(p), &mut |_| {});
        out.clear();
        t.apply(&delta("c"), UNSEQUENCED, start + Duration::from_secs(3), &mut |p| out.push(p), &mut |_| {});
        assert_eq!(last_finish(&out[..1]), "b:2 evicted");
        assert_eq!(t.len(), 2);
        assert_eq!(t.stats().evicted, 1);
        assert_eq!(t.take_closed(), vec![Box::from("b")]);
    }

    #[test]
    fn idle_streams_expire_oldest_first_with_work_proportional_to_closures() {
        let mut t = table(10);
        let start = Instant::now();
        let mut out = Vec::new();
        for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
            t.apply(&delta(id), UNSEQUENCED, start + Duration::from_secs(i as u64), &mut |p| out.push(p), &mut |_| {});
        }
        out.clear();
        assert_eq!(t.expire(start + Duration::from_secs(11), &mut |p| out.push(p)), 2);
        assert_eq!(t.take_closed(), vec![Box::from("a"), Box::from("b")]);
        assert_eq!(t.len(), 1);
        assert_eq!(last_finish(&out), "b:2 expired");
    }

    #[test]
    fn late_events_and_input_duplicates_are_reported_not_applied() {
        let mut t = table(10);
        let now = Instant::now();
        let mut out = Vec::new();
        use Disposition::{Applied, Duplicate};
        for (sequence, expected) in [(5, Applied), (5, Duplicate), (3, Duplicate), (9, Applied)] {
            let got = t.apply(&delta("a"), InputPosition::at(sequence), now, &mut |p| out.push(p), &mut |_| {});
            assert_eq!(got, expected, "sequence {sequence}");
        }
        let fin = decode(br#"{"type":"final","meta":{"message_id":"a"}}"#, 1 << 20).unwrap();
        assert_eq!(t.apply(&fin, InputPosition::at(10), now, &mut |p| out.push(p), &mut |_| {}), Disposition::Applied);
        assert_eq!(
            t.apply(&delta("a"), InputPosition::at(11), now, &mut |p| out.push(p), &mut |_| {}),
            Disposition::Late
        );
        assert_eq!(t.stats().late_events, 1);
        // The finished memory is bounded: the oldest ids are forgotten.
        for id in ["b", "c"] {
            let json = format!(r#"{{"type":"final","meta":{{"message_id":"{id}"}}}}"#);
            let fin = decode(json.as_bytes(), 1 << 20).unwrap();
            t.apply(&fin, UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        }
        assert_eq!(t.apply(&delta("a"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {}), Disposition::Applied);
    }

    #[test]
    fn abandoning_emits_nothing_and_counts_the_streams_handed_over() {
        let mut t = table(10);
        let mut out = Vec::new();
        for (id, partition) in [("a", 0), ("b", 1), ("c", 0)] {
            let input = InputPosition { partition, sequence: None };
            t.apply(&delta(id), input, Instant::now(), &mut |p| out.push(p), &mut |_| {});
        }
        out.clear();
        assert_eq!(t.abandon_partition(1), vec![Box::from("b")]);
        assert_eq!((t.len(), t.stats().handed_over), (2, 1));
        assert_eq!(t.abandon_all(), 2);
        assert!(out.is_empty() && t.is_empty() && t.take_closed().is_empty());
        let stats = t.stats();
        assert_eq!((stats.handed_over, stats.finished, stats.closed_at_shutdown), (3, 0, 0));
    }

    /// A canonical delta of `segment`, a segment of message `message`.
    fn segment(message: &str, segment: &str) -> InboundEvent<'static> {
        let json = format!(
            r#"{{"type":"text-delta","meta":{{"message_id":"{message}"}},"correlation":{{"segment_id":"{segment}"}},"delta":"x <core:x:v1>a: 1"}}"#
        );
        decode(json.as_bytes(), 1 << 20).unwrap().into_owned()
    }

    /// A canonical delta of `segment` of message `m`, naming provider call `call` unless empty.
    fn segment_of_call(segment: &str, call: &str, delta: &str) -> InboundEvent<'static> {
        let call = if call.is_empty() { String::new() } else { format!(r#","provider_call_id":"{call}""#) };
        let json = format!(
            r#"{{"type":"text-delta","meta":{{"message_id":"m"}},"correlation":{{"segment_id":"{segment}"{call}}},"delta":"{delta}"}}"#
        );
        decode(json.as_bytes(), 1 << 20).unwrap().into_owned()
    }

    /// An event in the legacy shape, as both vocabularies send `error` and `interrupt`.
    fn uncorrelated(kind: &str, message: &str) -> InboundEvent<'static> {
        let json =
            format!(r#"{{"type":"{kind}","meta":{{"message_id":"{message}"}},"error_string":"boom","text":"all"}}"#);
        decode(json.as_bytes(), 1 << 20).unwrap().into_owned()
    }

    /// `(stream id, finish reason, error)` of every final among `outputs`.
    fn finals(outputs: &[Publication]) -> Vec<(String, String, String)> {
        use prost::Message;
        outputs
            .iter()
            .filter(|p| p.type_name == crate::codec::proto::names::FILTERED_TEXT)
            .map(|p| crate::codec::proto::FilteredText::decode(p.payload.clone()).unwrap())
            .filter(|text| text.r#final)
            .map(|text| (text.stream.unwrap_or_default().stream_id, text.finish_reason, text.error))
            .collect()
    }

    #[test]
    fn an_error_or_interrupt_naming_no_segment_ends_every_open_stream_of_its_message() {
        let mut t = table(10);
        t.limits.finished_memory = 10;
        let now = Instant::now();
        let mut out = Vec::new();
        for (message, seg) in [("m", "m:s1"), ("other", "o:s1"), ("m", "m:s2"), ("n", "n:s1")] {
            t.apply(&segment(message, seg), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        }
        out.clear();
        let got = t.apply(&uncorrelated("error", "m"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        assert_eq!(got, Disposition::Applied);
        let error = |id: &str| (id.to_owned(), "error".to_owned(), "boom".to_owned());
        assert_eq!(finals(&out), vec![error("m:s1"), error("m:s2")]);
        // Each segment's open block completed as any stream end completes it.
        assert_eq!(out.iter().filter(|p| p.type_name == crate::codec::proto::names::BLOCK_EVENT).count(), 2);
        assert_eq!(t.take_closed(), vec![Box::from("m/m:s1"), Box::from("m/m:s2")]);
        assert_eq!((t.len(), t.stats().finished), (2, 2));
        // Later events of the segments, and the same event again, are late.
        for late in [segment("m", "m:s1"), uncorrelated("error", "m")] {
            assert_eq!(t.apply(&late, UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {}), Disposition::Late);
        }
        out.clear();
        // An interrupt ends its message's segment with its reason, the segment's own text kept.
        t.apply(&uncorrelated("interrupt", "n"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        assert_eq!(finals(&out), vec![("n:s1".to_owned(), "interrupt".to_owned(), String::new())]);
        let text = |p: &Publication| {
            use prost::Message;
            crate::codec::proto::FilteredText::decode(p.payload.clone()).unwrap().text
        };
        assert_eq!(text(out.last().unwrap()), "x ");
        // With no segment of its message open, it ends the stream of its message id, as before.
        out.clear();
        t.apply(&uncorrelated("error", "quiet"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        assert_eq!(finals(&out), vec![error("quiet")]);
        assert_eq!(t.len(), 1, "only the other message's segment is open");
    }

    #[test]
    fn an_open_stream_fits_its_map_node_in_a_320_byte_allocation() {
        // 288 bytes, with the key and the two links of a map node: mimalloc's size classes go
        // 256, 320, 384; 8 bytes more cost 64 bytes per open stream.
        assert!(std::mem::size_of::<OpenStream>() <= 288, "{} bytes", std::mem::size_of::<OpenStream>());
    }

    #[test]
    fn a_message_ending_finds_its_segments_by_its_escaped_id_whatever_slashes_the_ids_hold() {
        let mut t = table(10);
        let now = Instant::now();
        let mut out = Vec::new();
        // Keys `a/b/c` and `a%2Fb/c`: the segments are found by the key's part before its first
        // slash, which is the message id escaped.
        for (message, seg) in [("a", "b/c"), ("a/b", "c")] {
            t.apply(&segment(message, seg), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        }
        for (message, ended) in [("a/b", "a%2Fb/c"), ("a", "a/b/c")] {
            out.clear();
            t.apply(&uncorrelated("error", message), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
            assert_eq!(t.take_closed(), vec![Box::from(ended)], "the error of {message}");
        }
        assert_eq!(finals(&out), vec![("b/c".to_owned(), "error".to_owned(), "boom".to_owned())]);
        assert!(t.is_empty() && t.segments.is_empty());
    }

    #[test]
    fn a_segment_id_another_message_reuses_names_another_stream() {
        let mut t = table(10);
        t.limits.finished_memory = 10;
        let now = Instant::now();
        let mut out = Vec::new();
        let segment_finished = |message: &str| {
            let json = format!(
                r#"{{"type":"text-segment-finished","meta":{{"message_id":"{message}"}},"correlation":{{"segment_id":"s"}},"finish_reason":"stop"}}"#
            );
            decode(json.as_bytes(), 1 << 20).unwrap().into_owned()
        };
        // Each call of a tool loop has a message id of its own; a producer that numbers every call
        // 0 gives their segments one id. The second call's segment is not the first one's late
        // event: it opens and ends on its own, with output ids of its own.
        for message in ["call-1", "call-2"] {
            assert_eq!(
                t.apply(&segment(message, "s"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {}),
                Disposition::Applied
            );
            assert_eq!(
                t.apply(&segment_finished(message), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {}),
                Disposition::Applied
            );
        }
        assert_eq!(t.take_closed(), vec![Box::from("call-1/s"), Box::from("call-2/s")]);
        let ids: Vec<&str> = out.iter().map(|p| p.msg_id.as_str()).collect();
        let unique: std::collections::HashSet<&str> = ids.iter().copied().collect();
        assert_eq!(unique.len(), ids.len(), "output ids repeat: {ids:?}");
        assert_eq!(t.stats().late_events, 0);
        // Open at once, neither touches the other: another message's end of `s` leaves it open.
        out.clear();
        t.apply(&segment("victim", "s"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        t.apply(&segment("intruder", "s"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        t.apply(&segment_finished("intruder"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        assert_eq!((t.take_closed(), t.len()), (vec![Box::from("intruder/s")], 1));
        // The intruder's final holds its own text only, under its own message id.
        use prost::Message;
        let last = crate::codec::proto::FilteredText::decode(out.last().unwrap().payload.clone()).unwrap();
        let stream = last.stream.unwrap_or_default();
        assert_eq!((stream.message_id.as_str(), stream.stream_id.as_str()), ("intruder", "s"));
        assert_eq!((last.r#final, last.text.as_str()), (true, "x "));
        let victims: Vec<Publication> = out.iter().filter(|p| p.msg_id.starts_with("victim/s:")).cloned().collect();
        assert!(!victims.is_empty() && finals(&victims).is_empty(), "the victim's segment stays open");
    }

    #[test]
    fn the_end_of_a_provider_call_ends_its_open_segments_and_the_event_goes_through() {
        let mut t = table(10);
        let now = Instant::now();
        let mut out = Vec::new();
        let call_finished = |call: &str| {
            let json = format!(
                r#"{{"type":"provider-call-finished","meta":{{"message_id":"m"}},"correlation":{{"provider_call_id":"{call}"}},"finish_class":"cancelled"}}"#
            );
            decode(json.as_bytes(), 1 << 20).unwrap().into_owned()
        };
        for (segment, call) in [("a", "p1"), ("b", "p2"), ("c", "p1"), ("d", "")] {
            t.apply(
                &segment_of_call(segment, call, "x <core:x:v1>a: 1"),
                UNSEQUENCED,
                now,
                &mut |p| out.push(p),
                &mut |_| {},
            );
        }
        t.apply(&segment("other", "o"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        out.clear();
        // p1's segments, and the one that named no call, end; p2's and another message's stay.
        let got = t.apply(&call_finished("p1"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        assert_eq!(got, Disposition::PassThrough);
        let cancelled = |id: &str| (id.to_owned(), "cancelled".to_owned(), String::new());
        assert_eq!(finals(&out), vec![cancelled("a"), cancelled("c"), cancelled("d")]);
        assert_eq!(t.take_closed(), vec![Box::from("m/a"), Box::from("m/c"), Box::from("m/d")]);
        assert_eq!((t.len(), t.stats().finished), (2, 3));
        // The same end again, or the end of a call with nothing open, changes nothing.
        for event in [call_finished("p1"), call_finished("p9")] {
            out.clear();
            assert_eq!(t.apply(&event, UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {}), Disposition::PassThrough);
            assert!(out.is_empty() && t.take_closed().is_empty());
        }
        t.apply(&call_finished("p2"), UNSEQUENCED, now, &mut |p| out.push(p), &mut |_| {});
        assert_eq!(finals(&out), vec![cancelled("b")]);
        assert_eq!(t.len(), 1, "only the other message's segment is open");
    }

    #[test]
    fn a_redelivered_end_leaves_the_segments_opened_after_it_open() {
        let mut t = table(10);
        t.limits.finished_memory = 10;
        let now = Instant::now();
        let mut out = Vec::new();
        let call_finished = decode(
            br#"{"type":"provider-call-finished","meta":{"message_id":"m"},"correlation":{"provider_call_id":"p"}}"#,
            1 << 20,
        )
        .unwrap();
        let mut apply = |t: &mut StreamTable, event: &InboundEvent<'_>, sequence: u64| {
            t.apply(event, InputPosition::at(sequence), now, &mut |p| out.push(p), &mut |_| {})
        };
        // A call ends its segment; the next call reuses its id (geppetto's OpenAI chat engine
        // numbers every call 0 when its caller sets no index) and opens another.
        apply(&mut t, &segment_of_call("a", "p", "x"), 1);
        assert_eq!(apply(&mut t, &call_finished, 2), Disposition::PassThrough);
        apply(&mut t, &segment_of_call("b", "p", "x"), 3);
        // The first call's end delivered again, after the second call's segment: it stays open.
        assert_eq!(apply(&mut t, &call_finished, 2), Disposition::PassThrough);
        assert_eq!((t.take_closed(), t.len()), (vec![Box::from("m/a")], 1));
        // An error ends the message's segment; a redelivery of it, after a segment that opened
        // since, is a duplicate and leaves that segment open.
        assert_eq!(apply(&mut t, &uncorrelated("error", "m"), 4), Disposition::Applied);
        apply(&mut t, &segment_of_call("c", "q", "x"), 5);
        assert_eq!(apply(&mut t, &uncorrelated("error", "m"), 4), Disposition::Duplicate);
        assert_eq!((t.take_closed(), t.len()), (vec![Box::from("m/b")], 1));
        // A later error ends it.
        assert_eq!(apply(&mut t, &uncorrelated("error", "m"), 6), Disposition::Applied);
        assert_eq!((t.take_closed(), t.len()), (vec![Box::from("m/c")], 0));
    }

    /// One event of two messages' segments, provider calls and legacy streams (see
    /// [`redeliveries_change_nothing`]).
    fn any_event() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let message = prop_oneof![Just("m"), Just("n")];
        let segment = (message.clone(), 1..4u8, prop_oneof![Just("p"), Just("q"), Just("")]);
        let text = prop_oneof![Just("x "), Just("<core:x:v1>"), Just("a: 1\\n"), Just("</core:x:v1>"), Just("<core:x")];
        let correlation = |segment: &str, call: &str| {
            format!(r#""correlation":{{"segment_id":"{segment}","provider_call_id":"{call}"}}"#)
        };
        prop_oneof![
            4 => (segment.clone(), text.clone()).prop_map(move |((m, s, call), text)| format!(
                r#"{{"type":"text-delta","meta":{{"message_id":"{m}"}},{},"delta":"{text}"}}"#,
                correlation(&format!("{m}:s{s}"), call)
            )),
            1 => segment.prop_map(move |(m, s, call)| format!(
                r#"{{"type":"text-segment-finished","meta":{{"message_id":"{m}"}},{},"finish_reason":"stop"}}"#,
                correlation(&format!("{m}:s{s}"), call)
            )),
            1 => (message.clone(), text).prop_map(|(m, text)| format!(
                r#"{{"type":"partial","meta":{{"message_id":"{m}"}},"delta":"{text}"}}"#
            )),
            1 => (message.clone(), prop_oneof![Just("error"), Just("interrupt"), Just("final")])
                .prop_map(|(m, kind)| format!(r#"{{"type":"{kind}","meta":{{"message_id":"{m}"}},"error_string":"e"}}"#)),
            1 => (message, prop_oneof![Just("p"), Just("q")]).prop_map(|(m, call)| format!(
                r#"{{"type":"provider-call-finished","meta":{{"message_id":"{m}"}},"correlation":{{"provider_call_id":"{call}"}}}}"#
            )),
        ]
    }

    proptest::proptest! {
        /// With JetStream input any event may be delivered again, after later ones (a lost ack,
        /// a takeover's read of the stream): applied again at its own input sequence it must
        /// emit nothing and change nothing, whatever streams opened or ended since (by their
        /// events, by expiry, or evicted: at most four are open).
        #[test]
        fn redeliveries_change_nothing(
            events in proptest::collection::vec(any_event(), 1..40),
            again in proptest::collection::vec((0..40usize, 0..40usize), 0..20),
            idle in proptest::collection::vec(0..40usize, 0..4),
        ) {
            let events: Vec<InboundEvent<'static>> =
                events.iter().map(|json| decode(json.as_bytes(), 1 << 20).unwrap().into_owned()).collect();
            let run = |redeliver: bool| {
                let mut t = table(4);
                t.limits.finished_memory = 100;
                let mut now = Instant::now();
                let mut out = Vec::new();
                for (i, event) in events.iter().enumerate() {
                    // Every open stream goes idle for longer than the timeout, and expires.
                    if idle.contains(&i) {
                        now += t.limits.idle_timeout + Duration::from_secs(1);
                        t.expire(now, &mut |p| out.push(p));
                    }
                    t.apply(event, InputPosition::at(i as u64 + 1), now, &mut |p| out.push(p), &mut |_| {});
                    // Events delivered again after this one: any earlier one, at its own sequence.
                    for &(after, earlier) in again.iter().filter(|&&(after, _)| redeliver && after == i) {
                        let earlier = earlier % (after + 1);
                        let before = out.len();
                        let got = t.apply(&events[earlier], InputPosition::at(earlier as u64 + 1), now, &mut |p| out.push(p), &mut |_| {});
                        proptest::prop_assert_ne!(got, Disposition::Applied, "event {} again after {}", earlier, after);
                        proptest::prop_assert_eq!(out.len(), before, "event {} again after {} emitted", earlier, after);
                    }
                }
                t.close_all("shutdown", &mut |p| out.push(p));
                let outputs: Vec<(String, bytes::Bytes)> = out.into_iter().map(|p| (p.msg_id, p.payload)).collect();
                Ok((outputs, t.take_closed()))
            };
            proptest::prop_assert_eq!(run(true)?, run(false)?);
        }
    }

    #[test]
    fn a_segment_leaves_its_messages_list_however_it_ends() {
        let now = Instant::now();
        let mut out = Vec::new();
        let mut t = table(2);
        let mut open = |t: &mut StreamTable, message: &str, seg: &str, partition: u32| {
            let input = InputPosition { partition, sequence: None };
            t.apply(&segment(message, seg), input, now, &mut |p| out.push(p), &mut |_| {});
        };
        // Evicted, expired, discarded, given up with its partition, or closed at shutdown: an
        // error of its message later finds no segment listed that is not open (it would panic).
        open(&mut t, "a", "a:1", 0);
        open(&mut t, "b", "b:1", 0);
        open(&mut t, "c", "c:1", 0);
        t.expire(now + Duration::from_secs(60), &mut |_| {});
        open(&mut t, "d", "d:1", 0);
        t.discard("d:1");
        open(&mut t, "e", "e:1", 1);
        t.abandon_partition(1);
        open(&mut t, "f", "f:1", 0);
        t.close_all("shutdown", &mut |_| {});
        assert!(t.is_empty() && t.segments.is_empty());
        open(&mut t, "g", "g:1", 0);
        t.abandon_all();
        assert!(t.is_empty() && t.segments.is_empty());
        for message in ["a", "b", "c", "d", "e", "f", "g"] {
            let mut outputs = Vec::new();
            t.apply(&uncorrelated("error", message), UNSEQUENCED, now, &mut |p| outputs.push(p), &mut |_| {});
            assert_eq!(finals(&outputs), vec![(message.to_owned(), "error".to_owned(), "boom".to_owned())]);
        }
        assert!(t.segments.is_empty());
    }

    #[test]
    fn events_from_another_partition_than_their_streams_are_counted_and_applied() {
        let mut t = table(10);
        let mut out = Vec::new();
        let fin = decode(br#"{"type":"final","meta":{"message_id":"a"}}"#, 1 << 20).unwrap();
        for (event, partition, conflicts) in [(delta("a"), 1, 0), (delta("a"), 1, 0), (delta("a"), 0, 1), (fin, 2, 2)] {
            let input = InputPosition { partition, sequence: None };
            let got = t.apply(&event, input, Instant::now(), &mut |p| out.push(p), &mut |_| {});
            assert_eq!((got, t.stats().partition_conflicts), (Disposition::Applied, conflicts));
        }
        // The stream kept its first partition throughout, and closed normally.
        assert_eq!((t.len(), t.stats().finished), (0, 1));
    }
}
