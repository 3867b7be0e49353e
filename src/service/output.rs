//! Where a shard's results go: [`NatsSink`] publishes outputs, dead letters and pass-through
//! events to NATS, and acknowledges JetStream input: at once for events that leave the pipeline,
//! and, for text events, only once their stream has ended and (when a stream stores them) its
//! outputs' storage is confirmed, holding one acknowledgement per open stream (its anchor, see
//! [`HeldAcks`]). It also turns its shard's counters into metrics. One sink per shard worker,
//! owned by it: nothing here is shared between workers but the connection, the metrics, the stop
//! signal and whether outputs went unconfirmed after it.
//!
//! It knows the service's output contract (subjects, headers, message ids) and JetStream's
//! acknowledgement and publish-confirmation rules; it does not know where input comes from
//! (see `input`), how streams are kept (`shard`), nor the service's start-up and shutdown order.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue, Subject};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::{Envelope, ERROR_DETAIL_HEADER, ERROR_HEADER, PAYLOAD_OMITTED_HEADER, SOURCE_SUBJECT_HEADER, TYPE_HEADER};
use crate::bus;
use crate::codec::outbound::{payload_bound, stream_key, OutputEncoder, Publication};
use crate::config::Config;
use crate::metrics::{BlockFailure, CloseReason, DeadLetterReason, DropReason, Metrics, OutputKind};
use crate::pipeline::PipelineStats;
use crate::shard::table::{InputPosition, TableStats};
use crate::shard::worker::{ShardSink, Standing};

const TYPE_HEADER_NAME: HeaderName = HeaderName::from_static(TYPE_HEADER);
const CONTENT_TYPE_HEADER: HeaderName = HeaderName::from_static("Content-Type");

/// Counters last reported by a shard, to turn totals into increments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Reported {
    open_streams: usize,
    table: TableStats,
    pipeline: PipelineStats,
}

/// Publishes a worker's outputs to NATS, and acknowledges JetStream input: immediately for
/// events that leave the pipeline (dead letters, pass-through, drops), and only once their
/// stream has ended for text events, so that a stream interrupted by a crash is delivered again
/// from its first event to the next owner.
pub struct NatsSink {
    pub(super) client: async_nats::Client,
    pub(super) metrics: Arc<Metrics>,
    pass_through: Option<Subject>,
    dead_letter: Subject,
    reported: Reported,
    templates: OutputTemplates,
    /// JetStream acks held per open stream until it ends (its anchor, see [`HeldAcks`]).
    held: HeldAcks,
    /// JetStream input: outputs are published through JetStream and their storage confirmed
    /// before the stream's input is acknowledged (a core publish can be lost when the server
    /// that took it dies before passing it on to the stream's leader).
    confirm: Option<async_nats::jetstream::Context>,
    /// JetStream input: the input stream's name, for the message ids of forwarded input events
    /// (see [`NatsSink::forward`]).
    input_stream: Arc<str>,
    /// Whether a stream stores each output subject, and since when that is known.
    captures: FastMap<Arc<str>, (bool, Instant)>,
    /// Storage confirmations not yet awaited, per open stream.
    unconfirmed: FastMap<Box<str>, Vec<Unconfirmed>>,
    /// The number of confirmations in `unconfirmed`.
    unconfirmed_total: usize,
    /// Open streams with an output whose storage was not confirmed before shutdown: their input
    /// is not acknowledged.
    unconfirmed_failures: std::collections::HashSet<Box<str>>,
    /// Fired when the service begins to stop: outputs not confirmed by then are no longer
    /// published again (their input stays unacknowledged for the next owner).
    stopping: CancellationToken,
    /// Set, for every worker's sink, once outputs went unconfirmed after the service began to
    /// stop: later confirmations are not awaited (see [`NatsSink::await_confirmations`]).
    unconfirmed_at_stop: Arc<AtomicBool>,
}

/// What every output of one kind shares, prepared once and cloned for each output: its NATS
/// subject (converting the encoder's subject string costs an allocation and a copy) and its
/// `Content-Type` and `Structured-Sink-Type` headers (building a header map entry by entry costs a
/// name lookup, a hash and two allocations per header). Keyed by subject, message type and content
/// type, all fixed by the configuration and the schema registry, so bounded by them.
#[derive(Default)]
struct OutputTemplates(Vec<OutputTemplate>);

struct OutputTemplate {
    subject_text: Arc<str>,
    type_name: &'static str,
    content_type: &'static str,
    subject: Subject,
    headers: HeaderMap,
    /// The metric label of the message type.
    kind: OutputKind,
}

impl OutputTemplates {
    /// The template of `publication`'s kind (its index, to build its headers with
    /// [`OutputTemplates::headers`]), its subject and its metric label.
    fn prepared(&mut self, publication: &Publication) -> (usize, Subject, OutputKind) {
        let (subject_text, type_name, content_type) =
            (&publication.subject, publication.type_name, publication.content_type);
        // By pointer first: every output of a kind shares its encoder's subject string, and the
        // names are constants (a constant used in two places may still have two addresses, hence
        // the comparison of contents after).
        let same = |a: &str, b: &str| std::ptr::eq(a, b) || a == b;
        let found = self.0.iter().position(|t| {
            (Arc::ptr_eq(&t.subject_text, subject_text) || t.subject_text == *subject_text)
                && same(t.type_name, type_name)
                && same(t.content_type, content_type)
        });
        let index = match found {
            Some(index) => index,
            None => {
                let mut headers = HeaderMap::new();
                headers.insert(CONTENT_TYPE_HEADER, content_type);
                headers.insert(TYPE_HEADER_NAME, type_name);
                let subject = Subject::from(subject_text.as_ref());
                self.0.push(OutputTemplate {
                    subject_text: subject_text.clone(),
                    type_name,
                    content_type,
                    subject,
                    headers,
                    kind: output_kind(type_name),
                });
                self.0.len() - 1
            }
        };
        let template = &self.0[index];
        (index, template.subject.clone(), template.kind)
    }

