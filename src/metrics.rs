//! The service's Prometheus metrics: every metric name is defined here, once.
//!
//! [`Metrics`] is shared behind an `Arc` by the dispatcher, the shard workers, the publisher and
//! the HTTP endpoint. Every value is a relaxed atomic, so recording never blocks and never takes a
//! lock. Label values come only from the small fixed enums below ([`DeadLetterReason`],
//! [`DropReason`], [`OutputKind`], [`CloseReason`], [`ConnectionEventKind`]), never from payload
//! text, subjects or ids, so the number of series is fixed at compile time.
//!
//! [`Metrics::render`] writes the Prometheus text exposition format 0.0.4; [`Metrics::snapshot`]
//! gives the same numbers as plain values (for tests and the NATS service API `$SRV.STATS`).
//!
//! This module knows metric names, help texts and label sets. It knows nothing of NATS, shards
//! or the pipeline: callers translate their own events (for example
//! `ConnectionEvent::kind()` or `DecodeError::code()`) with the `from_label` functions.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// The common prefix of every metric name.
pub const PREFIX: &str = "structured_sink_";

/// Upper bounds of the [`event latency`](Metrics::observe_event_latency) histogram buckets (10 µs
/// to 100 ms; slower events land in the implicit `+Inf` bucket). Bounds are inclusive.
pub const LATENCY_BUCKETS: [Duration; 13] = [
    Duration::from_micros(10),
    Duration::from_micros(25),
    Duration::from_micros(50),
    Duration::from_micros(100),
    Duration::from_micros(250),
    Duration::from_micros(500),
    Duration::from_millis(1),
    Duration::from_micros(2_500),
    Duration::from_millis(5),
    Duration::from_millis(10),
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(100),
];

/// A fixed set of label values of one label.
pub trait LabelValue: Copy + 'static {
    /// The label's name, e.g. `reason`.
    const LABEL: &'static str;
    /// Every value, in rendering order.
    const ALL: &'static [Self];
    /// This value as it appears in the metric label.
    fn as_str(self) -> &'static str;
    /// The position of this value in [`ALL`](LabelValue::ALL).
    fn index(self) -> usize;
}

/// Declares a label enum with its label strings, `as_str`, `from_label` and [`LabelValue`].
macro_rules! label_enum {
    (
        $(#[$meta:meta])*
        $name:ident, label = $label_name:literal {
            $( $(#[$vmeta:meta])* $variant:ident => $label:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// This value as it appears in the metric label.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $label, )+
                }
            }

            /// The value whose label is `label`, or `None` for a string outside the fixed set.
            pub fn from_label(label: &str) -> Option<Self> {
                match label {
                    $( $label => Some($name::$variant), )+
                    _ => None,
                }
            }
        }

        impl LabelValue for $name {
            const LABEL: &'static str = $label_name;
            const ALL: &'static [Self] = &[ $( $name::$variant, )+ ];
            fn as_str(self) -> &'static str {
                $name::as_str(self)
            }
            fn index(self) -> usize {
                self as usize
            }
        }
    };
}

label_enum! {
    /// Why an event was dead-lettered (label `reason` of `events_dead_lettered_total`). The first
    /// seven match `codec::inbound::DecodeError::code()`.
    DeadLetterReason, label = "reason" {
        /// Larger than `input.max_event_bytes`.
        TooLarge => "too_large",
        /// Not JSON, not UTF-8, or nested too deeply.
        InvalidJson => "invalid_json",
        /// JSON, but not an object.
        NotAnObject => "not_an_object",
        /// A field has the wrong type.
        WrongFieldType => "wrong_field_type",
        /// No `type` field.
        MissingType => "missing_type",
        /// No or empty `meta.message_id`.
        MissingMessageId => "missing_message_id",
        /// A text event lacks the field carrying its text.
        MissingField => "missing_field",
        /// A text event for a stream that has already finished.
        StreamFinished => "stream_finished",
        /// A message id that cannot be used (for example in a `Nats-Msg-Id`).
        InvalidMessageId => "invalid_message_id",
        /// Another id or a finish reason longer than 256 bytes.
        FieldTooLong => "field_too_long",
        /// Processing the event failed (a bug); its stream was discarded.
        InternalError => "internal_error",
    }
}

label_enum! {
    /// Why an event was dropped without being published anywhere (label `reason` of
    /// `events_dropped_total`).
    DropReason, label = "reason" {
        /// Not a text event, and `input.pass_through_subject` is empty.
        NoPassThroughSubject => "no_pass_through_subject",
        /// Filter mode: the message id belongs to a partition another replica owns.
        NotOwned => "not_owned",
        /// Its shard's worker had stopped (a failure outside any one stream); `/healthz` fails
        /// from then on.
        ShardStopped => "shard_stopped",
    }
}

label_enum! {
    /// What a published message carries (label `kind` of `messages_published_total`,
    /// `publish_errors_total` and `outputs_republished_total`).
    OutputKind, label = "kind" {
        /// Filtered visible text (`chat.filtered`).
        Filtered => "filtered",
        /// A completed structured block (the per-type subjects).
        Block => "block",
        /// Thinking text (`chat.thinking`).
        Thinking => "thinking",
        /// A tool call (`chat.tools`).
        Tool => "tool",
        /// An undecodable event forwarded to the dead-letter subject.
        DeadLetter => "dead_letter",
        /// A non-text event forwarded unchanged to the pass-through subject.
        PassThrough => "pass_through",
    }
}

