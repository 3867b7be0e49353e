//! Input: where events come from, which of them this replica owns, and how they reach a shard.
//!
//! A [`Source`] is a core NATS subscription or a JetStream pull consumer. Each source has one
//! [`Dispatcher`] task: it decodes events (bad ones are dead-lettered here), drops those of
//! partitions other replicas own (filter mode), checks that a partition subject's last token is
//! the event's message id and its partition token that id's (subject mode), and routes the rest
//! by message id to a shard worker; with one source and one shard it owns the shard and applies
//! each event itself ([`Route`]).
//!
//! Partitions follow the server's `{{partition(P,1)}}` mapping: FNV-1a 32-bit of the subject
//! token modulo P, the token being the message id escaped with
//! [`crate::codec::subject::escape_token`]. Both modes therefore agree on every id.
//!
//! JetStream (module `jetstream`): one durable pull consumer per owned partition, explicit acks;
//! each stream's first event is acknowledged only once the stream has ended, which keeps the ack
//! floor below every open stream (see `HeldAcks` in `output`). At start-up each consumer is
//! recreated at its ack floor, so that everything above it is delivered again in stream order and
//! the streams that were open when the previous owner stopped are rebuilt from their first event.
//!
//! JetStream with `jetstream.pinned_client` (server 2.11 or later): the partition consumers are
//! shared by every replica through a pinned-client priority group, so they cannot be recreated at
//! start-up. Each replica pulls from the partitions it owns and, on standby, from the others; the
//! server delivers each partition to its pinned replica only. A replica that becomes pinned
//! rebuilds the open streams by reading the stream from the consumer's ack floor (see `Pinned` in
//! `jetstream`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;

use super::{round_trip, Envelope, NatsSink, ServiceError};
use crate::bus::BusError;
use crate::codec::inbound::decode;
use crate::codec::subject::{escape_token, partition_of};
use crate::config::{Config, PartitionMode};
use crate::metrics::DropReason;
use crate::shard::worker::{Shard, ShardEvent, ShardSet};

mod jetstream;

use jetstream::open_consumers;
pub use jetstream::{take_held, HeldPins, JetStreamSource, PinRelease};

/// Header marking the start-up probe of the partition mapping; such messages are skipped.
pub const PROBE_HEADER: &str = "Structured-Sink-Probe";

/// Which message ids this replica owns.
#[derive(Debug, Clone)]
pub struct Ownership {
    mode: PartitionMode,
    count: u32,
    owned: Vec<bool>,
    prefix: String,
}

/// What ownership says about one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Owned,
    NotOwned,
    /// Subject mode: the subject's last token is not the escaped message id, or its partition
    /// token is not that id's partition.
    TokenMismatch,
}

impl Ownership {
    /// The ownership `config` describes.
    pub fn new(config: &Config) -> Result<Self, ServiceError> {
        let p = &config.partitions;
        let mut owned = vec![false; p.count as usize];
        for partition in p.owned_partitions()? {
            owned[partition as usize] = true;
        }
        Ok(Ownership { mode: p.mode, count: p.count, owned, prefix: p.subject_prefix.clone() })
    }

    /// The partitions owned, in order.
    pub fn partitions(&self) -> Vec<u32> {
        (0..self.count).filter(|p| self.owned[*p as usize]).collect()
    }

    /// The subject partition `p`'s events arrive on in subject mode.
    pub fn partition_subject(&self, p: u32) -> String {
        format!("{}.p.{p}.*", self.prefix)
    }

    fn verdict(&self, subject: &str, message_id: &str) -> Verdict {
        match self.mode {
            PartitionMode::None => Verdict::Owned,
            // The subscription or consumer filter already selected the partition; an event
            // published straight to a partition subject must name its id's own, or two replicas
            // would each keep a stream of that id.
            PartitionMode::Subject => {
                let token = escape_token(message_id);
                let mut tokens = subject.rsplit('.');
                let named = tokens.next() == Some(token.as_ref());
                let partition = tokens.next().and_then(|p| p.parse::<u32>().ok());
                if named && partition == Some(partition_of(&token, self.count)) {
                    Verdict::Owned
                } else {
                    Verdict::TokenMismatch
                }
            }
            PartitionMode::Filter if self.owned[partition_of(&escape_token(message_id), self.count) as usize] => {
                Verdict::Owned
            }
            PartitionMode::Filter => Verdict::NotOwned,
        }
    }
}

