//! Input: where events come from, which of them this replica owns, and how they reach a shard.
//!
//! A [`Source`] is a core NATS subscription or a JetStream pull consumer. Each source has one
//! [`Dispatcher`] task: it decodes events (bad ones are dead-lettered here), drops those of
//! partitions other replicas own (filter mode), checks that a partition subject's last token is
//! the event's message id (subject mode), and routes the rest by message id to a shard worker.
//!
//! Partitions follow the server's `{{partition(P,1)}}` mapping: FNV-1a 32-bit of the subject
//! token modulo P, the token being the message id escaped with
//! [`crate::codec::subject::escape_token`]. Both modes therefore agree on every id.
//!
//! JetStream: one durable pull consumer per owned partition, explicit acks, acked only once the
//! event's stream has ended (see [`super::NatsSink`]). At start-up each consumer is recreated at
//! its ack floor, so that everything not acknowledged is delivered again in stream order and the
//! streams that were open when the previous owner stopped are rebuilt from their first event.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{round_trip, Envelope, NatsSink, ServiceError};
use crate::bus::BusError;
use crate::codec::inbound::decode;
use crate::codec::subject::{escape_token, partition_of};
use crate::config::{Config, PartitionMode};
use crate::metrics::DropReason;
use crate::shard::worker::{ShardEvent, ShardSet};

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
    /// Subject mode: the subject's last token is not the escaped message id.
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
        let token = escape_token(message_id);
        match self.mode {
            PartitionMode::None => Verdict::Owned,
            PartitionMode::Subject if subject.rsplit('.').next() != Some(token.as_ref()) => Verdict::TokenMismatch,
            // The subscription or consumer filter already selected the partition.
            PartitionMode::Subject => Verdict::Owned,
            PartitionMode::Filter if self.owned[partition_of(&token, self.count) as usize] => Verdict::Owned,
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

/// Where one dispatcher's events come from.
pub enum Source {
    /// A core NATS subscription.
    Core(async_nats::Subscriber),
    /// A JetStream pull consumer and its message stream.
    JetStream(Box<(jetstream::consumer::PullConsumer, pull::Stream)>),
}

/// Opens the sources of this replica: subscriptions, or JetStream consumers.
pub async fn open_sources(
    client: &async_nats::Client,
    config: &Config,
    ownership: &Ownership,
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
    open_consumers(client, config, ownership, subjects).await
}

async fn open_consumers(
    client: &async_nats::Client,
    config: &Config,
    ownership: &Ownership,
    subjects: Vec<String>,
) -> Result<Vec<(String, Source)>, ServiceError> {
    let js = jetstream::new(client.clone());
    let cfg = &config.jetstream;
    let js_error = |what: &str, e: &dyn std::fmt::Display| ServiceError::JetStream(format!("{what}: {e}"));
    let stream_subjects = match config.partitions.mode {
        PartitionMode::Subject => vec![format!("{}.p.*.*", config.partitions.subject_prefix)],
        PartitionMode::None | PartitionMode::Filter => config.input.subjects.clone(),
    };
    let stream = if cfg.create_stream {
        js.get_or_create_stream(stream::Config {
            name: cfg.stream.clone(),
            subjects: stream_subjects,
            num_replicas: cfg.stream_replicas,
            ..Default::default()
        })
        .await
        .map_err(|e| js_error(&format!("stream {}", cfg.stream), &e))?
    } else {
        js.get_stream(&cfg.stream)
            .await
            .map_err(|e| js_error(&format!("stream {} (jetstream.create_stream is false)", cfg.stream), &e))?
    };
    let version = crate::bus::server_version(client);
    if cfg.pinned_client {
        tracing::warn!(
            ?version,
            "jetstream.pinned_client is not supported yet: each partition has one owner replica; ignoring it"
        );
    }
    let mut sources = Vec::new();
    let names: Vec<(String, String)> = match config.partitions.mode {
        PartitionMode::Subject => ownership
            .partitions()
            .into_iter()
            .zip(subjects)
            .map(|(p, subject)| (format!("{}-p{p}", cfg.consumer_prefix), subject))
            .collect(),
        // Every replica reads everything in these modes, so each has its own consumer.
        PartitionMode::None | PartitionMode::Filter => subjects
            .into_iter()
            .enumerate()
            .map(|(i, subject)| (format!("{}-r{}-s{i}", cfg.consumer_prefix, config.partitions.replica_index), subject))
            .collect(),
    };
    for (name, subject) in names {
        let start = restart_point(&stream, &name).await;
        let consumer_config = pull::Config {
            durable_name: Some(name.clone()),
            filter_subject: subject.clone(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_millis(cfg.ack_wait_ms),
            max_ack_pending: cfg.max_ack_pending,
            deliver_policy: match start {
                Some(sequence) => jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: sequence },
                None => jetstream::consumer::DeliverPolicy::All,
            },
            ..Default::default()
        };
        let consumer: jetstream::consumer::Consumer<pull::Config> =
            stream.create_consumer(consumer_config).await.map_err(|e| js_error(&format!("consumer {name}"), &e))?;
        let messages = consumer.messages().await.map_err(|e| js_error(&format!("consumer {name}"), &e))?;
        tracing::info!(consumer = %name, %subject, start = ?start, "consuming");
        sources.push((subject, Source::JetStream(Box::new((consumer, messages)))));
    }
    Ok(sources)
}

/// Where a partition's consumer resumes: right after its ack floor. The old consumer is deleted
/// so that everything not yet acknowledged is delivered again, in stream order (a consumer would
/// otherwise deliver new messages before redelivering those a stopped replica held).
async fn restart_point(stream: &stream::Stream, name: &str) -> Option<u64> {
    let mut consumer: jetstream::consumer::PullConsumer = stream.get_consumer(name).await.ok()?;
    let info = consumer.info().await.ok()?;
    let floor = info.ack_floor.stream_sequence;
    if let Err(e) = stream.delete_consumer(name).await {
        tracing::warn!(consumer = %name, error = %e, "could not delete the consumer to restart it at its ack floor");
        return None;
    }
    Some(floor + 1)
}

impl Source {
    /// The next envelope; `None` when the source has ended.
    async fn next(&mut self) -> Option<Envelope> {
        loop {
            match self {
                Source::Core(subscriber) => {
                    let message = subscriber.next().await?;
                    return Some(Envelope::core(message));
                }
                Source::JetStream(pair) => match pair.1.next().await {
                    None => {
                        // The pull stream ended (a consumer leader lost with its node, a
                        // reconnect): open it again; only shutdown ends a JetStream source.
                        tracing::warn!("JetStream pull stream ended; reopening it");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        match pair.0.messages().await {
                            Ok(messages) => pair.1 = messages,
                            Err(e) => tracing::warn!(error = %e, "reopening the pull stream failed; retrying"),
                        }
                    }
                    Some(Ok(message)) => {
                        let (sequence, delivered) =
                            message.info().map(|i| (i.stream_sequence, i.delivered)).unwrap_or((0, 1));
                        let ack = message.message.reply.clone();
                        let mut envelope = Envelope::core(message.message);
                        envelope.ack = ack;
                        envelope.sequence = Some(sequence);
                        envelope.redelivered = delivered > 1;
                        return Some(envelope);
                    }
                    Some(Err(e)) => {
                        // Heartbeats missed, leader changes, reconnects: the stream keeps pulling.
                        tracing::warn!(error = %e, "JetStream pull failed; retrying");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
    }
}

/// Takes events from one source, dead-letters bad ones, routes the rest.
pub struct Dispatcher {
    /// The source.
    pub source: Source,
    /// The shards.
    pub shards: Arc<ShardSet<Envelope>>,
    /// For dead letters, drops and acks.
    pub sink: NatsSink,
    /// `input.max_event_bytes`.
    pub max_event_bytes: usize,
    /// Fired at shutdown.
    pub cancel: CancellationToken,
    /// Which message ids are ours.
    pub ownership: Arc<Ownership>,
}

impl Dispatcher {
    /// Runs until the source ends or shutdown; at shutdown a core subscription is drained and
    /// what it delivered is dispatched; a JetStream source simply stops (unacknowledged events
    /// are delivered again to whoever consumes the partition next).
    pub async fn run(mut self) {
        let shards = self.shards.clone();
        loop {
            let envelope = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break,
                envelope = self.source.next() => envelope,
            };
            let Some(envelope) = envelope else { return };
            self.dispatch(&shards, envelope).await;
        }
        if let Source::Core(subscriber) = &mut self.source {
            // async-nats' `drain` forgets the subscription on its next poll without waiting for
            // the server's PONG, so messages the server had already sent but the client had not
            // yet read would be dropped. A round trip through the server first makes sure
            // everything it queued for us before shutdown began has been read; then unsubscribe
            // and hand on what was delivered. (Core NATS is at-most-once: events published during
            // the moment between that round trip and the unsubscribe can still be lost;
            // JetStream input closes that gap.)
            round_trip(&self.sink.client).await;
            if let Err(e) = subscriber.drain().await {
                tracing::warn!(error = %e, "draining the subscription failed");
            }
            while let Some(envelope) = self.source.next().await {
                self.dispatch(&shards, envelope).await;
            }
        }
    }

    async fn dispatch(&mut self, shards: &ShardSet<Envelope>, envelope: Envelope) {
        if envelope.headers.as_ref().is_some_and(|h| h.get(PROBE_HEADER).is_some()) {
            self.sink.ack(&envelope).await;
            return;
        }
        self.sink.metrics.count_received();
        let event = match decode(&envelope.payload, self.max_event_bytes) {
            Ok(event) => event.into_owned(),
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
                tracing::warn!(message_id = %event.stream.message_id, subject = %envelope.subject, "subject token is not the message id");
                let detail = "the subject's last token is not the escaped message id";
                self.sink.dead_letter_with_detail(envelope, "invalid_message_id", detail).await;
                return;
            }
        }
        match shards.route(ShardEvent { event, envelope }).await {
            Ok(true) => self.sink.metrics.count_shard_inbox_full(),
            Ok(false) => {}
            Err(e) => tracing::error!(error = %e, "event lost: its shard has stopped"),
        }
    }
}

impl Envelope {
    fn core(message: async_nats::Message) -> Envelope {
        Envelope {
            subject: message.subject,
            payload: message.payload,
            headers: message.headers,
            received: Instant::now(),
            ack: None,
            sequence: None,
            redelivered: false,
        }
    }
}