label_enum! {
    /// Why a stream was closed (label `reason` of `streams_closed_total`).
    CloseReason, label = "reason" {
        /// Its own final, segment-finished, interrupt or error event, or an error, interrupt or
        /// provider call end that ended it without naming it.
        Finished => "finished",
        /// No event for `shards.idle_timeout_ms`.
        Expired => "expired",
        /// The longest-idle stream, closed to stay under `shards.max_streams`.
        Evicted => "evicted",
        /// Closed by a graceful shutdown.
        Shutdown => "shutdown",
        /// Discarded after processing one of its events failed.
        Failed => "failed",
        /// Left without outputs and unacknowledged (JetStream), to be rebuilt from its input by
        /// whichever replica consumes the partition next, possibly this one: at shutdown, or
        /// when the partition's pin moved.
        HandedOver => "handed_over",
    }
}

label_enum! {
    /// Why a completed block failed (label `reason` of `blocks_failed_total`). Blocks that hit
    /// their capture limit or never closed have their own counters.
    BlockFailure, label = "reason" {
        /// The payload is not valid YAML or JSON (after repair).
        InvalidPayload => "invalid_payload",
        /// The payload does not fit the block's declared message type.
        SchemaMismatch => "schema_mismatch",
        /// The payload nests messages deeper than `schemas.max_depth`.
        TooDeep => "too_deep",
    }
}

label_enum! {
    /// A NATS connection event (label `event` of `nats_connection_events_total`). The labels are
    /// exactly the strings of `bus::ConnectionEvent::kind()`, so
    /// `ConnectionEventKind::from_label(event.kind())` always succeeds.
    ConnectionEventKind, label = "event" {
        /// Connected (at start-up and after each reconnect).
        Connected => "connected",
        /// The connection was lost.
        Disconnected => "disconnected",
        /// The server announced lame duck mode.
        LameDuckMode => "lame_duck_mode",
        /// The client dropped messages of a subscription that fell behind.
        SlowConsumer => "slow_consumer",
        /// The server refused the credentials.
        AuthorizationViolation => "authorization_violation",
        /// The server refused a publish or subscribe.
        PermissionViolation => "permission_violation",
        /// Any other server error.
        ServerError => "server_error",
        /// An error inside the client.
        ClientError => "client_error",
        /// The connection is draining.
        Draining => "draining",
        /// The connection is closed for good.
        Closed => "closed",
    }
}

/// The Prometheus type of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

impl MetricType {
    fn as_str(self) -> &'static str {
        match self {
            MetricType::Counter => "counter",
            MetricType::Gauge => "gauge",
            MetricType::Histogram => "histogram",
        }
    }
}

/// One metric family: its name (without [`PREFIX`]), help text and type. Every family is one of
/// the constants below, so each name is written exactly once.
#[derive(Debug, Clone, Copy)]
struct MetricDef {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
}

const EVENTS_RECEIVED: MetricDef = MetricDef {
    name: "events_received_total",
    help: "NATS messages taken from the input subscriptions.",
    kind: MetricType::Counter,
};
const EVENTS_DEAD_LETTERED: MetricDef = MetricDef {
    name: "events_dead_lettered_total",
    help: "Events sent to the dead-letter subject, by reason.",
    kind: MetricType::Counter,
};
const EVENTS_PASSED_THROUGH: MetricDef = MetricDef {
    name: "events_passed_through_total",
    help: "Non-text events forwarded unchanged to the pass-through subject.",
    kind: MetricType::Counter,
};
const EVENTS_DROPPED: MetricDef = MetricDef {
    name: "events_dropped_total",
    help: "Events neither processed nor forwarded, by reason.",
    kind: MetricType::Counter,
};
const MESSAGES_PUBLISHED: MetricDef = MetricDef {
    name: "messages_published_total",
    help: "Messages handed to the NATS client for publishing, by kind.",
    kind: MetricType::Counter,
};
const PUBLISH_ERRORS: MetricDef = MetricDef {
    name: "publish_errors_total",
    help: "Messages the NATS client refused to publish, by kind.",
    kind: MetricType::Counter,
};
const OUTPUTS_REPUBLISHED: MetricDef = MetricDef {
    name: "outputs_republished_total",
    help: "Messages published again because the JetStream stream that stores their subject did not confirm storing them (no leader, a server restart, a full stream), by kind.",
    kind: MetricType::Counter,
};
const STREAMS_OPEN: MetricDef =
    MetricDef { name: "streams_open", help: "Streams currently open, over all shards.", kind: MetricType::Gauge };
const STREAMS_OPENED: MetricDef =
    MetricDef { name: "streams_opened_total", help: "Streams opened.", kind: MetricType::Counter };
const STREAMS_CLOSED: MetricDef =
    MetricDef { name: "streams_closed_total", help: "Streams closed, by reason.", kind: MetricType::Counter };