/// Checks at start-up that the server maps `<prefix>.<token>` to `<prefix>.p.<partition>.<token>`
/// with the partition our hash predicts; stops with a clear error otherwise.
pub async fn verify_mapping(client: &async_nats::Client, ownership: &Ownership) -> Result<(), ServiceError> {
    let Some(&partition) = ownership.partitions().first() else { return Ok(()) };
    let nonce = client.new_inbox();
    let nonce = nonce.rsplit('.').next().unwrap_or("probe");
    let token = (0..)
        .map(|i| format!("probe-{nonce}-{i}"))
        .find(|t| partition_of(t, ownership.count) == partition)
        .expect("some token hashes to every partition");
    let expected = format!("{}.p.{partition}.{token}", ownership.prefix);
    let mut probe_sub = client
        .subscribe(expected.clone())
        .await
        .map_err(|e| BusError::Subscribe { subject: expected.clone(), error: e })?;
    round_trip(client).await;
    let mut headers = HeaderMap::new();
    headers.insert(PROBE_HEADER, "1");
    let published = format!("{}.{token}", ownership.prefix);
    client
        .publish_with_headers(published.clone(), headers, Bytes::from_static(b"probe"))
        .await
        .map_err(|e| BusError::Publish { subject: published.clone(), error: e })?;
    let arrived = tokio::time::timeout(Duration::from_secs(3), probe_sub.next()).await;
    let _ = probe_sub.unsubscribe().await;
    match arrived {
        Ok(Some(_)) => Ok(()),
        _ => Err(ServiceError::Mapping(format!(
            "a probe published to {published} did not arrive on {expected}: the server must map {prefix}.* to \
             {prefix}.p.{{{{partition({count},1)}}}}.{{{{wildcard(1)}}}} (see deploy/nats.conf)",
            prefix = ownership.prefix,
            count = ownership.count,
        ))),
    }
}

/// What a source hands its dispatcher.
// Events are nearly all of it: boxing them to shrink the rare variant would allocate per event.
#[allow(clippy::large_enum_variant)]
enum Input {
    /// An event.
    Event(Envelope),
    /// This replica no longer holds the pin of a pinned-client partition: another replica
    /// consumes it now and rebuilds its open streams, so they are given up here (see
    /// `Pinned::lost` in `jetstream`).
    PinLost(u32),
    /// The partition's consumer no longer exists (an operator deleted it, or its stream): nothing
    /// will be delivered, and what it had acknowledged is unknown to a new one.
    ConsumerGone(String),
}

/// Where one dispatcher's events come from.
pub enum Source {
    /// A core NATS subscription.
    Core(async_nats::Subscriber),
    /// A JetStream pull consumer and its message stream.
    JetStream(Box<JetStreamSource>),
}

/// How long the core subscription's drain may go without a message before shutdown stops waiting
/// for it to end (only a connection lost meanwhile keeps it from ending).
const DRAIN_IDLE: Duration = Duration::from_secs(2);

/// Opens the sources of this replica: subscriptions, or JetStream consumers.
pub async fn open_sources(
    client: &async_nats::Client,
    config: &Config,
    ownership: &Ownership,
    held_pins: &HeldPins,
) -> Result<Vec<(String, Source)>, ServiceError> {
    let subjects: Vec<String> = match config.partitions.mode {
        PartitionMode::Subject => ownership.partitions().into_iter().map(|p| ownership.partition_subject(p)).collect(),
        PartitionMode::None | PartitionMode::Filter => config.input.subjects.clone(),
    };
    if !config.jetstream.enabled {
        let mut sources = Vec::new();
        for subject in subjects {
            let subscriber = client
                .subscribe(subject.clone())
                .await
                .map_err(|e| BusError::Subscribe { subject: subject.clone(), error: e })?;
            sources.push((subject, Source::Core(subscriber)));
        }
        return Ok(sources);
    }
    open_consumers(client, config, ownership, subjects, held_pins).await
}

impl Source {
    /// The next input; `None` when the source has ended. Cancel-safe: dropped (at shutdown, or by
    /// `ready` when nothing is there yet), nothing is lost. The dispatcher's expiry ticks do not
    /// drop it.
    async fn next(&mut self) -> Option<Input> {
        match self {
            Source::Core(subscriber) => subscriber.next().await.map(|message| Input::Event(Envelope::core(message))),
            Source::JetStream(source) => Some(source.next().await),
        }
    }

    /// The next input if one is already there, without waiting: `Some(None)` when the source
    /// has ended, `None` when nothing is ready (`next` is cancel-safe, so polling it once and
    /// dropping it loses nothing).
    fn ready(&mut self) -> Option<Option<Input>> {
        // Per source kind: polling `next` would build (and move) the future of both kinds, and
        // the JetStream one is large; this runs for nearly every event.
        match self {
            Source::Core(subscriber) => {
                subscriber.next().now_or_never().map(|message| message.map(|m| Input::Event(Envelope::core(m))))
            }
            Source::JetStream(source) => source.next().now_or_never().map(Some),
        }
    }
}