    /// The headers of an output made from template `index`: the template's, the output's message
    /// id and its event's trace context.
    fn headers(&self, index: usize, msg_id: HeaderValue, trace: &[(HeaderName, HeaderValue)]) -> HeaderMap {
        let mut headers = self.0[index].headers.clone();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
        for (name, value) in trace {
            headers.insert(name.clone(), value.clone());
        }
        headers
    }
}

/// The sink's maps looked up per event or per output (held acks, unconfirmed outputs per stream,
/// captured subjects), with the stream table's hasher (foldhash, seeded per process) instead of
/// SipHash: hashing was about 450 instructions per JetStream event (callgrind over the bench),
/// for keys the stream table already hashes the same way.
type FastMap<K, V> = HashMap<K, V, hashlink::DefaultHashBuilder>;

/// The JetStream acks held back until their stream ends: per open stream, its anchor, the
/// lowest-sequence message applied here, with the reply subject of its latest delivery. Every
/// other message of the stream is acknowledged as soon as it is applied.
///
/// Why one ack is enough: where a restart or a takeover resumes is the consumer's ack floor (the
/// highest sequence below which everything is acknowledged), and everything above it is read
/// again, acknowledged or not (a restarted consumer is recreated at the floor, a takeover reads
/// the stream from it). An unacknowledged anchor keeps the floor below the stream's first event,
/// so the whole stream stays re-readable, while the server tracks one pending message per open
/// stream instead of every event of it: holding every ack cost nats-server 1.5 to 6 µs per
/// event in the bench and made `max_ack_pending` a bound on the events of all open streams.
///
/// A lower-sequence message that arrives later (after a takeover, the previous owner's anchor
/// is redelivered after messages this replica already anchored on) is held as well, so a stream
/// holds a few entries at most, lowest last.
///
/// An open stream's entry shares the stream table's copy of its key and keeps its anchor inline:
/// a copied key and a one-entry `Vec` cost two allocations and 60 to 140 bytes per open stream
/// (BENCHMARKS.md, thirty-sixth session).
#[derive(Default)]
struct HeldAcks(FastMap<Arc<str>, Held>);

/// One stream's held acks (sequence and reply subject), lowest sequence last.
enum Held {
    /// Its anchor alone: almost always (a lower message arrives later only at a takeover).
    Anchor((u64, Subject)),
    Several(Vec<(u64, Subject)>),
}

impl Held {
    fn entries(&mut self) -> &mut [(u64, Subject)] {
        match self {
            Held::Anchor(entry) => std::slice::from_mut(entry),
            Held::Several(entries) => entries,
        }
    }

    fn push(&mut self, entry: (u64, Subject)) {
        *self = match std::mem::replace(self, Held::Several(Vec::new())) {
            Held::Anchor(anchor) => Held::Several(vec![anchor, entry]),
            Held::Several(mut entries) => {
                entries.push(entry);
                Held::Several(entries)
            }
        };
    }

    fn into_replies(self) -> impl Iterator<Item = Subject> {
        let (anchor, others) = match self {
            Held::Anchor(anchor) => (Some(anchor), Vec::new()),
            Held::Several(entries) => (None, entries),
        };
        anchor.into_iter().chain(others).map(|(_, reply)| reply)
    }
}

impl HeldAcks {
    /// Takes the ack of stream `key`'s message at `sequence`: held when no lower message of the
    /// stream is (a redelivery of a held message replaces its reply subject: the ack goes to the
    /// latest delivery); otherwise handed back, to be sent now. `shared` is the stream table's
    /// copy of the key, when it has one, kept instead of a copy.
    fn hold(&mut self, key: &str, shared: Option<&Arc<str>>, sequence: u64, reply: Subject) -> Option<Subject> {
        // Looked up before inserting: an entry would need an owned key for every event.
        let Some(held) = self.0.get_mut(key) else {
            debug_assert!(shared.is_none_or(|shared| shared.as_ref() == key), "another stream's key");
            self.0.insert(shared.map_or_else(|| Arc::from(key), Arc::clone), Held::Anchor((sequence, reply)));
            return None;
        };
        let entries = held.entries();
        if let Some(entry) = entries.iter_mut().find(|(s, _)| *s == sequence) {
            entry.1 = reply;
            return None;
        }
        // Entries are pushed only below every held one, so the last is the lowest.
        if entries.last().is_some_and(|(lowest, _)| sequence < *lowest) {
            held.push((sequence, reply));
            return None;
        }
        Some(reply)
    }

    /// Drops stream `key`'s held acks unsent (its input stays unacknowledged).
    fn forget(&mut self, key: &str) {
        self.0.remove(key);
    }

    /// The reply subjects of stream `key`'s held acks; none are held for it afterwards.
    fn take(&mut self, key: &str) -> impl Iterator<Item = Subject> {
        self.0.remove(key).into_iter().flat_map(Held::into_replies)
    }
}

/// An output published through JetStream whose storage is not confirmed yet.
struct Unconfirmed {
    /// Which of the streams whose outputs are awaited together it belongs to (see
    /// [`NatsSink::await_confirmations`]); 0 when they are one stream's.
    stream: usize,
    /// The confirmation to await, or why the publish could not even be sent.
    sent: Result<PublishAckFuture, PublishError>,
    output: Output,
}

/// Where a forwarded input event's acknowledgement goes (JetStream input only).
struct Input {
    ack: Option<Subject>,
    sequence: Option<u64>,
}

/// What it takes to publish an output again (same `Nats-Msg-Id` header, so a copy that was stored
/// after all is dropped by the stream).
struct Output {
    subject: Subject,
    headers: KeptHeaders,
    payload: Bytes,
    /// Its metric label.
    kind: OutputKind,
}

/// The headers of an output kept to publish it again.
enum KeptHeaders {
    /// A forwarded input event's, as published.
    Whole(HeaderMap),
    /// An output of the pipeline's: what its headers are made of ([`OutputTemplates::headers`]),
    /// put together again only if it is published again. Keeping a copy of the whole map cost
    /// about seven allocations per output, most of what keeping it cost.
    Made { template: usize, msg_id: HeaderValue, trace: Vec<(HeaderName, HeaderValue)> },
}