const STREAM_PARTITION_CONFLICTS: MetricDef = MetricDef {
    name: "stream_partition_conflicts_total",
    help: "Events of an open stream that arrived from another input partition than its first event.",
    kind: MetricType::Counter,
};
const PAYLOADS_OMITTED: MetricDef = MetricDef {
    name: "forwarded_payloads_omitted_total",
    help:
        "Dead letters and pass-through events sent without their payload, too large for max_payload with the headers.",
    kind: MetricType::Counter,
};
const CAPTURES_OVERFLOWED: MetricDef = MetricDef {
    name: "captures_overflowed_total",
    help: "Captured blocks that hit their byte limit and completed unsuccessfully.",
    kind: MetricType::Counter,
};
const CAPTURES_UNCLOSED: MetricDef = MetricDef {
    name: "captures_unclosed_total",
    help: "Captured blocks still open when their stream ended.",
    kind: MetricType::Counter,
};
const FINALS_DIVERGED: MetricDef = MetricDef {
    name: "finals_diverged_total",
    help: "Final events whose text did not extend the deltas already seen (the deltas won).",
    kind: MetricType::Counter,
};
const OUTPUTS_TRIMMED: MetricDef = MetricDef {
    name: "outputs_trimmed_total",
    help: "Outputs that would have exceeded the server's max_payload, or their stream's max_msg_size, and went with their bulk left out.",
    kind: MetricType::Counter,
};
const TEXT_OVERFLOWS: MetricDef = MetricDef {
    name: "text_overflows_total",
    help: "Streams whose retained visible text outgrew pipeline.max_text_bytes.",
    kind: MetricType::Counter,
};
const ERROR_TEXTS_CUT: MetricDef = MetricDef {
    name: "error_texts_cut_total",
    help: "Upstream error texts longer than 4 KiB, cut to 4 KiB on their stream's final.",
    kind: MetricType::Counter,
};
const BLOCKS_FAILED: MetricDef = MetricDef {
    name: "blocks_failed_total",
    help: "Completed blocks whose payload could not be decoded or typed, by reason.",
    kind: MetricType::Counter,
};
const SNAPSHOTS_SKIPPED: MetricDef = MetricDef {
    name: "snapshots_skipped_total",
    help: "Live-snapshot attempts skipped because they would exceed pipeline.snapshot_budget.",
    kind: MetricType::Counter,
};
const NATS_CONNECTION_EVENTS: MetricDef = MetricDef {
    name: "nats_connection_events_total",
    help: "NATS connection events reported by the client, by event.",
    kind: MetricType::Counter,
};
const SHARD_INBOX_FULL: MetricDef = MetricDef {
    name: "shard_inbox_full_total",
    help: "Times a dispatcher had to wait because a shard inbox was full.",
    kind: MetricType::Counter,
};
const EVENT_LATENCY: MetricDef = MetricDef {
    name: "event_latency_seconds",
    help: "Time from receiving an event to having handed all its outputs to the publisher.",
    kind: MetricType::Histogram,
};
const BUILD_INFO: MetricDef =
    MetricDef { name: "build_info", help: "Always 1; the version label names the build.", kind: MetricType::Gauge };

/// A monotonically increasing count.
#[derive(Debug, Default)]
struct Counter(AtomicU64);

impl Counter {
    fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One counter per value of the label `L`.
#[derive(Debug)]
struct CounterFamily<L: LabelValue> {
    counts: Box<[Counter]>,
    _label: std::marker::PhantomData<L>,
}

impl<L: LabelValue> CounterFamily<L> {
    fn new() -> Self {
        CounterFamily { counts: L::ALL.iter().map(|_| Counter::default()).collect(), _label: std::marker::PhantomData }
    }

    fn add(&self, label: L, n: u64) {
        self.counts[label.index()].add(n);
    }

    fn get(&self, label: L) -> u64 {
        self.counts[label.index()].get()
    }

    fn snapshot(&self) -> BTreeMap<&'static str, u64> {
        L::ALL.iter().map(|&label| (label.as_str(), self.get(label))).collect()
    }
}

/// A histogram with fixed buckets: one atomic count per bucket (not cumulative; the rendering
/// accumulates), plus the sum in nanoseconds.
#[derive(Debug)]
struct LatencyHistogram {
    /// `buckets[i]` counts observations in `(bound[i-1], bound[i]]`; the last slot is `+Inf`.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    /// Sum of all observations in nanoseconds (wraps after 584 years of total latency).
    sum_nanos: AtomicU64,
}

impl LatencyHistogram {
    fn new() -> Self {
        LatencyHistogram { buckets: std::array::from_fn(|_| AtomicU64::new(0)), sum_nanos: AtomicU64::new(0) }
    }

    fn observe(&self, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let slot = LATENCY_BUCKETS.partition_point(|&bound| bound < elapsed);
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(LATENCY_BUCKETS.len());
        for (slot, bound) in LATENCY_BUCKETS.iter().enumerate() {
            cumulative += self.buckets[slot].load(Ordering::Relaxed);
            buckets.push((bound.as_secs_f64(), cumulative));
        }
        // The count is derived from the buckets so that `+Inf` always equals `_count`, even while
        // other threads record.
        let count = cumulative + self.buckets[LATENCY_BUCKETS.len()].load(Ordering::Relaxed);
        let sum_seconds = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        HistogramSnapshot { buckets, count, sum_seconds }
    }
}

/// The values of a histogram at one moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistogramSnapshot {
    /// `(upper bound in seconds, observations at or below it)`, cumulative, ascending; the
    /// `+Inf` bucket is [`count`](HistogramSnapshot::count).
    pub buckets: Vec<(f64, u64)>,
    /// All observations.
    pub count: u64,
    /// Sum of all observations, in seconds.
    pub sum_seconds: f64,
}