/// Where a dispatcher's events go.
pub enum Route {
    /// Several shards, or several sources: by message id, into the inbox of a worker task.
    Shards(Arc<ShardSet<Envelope>>),
    /// One source and one shard: the dispatcher owns the shard and applies each event itself, as
    /// it decodes it. No hand-off between tasks: no queue, no wake-up, no detaching of the event
    /// from its payload; backpressure is the subscription's own buffer.
    Own(Box<Shard<NatsSink>>),
}

/// Takes events from one source, dead-letters bad ones, routes the rest.
pub struct Dispatcher {
    /// The source.
    pub source: Source,
    /// Where events go.
    pub route: Route,
    /// For dead letters, drops and acks.
    pub sink: NatsSink,
    /// `input.max_event_bytes`.
    pub max_event_bytes: usize,
    /// Fired at shutdown.
    pub cancel: CancellationToken,
    /// Which message ids are ours.
    pub ownership: Arc<Ownership>,
    /// Told when a shard worker is found stopped (liveness).
    pub readiness: Arc<crate::http::Readiness>,
}

impl Dispatcher {
    /// Runs until the source ends or shutdown; at shutdown a core subscription is drained and
    /// what it delivered is dispatched; a JetStream source simply stops (unacknowledged events
    /// are delivered again to whoever consumes the partition next); the pin it holds, if any,
    /// stays in [`HeldPins`] for the caller to release once every shard has drained. An owned
    /// shard is finished last.
    pub async fn run(mut self) {
        loop {
            let input = {
                // Outside the wait, so that an expiry tick does not drop it: a JetStream source's
                // `next` may be in the middle of an API call (a consumer lookup, a rebuild's read),
                // and one slower than the tick period would be started again every tick, for good.
                let mut next = std::pin::pin!(self.source.next());
                loop {
                    tokio::select! {
                        biased;
                        _ = self.cancel.cancelled() => break None,
                        // Before the input: expiry must not wait for the input to pause (the tick
                        // is ready once per period, so polling it first costs little).
                        now = own_tick(&mut self.route) => {
                            if let Route::Own(shard) = &mut self.route {
                                shard.expire(now).await;
                                shard.report();
                            }
                        }
                        input = &mut next => break Some(input),
                    }
                }
            };
            let Some(input) = input else { break };
            let Some(input) = input else {
                self.finish().await;
                return;
            };
            self.take(input).await;
            // What the source already holds is taken without another round of `select!`, at most
            // a burst at a time so that shutdown and expiry are still looked at.
            for _ in 1..BURST {
                match self.source.ready() {
                    Some(Some(input)) => self.take(input).await,
                    Some(None) => {
                        self.finish().await;
                        return;
                    }
                    None => break,
                }
            }
            // An owned shard's counters once per burst, like a worker's once per batch: they are
            // read by scrapes, so they may lag while events keep coming (by 64 at most) and are
            // current whenever the input pauses. Per event, reading and comparing the counters
            // cost 2.5 % of the input task's instructions (callgrind, BENCHMARKS.md,
            // thirty-seventh session).
            if let Route::Own(shard) = &mut self.route {
                shard.report();
            }
        }
        if let Source::JetStream(source) = &mut self.source {
            source.stop();
        }
        if let Source::Core(subscriber) = &mut self.source {
            // async-nats' `drain` forgets the subscription on its next poll without waiting for
            // the server's PONG, so messages the server had already sent but the client had not
            // yet read would be dropped. A round trip through the server first makes sure
            // everything it queued for us before shutdown began has been read; then unsubscribe
            // and hand on what was delivered. (Core NATS is at-most-once: events published during
            // the moment between that round trip and the unsubscribe can still be lost;
            // JetStream input closes that gap.)
            //
            // async-nats handles a drain only while connected: with the server unreachable the
            // subscription would never end and the shutdown would wait out its timeout, without
            // closing the open streams. Then what the client holds is taken, and the rest left.
            let connected = self.sink.client.connection_state() == async_nats::connection::State::Connected;
            if connected {
                round_trip(&self.sink.client).await;
                if let Err(e) = subscriber.drain().await {
                    tracing::warn!(error = %e, "draining the subscription failed");
                }
            } else {
                tracing::warn!("the connection is down at shutdown: taking what the client holds, not draining");
            }
            loop {
                // Connected, the drain ends the subscription at once; should the connection drop
                // meanwhile, the wait is bounded as the flush and the round trip are.
                let next = if connected {
                    tokio::time::timeout(DRAIN_IDLE, self.source.next()).await.unwrap_or_else(|_| {
                        tracing::warn!("the subscription's drain did not end; the connection is down");
                        None
                    })
                } else {
                    self.source.ready().flatten()
                };
                let Some(input) = next else { break };
                self.take(input).await;
            }
        }
        self.finish().await;
    }