/// Rounds of publishing unconfirmed outputs again between two error logs (the first rounds are
/// expected while a stream elects a leader, so they are only warnings).
const ROUNDS_PER_ERROR_LOG: u32 = 10;

/// How long a storage confirmation (and a JetStream API request of the sink) is awaited before
/// the output is published again; also how long a worker's last flush may wait at shutdown.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);

/// How long whether a stream stores an output subject is remembered (see [`NatsSink::captured`]).
const CAPTURE_TTL: Duration = Duration::from_secs(10);

/// Confirmations outstanding per worker before all of them are awaited. It bounds memory, and
/// stays below the in-flight publish acks of the worker's own JetStream context
/// ([`confirming_context`]), beyond which a publish would wait for permits that only awaiting
/// confirmations frees.
const MAX_UNCONFIRMED: usize = 1024;

/// A JetStream context for one worker's storage confirmations. One per worker: async-nats bounds
/// the confirmations in flight per context, and a worker holds up to [`MAX_UNCONFIRMED`] of them
/// unawaited, so workers sharing a context (5,000 slots) could all wait for a slot that only one
/// of them awaiting its confirmations would free, and stop for good. The timeout is short: a
/// confirmation lost with a failing server is published again soon instead of holding the worker
/// for async-nats' default of 5 s per awaited confirmation (`ack_timeout` would only bound
/// confirmations nobody awaits).
fn confirming_context(client: &async_nats::Client) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(CONFIRM_TIMEOUT)
        .max_ack_inflight(2 * MAX_UNCONFIRMED)
        .build(client.clone())
}

impl Clone for NatsSink {
    /// A sink for another worker: same connection and settings, nothing held.
    fn clone(&self) -> Self {
        NatsSink {
            client: self.client.clone(),
            metrics: self.metrics.clone(),
            pass_through: self.pass_through.clone(),
            dead_letter: self.dead_letter.clone(),
            reported: Reported::default(),
            templates: OutputTemplates::default(),
            held: HeldAcks::default(),
            // Its own: the in-flight bound is per context (see `confirming_context`).
            confirm: self.confirm.as_ref().map(|_| confirming_context(&self.client)),
            input_stream: self.input_stream.clone(),
            captures: FastMap::default(),
            unconfirmed: FastMap::default(),
            unconfirmed_total: 0,
            unconfirmed_failures: Default::default(),
            stopping: self.stopping.clone(),
            unconfirmed_at_stop: self.unconfirmed_at_stop.clone(),
        }
    }
}

impl NatsSink {
    /// The sink a service's workers start from (each takes a clone): publishing on `client`,
    /// counting into `metrics`, with the configured pass-through and dead-letter subjects and,
    /// with JetStream input, storage confirmations. `stopping` fires when the service begins to
    /// stop.
    pub fn new(
        client: &async_nats::Client,
        metrics: &Arc<Metrics>,
        config: &Config,
        stopping: CancellationToken,
    ) -> Self {
        NatsSink {
            client: client.clone(),
            metrics: metrics.clone(),
            pass_through: (!config.input.pass_through_subject.is_empty())
                .then(|| Subject::from(config.input.pass_through_subject.as_str())),
            dead_letter: Subject::from(config.input.dead_letter_subject.as_str()),
            reported: Reported::default(),
            templates: OutputTemplates::default(),
            held: HeldAcks::default(),
            confirm: config.jetstream.enabled.then(|| confirming_context(client)),
            input_stream: config.jetstream.stream.as_str().into(),
            captures: FastMap::default(),
            unconfirmed: FastMap::default(),
            unconfirmed_total: 0,
            unconfirmed_failures: Default::default(),
            stopping,
            unconfirmed_at_stop: Arc::default(),
        }
    }

    async fn send(&self, kind: OutputKind, subject: Subject, headers: HeaderMap, payload: Bytes) {
        match self.client.publish_with_headers(subject.clone(), headers, payload).await {
            Ok(()) => self.metrics.count_published(kind),
            Err(e) => {
                self.metrics.count_publish_error(kind);
                tracing::error!(%subject, error = %e, "publish failed");
            }
        }
    }