/// Every metric's value at one moment, for tests and the NATS service API stats. Labelled
/// counters are maps from label value to count and contain every label value, zero or not.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    /// The crate version of `build_info`.
    pub version: &'static str,
    /// `events_received_total`.
    pub events_received: u64,
    /// `events_dead_lettered_total` by [`DeadLetterReason`].
    pub events_dead_lettered: BTreeMap<&'static str, u64>,
    /// `events_passed_through_total`.
    pub events_passed_through: u64,
    /// `events_dropped_total` by [`DropReason`].
    pub events_dropped: BTreeMap<&'static str, u64>,
    /// `messages_published_total` by [`OutputKind`].
    pub messages_published: BTreeMap<&'static str, u64>,
    /// `publish_errors_total` by [`OutputKind`].
    pub publish_errors: BTreeMap<&'static str, u64>,
    /// `outputs_republished_total` by [`OutputKind`].
    pub outputs_republished: BTreeMap<&'static str, u64>,
    /// `streams_open`, summed over shards.
    pub streams_open: u64,
    /// `streams_opened_total`.
    pub streams_opened: u64,
    /// `streams_closed_total` by [`CloseReason`].
    pub streams_closed: BTreeMap<&'static str, u64>,
    /// `stream_partition_conflicts_total`.
    pub stream_partition_conflicts: u64,
    /// `forwarded_payloads_omitted_total`.
    pub payloads_omitted: u64,
    /// `captures_overflowed_total`.
    pub captures_overflowed: u64,
    /// `captures_unclosed_total`.
    pub captures_unclosed: u64,
    /// `finals_diverged_total`.
    pub finals_diverged: u64,
    /// `text_overflows_total`.
    pub text_overflows: u64,
    /// `outputs_trimmed_total`.
    pub outputs_trimmed: u64,
    /// `error_texts_cut_total`.
    pub error_texts_cut: u64,
    /// `blocks_failed_total` by [`BlockFailure`].
    pub blocks_failed: BTreeMap<&'static str, u64>,
    /// `snapshots_skipped_total`.
    pub snapshots_skipped: u64,
    /// `nats_connection_events_total` by [`ConnectionEventKind`].
    pub nats_connection_events: BTreeMap<&'static str, u64>,
    /// `shard_inbox_full_total`.
    pub shard_inbox_full: u64,
    /// `event_latency_seconds`.
    pub event_latency: HistogramSnapshot,
}

impl MetricsSnapshot {
    /// Sum of all dead-lettered events, whatever the reason.
    pub fn events_dead_lettered_total(&self) -> u64 {
        self.events_dead_lettered.values().sum()
    }

    /// Sum of all published messages, whatever the kind.
    pub fn messages_published_total(&self) -> u64 {
        self.messages_published.values().sum()
    }

    /// Sum of all publish errors, whatever the kind.
    pub fn publish_errors_total(&self) -> u64 {
        self.publish_errors.values().sum()
    }

    /// Sum of all messages published again for want of a storage confirmation, whatever the kind.
    pub fn outputs_republished_total(&self) -> u64 {
        self.outputs_republished.values().sum()
    }

    /// Sum of all closed streams, whatever the reason.
    pub fn streams_closed_total(&self) -> u64 {
        self.streams_closed.values().sum()
    }
}

/// All of the service's metrics. Create one with [`Metrics::new`], share it with `Arc`, record
/// from any thread; every method is a relaxed atomic operation.
#[derive(Debug)]
pub struct Metrics {
    version: &'static str,
    events_received: Counter,
    events_dead_lettered: CounterFamily<DeadLetterReason>,
    events_passed_through: Counter,
    events_dropped: CounterFamily<DropReason>,
    messages_published: CounterFamily<OutputKind>,
    publish_errors: CounterFamily<OutputKind>,
    outputs_republished: CounterFamily<OutputKind>,
    /// One slot per shard, written only by that shard's worker, summed when read.
    streams_open: Box<[AtomicU64]>,
    streams_opened: Counter,
    streams_closed: CounterFamily<CloseReason>,
    stream_partition_conflicts: Counter,
    payloads_omitted: Counter,
    captures_overflowed: Counter,
    captures_unclosed: Counter,
    finals_diverged: Counter,
    text_overflows: Counter,
    outputs_trimmed: Counter,
    error_texts_cut: Counter,
    blocks_failed: CounterFamily<BlockFailure>,
    snapshots_skipped: Counter,
    nats_connection_events: CounterFamily<ConnectionEventKind>,
    shard_inbox_full: Counter,
    event_latency: LatencyHistogram,
}

impl Metrics {
    /// All metrics at zero, with one `streams_open` slot per shard (`shards` is the resolved
    /// worker count, at least 1 slot is kept).
    pub fn new(shards: usize) -> Self {
        Self::with_version(shards, env!("CARGO_PKG_VERSION"))
    }

    fn with_version(shards: usize, version: &'static str) -> Self {
        Metrics {
            version,
            events_received: Counter::default(),
            events_dead_lettered: CounterFamily::new(),
            events_passed_through: Counter::default(),
            events_dropped: CounterFamily::new(),
            messages_published: CounterFamily::new(),
            publish_errors: CounterFamily::new(),
            outputs_republished: CounterFamily::new(),
            streams_open: (0..shards.max(1)).map(|_| AtomicU64::new(0)).collect(),
            streams_opened: Counter::default(),
            streams_closed: CounterFamily::new(),
            stream_partition_conflicts: Counter::default(),
            payloads_omitted: Counter::default(),
            captures_overflowed: Counter::default(),
            captures_unclosed: Counter::default(),
            finals_diverged: Counter::default(),
            text_overflows: Counter::default(),
            outputs_trimmed: Counter::default(),
            error_texts_cut: Counter::default(),
            blocks_failed: CounterFamily::new(),
            snapshots_skipped: Counter::default(),
            nats_connection_events: CounterFamily::new(),
            shard_inbox_full: Counter::default(),
            event_latency: LatencyHistogram::new(),
        }
    }

    /// Counts one NATS message taken from an input subscription.
    pub fn count_received(&self) {
        self.events_received.add(1);
    }

    /// Counts one event sent to the dead-letter subject.
    pub fn count_dead_letter(&self, reason: DeadLetterReason) {
        self.events_dead_lettered.add(reason, 1);
    }