    /// No more input: an owned shard closes (or abandons) its streams and flushes.
    async fn finish(self) {
        if let Route::Own(shard) = self.route {
            shard.finish().await;
        }
    }

    async fn take(&mut self, input: Input) {
        match input {
            Input::Event(envelope) => self.dispatch(envelope).await,
            Input::PinLost(partition) => self.give_up(partition).await,
            Input::ConsumerGone(name) => {
                tracing::error!(
                    consumer = %name,
                    "the JetStream consumer no longer exists: nothing is delivered to this replica from it; \
                     failing /healthz so that a restart creates it again (from the start of the stream)"
                );
                self.readiness.set_consumer_lost();
            }
        }
    }

    /// Gives up the open streams of `partition`, after the events already routed (see
    /// `Pinned::lost` in `jetstream`).
    async fn give_up(&mut self, partition: u32) {
        match &mut self.route {
            Route::Own(shard) => {
                shard.abandon(partition);
                shard.report();
            }
            Route::Shards(shards) => {
                if let Err(e) = shards.abandon(partition).await {
                    self.readiness.set_shard_lost();
                    tracing::error!(error = %e, partition, "cannot give up the partition's streams: a shard has stopped; /healthz fails from now on");
                }
            }
        }
    }

    async fn dispatch(&mut self, envelope: Envelope) {
        // By name, not by hash lookup: events carry few headers, and most carry none.
        let probe = envelope
            .headers
            .as_ref()
            .is_some_and(|h| h.iter().any(|(name, _)| AsRef::<str>::as_ref(name) == PROBE_HEADER));
        if probe {
            self.sink.ack(&envelope).await;
            return;
        }
        self.sink.metrics.count_received();
        // A second handle on the payload (not a copy), so the event can borrow from it while the
        // envelope moves on.
        let payload = envelope.payload.clone();
        let event = match decode(&payload, self.max_event_bytes) {
            Ok(event) => event,
            Err(e) => {
                tracing::warn!(reason = e.code(), error = %e, subject = %envelope.subject, "dead-lettering an event");
                let detail = e.to_string();
                self.sink.dead_letter_with_detail(envelope, e.code(), &detail).await;
                return;
            }
        };
        match self.ownership.verdict(envelope.subject.as_str(), &event.stream.message_id) {
            Verdict::Owned => {}
            Verdict::NotOwned => {
                self.sink.metrics.count_dropped(DropReason::NotOwned);
                self.sink.ack(&envelope).await;
                return;
            }
            Verdict::TokenMismatch => {
                tracing::warn!(message_id = %event.stream.message_id, subject = %envelope.subject, "subject tokens do not match the message id");
                let detail = "the subject's last token is not the escaped message id, or not in its partition";
                self.sink.dead_letter_with_detail(envelope, "invalid_message_id", detail).await;
                return;
            }
        }
        match &mut self.route {
            Route::Shards(shards) => match shards.route(ShardEvent::new(event, &payload, envelope)).await {
                Ok(true) => self.sink.metrics.count_shard_inbox_full(),
                Ok(false) => {}
                Err(e) => {
                    // Nothing brings a stopped worker back: the replica must be restarted, and
                    // its unacknowledged input (JetStream) goes to the next owner.
                    self.readiness.set_shard_lost();
                    self.sink.metrics.count_dropped(DropReason::ShardStopped);
                    tracing::error!(error = %e, "event lost: its shard has stopped; /healthz fails from now on");
                }
            },
            Route::Own(shard) => {
                // The time it was received: no second clock read.
                let now = envelope.received;
                // Reported once per burst (see `run`).
                shard.apply(&event, envelope, now).await;
            }
        }
    }
}

/// Events a dispatcher takes from its source between two looks at shutdown and expiry.
const BURST: usize = 64;

/// The next expiry tick of an owned shard; never, when events go to worker tasks (they have
/// their own ticks).
async fn own_tick(route: &mut Route) -> Instant {
    match route {
        Route::Own(shard) => shard.next_tick().await,
        Route::Shards(_) => std::future::pending().await,
    }
}

impl Envelope {
    /// The envelope of a core NATS message (and the start of a JetStream delivery's).
    pub(super) fn core(message: async_nats::Message) -> Envelope {
        let trace = message.headers.as_ref().map(super::trace_context).unwrap_or_default();
        Envelope {
            subject: message.subject,
            payload: message.payload,
            headers: message.headers,
            trace,
            received: Instant::now(),
            ack: None,
            sequence: None,
            partition: 0,
            redelivered: false,
            rebuilt: false,
        }
    }
}