    /// Waits for storage confirmations, publishing again (with backoff, same message id) what was
    /// not confirmed, for instance across a server restart or while a replicated stream elects a
    /// new leader, until everything is stored or the service stops. Returns the streams (as
    /// [`Unconfirmed::stream`] numbers them) whose outputs are not all confirmed: none when every
    /// output was stored or has nowhere to be stored (no stream captures its subject); some only
    /// when the service stopped first. Several streams' outputs are awaited as one batch: one
    /// stream's slow confirmations are not waited for before the next stream's, and each
    /// confirmation is polled when it arrives rather than whenever one of its stream's does.
    ///
    /// There is no give-up short of shutdown: input whose outputs were given up would have to be
    /// processed again, but its stream has finished here, so a redelivery of it counts as a
    /// duplicate of a finished stream and is acknowledged without output. Retrying holds the
    /// worker, which is the backpressure a durable pipeline wants while its output store is
    /// unavailable; at shutdown the unacknowledged input goes to the next owner, which rebuilds the
    /// stream.
    ///
    /// Once outputs went unconfirmed after the service began to stop, later ones are not awaited:
    /// the server is not storing them, and awaiting would cost each closing stream a confirmation
    /// timeout and a JetStream API timeout (about 4 s) of the shutdown's time, for the same end
    /// (the input left unacknowledged).
    async fn await_confirmations(&self, pending: Vec<Unconfirmed>) -> Vec<usize> {
        let Some(js) = self.confirm.as_ref() else { return Vec::new() };
        if pending.is_empty() {
            return Vec::new();
        }
        if self.stopping.is_cancelled() && self.unconfirmed_at_stop.load(Ordering::Relaxed) {
            return streams_of(pending.iter().map(|u| u.stream));
        }
        let mut pending = pending;
        let mut round = 0u32;
        loop {
            let mut refused = Vec::new();
            let failed = unstored(js, pending, &mut refused).await;
            for output in refused {
                self.metrics.count_publish_error(output.kind);
            }
            let Some(Unstored { error, .. }) = failed.first() else { return Vec::new() };
            let error = match error.kind() {
                // `unstored` kept it, so a stream does capture the subject.
                PublishErrorKind::StreamNotFound => "no responders: the stream has no leader".to_owned(),
                _ => error.to_string(),
            };
            if self.stopping.is_cancelled() {
                return self.unconfirmed_when_stopping(&failed, &error);
            }
            round += 1;
            if round % ROUNDS_PER_ERROR_LOG == 0 {
                tracing::error!(outputs = failed.len(), round, %error, "outputs still not confirmed; publishing them again");
            } else {
                tracing::warn!(outputs = failed.len(), round, %error, "outputs not confirmed; publishing them again");
            }
            // All of a round's outputs are published again together: one at a time, a backlog of
            // them (every output published while a stream had no leader) would take minutes.
            let backoff = Duration::from_millis(100 * u64::from(round.min(10)));
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.stopping.cancelled() => return self.unconfirmed_when_stopping(&failed, &error),
            }
            pending = Vec::with_capacity(failed.len());
            for Unstored { stream, output, .. } in failed {
                self.metrics.count_republished(output.kind);
                let headers = match &output.headers {
                    KeptHeaders::Whole(headers) => headers.clone(),
                    KeptHeaders::Made { template, msg_id, trace } => {
                        self.templates.headers(*template, msg_id.clone(), trace)
                    }
                };
                let sent = js.publish_with_headers(output.subject.clone(), headers, output.payload.clone()).await;
                pending.push(Unconfirmed { stream, sent, output });
            }
        }
    }

    /// The end of [`NatsSink::await_confirmations`] when `failed` went unconfirmed after the
    /// service began to stop: logged, and remembered so that later confirmations are not awaited.
    /// Returns their streams.
    fn unconfirmed_when_stopping(&self, failed: &[Unstored], error: &str) -> Vec<usize> {
        self.unconfirmed_at_stop.store(true, Ordering::Relaxed);
        tracing::warn!(outputs = failed.len(), %error, "stopping with outputs whose storage is not confirmed");
        streams_of(failed.iter().map(|f| f.stream))
    }

    /// Whether a JetStream stream stores output `subject`, from the JetStream API, remembered for
    /// [`CAPTURE_TTL`] (one entry per output subject, so bounded by the registered tags). A stream
    /// created for an output subject while the service runs is confirmed against within that
    /// time; until then it stores those outputs without the service waiting for it. False for
    /// core NATS input (nothing is confirmed).
    async fn captured(&mut self, subject: &str) -> bool {
        let Some(js) = self.confirm.as_ref() else { return false };
        let now = Instant::now();
        if let Some(&(captured, at)) = self.captures.get(subject) {
            if now.duration_since(at) < CAPTURE_TTL {
                return captured;
            }
        }
        let captured = stream_captures(js, subject).await;
        self.captures.insert(subject.into(), (captured, now));
        captured
    }

    /// Acknowledges a JetStream input message (nothing for core NATS input).
    pub(super) async fn ack(&self, envelope: &Envelope) {
        if let Some(reply) = &envelope.ack {
            self.send_ack(reply.clone()).await;
        }
    }

    async fn send_ack(&self, reply: Subject) {
        if let Err(e) = self.client.publish(reply, Bytes::from_static(b"+ACK")).await {
            tracing::error!(error = %e, "ack failed");
        }
    }

    pub(super) async fn dead_letter_with_detail(&mut self, envelope: Envelope, reason: &'static str, detail: &str) {
        if envelope.rebuilt {
            return self.ack(&envelope).await;
        }
        if let Some(reason) = DeadLetterReason::from_label(reason) {
            self.metrics.count_dead_letter(reason);
        }
        let mut headers = forwarded_headers(envelope.headers);
        headers.insert(ERROR_HEADER, reason);
        headers.insert(ERROR_DETAIL_HEADER, detail);
        headers.insert(SOURCE_SUBJECT_HEADER, envelope.subject.as_str());
        let input = Input { ack: envelope.ack, sequence: envelope.sequence };
        self.forward(OutputKind::DeadLetter, self.dead_letter.clone(), headers, envelope.payload, input).await;
    }

    /// Publishes an input event itself (a dead letter or a pass-through), then acknowledges the
    /// input. Core NATS input has no ack. JetStream input: published before the ack, on the same
    /// connection, so a connection lost in between loses the ack too and the event comes back;
    /// when a stream stores `subject`, the ack waits for the confirmation of its storage, with the
    /// retries outputs get (so the input stays unacknowledged while that stream refuses it, and
    /// goes to the next owner if the service stops first). It carries
    /// `Nats-Msg-Id: <input stream>:<stream sequence>` unless the producer set one, so a copy
    /// published again after a lost confirmation, a restart or a takeover is dropped by a stream
    /// that deduplicates.
    async fn forward(
        &mut self,
        kind: OutputKind,
        subject: Subject,
        mut headers: HeaderMap,
        payload: Bytes,
        input: Input,
    ) {
        if let Some(sequence) = input.sequence {
            if headers.get(async_nats::header::NATS_MESSAGE_ID).is_none() {
                // A stream name holds no line break (the server refuses one), nor does a number.
                if let Some(id) = bus::header_value(format!("{}:{sequence}", self.input_stream)) {
                    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
                }
            }
        }
        // The headers added here can push an input that just fit the server's `max_payload` over
        // it, and such a copy could never be published: it goes without its payload, saying so.
        // (0: the client has no server info yet, and nothing to compare with.)
        let max_payload = self.client.max_payload();
        let payload = if max_payload > 0 && header_bytes(&headers) + payload.len() > max_payload {
            headers.insert(PAYLOAD_OMITTED_HEADER, payload.len().to_string());
            self.metrics.count_payload_omitted();
            Bytes::new()
        } else {
            payload
        };
        // Core NATS input: no sequence, no ack. (A JetStream message read during a takeover has a
        // sequence and no ack of its own: its redelivery acknowledges it, published again under
        // the same id.)
        if input.sequence.is_none() {
            return self.send(kind, subject, headers, payload).await;
        }
        // `captured` is false without a JetStream context.
        let stored = match self.captured(subject.as_str()).await.then_some(self.confirm.as_ref()).flatten() {
            Some(js) => {
                let sent = js.publish_with_headers(subject.clone(), headers.clone(), payload.clone()).await;
                if !self.to_confirm(kind, &subject, &sent) {
                    // It can never be stored: the input is acknowledged, as with core NATS output
                    // (holding it would stall the partition for good).
                    if let Some(reply) = input.ack {
                        self.send_ack(reply).await;
                    }
                    return;
                }
                let output = Output { subject, headers: KeptHeaders::Whole(headers), payload, kind };
                self.await_confirmations(vec![Unconfirmed { stream: 0, sent, output }]).await.is_empty()
            }
            _ => {
                self.send(kind, subject, headers, payload).await;
                true
            }
        };
        match (stored, input.ack) {
            (true, Some(reply)) => self.send_ack(reply).await,
            (true, None) => {}
            (false, _) => {
                tracing::warn!(
                    "stopping before an input event's own publication was confirmed; leaving it unacknowledged"
                )
            }
        }
    }

    /// Counts a JetStream publish of `kind` to `subject` and tells whether its storage is to be
    /// confirmed (and it published again until stored). Not a message the server can never take
    /// (too large): publishing it again would hold the worker for good, so it is reported and
    /// dropped, as with core NATS output. A send that failed otherwise (too many confirmations in
    /// flight, a reconnect) is published again with the unconfirmed ones.
    fn to_confirm(&self, kind: OutputKind, subject: &Subject, sent: &Result<PublishAckFuture, PublishError>) -> bool {
        match sent {
            Ok(_) => {
                self.metrics.count_published(kind);
                true
            }
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                self.metrics.count_publish_error(kind);
                tracing::error!(%subject, error = %e, "publish failed");
                false
            }
            Err(e) => {
                self.metrics.count_publish_error(kind);
                tracing::warn!(%subject, error = %e, "publish failed; it will be published again");
                true
            }
        }
    }
}