    /// Counts one non-text event forwarded to the pass-through subject.
    pub fn count_passed_through(&self) {
        self.events_passed_through.add(1);
    }

    /// Counts one event dropped without being published.
    pub fn count_dropped(&self, reason: DropReason) {
        self.events_dropped.add(reason, 1);
    }

    /// Counts one message handed to the NATS client.
    pub fn count_published(&self, kind: OutputKind) {
        self.messages_published.add(kind, 1);
    }

    /// Counts one message the NATS client refused.
    pub fn count_publish_error(&self, kind: OutputKind) {
        self.publish_errors.add(kind, 1);
    }

    /// Counts one message published again because its storage was not confirmed.
    pub fn count_republished(&self, kind: OutputKind) {
        self.outputs_republished.add(kind, 1);
    }

    /// Sets the number of streams open in shard `shard` (0-based). A shard index beyond the count
    /// given to [`Metrics::new`] is a wiring bug: it panics in debug builds and is ignored in
    /// release builds.
    pub fn set_streams_open(&self, shard: usize, open: u64) {
        debug_assert!(shard < self.streams_open.len(), "shard {shard} beyond {}", self.streams_open.len());
        if let Some(slot) = self.streams_open.get(shard) {
            slot.store(open, Ordering::Relaxed);
        }
    }

    /// Counts `n` newly opened streams.
    pub fn count_streams_opened(&self, n: u64) {
        self.streams_opened.add(n);
    }

    /// Counts `n` streams closed for `reason`.
    pub fn count_streams_closed(&self, reason: CloseReason, n: u64) {
        self.streams_closed.add(reason, n);
    }

    /// Counts `n` captures that hit their byte limit.
    pub fn count_captures_overflowed(&self, n: u64) {
        self.captures_overflowed.add(n);
    }

    /// Counts `n` captures still open at the end of their stream.
    pub fn count_captures_unclosed(&self, n: u64) {
        self.captures_unclosed.add(n);
    }

    /// Counts `n` finals whose text diverged from the deltas.
    pub fn count_finals_diverged(&self, n: u64) {
        self.finals_diverged.add(n);
    }

    /// Counts `n` streams whose retained text outgrew its limit.
    pub fn count_text_overflows(&self, n: u64) {
        self.text_overflows.add(n);
    }

    /// Counts `n` outputs that went with their bulk left out to fit the server's `max_payload` or
    /// their stream's `max_msg_size`.
    pub fn count_outputs_trimmed(&self, n: u64) {
        self.outputs_trimmed.add(n);
    }

    /// Counts `n` events that arrived from another input partition than their open stream's.
    pub fn count_stream_partition_conflicts(&self, n: u64) {
        self.stream_partition_conflicts.add(n);
    }

    /// Counts one dead letter or pass-through event published without its payload.
    pub fn count_payload_omitted(&self) {
        self.payloads_omitted.add(1);
    }

    /// Counts `n` upstream error texts cut to their limit.
    pub fn count_error_texts_cut(&self, n: u64) {
        self.error_texts_cut.add(n);
    }

    /// Counts `n` completed blocks that failed for `reason`.
    pub fn count_blocks_failed(&self, reason: BlockFailure, n: u64) {
        self.blocks_failed.add(reason, n);
    }

    /// Counts `n` snapshot attempts skipped for the snapshot budget.
    pub fn count_snapshots_skipped(&self, n: u64) {
        self.snapshots_skipped.add(n);
    }

    /// Counts one NATS connection event.
    pub fn count_connection_event(&self, event: ConnectionEventKind) {
        self.nats_connection_events.add(event, 1);
    }

    /// Counts one time a dispatcher waited for room in a full shard inbox.
    pub fn count_shard_inbox_full(&self) {
        self.shard_inbox_full.add(1);
    }

    /// Records the time from receiving one event to having handed all its outputs to the
    /// publisher.
    pub fn observe_event_latency(&self, elapsed: Duration) {
        self.event_latency.observe(elapsed);
    }