impl ShardSink for NatsSink {
    type Envelope = Envelope;

    async fn publish(&mut self, publication: Publication, cause: Option<&Envelope>) {
        // JetStream mode confirms the storage of outputs that a stream stores; the others (core
        // subscribers only) are published plainly: their confirmation could only time out.
        // The JetStream context is borrowed, never cloned here: a clone and drop of its client per
        // output was about 8% of the input task's time in JetStream mode.
        let confirm = self.captured(&publication.subject).await;
        let (template, subject, kind) = self.templates.prepared(&publication);
        let Publication { msg_id, payload, .. } = publication;
        // The id is the stream key (its message and stream ids, checked for control characters
        // when its event was decoded) and a number, so it never holds a line break; were it to,
        // the output is reported and dropped rather than published with a forged header or a
        // panic.
        let Some(msg_id) = bus::header_value(msg_id) else {
            self.metrics.count_publish_error(kind);
            tracing::error!(%subject, "publish failed: the output's message id holds a line break");
            return;
        };
        let trace = cause.map_or(&[][..], |c| &c.trace);
        // `captured` is false without a JetStream context.
        let Some(js) = self.confirm.as_ref().filter(|_| confirm) else {
            let headers = self.templates.headers(template, msg_id, trace);
            return self.send(kind, subject, headers, payload).await;
        };
        let headers = self.templates.headers(template, msg_id.clone(), trace);
        let sent = js.publish_with_headers(subject.clone(), headers, payload.clone()).await;
        // Not retried, it can never be sent: its stream's input is acknowledged as usual.
        if self.to_confirm(kind, &subject, &sent) {
            let kept = |msg_id| {
                let headers = KeptHeaders::Made { template, msg_id, trace: trace.to_vec() };
                Unconfirmed { stream: 0, sent, output: Output { subject, headers, payload, kind } }
            };
            // Kept per stream, looked up once; the key is copied only for a stream's first output
            // in a batch.
            let key = stream_key(msg_id.as_str());
            match self.unconfirmed.get_mut(key) {
                Some(outputs) => outputs.push(kept(msg_id)),
                None => {
                    let key = Box::from(key);
                    self.unconfirmed.insert(key, vec![kept(msg_id)]);
                }
            }
            self.unconfirmed_total += 1;
        }
        if self.unconfirmed_total >= MAX_UNCONFIRMED {
            // Every stream's confirmations in one batch, each output numbered by its stream.
            let (streams, pending): (Vec<Box<str>>, Vec<Vec<Unconfirmed>>) =
                std::mem::take(&mut self.unconfirmed).into_iter().unzip();
            let pending = pending
                .into_iter()
                .enumerate()
                .flat_map(|(stream, outputs)| outputs.into_iter().map(move |u| Unconfirmed { stream, ..u }))
                .collect();
            self.unconfirmed_total = 0;
            for stream in self.await_confirmations(pending).await {
                self.unconfirmed_failures.insert(streams[stream].clone());
            }
        }
    }

    async fn pass_through(&mut self, envelope: Envelope) {
        if envelope.rebuilt {
            return self.ack(&envelope).await;
        }
        match self.pass_through.clone() {
            Some(subject) => {
                self.metrics.count_passed_through();
                let mut headers = forwarded_headers(envelope.headers);
                headers.insert(SOURCE_SUBJECT_HEADER, envelope.subject.as_str());
                let input = Input { ack: envelope.ack, sequence: envelope.sequence };
                self.forward(OutputKind::PassThrough, subject, headers, envelope.payload, input).await;
            }
            None => {
                self.ack(&envelope).await;
                self.metrics.count_dropped(DropReason::NoPassThroughSubject);
            }
        }
    }

    async fn dead_letter(&mut self, envelope: Envelope, reason: &'static str) {
        if reason == "stream_finished" && envelope.redelivered {
            // A JetStream redelivery of an event whose stream already ended here: not late, just
            // delivered twice.
            self.ack(&envelope).await;
            return;
        }
        let detail = match reason {
            "stream_finished" => "event for a stream that already finished",
            other => other,
        };
        self.dead_letter_with_detail(envelope, reason, detail).await;
    }

    fn position(&self, envelope: &Envelope) -> InputPosition {
        InputPosition { partition: envelope.partition, sequence: envelope.sequence }
    }

    async fn applied(&mut self, key: &str, shared: Option<&Arc<str>>, envelope: Envelope, standing: Standing) {
        // Once per event, whatever number of outputs it had (all of them are handed over now).
        self.metrics.observe_event_latency(envelope.received.elapsed());
        let (Some(reply), Some(sequence)) = (envelope.ack, envelope.sequence) else { return };
        // An event that followed others of its open stream is acknowledged at once, without
        // looking the stream up (that lookup touches data 1,000 interleaved streams have pushed
        // out of the cache: about 130 ns per event, BENCHMARKS.md, sixteenth session). It is above
        // everything held for the stream, so `hold` would hand its ack back, with one exception:
        // a stream rebuilt at a takeover from reads that carry no ack has nothing held yet, and
        // `hold` would have held its first delivery. That is not needed: the stream's first event
        // is still unacknowledged (the previous owner held it), so the ack floor stays below the
        // stream, and it is held here when the server redelivers it (a duplicate).
        // An orphaned repeat has no open stream to anchor (see `Standing::Orphaned`): held, it
        // would stay so for good, in an entry nothing releases.
        if matches!(standing, Standing::Following | Standing::Orphaned) {
            self.send_ack(reply).await;
            return;
        }
        if let Some(reply) = self.held.hold(key, shared, sequence, reply) {
            self.send_ack(reply).await;
        }
    }

    async fn stream_closed(&mut self, key: &str) {
        // Core publishes: the stream's outputs went out before these acks on the same connection.
        // JetStream: their storage is confirmed first, however long that takes; only when the
        // service stops first does the input stay unacknowledged, for the next owner to process
        // it again.
        let pending = self.unconfirmed.remove(key).unwrap_or_default();
        self.unconfirmed_total -= pending.len();
        let stored = self.await_confirmations(pending).await.is_empty();
        if !stored || self.unconfirmed_failures.remove(key) {
            tracing::warn!(
                stream.key = key,
                "outputs not confirmed before shutdown; leaving the stream's input unacknowledged"
            );
            self.held.forget(key);
            return;
        }
        for reply in self.held.take(key) {
            self.send_ack(reply).await;
        }
    }

    fn stream_abandoned(&mut self, key: &str) {
        // Its input stays unacknowledged for the replica that consumes the partition now, which
        // publishes the stream's outputs again under the same ids: whether those published here
        // were stored no longer matters.
        self.held.forget(key);
        let pending = self.unconfirmed.remove(key).unwrap_or_default();
        self.unconfirmed_total -= pending.len();
        self.unconfirmed_failures.remove(key);
    }

    fn stream_opened(&mut self, span: &tracing::Span, cause: &Envelope) {
        let Some(headers) = cause.headers.as_ref() else { return };
        let parent = crate::telemetry::extract_context(|name| headers.get(name).map(|v| v.to_string()));
        crate::telemetry::set_remote_parent(span, parent);
    }

    fn report(&mut self, shard: usize, open_streams: usize, table: TableStats, pipeline: PipelineStats) {
        let now = Reported { open_streams, table, pipeline };
        // Most events change no counter: then nothing is written to the shared metrics.
        if now == self.reported {
            return;
        }
        let (last, m) = (self.reported, &self.metrics);
        m.set_streams_open(shard, open_streams as u64);
        m.count_streams_opened(table.opened - last.table.opened);
        m.count_streams_closed(CloseReason::Finished, table.finished - last.table.finished);
        m.count_streams_closed(CloseReason::Expired, table.expired - last.table.expired);
        m.count_streams_closed(CloseReason::Evicted, table.evicted - last.table.evicted);
        m.count_streams_closed(CloseReason::Shutdown, table.closed_at_shutdown - last.table.closed_at_shutdown);
        m.count_streams_closed(CloseReason::Failed, table.failed - last.table.failed);
        m.count_streams_closed(CloseReason::HandedOver, table.handed_over - last.table.handed_over);
        m.count_stream_partition_conflicts(table.partition_conflicts - last.table.partition_conflicts);
        m.count_captures_overflowed(pipeline.capture_overflows - last.pipeline.capture_overflows);
        m.count_captures_unclosed(pipeline.unclosed_captures - last.pipeline.unclosed_captures);
        m.count_finals_diverged(pipeline.diverged_finals - last.pipeline.diverged_finals);
        m.count_text_overflows(pipeline.text_overflows - last.pipeline.text_overflows);
        m.count_error_texts_cut(pipeline.error_texts_cut - last.pipeline.error_texts_cut);
        m.count_blocks_failed(BlockFailure::InvalidPayload, pipeline.invalid_payloads - last.pipeline.invalid_payloads);
        m.count_blocks_failed(
            BlockFailure::SchemaMismatch,
            table.typed.schema_mismatches - last.table.typed.schema_mismatches,
        );
        m.count_blocks_failed(BlockFailure::TooDeep, table.typed.too_deep - last.table.typed.too_deep);
        m.count_outputs_trimmed(table.typed.outputs_trimmed - last.table.typed.outputs_trimmed);
        m.count_snapshots_skipped(pipeline.snapshot_budget_skips - last.pipeline.snapshot_budget_skips);
        self.reported = now;
    }

    async fn flush(&mut self) {
        // Bounded: while the connection is down, async-nats' flush waits for a reconnect, which
        // would hold the shutdown to its timeout.
        match tokio::time::timeout(CONFIRM_TIMEOUT, self.client.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "flush failed"),
            Err(_) => tracing::warn!("flush timed out; the connection is down"),
        }
    }
}