    /// Every value at this moment. Values are read one by one, so a snapshot taken while others
    /// record is not one atomic cut (each value is exact at its own read).
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            version: self.version,
            events_received: self.events_received.get(),
            events_dead_lettered: self.events_dead_lettered.snapshot(),
            events_passed_through: self.events_passed_through.get(),
            events_dropped: self.events_dropped.snapshot(),
            messages_published: self.messages_published.snapshot(),
            publish_errors: self.publish_errors.snapshot(),
            outputs_republished: self.outputs_republished.snapshot(),
            streams_open: self.streams_open.iter().map(|slot| slot.load(Ordering::Relaxed)).sum(),
            streams_opened: self.streams_opened.get(),
            streams_closed: self.streams_closed.snapshot(),
            stream_partition_conflicts: self.stream_partition_conflicts.get(),
            payloads_omitted: self.payloads_omitted.get(),
            captures_overflowed: self.captures_overflowed.get(),
            captures_unclosed: self.captures_unclosed.get(),
            finals_diverged: self.finals_diverged.get(),
            text_overflows: self.text_overflows.get(),
            outputs_trimmed: self.outputs_trimmed.get(),
            error_texts_cut: self.error_texts_cut.get(),
            blocks_failed: self.blocks_failed.snapshot(),
            snapshots_skipped: self.snapshots_skipped.get(),
            nats_connection_events: self.nats_connection_events.snapshot(),
            shard_inbox_full: self.shard_inbox_full.get(),
            event_latency: self.event_latency.snapshot(),
        }
    }

    /// All metrics in the Prometheus text exposition format 0.0.4 (serve it with content type
    /// `text/plain; version=0.0.4`). Every family has one `# HELP` and one `# TYPE` line; labelled
    /// counters list every label value, zero or not.
    pub fn render(&self) -> String {
        let s = self.snapshot();
        let mut out = Renderer { out: String::with_capacity(8 * 1024) };
        out.scalar(EVENTS_RECEIVED, s.events_received);
        out.family::<DeadLetterReason>(EVENTS_DEAD_LETTERED, &s.events_dead_lettered);
        out.scalar(EVENTS_PASSED_THROUGH, s.events_passed_through);
        out.family::<DropReason>(EVENTS_DROPPED, &s.events_dropped);
        out.family::<OutputKind>(MESSAGES_PUBLISHED, &s.messages_published);
        out.family::<OutputKind>(PUBLISH_ERRORS, &s.publish_errors);
        out.family::<OutputKind>(OUTPUTS_REPUBLISHED, &s.outputs_republished);
        out.scalar(STREAMS_OPEN, s.streams_open);
        out.scalar(STREAMS_OPENED, s.streams_opened);
        out.family::<CloseReason>(STREAMS_CLOSED, &s.streams_closed);
        out.scalar(STREAM_PARTITION_CONFLICTS, s.stream_partition_conflicts);
        out.scalar(PAYLOADS_OMITTED, s.payloads_omitted);
        out.scalar(CAPTURES_OVERFLOWED, s.captures_overflowed);
        out.scalar(CAPTURES_UNCLOSED, s.captures_unclosed);
        out.scalar(FINALS_DIVERGED, s.finals_diverged);
        out.scalar(TEXT_OVERFLOWS, s.text_overflows);
        out.scalar(OUTPUTS_TRIMMED, s.outputs_trimmed);
        out.scalar(ERROR_TEXTS_CUT, s.error_texts_cut);
        out.family::<BlockFailure>(BLOCKS_FAILED, &s.blocks_failed);
        out.scalar(SNAPSHOTS_SKIPPED, s.snapshots_skipped);
        out.family::<ConnectionEventKind>(NATS_CONNECTION_EVENTS, &s.nats_connection_events);
        out.scalar(SHARD_INBOX_FULL, s.shard_inbox_full);
        out.histogram(EVENT_LATENCY, &s.event_latency);
        out.header(BUILD_INFO);
        out.sample(BUILD_INFO.name, "", &[("version", s.version)], 1);
        out.out
    }
}

/// Writes families in the text format. Writing to a `String` cannot fail, so `fmt::Result`s are
/// ignored.
struct Renderer {
    out: String,
}

impl Renderer {
    fn header(&mut self, def: MetricDef) {
        let _ = writeln!(self.out, "# HELP {PREFIX}{} {}", def.name, escape_help(def.help));
        let _ = writeln!(self.out, "# TYPE {PREFIX}{} {}", def.name, def.kind.as_str());
    }

    fn sample(&mut self, name: &str, suffix: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let _ = write!(self.out, "{PREFIX}{name}{suffix}");
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"{}\"", escape_label_value(value));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    fn scalar(&mut self, def: MetricDef, value: u64) {
        self.header(def);
        self.sample(def.name, "", &[], value);
    }

    fn family<L: LabelValue>(&mut self, def: MetricDef, values: &BTreeMap<&'static str, u64>) {
        self.header(def);
        for label in L::ALL {
            let label = label.as_str();
            self.sample(def.name, "", &[(L::LABEL, label)], values.get(label).copied().unwrap_or(0));
        }
    }

    fn histogram(&mut self, def: MetricDef, h: &HistogramSnapshot) {
        self.header(def);
        for &(le, count) in &h.buckets {
            self.sample(def.name, "_bucket", &[("le", &le.to_string())], count);
        }
        self.sample(def.name, "_bucket", &[("le", "+Inf")], h.count);
        self.sample(def.name, "_sum", &[], h.sum_seconds);
        self.sample(def.name, "_count", &[], h.count);
    }
}

/// Escapes a label value: backslash, double quote and line feed (text format 0.0.4).
fn escape_label_value(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return value.into();
    }
    let mut escaped = String::with_capacity(value.len() + 4);
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped.into()
}