/// The headers of an input event as forwarded (a dead letter, a pass-through event): all of them
/// but the producer's JetStream publish controls. The server stores those with the event and
/// would apply them to the copy: a stream that stores the copy would refuse it for good
/// (`Nats-Expected-Stream` names the input stream, `Nats-Expected-Last-*` its sequences), which
/// held the input unacknowledged and the partition stalled, or expire it or roll it up.
/// `Nats-Msg-Id` stays (see [`NatsSink::forward`]).
fn forwarded_headers(headers: Option<HeaderMap>) -> HeaderMap {
    let Some(headers) = headers else { return HeaderMap::new() };
    if !headers.iter().any(|(name, _)| is_publish_control(name.as_ref())) {
        return headers;
    }
    let mut kept = HeaderMap::new();
    for (name, values) in headers.iter().filter(|(name, _)| !is_publish_control(name.as_ref())) {
        for value in values {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// The size of `headers` on the wire, as the client checks it against `max_payload` (the
/// `NATS/1.0` line, a line per value, the blank line).
fn header_bytes(headers: &HeaderMap) -> usize {
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            let name: &str = name.as_ref();
            values.iter().map(|value| name.len() + value.as_str().len() + ": \r\n".len()).sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n\r\n".len() + lines
}

/// Whether `name` is a header that tells JetStream how to store the message that carries it
/// (nats-server 2.2 to 2.12), compared without regard to case.
fn is_publish_control(name: &str) -> bool {
    const PREFIXES: [&str; 3] = ["nats-expected-", "nats-batch-", "nats-schedule"];
    const NAMES: [&str; 3] = ["nats-rollup", "nats-ttl", "nats-incr"];
    let starts = |prefix: &str| name.get(..prefix.len()).is_some_and(|head| head.eq_ignore_ascii_case(prefix));
    PREFIXES.iter().any(|p| starts(p)) || NAMES.iter().any(|n| name.eq_ignore_ascii_case(n))
}

/// An output whose storage was not confirmed, with its stream's number and why.
struct Unstored {
    stream: usize,
    output: Output,
    error: PublishError,
}

/// Each stream number of `streams` once, in order.
fn streams_of(streams: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut streams: Vec<usize> = streams.collect();
    streams.sort_unstable();
    streams.dedup();
    streams
}

/// Awaits the confirmations of `outputs` and returns those not stored, each with its error.
/// Outputs whose subject no stream captures are left out: nothing downstream stores them, so
/// there is nothing to confirm. Those a stream refuses for good go to `permanently_refused`.
async fn unstored(
    js: &async_nats::jetstream::Context,
    outputs: Vec<Unconfirmed>,
    permanently_refused: &mut Vec<Output>,
) -> Vec<Unstored> {
    // One after the other under one deadline: each confirmation's own timeout starts when it is
    // awaited, so with those alone a server that does not answer would cost a timeout per output.
    // (A confirmation that arrived is taken even past the deadline: the inner future is polled
    // first.) Most have arrived by the time they are awaited; polling them together instead
    // (`join_all`) cost 1.5 k instructions more per output in its own bookkeeping and in polls
    // again of those not yet arrived, 2.8 k over a whole batch of streams (callgrind,
    // BENCHMARKS.md, thirty-seventh session).
    let deadline = tokio::time::Instant::now() + CONFIRM_TIMEOUT;
    let mut results = Vec::with_capacity(outputs.len());
    for Unconfirmed { stream, sent, output } in outputs {
        let stored = match sent {
            Ok(confirmation) => match tokio::time::timeout_at(deadline, confirmation).await {
                Ok(confirmed) => confirmed.map(drop),
                Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
            },
            Err(e) => Err(e),
        };
        results.push((stream, output, stored));
    }
    let mut failed = Vec::new();
    // One JetStream API request per subject and round, not per output.
    let mut captured: HashMap<String, bool> = HashMap::new();
    for (stream, output, stored) in results {
        let Err(error) = stored else { continue };
        // A stream that refuses the message for good (larger than its `max_msg_size`, headers over
        // its limit, sealed) would refuse it in every round, and the rounds hold the worker and
        // every stream of its shard: reported and given up, like an output over `max_payload`.
        if let Some(reason) = refused_for_good(&error) {
            tracing::error!(subject = %output.subject, %reason, "the stream refuses the output for good; it is dropped");
            permanently_refused.push(output);
            continue;
        }
        // Neither error tells whether a stream captures the subject. async-nats reports the
        // server's "no responders" status as `StreamNotFound`; the server sends it when nothing
        // listens on the subject, which is also the case while a stream that captures it has no
        // leader (only the leader listens on the stream's subjects, and an R3 stream whose
        // leader's node stopped takes seconds to elect another): taking it for "no stream" there
        // acknowledged input whose outputs were never stored. A timeout comes from a stream that
        // did not answer in time, or from core subscribers that never answer when there is no
        // stream. Only the JetStream API, which knows every stream, tells these apart.
        if matches!(error.kind(), PublishErrorKind::StreamNotFound | PublishErrorKind::TimedOut) {
            let captures = match captured.get(output.subject.as_str()) {
                Some(&captures) => captures,
                None => {
                    let captures = stream_captures(js, &output.subject).await;
                    captured.insert(output.subject.to_string(), captures);
                    captures
                }
            };
            if !captures {
                continue;
            }
        }
        failed.push(Unstored { stream, output, error });
    }
    failed
}

/// Bounds the outputs of each subject that a JetStream stream captures by what that stream takes
/// (`max_msg_size`, headers included), so that an output too large for it goes with its bulk left
/// out rather than refused. A stream created or changed after start-up is not seen: what it
/// refuses for good is given up (see [`refused_for_good`]).
pub(super) async fn bound_by_downstream_streams(
    client: &async_nats::Client,
    mut encoder: OutputEncoder,
) -> OutputEncoder {
    // Short: a JetStream API that does not answer must not hold start-up for long per subject.
    let js = async_nats::jetstream::ContextBuilder::new().timeout(Duration::from_secs(2)).build(client.clone());
    for subject in encoder.subjects() {
        let Ok(name) = js.stream_by_subject(&*subject).await else { continue };
        let Ok(stream) = js.get_stream(&name).await else { continue };
        let limit = stream.cached_info().config.max_message_size;
        if let Ok(limit @ 1..) = usize::try_from(limit) {
            tracing::info!(%subject, stream = %name, max_msg_size = limit, "outputs bounded by their stream's message size");
            encoder = encoder.with_subject_limit(&subject, payload_bound(limit));
        }
    }
    encoder
}

/// The server's reason when `error` is a refusal that no later attempt can change.
fn refused_for_good(error: &PublishError) -> Option<String> {
    use async_nats::jetstream::ErrorCode;
    let source = std::error::Error::source(error)?.downcast_ref::<async_nats::jetstream::Error>()?;
    matches!(
        source.error_code(),
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM | ErrorCode::STREAM_SEALED
    )
    .then(|| source.to_string())
}

/// Whether a JetStream stream may capture `subject`: false only when the JetStream API answers
/// that none does. An API that does not answer (its meta leader is being elected) counts as
/// "may", so that the output is published again rather than given up as having nowhere to go.
async fn stream_captures(js: &async_nats::jetstream::Context, subject: &str) -> bool {
    use async_nats::jetstream::context::GetStreamByNameErrorKind;
    match js.stream_by_subject(subject).await {
        Ok(_) => true,
        Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => false,
        Err(e) => {
            tracing::debug!(%subject, error = %e, "cannot tell whether a stream captures the subject");
            true
        }
    }
}

/// The metric label of an output message type.
fn output_kind(type_name: &str) -> OutputKind {
    use crate::codec::proto::names;
    match type_name {
        names::BLOCK_EVENT => OutputKind::Block,
        names::THINKING_TEXT => OutputKind::Thinking,
        names::TOOL_CALL => OutputKind::Tool,
        _ => OutputKind::Filtered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(held: &mut HeldAcks, stream_id: &str) -> Vec<String> {
        held.take(stream_id).map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_each_streams_lowest_message_is_held_and_the_rest_are_acknowledged_at_once() {
        let mut held = HeldAcks::default();
        let ack = |text: String| Some(Subject::from(text));
        assert_eq!(held.hold("a", None, 1, Subject::from("ack.1.first")), None, "the first message is held");
        for sequence in 2..=1000 {
            let reply = format!("ack.{sequence}.first");
            assert_eq!(
                held.hold("a", None, sequence, Subject::from(reply.clone())),
                ack(reply),
                "acknowledged at once"
            );
        }
        // A redelivery of the held message replaces its reply subject; one of another is
        // acknowledged again.
        assert_eq!(held.hold("a", None, 1, Subject::from("ack.1.again")), None);
        assert_eq!(held.hold("a", None, 500, Subject::from("ack.500.again")), ack("ack.500.again".into()));
        // After a takeover the previous owner's anchor (lower) comes after this replica's: held
        // too, and messages between the two are acknowledged.
        assert_eq!(held.hold("b", None, 5, Subject::from("ack.b.5")), None);
        assert_eq!(held.hold("b", None, 3, Subject::from("ack.b.3")), None);
        assert_eq!(held.hold("b", None, 4, Subject::from("ack.b.4")), ack("ack.b.4".into()));
        assert_eq!(held.hold("b", None, 5, Subject::from("ack.b.5.again")), None);
        assert_eq!(held.hold("b", None, 2, Subject::from("ack.b.2")), None, "a third, lower still");
        assert_eq!(taken(&mut held, "a"), ["ack.1.again"]);
        assert!(taken(&mut held, "a").is_empty(), "taken once");
        assert_eq!(taken(&mut held, "b"), ["ack.b.5.again", "ack.b.3", "ack.b.2"]);
        held.hold("c", None, 7, Subject::from("ack.c.7"));
        held.forget("c");
        assert!(taken(&mut held, "c").is_empty(), "forgotten acks are never sent");
    }

    #[test]
    fn an_open_streams_held_ack_keeps_the_tables_key_and_its_anchor_inline() {
        let mut held = HeldAcks::default();
        let key: Arc<str> = Arc::from("m/s");
        assert_eq!(held.hold("m/s", Some(&key), 1, Subject::from("ack.1")), None);
        assert_eq!(Arc::strong_count(&key), 2, "shared by the table and the held ack");
        assert_eq!(held.hold("m/s", Some(&key), 2, Subject::from("ack.2")), Some(Subject::from("ack.2")));
        assert_eq!(taken(&mut held, "m/s"), ["ack.1"]);
        assert_eq!(Arc::strong_count(&key), 1, "released with the ack");
        // A map entry: the key's pointer and length, the anchor's sequence and reply subject.
        assert_eq!(std::mem::size_of::<(Arc<str>, Held)>(), 56);
    }

    #[test]
    fn forwarded_headers_leave_the_producers_publish_controls_behind() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("Nats-Expected-Stream", "CHAT_RAW"),
            ("nats-expected-last-sequence", "7"),
            ("Nats-TTL", "1s"),
            ("Nats-Rollup", "sub"),
            ("Nats-Batch-Id", "b"),
            ("Nats-Msg-Id", "m:1"),
            ("traceparent", "00-x"),
            ("App", "one"),
        ] {
            headers.append(name, value);
        }
        headers.append("App", "two");
        let kept = forwarded_headers(Some(headers));
        let mut names: Vec<&str> = kept.iter().map(|(name, _)| name.as_ref()).collect();
        names.sort_unstable();
        assert_eq!(names, ["App", "Nats-Msg-Id", "traceparent"]);
        assert_eq!(kept.get_all("App").map(|v| v.as_str()).collect::<Vec<_>>(), ["one", "two"]);
        assert!(forwarded_headers(None).is_empty());
        // "NATS/1.0\r\n" + "App: one\r\n" + "App: two\r\n" + ... + "\r\n", as async-nats counts it.
        let lines = ["App: one", "App: two", "Nats-Msg-Id: m:1", "traceparent: 00-x"];
        assert_eq!(header_bytes(&kept), 12 + lines.iter().map(|l| l.len() + 2).sum::<usize>());
        assert!(!is_publish_control("Nats-Expected") && !is_publish_control("Nats-TTLx"));
    }
}