/// Escapes a help text: backslash and line feed (text format 0.0.4).
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_DEFS: [MetricDef; 24] = [
        EVENTS_RECEIVED,
        EVENTS_DEAD_LETTERED,
        EVENTS_PASSED_THROUGH,
        EVENTS_DROPPED,
        MESSAGES_PUBLISHED,
        PUBLISH_ERRORS,
        OUTPUTS_REPUBLISHED,
        STREAMS_OPEN,
        STREAMS_OPENED,
        STREAMS_CLOSED,
        STREAM_PARTITION_CONFLICTS,
        PAYLOADS_OMITTED,
        CAPTURES_OVERFLOWED,
        CAPTURES_UNCLOSED,
        FINALS_DIVERGED,
        TEXT_OVERFLOWS,
        OUTPUTS_TRIMMED,
        ERROR_TEXTS_CUT,
        BLOCKS_FAILED,
        SNAPSHOTS_SKIPPED,
        NATS_CONNECTION_EVENTS,
        SHARD_INBOX_FULL,
        EVENT_LATENCY,
        BUILD_INFO,
    ];

    /// The value of the one sample line that starts with `series` followed by a space.
    fn sample_value(text: &str, series: &str) -> String {
        let lines: Vec<&str> =
            text.lines().filter(|line| line.strip_prefix(series).is_some_and(|rest| rest.starts_with(' '))).collect();
        assert_eq!(lines.len(), 1, "expected exactly one sample {series}, got {lines:?}");
        lines[0][series.len() + 1..].to_owned()
    }

    #[test]
    fn every_family_has_one_help_and_one_type_line() {
        let text = Metrics::new(2).render();
        for def in ALL_DEFS {
            let name = format!("{PREFIX}{}", def.name);
            let help = format!("# HELP {name} ");
            let ty = format!("# TYPE {name} {}\n", def.kind.as_str());
            assert_eq!(text.matches(&help).count(), 1, "{help}");
            assert_eq!(text.matches(&ty).count(), 1, "{ty}");
            if def.kind == MetricType::Counter {
                assert!(def.name.ends_with("_total"), "counter {name} must end in _total");
            } else {
                assert!(!def.name.ends_with("_total"), "{name} is not a counter");
            }
        }
        // No family is rendered that is not in the list above.
        assert_eq!(text.lines().filter(|l| l.starts_with("# TYPE ")).count(), ALL_DEFS.len());
        // Every sample line belongs to a declared family and parses as a number.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
            assert!(
                ALL_DEFS.iter().any(|d| series.starts_with(&format!("{PREFIX}{}", d.name))),
                "undeclared series {series}"
            );
        }
    }

    #[test]
    fn names_are_unique_and_valid() {
        let mut names: Vec<&str> = ALL_DEFS.iter().map(|d| d.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL_DEFS.len());
        for name in names {
            assert!(name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{name}");
        }
    }

    #[test]
    fn counters_increment() {
        let m = Metrics::new(1);
        m.count_received();
        m.count_received();
        m.count_dead_letter(DeadLetterReason::TooLarge);
        m.count_dead_letter(DeadLetterReason::InvalidMessageId);
        m.count_dead_letter(DeadLetterReason::InvalidMessageId);
        m.count_passed_through();
        m.count_dropped(DropReason::NoPassThroughSubject);
        m.count_published(OutputKind::Filtered);
        m.count_published(OutputKind::Filtered);
        m.count_published(OutputKind::Tool);
        m.count_publish_error(OutputKind::DeadLetter);
        m.count_republished(OutputKind::Block);
        m.count_republished(OutputKind::Block);
        m.count_streams_opened(3);
        m.count_streams_closed(CloseReason::Expired, 2);
        m.count_captures_overflowed(4);
        m.count_captures_unclosed(5);
        m.count_finals_diverged(6);
        m.count_text_overflows(7);
        m.count_error_texts_cut(8);
        m.count_stream_partition_conflicts(9);
        m.count_payload_omitted();
        m.count_outputs_trimmed(10);
        m.count_connection_event(ConnectionEventKind::Disconnected);
        m.count_shard_inbox_full();

        let s = m.snapshot();
        assert_eq!(s.events_received, 2);
        assert_eq!(s.events_dead_lettered["too_large"], 1);
        assert_eq!(s.events_dead_lettered["invalid_message_id"], 2);
        assert_eq!(s.events_dead_lettered["invalid_json"], 0);
        assert_eq!(s.events_dead_lettered_total(), 3);
        assert_eq!(s.events_passed_through, 1);
        assert_eq!(s.events_dropped["no_pass_through_subject"], 1);
        assert_eq!(s.messages_published["filtered"], 2);
        assert_eq!(s.messages_published_total(), 3);
        assert_eq!(s.publish_errors_total(), 1);
        assert_eq!((s.outputs_republished["block"], s.outputs_republished_total()), (2, 2));
        assert_eq!(s.streams_opened, 3);
        assert_eq!(s.streams_closed["expired"], 2);
        assert_eq!(s.streams_closed_total(), 2);
        assert_eq!((s.captures_overflowed, s.captures_unclosed, s.finals_diverged, s.text_overflows), (4, 5, 6, 7));
        assert_eq!((s.error_texts_cut, s.stream_partition_conflicts, s.payloads_omitted), (8, 9, 1));
        assert_eq!(s.outputs_trimmed, 10);
        assert_eq!(s.nats_connection_events["disconnected"], 1);
        assert_eq!(s.shard_inbox_full, 1);

        let text = m.render();
        assert_eq!(sample_value(&text, "structured_sink_events_received_total"), "2");
        assert_eq!(
            sample_value(&text, "structured_sink_events_dead_lettered_total{reason=\"invalid_message_id\"}"),
            "2"
        );
        assert_eq!(sample_value(&text, "structured_sink_events_dead_lettered_total{reason=\"missing_type\"}"), "0");
        assert_eq!(sample_value(&text, "structured_sink_messages_published_total{kind=\"filtered\"}"), "2");
        assert_eq!(sample_value(&text, "structured_sink_publish_errors_total{kind=\"dead_letter\"}"), "1");
        assert_eq!(sample_value(&text, "structured_sink_outputs_republished_total{kind=\"block\"}"), "2");
        assert_eq!(sample_value(&text, "structured_sink_outputs_republished_total{kind=\"tool\"}"), "0");
        assert_eq!(sample_value(&text, "structured_sink_streams_closed_total{reason=\"expired\"}"), "2");
        assert_eq!(sample_value(&text, "structured_sink_nats_connection_events_total{event=\"disconnected\"}"), "1");
        assert_eq!(sample_value(&text, "structured_sink_shard_inbox_full_total"), "1");
    }

    #[test]
    fn streams_open_sums_shard_slots_and_overwrites() {
        let m = Metrics::new(3);
        m.set_streams_open(0, 5);
        m.set_streams_open(2, 7);
        assert_eq!(m.snapshot().streams_open, 12);
        m.set_streams_open(0, 1);
        assert_eq!(m.snapshot().streams_open, 8);
        assert_eq!(sample_value(&m.render(), "structured_sink_streams_open"), "8");
    }

    #[test]
    fn counters_are_exact_under_concurrency() {
        let m = std::sync::Arc::new(Metrics::new(1));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        m.count_received();
                        m.observe_event_latency(Duration::from_micros(30));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = m.snapshot();
        assert_eq!(s.events_received, 40_000);
        assert_eq!(s.event_latency.count, 40_000);
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::new(1);
        for micros in [5, 10, 11, 700, 3_000, 250_000] {
            m.observe_event_latency(Duration::from_micros(micros));
        }
        let h = m.snapshot().event_latency;
        assert_eq!(h.count, 6);
        assert!((h.sum_seconds - 0.253_726).abs() < 1e-9, "{}", h.sum_seconds);
        let at = |le: f64| h.buckets.iter().find(|(bound, _)| *bound == le).unwrap().1;
        // Bounds are inclusive: 10 µs falls in the 10 µs bucket.
        assert_eq!(at(0.000_01), 2);
        assert_eq!(at(0.000_025), 3);
        assert_eq!(at(0.001), 4);
        assert_eq!(at(0.005), 5);
        assert_eq!(at(0.1), 5);
        assert!(h.buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));

        let text = m.render();
        let name = "structured_sink_event_latency_seconds";
        assert_eq!(sample_value(&text, &format!("{name}_bucket{{le=\"0.00001\"}}")), "2");
        assert_eq!(sample_value(&text, &format!("{name}_bucket{{le=\"0.1\"}}")), "5");
        assert_eq!(sample_value(&text, &format!("{name}_bucket{{le=\"+Inf\"}}")), "6");
        assert_eq!(sample_value(&text, &format!("{name}_count")), "6");
        let mut previous = 0;
        for line in text.lines().filter(|l| l.starts_with(&format!("{name}_bucket"))) {
            let count: u64 = line.rsplit_once(' ').unwrap().1.parse().unwrap();
            assert!(count >= previous, "{line}");
            previous = count;
        }
        assert_eq!(text.lines().filter(|l| l.starts_with(&format!("{name}_bucket"))).count(), 14);
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label_value("plain"), "plain");
        assert_eq!(escape_label_value("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
        assert_eq!(escape_help("x\\y\nz"), "x\\\\y\\nz");
        let text = Metrics::with_version(1, "1.0\"\n\\").render();
        assert_eq!(sample_value(&text, "structured_sink_build_info{version=\"1.0\\\"\\n\\\\\"}"), "1");
    }

    #[test]
    fn build_info_names_the_crate_version() {
        let text = Metrics::new(1).render();
        let series = format!("structured_sink_build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"));
        assert_eq!(sample_value(&text, &series), "1");
    }

    #[test]
    fn labels_round_trip_and_are_unique() {
        fn check<L: LabelValue + PartialEq + std::fmt::Debug>(from_label: fn(&str) -> Option<L>) {
            let mut seen = std::collections::HashSet::new();
            for (i, &value) in L::ALL.iter().enumerate() {
                assert_eq!(value.index(), i);
                assert!(seen.insert(value.as_str()), "duplicate label {}", value.as_str());
                assert_eq!(from_label(value.as_str()), Some(value));
            }
            assert_eq!(from_label("not a label"), None);
        }
        check(DeadLetterReason::from_label);
        check(DropReason::from_label);
        check(OutputKind::from_label);
        check(CloseReason::from_label);
        check(ConnectionEventKind::from_label);
    }

    #[test]
    fn connection_event_labels_match_the_bus() {
        use crate::bus::ConnectionEvent;
        let events = [
            ConnectionEvent::Connected,
            ConnectionEvent::Disconnected,
            ConnectionEvent::LameDuckMode,
            ConnectionEvent::SlowConsumer { subscription_id: 1 },
            ConnectionEvent::AuthorizationViolation,
            ConnectionEvent::PermissionViolation { message: String::new() },
            ConnectionEvent::ServerError { message: String::new() },
            ConnectionEvent::ClientError { message: String::new() },
            ConnectionEvent::Draining,
            ConnectionEvent::Closed,
        ];
        assert_eq!(events.len(), ConnectionEventKind::ALL.len());
        for event in events {
            let kind = ConnectionEventKind::from_label(event.kind());
            assert_eq!(kind.map(ConnectionEventKind::as_str), Some(event.kind()));
        }
    }

    #[test]
    fn decode_error_codes_are_dead_letter_reasons() {
        use crate::codec::inbound::DecodeError;
        let errors = [
            DecodeError::TooLarge { size: 2, limit: 1 },
            DecodeError::InvalidJson { line: 1, column: 1 },
            DecodeError::NotAnObject,
            DecodeError::WrongFieldType { line: 1, column: 1 },
            DecodeError::MissingType,
            DecodeError::MissingMessageId,
            DecodeError::MissingField { kind: "partial", field: "delta" },
        ];
        for error in errors {
            assert!(DeadLetterReason::from_label(error.code()).is_some(), "{}", error.code());
        }
    }

    #[test]
    fn snapshot_serializes_with_label_maps() {
        let m = Metrics::new(1);
        m.count_published(OutputKind::Block);
        let json = serde_json::to_value(m.snapshot()).unwrap();
        assert_eq!(json["messages_published"]["block"], 1);
        assert_eq!(json["events_dead_lettered"]["too_large"], 0);
        assert_eq!(json["event_latency"]["count"], 0);
    }
}
