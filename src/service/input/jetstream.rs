//! JetStream input: one durable pull consumer per owned partition ([`JetStreamSource`]), read
//! with explicit acks; what it takes to read a partition again from the stream when deliveries
//! did not reach this replica ([`Recovery`]) and to notice that they did not ([`LossCheck`]); and,
//! with `jetstream.pinned_client`, the partition's pin ([`Pinned`], [`HeldPins`]).
//!
//! It knows JetStream's consumers, pull streams and ack subjects; it does not know how events
//! are decoded or routed (the dispatcher in [`super`]), nor when acknowledgements are sent (the
//! sink in `output`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::header::NATS_PIN_ID;
use async_nats::jetstream::{self, consumer::pull, stream};
use futures::{FutureExt, StreamExt};

use super::{Input, Ownership, Source};
use crate::codec::subject::ack_position;
use crate::config::{Config, PartitionMode};
use crate::service::{Envelope, ServiceError};

/// A partition's pull consumer, what it takes to read the partition again when deliveries did not
/// reach this replica, and with `jetstream.pinned_client` its pin.
pub struct JetStreamSource {
    consumer: jetstream::consumer::PullConsumer,
    /// How much one pull request asks for.
    pull: Pull,
    /// `None` until the first pull (a standby replica waits a moment before pulling), and from
    /// the end of a pull stream until the next one opens.
    messages: Option<pull::Stream>,
    /// The consumer was found gone and the dispatcher told (once).
    gone_reported: bool,
    /// No pull stream opens before this instant. A deadline, not a sleep's duration: `next` may be
    /// dropped (at shutdown; `ready` drops it whenever nothing is there yet), and a sleep would
    /// start again on every call.
    open_at: Option<tokio::time::Instant>,
    /// Reading the partition from the stream before going on (see [`Recovery`]).
    recovery: Recovery,
    /// Set for pinned-client consumers.
    pinned: Option<Pinned>,
    /// Asking the consumer for deliveries lost at the end of the input.
    check: LossCheck,
}

/// Deliveries lost with a connection are found by the next delivery's consumer sequence (see
/// [`Recovery`]); nothing shows those at the end of the input, which the server would redeliver
/// only after `ack_wait` (ten minutes by default), with their streams stalled until then. So after
/// a reconnect, a new pull stream or a failed pull (missed heartbeats, a consumer leader lost with
/// deliveries on their way), once the partition has been quiet for [`QUIET`], the replica
/// asks the consumer how far it has delivered: beyond the last delivery that arrived here, the
/// rest was lost and is read from the stream like any other loss. A delivery that is merely
/// slower than [`QUIET`] (or overtaken by the consumer's answer) is then read twice, which is
/// harmless: its own delivery counts as rebuilt. The same look finds a pin lost (see
/// [`Pinned::lost`]).
///
/// Costs: while the partition waits for input, one timer, looked at every [`LOOK`] (an atomic
/// load); one consumer-info request per partition after a reconnect, a new pull stream or a failed
/// pull (none for a pinned partition not held here); and for a pinned partition held here, one
/// per `pinned_ttl_ms` without a delivery. While it asks, the partition's next delivery waits (the
/// request is a round trip; after a failure it asks again at the next look).
struct LossCheck {
    /// The client's counters, whose count of connections made shows a reconnect.
    statistics: Arc<async_nats::Statistics>,
    /// That count when last looked at.
    connects: u64,
    /// A reconnect, a new pull stream or a failed pull since the consumer was last asked:
    /// deliveries may have been lost at the end of the input.
    suspect: bool,
    /// The later of the last delivery here and the last answer of the consumer.
    heard: Instant,
    /// The next look. One timer, reset at each look, rather than one made for every wait (a
    /// dropped [`JetStreamSource::next`] leaves it in place).
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
}

/// How often a waiting partition looks at the connection count.
const LOOK: Duration = Duration::from_secs(1);

/// How long a partition must go without a delivery, after a reconnect, before the consumer is
/// asked whether deliveries were lost.
const QUIET: Duration = Duration::from_secs(1);

impl LossCheck {
    fn new(client: &async_nats::Client) -> Self {
        let statistics = client.statistics();
        let connects = statistics.connects.load(std::sync::atomic::Ordering::Relaxed);
        let timer = Box::pin(tokio::time::sleep(LOOK));
        LossCheck { statistics, connects, suspect: false, heard: Instant::now(), timer }
    }
}

/// How much one pull request asks for (`jetstream.pull_batch`, `jetstream.pull_max_bytes`).
#[derive(Debug, Clone, Copy)]
struct Pull {
    batch: usize,
    max_bytes: usize,
}

/// How often the server signals an idle pull (async-nats' default for `messages()`).
const PULL_HEARTBEAT: Duration = Duration::from_secs(15);

impl Pull {
    fn of(cfg: &crate::config::JetStreamConfig) -> Pull {
        Pull { batch: cfg.pull_batch, max_bytes: cfg.pull_max_bytes }
    }

    /// A pull stream builder on `consumer` with these limits.
    fn stream(self, consumer: &jetstream::consumer::PullConsumer) -> pull::StreamBuilder<'_> {
        let builder = consumer.stream().max_messages_per_batch(self.batch);
        if self.max_bytes > 0 {
            builder.max_bytes_per_batch(self.max_bytes)
        } else {
            builder
        }
    }
}

/// Refuses a pull byte limit too small for the largest message the server accepts (such a
/// message could never be pulled, and its partition would stop there).
fn check_pull_max_bytes(cfg: &crate::config::JetStreamConfig, max_payload: usize) -> Result<(), ServiceError> {
    const OVERHEAD: usize = 4096;
    if cfg.pull_max_bytes == 0 || cfg.pull_max_bytes >= max_payload + OVERHEAD {
        return Ok(());
    }
    Err(ServiceError::JetStream(format!(
        "jetstream.pull_max_bytes = {} is below the server's max_payload ({max_payload}) plus {OVERHEAD} bytes: a \
         message that large could never be pulled; raise it or set 0",
        cfg.pull_max_bytes
    )))
}

/// The pins this replica's partition consumers hold, by consumer name: added when a delivery
/// shows a new pin, taken off when the pin is found gone. Shared with the service, which releases
/// those still held at the end of its shutdown, also when it had to stop an input task before that
/// task stopped pulling (a shutdown that timed out).
pub type HeldPins = Arc<std::sync::Mutex<std::collections::BTreeMap<String, PinRelease>>>;

/// Takes every pin out of `held`, for release.
pub fn take_held(held: &HeldPins) -> Vec<PinRelease> {
    let mut held = held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    std::mem::take(&mut *held).into_values().collect()
}

/// The priority group every replica pulls a pinned-client partition consumer through.
const PRIORITY_GROUP: &str = "sink";

/// How long a replica waits before pulling a partition it only stands by for, so that at a normal
/// start the server pins each partition to its owner (the first client to pull gets the pin).
const STANDBY_DELAY: Duration = Duration::from_secs(1);

/// What releases a pin this replica held at shutdown, so that a standby takes over at once
/// instead of after `pinned_ttl_ms` (the unacknowledged input of the streams open here is rebuilt
/// there).
///
/// Used only once every shard has drained: events already handed to a shard are processed,
/// published and acknowledged here. Released before, the standby would read them from the ack
/// floor too and publish their outputs a second time, which only a deduplicating downstream
/// stream hides. A shutdown that times out first stops every task that could still acknowledge
/// (as a crash would), then releases the pin.
#[derive(Clone)]
pub struct PinRelease {
    stream: stream::Stream,
    consumer: String,
}

impl PinRelease {
    /// Asks the server to release the pin; a failure leaves it to lapse after `pinned_ttl_ms`.
    pub async fn release(self) {
        let PinRelease { stream, consumer } = self;
        match stream.unpin_consumer(&consumer, PRIORITY_GROUP).await {
            Ok(()) => tracing::info!(%consumer, "released the pin"),
            Err(e) => tracing::warn!(%consumer, error = %e, "releasing the pin failed; it lapses after pinned_ttl_ms"),
        }
    }
}

/// The pin of a pinned-client partition consumer. The server delivers a partition to one pinned
/// pull client at a time; a delivery under a new pin id means the partition moved here (the
/// previous client died, or stopped pulling for `pinned_ttl_ms`) and starts a [`Recovery`].
struct Pinned {
    /// `pinned_ttl_ms`: a pin lost without a reconnect (pulls held up that long on a connection
    /// that survived) is looked for once the partition has been quiet that long.
    ttl: Duration,
    /// Pull expiry: well below the pin TTL, since the pin lapses when no pull arrives in time.
    expires: Duration,
    /// The pin id of the latest delivery: `None` before the first, after a new pull stream, and
    /// once the pin is found gone.
    pin: Option<String>,
    /// The pin found gone last: deliveries still arriving under it were sent before it moved and
    /// are left to the new owner (unacknowledged here).
    gone: Option<String>,
    /// The pin was found gone, and the dispatcher has not been told yet. A replica cut off for
    /// longer than `pinned_ttl_ms` is not told by async-nats (it swallows the server's pin
    /// mismatch), so the pin is compared with the consumer's after every reconnect (see
    /// [`LossCheck`]) and after `ttl` without a delivery; a new pull stream is a new client, and a
    /// new pin means the partition came back after it had gone: either way the pin held before is
    /// gone. The streams open here would otherwise expire here later (finals under ids the new
    /// owner uses for its own outputs, acks that let the ack floor pass streams the new owner still
    /// has open), or go on from the middle after a takeover read.
    lost: bool,
    /// Where the pin held here is published for the service, and what releases it.
    held: HeldPins,
    release: PinRelease,
}

impl Pinned {
    /// A delivery came under `pin`, new here: any pin held before is gone (see [`Pinned::lose`]).
    fn take_pin(&mut self, pin: String) {
        self.lose();
        self.pin = Some(pin);
        self.held_pins().insert(self.release.consumer.clone(), self.release.clone());
    }

    /// The pin held here, if any, is gone: remembered as such, and the dispatcher is to be told.
    fn lose(&mut self) {
        if let Some(old) = self.pin.take() {
            self.held_pins().remove(&self.release.consumer);
            self.gone = Some(old);
            self.lost = true;
        }
    }

    fn held_pins(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, PinRelease>> {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Reading a partition again from its consumer's ack floor, when deliveries did not reach this
/// replica: at a takeover (a new pin: the previous client received them), or when the consumer
/// sequence of a delivery jumps (a connection lost with deliveries in flight, which the server
/// counts as delivered).
///
/// Such deliveries are still pending, but the server redelivers them only after `ack_wait`, after
/// newer messages: applied then, a stream's later events would have gone first (a lost delivery
/// of an open stream would be skipped as a duplicate of them), and the streams open at a takeover
/// would be rebuilt from the middle. Instead, before handing on the delivery that revealed the
/// loss, this replica reads the partition's messages from the consumer's ack floor + 1 up to its
/// delivered sequence straight from the stream, in order, through an ephemeral ordered consumer.
/// A delivery at or below that sequence was rebuilt already: it is marked as a redelivery, so the
/// table skips it by stream sequence (or, for a stream that has ended, the sink acknowledges it as
/// delivered twice) and its ack is taken like any other.
struct Recovery {
    stream: stream::Stream,
    subject: String,
    /// The partition the source's consumer delivers (0 when its consumer is not a partition's):
    /// given to every envelope it hands on (see [`Envelope::jetstream`]), and the one a lost pin
    /// gives up.
    partition: u32,
    /// The consumer sequence of the latest delivery here. A replica's own consumer starts from
    /// what it had delivered when opened; a shared (pinned) one from `None`, until the first.
    last_delivery: Option<u64>,
    /// The highest stream sequence processed here (delivered, or read by a rebuild).
    seen_through: u64,
    /// Deliveries at or below this stream sequence have been rebuilt from the stream.
    rebuilt_through: u64,
    /// A rebuild in progress.
    rebuild: Option<Rebuild>,
    /// A loss found, until its rebuild has started: kept here rather than in a future, so that a
    /// dropped [`JetStreamSource::next`] loses nothing.
    loss: Option<Loss>,
}

/// A loss found and not yet being rebuilt.
struct Loss {
    /// The delivery that revealed it; `None` when asking the consumer did (see [`LossCheck`]).
    revealed: Option<Envelope>,
    /// What counts as processed before ([`Rebuild::handled_through`]).
    handled_through: u64,
}

/// A recovery's read of the stream.
struct Rebuild {
    /// The ordered read from `next`: `None` until it is opened, and again after it went idle.
    reader: Option<pull::Ordered>,
    /// The next stream sequence to read (the ack floor + 1 at first).
    next: u64,
    /// Everything up to `through` has been read, or nothing is left to read.
    done: bool,
    /// When the read counts as idle (see [`REBUILD_IDLE`]) unless a message comes first: a
    /// deadline, kept here so that a dropped [`JetStreamSource::next`] does not restart it.
    idle_at: tokio::time::Instant,
    /// No read opens before this (at once at first, [`REOPEN_PAUSE`] after an attempt).
    open_at: tokio::time::Instant,
    /// The last stream sequence to read: the consumer's delivered sequence when it started.
    through: u64,
    /// The delivery that revealed the loss, handed on after the rebuilt messages; `None` when
    /// asking the consumer did (see [`LossCheck`]).
    revealed: Option<Envelope>,
    /// Messages read at or below this stream sequence were processed here before and count as
    /// redeliveries; those above (lost on the way here, or delivered to the previous owner at a
    /// takeover) are processed as first deliveries: a late event among them is dead-lettered.
    handled_through: u64,
}

/// How long a recovery's stream read may go without a message before it is opened again from
/// where it stands. The new read either goes on (the old one had stalled: a leader election, a
/// reconnect) or finds nothing left to read (the messages up to the delivered sequence were
/// removed by the stream's limits since they were delivered), which ends the rebuild.
const REBUILD_IDLE: Duration = Duration::from_secs(5);

/// The pause before a pull stream that ended opens again, and between two attempts to open a
/// recovery's stream read.
const REOPEN_PAUSE: Duration = Duration::from_millis(200);

/// How often a consumer found gone is looked for again.
const GONE_PAUSE: Duration = Duration::from_secs(1);

/// Opens an ordered read of `subject` in `stream` from stream sequence `from`; `None` when
/// nothing of `subject` is stored from `from` on.
async fn open_read(stream: &stream::Stream, subject: &str, from: u64) -> Result<Option<pull::Ordered>, String> {
    use jetstream::consumer::DeliverPolicy;
    let config = pull::OrderedConfig {
        filter_subject: subject.to_owned(),
        deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: from },
        ..Default::default()
    };
    let consumer = stream.create_consumer(config).await.map_err(|e| e.to_string())?;
    if consumer.cached_info().num_pending == 0 {
        return Ok(None);
    }
    consumer.messages().await.map(Some).map_err(|e| e.to_string())
}

/// The first server version with pinned-client priority groups.
const PRIORITY_GROUPS_SINCE: (u32, u32, u32) = (2, 11, 0);

/// Refuses `jetstream.pinned_client` on a server older than 2.11 (or one whose version cannot be
/// read): such a server accepts the consumer's priority settings and silently ignores them, so
/// every replica would consume every partition it stands by for.
pub fn check_pinned_client_support(config: &Config, server_version: &str) -> Result<(), ServiceError> {
    if !config.jetstream.pinned_client {
        return Ok(());
    }
    match crate::bus::parse_server_version(server_version) {
        Some(version) if version >= PRIORITY_GROUPS_SINCE => Ok(()),
        _ => Err(ServiceError::JetStream(format!(
            "jetstream.pinned_client needs nats-server 2.11 or later (pinned-client priority groups), but the \
             server reports version {server_version:?}; upgrade the server or set jetstream.pinned_client = false"
        ))),
    }
}

pub(super) async fn open_consumers(
    client: &async_nats::Client,
    config: &Config,
    ownership: &Ownership,
    subjects: Vec<String>,
    held_pins: &HeldPins,
) -> Result<Vec<(String, Source)>, ServiceError> {
    let js = jetstream::new(client.clone());
    let cfg = &config.jetstream;
    let js_error = |what: &str, e: &dyn std::fmt::Display| ServiceError::JetStream(format!("{what}: {e}"));
    // Before anything is created: a refused start-up leaves the server as it was.
    check_pinned_client_support(config, &client.server_info().version)?;
    check_pull_max_bytes(cfg, client.server_info().max_payload)?;
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
    // Open streams are rebuilt from the events above the ack floor, acknowledged or not (the
    // service acknowledges all but each open stream's first event at once); a stream that deletes
    // acknowledged messages would rebuild them with their middle missing.
    let retention = stream.cached_info().config.retention;
    if retention != stream::RetentionPolicy::Limits {
        return Err(ServiceError::JetStream(format!(
            "stream {} has {retention:?} retention, which deletes acknowledged events that rebuilding an open \
             stream after a restart or takeover reads again; the input stream needs Limits retention",
            cfg.stream
        )));
    }
    if cfg.pinned_client {
        return open_pinned_consumers(client, config, ownership, &stream, held_pins).await;
    }
    let mut sources = Vec::new();
    // (partition, consumer name, filter subject)
    let names: Vec<(u32, String, String)> = match config.partitions.mode {
        PartitionMode::Subject => ownership
            .partitions()
            .into_iter()
            .zip(subjects)
            .map(|(p, subject)| (p, format!("{}-p{p}", cfg.consumer_prefix), subject))
            .collect(),
        // Every replica reads everything in these modes, so each has its own consumer (and no
        // consumer is a partition's).
        PartitionMode::None | PartitionMode::Filter => subjects
            .into_iter()
            .enumerate()
            .map(|(i, subject)| {
                (0, format!("{}-r{}-s{i}", cfg.consumer_prefix, config.partitions.replica_index), subject)
            })
            .collect(),
    };
    for (partition, name, subject) in names {
        let start = restart_point(&stream, &name).await?;
        let consumer_config = partition_consumer(cfg, &name, &subject, start);
        let consumer: jetstream::consumer::Consumer<pull::Config> =
            stream.create_consumer(consumer_config).await.map_err(|e| js_error(&format!("consumer {name}"), &e))?;
        let pull = Pull::of(cfg);
        let messages = pull
            .stream(&consumer)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(|e| js_error(&format!("consumer {name}"), &e))?;
        tracing::info!(consumer = %name, %subject, start = ?start, "consuming");
        // The consumer is this replica's alone (and new, see `restart_point`): what it has
        // delivered so far is the baseline, so that even the first deliveries can be found lost.
        let delivered = consumer.cached_info().delivered.consumer_sequence;
        let recovery = Recovery::new(&stream, &subject, partition, Some(delivered));
        let check = LossCheck::new(client);
        let source = JetStreamSource {
            consumer,
            pull,
            messages: Some(messages),
            gone_reported: false,
            open_at: None,
            recovery,
            pinned: None,
            check,
        };
        sources.push((subject, Source::JetStream(Box::new(source))));
    }
    Ok(sources)
}

/// The configuration of a durable partition consumer: explicit acks, the configured ack wait and
/// pending limit, delivering from `start` (a stream sequence) or from the beginning.
fn partition_consumer(
    cfg: &crate::config::JetStreamConfig,
    name: &str,
    subject: &str,
    start: Option<u64>,
) -> pull::Config {
    use jetstream::consumer::DeliverPolicy;
    pull::Config {
        durable_name: Some(name.to_owned()),
        filter_subject: subject.to_owned(),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_millis(cfg.ack_wait_ms),
        max_ack_pending: cfg.max_ack_pending,
        deliver_policy: match start {
            Some(start_sequence) => DeliverPolicy::ByStartSequence { start_sequence },
            None => DeliverPolicy::All,
        },
        ..Default::default()
    }
}

/// `jetstream.pinned_client`: one pinned-client consumer per partition, shared by every replica,
/// pulled from for the owned partitions at once and for the standby partitions after
/// [`STANDBY_DELAY`]. Consumers are never deleted here (other replicas are pulling from them); a
/// consumer left from a deployment without `pinned_client` is replaced once, at its ack floor.
async fn open_pinned_consumers(
    client: &async_nats::Client,
    config: &Config,
    ownership: &Ownership,
    stream: &stream::Stream,
    held_pins: &HeldPins,
) -> Result<Vec<(String, Source)>, ServiceError> {
    use jetstream::consumer::PriorityPolicy;
    let cfg = &config.jetstream;
    let js_error = |what: &str, e: &dyn std::fmt::Display| ServiceError::JetStream(format!("{what}: {e}"));
    let ttl = Duration::from_millis(cfg.pinned_ttl_ms);
    let owned = ownership.partitions();
    let standby = config.partitions.standby_partitions(&cfg.standby)?;
    let mut sources = Vec::new();
    for (partition, is_owner) in owned.iter().map(|p| (*p, true)).chain(standby.iter().map(|p| (*p, false))) {
        let name = format!("{}-p{partition}", cfg.consumer_prefix);
        let subject = ownership.partition_subject(partition);
        let existing = find_consumer(stream, &name).await?;
        let consumer = match existing {
            Some(consumer) if consumer.cached_info().config.priority_policy == PriorityPolicy::PinnedClient => {
                // Reused as the other replicas pull from it; settings changed since it was created
                // are applied to it, so that the server's pin timeout is the one this replica's
                // pull renewals and lapse check are timed by.
                let server = &consumer.cached_info().config;
                let ack_wait = Duration::from_millis(cfg.ack_wait_ms);
                if server.priority_timeout == ttl
                    && server.ack_wait == ack_wait
                    && server.max_ack_pending == cfg.max_ack_pending
                {
                    consumer
                } else {
                    let updated = jetstream::consumer::Config {
                        priority_timeout: ttl,
                        ack_wait,
                        max_ack_pending: cfg.max_ack_pending,
                        ..server.clone()
                    };
                    tracing::info!(consumer = %name, "applying changed pinned_ttl_ms, ack_wait_ms or max_ack_pending to the consumer");
                    stream
                        .update_consumer(updated)
                        .await
                        .map_err(|e| js_error(&format!("updating consumer {name}"), &e))?;
                    stream.get_consumer(&name).await.map_err(|e| js_error(&format!("consumer {name}"), &e))?
                }
            }
            existing => {
                let start = match existing {
                    Some(_) => restart_point(stream, &name).await?,
                    None => None,
                };
                // Replicas starting together create the same configuration, which the server
                // accepts as one consumer.
                let consumer_config = pull::Config {
                    priority_policy: PriorityPolicy::PinnedClient,
                    priority_groups: vec![PRIORITY_GROUP.to_owned()],
                    priority_timeout: ttl,
                    ..partition_consumer(cfg, &name, &subject, start)
                };
                stream.create_consumer(consumer_config).await.map_err(|e| js_error(&format!("consumer {name}"), &e))?
            }
        };
        tracing::info!(consumer = %name, %subject, owner = is_owner, "consuming as a pinned-client group member");
        let release = PinRelease { stream: stream.clone(), consumer: name.clone() };
        let held = held_pins.clone();
        let pinned = Pinned { ttl, expires: ttl / 3, pin: None, gone: None, lost: false, held, release };
        let open_at = (!is_owner).then(|| tokio::time::Instant::now() + STANDBY_DELAY);
        // Shared: what it delivered went to whichever replica held the pin.
        let recovery = Recovery::new(stream, &subject, partition, None);
        let source = JetStreamSource {
            consumer,
            pull: Pull::of(cfg),
            messages: None,
            gone_reported: false,
            open_at,
            recovery,
            pinned: Some(pinned),
            check: LossCheck::new(client),
        };
        sources.push((subject, Source::JetStream(Box::new(source))));
    }
    Ok(sources)
}

/// Where a partition's consumer resumes: right after its ack floor. The old consumer is deleted
/// so that everything not yet acknowledged is delivered again, in stream order (a consumer would
/// otherwise deliver new messages before redelivering those a stopped replica held).
///
/// `None` only when the consumer does not exist (a first start: from the stream's beginning). Any
/// other failure stops the start: taken for "no consumer", it would have created the consumer
/// anew, or, since creating one that exists with the same configuration succeeds, resumed the old
/// one where it stood, past events of open streams that it had acknowledged.
async fn restart_point(stream: &stream::Stream, name: &str) -> Result<Option<u64>, ServiceError> {
    let Some(consumer) = find_consumer(stream, name).await? else { return Ok(None) };
    let floor = consumer.cached_info().ack_floor.stream_sequence;
    stream.delete_consumer(name).await.map_err(|e| {
        ServiceError::JetStream(format!("deleting consumer {name} to restart it at its ack floor: {e}"))
    })?;
    Ok(Some(floor + 1))
}

/// The consumer `name` of `stream`, `None` when it does not exist; any other failure is an error.
async fn find_consumer(
    stream: &stream::Stream,
    name: &str,
) -> Result<Option<jetstream::consumer::PullConsumer>, ServiceError> {
    use jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind};
    match stream.get_consumer(name).await {
        Ok(consumer) => Ok(Some(consumer)),
        Err(e)
            if e.downcast_ref::<ConsumerInfoError>().is_some_and(|e| e.kind() == ConsumerInfoErrorKind::NotFound) =>
        {
            Ok(None)
        }
        Err(e) => Err(ServiceError::JetStream(format!("reading consumer {name}: {e}"))),
    }
}

impl JetStreamSource {
    /// The next input (an event, or a pin found gone); only shutdown (which drops this future)
    /// ends a JetStream source.
    ///
    /// Cancel-safe: every state it waits in lives in `self` (a recovery's revealing delivery in
    /// [`Recovery::loss`], a rebuild's read in [`Recovery::rebuild`], the waits before a pull
    /// stream opens and before a rebuild's read counts as idle as deadlines, the loss check's
    /// timer), and async-nats' pull stream sends no pull request before its first poll, so opening
    /// one may be dropped too.
    pub(super) async fn next(&mut self) -> Input {
        loop {
            if let Some(pinned) = self.pinned.as_mut().filter(|p| p.lost) {
                pinned.lost = false;
                return Input::PinLost(self.recovery.partition);
            }
            if let Some(envelope) = self.recovery.next_rebuilt().await {
                return Input::Event(envelope);
            }
            if self.recovery.loss.is_some() {
                // Boxed, as are the other rare waits below: inline, their futures would make the
                // future of every `next` larger, and it is made (and moved) once per event.
                Box::pin(self.recovery.start_rebuild(&self.consumer)).await;
                continue;
            }
            let Some(messages) = self.messages.as_mut() else {
                if let Some(gone) = Box::pin(self.open()).await {
                    return gone;
                }
                continue;
            };
            // What is there already is taken without looking at the timer; only a wait also waits
            // for the next look of the loss check.
            let item = match messages.next().now_or_never() {
                Some(item) => Some(item),
                None => tokio::select! {
                    biased;
                    item = messages.next() => Some(item),
                    () = self.check.timer.as_mut() => None,
                },
            };
            let Some(item) = item else {
                Box::pin(self.look()).await;
                continue;
            };
            match item {
                None => {
                    // The pull stream ended (the consumer deleted, or a request refused; a reconnect
                    // does not end it): open it again. A new pull stream is a new client for the
                    // server, so a pin held by the old one is gone: the next pin seen here starts
                    // a takeover.
                    tracing::warn!("JetStream pull stream ended; reopening it");
                    self.messages = None;
                    self.open_at = Some(tokio::time::Instant::now() + REOPEN_PAUSE);
                }
                Some(Ok(message)) => {
                    // Only pinned-client consumers carry a pin: others skip the header lookup.
                    let mut new_pin = false;
                    if let Some(pinned) = self.pinned.as_mut() {
                        let pin = message.headers.as_ref().and_then(|h| h.get_last(NATS_PIN_ID)).map(|v| v.to_string());
                        if pin.is_some() && pin == pinned.gone {
                            // Sent before the pin moved, read only now: the new owner has it.
                            continue;
                        }
                        if let Some(pin) = pin.filter(|pin| pinned.pin.as_ref() != Some(pin)) {
                            // A pin held before is gone: its streams are given up (the loop tells
                            // the dispatcher first) before the takeover read rebuilds them.
                            pinned.take_pin(pin);
                            new_pin = true;
                        }
                    }
                    let (envelope, delivery) = Envelope::jetstream(message, self.recovery.partition);
                    self.check.heard = envelope.received;
                    let missed = self.recovery.missed(delivery);
                    if !new_pin && !missed {
                        return Input::Event(self.recovery.mark(envelope));
                    }
                    if !new_pin {
                        tracing::warn!(
                            subject = %self.recovery.subject,
                            delivery,
                            "deliveries did not reach this replica (lost with a connection); reading the partition again from the ack floor"
                        );
                    }
                    // Only what this replica processed itself counts as processed before: at a
                    // takeover too (what the previous owner processed is unknown), so that a late
                    // event it never got to is dead-lettered rather than acknowledged. One it had
                    // dead-lettered already is published again under the same `Nats-Msg-Id`.
                    let handled_through = self.recovery.seen_through;
                    self.recovery.loss = Some(Loss { revealed: Some(envelope), handled_through });
                }
                Some(Err(e)) => {
                    // Heartbeats missed, leader changes, reconnects: the stream keeps pulling.
                    // Deliveries may have been lost with the failure (a consumer leader that dies
                    // with them on their way, the client's own connection up): a later delivery
                    // shows them, and at the end of the input the loss check asks the consumer.
                    self.check.suspect = true;
                    tracing::warn!(error = %e, "JetStream pull failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// The loss check's look (see [`LossCheck`]): at the count of connections and, when the
    /// partition has been quiet long enough, at the consumer. Dropped while asking, it asks again
    /// on the next call (the timer has fired and stays so).
    async fn look(&mut self) {
        let connects = self.check.statistics.connects.load(std::sync::atomic::Ordering::Relaxed);
        if connects != self.check.connects {
            self.check.connects = connects;
            self.check.suspect = true;
        }
        let quiet = self.check.heard.elapsed();
        // A pinned partition not held here: nothing delivered here can be lost, no pin to lose.
        let held = self.pinned.as_ref().is_none_or(|p| p.pin.is_some());
        let pin_may_lapse = self.pinned.as_ref().is_some_and(|p| p.pin.is_some() && quiet >= p.ttl);
        if !held {
            self.check.suspect = false;
        } else if (self.check.suspect && quiet >= QUIET) || pin_may_lapse {
            match self.consumer.get_info().await {
                Ok(info) => {
                    self.check.heard = Instant::now();
                    let tail = std::mem::take(&mut self.check.suspect);
                    self.audit(&info, tail);
                }
                Err(e) => {
                    tracing::warn!(error = %e, subject = %self.recovery.subject, "consumer info for the loss check failed; asking again")
                }
            }
        }
        self.check.timer.as_mut().reset(tokio::time::Instant::now() + LOOK);
    }

    /// For a pinned partition, finds out whether the pin is still this replica's; then, when
    /// deliveries may have been lost (`tail`: a reconnect, a new pull stream or a failed pull; a
    /// pull that went on without a failure lost nothing), starts a recovery if the consumer has
    /// delivered more than reached this replica.
    fn audit(&mut self, info: &jetstream::consumer::Info, tail: bool) {
        if let Some(pinned) = self.pinned.as_mut() {
            // Not pinned here: the deliveries are another replica's.
            let Some(pin) = pinned.pin.as_deref() else { return };
            let ours = info
                .priority_groups
                .iter()
                .any(|g| g.group == PRIORITY_GROUP && g.pinned_client_id.as_deref() == Some(pin));
            if !ours {
                tracing::warn!(
                    subject = %self.recovery.subject,
                    "the partition's pin has moved to another replica; giving up its open streams here"
                );
                pinned.lose();
                return;
            }
        }
        if !tail {
            return;
        }
        let delivered = info.delivered.consumer_sequence;
        // Nothing delivered here yet: nothing processed here can be out of order.
        let Some(last) = self.recovery.last_delivery else { return };
        if delivered <= last {
            return;
        }
        tracing::warn!(
            subject = %self.recovery.subject,
            last,
            delivered,
            "deliveries at the end of the input did not reach this replica (lost with a connection); reading the partition again from the ack floor"
        );
        // Those deliveries are counted as seen: the next one continues the sequence.
        self.recovery.last_delivery = Some(delivered);
        self.recovery.loss = Some(Loss { revealed: None, handled_through: self.recovery.seen_through });
    }

    /// Shutdown: stops pulling. A pin held stays in [`HeldPins`] for the service to release once
    /// every shard has drained.
    pub(super) fn stop(&mut self) {
        // Stop pulling first, or the server could pin this replica's waiting pull request again.
        self.messages = None;
    }

    /// Opens the pull stream, retrying until it opens; tells once when the consumer is gone.
    ///
    /// async-nats opens a pull stream on a consumer that no longer exists without a word (its
    /// pulls then fail, as after a leader change), and a deleted consumer ends the pull stream:
    /// the consumer is looked up first, or a deleted one would be pulled from for good, silently.
    async fn open(&mut self) -> Option<Input> {
        use jetstream::context::ConsumerInfoErrorKind;
        if let Some(at) = self.open_at {
            tokio::time::sleep_until(at).await;
            self.open_at = None;
        }
        loop {
            match self.consumer.info().await {
                Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => {
                    self.open_at = Some(tokio::time::Instant::now() + GONE_PAUSE);
                    if !std::mem::replace(&mut self.gone_reported, true) {
                        return Some(Input::ConsumerGone(self.consumer.cached_info().name.clone()));
                    }
                    // Reported: looked for again now and then (recreated, it is read again).
                    tokio::time::sleep(GONE_PAUSE).await;
                    continue;
                }
                // Anything else (no answer in time, a leader being elected) is for the pull stream
                // to meet and retry.
                _ => {}
            }
            let opened = match &self.pinned {
                None => self.pull.stream(&self.consumer).heartbeat(PULL_HEARTBEAT).messages().await,
                Some(pinned) => {
                    self.pull
                        .stream(&self.consumer)
                        .group(PRIORITY_GROUP)
                        .expires(pinned.expires)
                        .heartbeat(pinned.expires / 4)
                        .messages()
                        .await
                }
            };
            match opened {
                Ok(messages) => {
                    self.messages = Some(messages);
                    if let Some(pinned) = self.pinned.as_mut() {
                        // The old stream's pin is not this one's.
                        pinned.lose();
                    }
                    // Deliveries in flight to the old pull stream are lost with it.
                    self.check.suspect = true;
                    return None;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "opening the pull stream failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

impl Recovery {
    fn new(stream: &stream::Stream, subject: &str, partition: u32, last_delivery: Option<u64>) -> Self {
        Recovery {
            stream: stream.clone(),
            subject: subject.to_owned(),
            partition,
            last_delivery,
            seen_through: 0,
            rebuilt_through: 0,
            rebuild: None,
            loss: None,
        }
    }

    /// Whether deliveries before consumer sequence `delivery` did not reach this replica (0:
    /// unknown, never a loss). A lower sequence than the last (a consumer created again) starts
    /// counting afresh.
    fn missed(&mut self, delivery: u64) -> bool {
        if delivery == 0 {
            return false;
        }
        let missed = self.last_delivery.is_some_and(|last| delivery > last + 1);
        self.last_delivery = Some(delivery);
        missed
    }

    /// During a recovery: the next message rebuilt from the stream, then the delivery that
    /// revealed the loss, if one did; `None` when no rebuild is under way (or it has just ended
    /// with nothing more to hand on).
    async fn next_rebuilt(&mut self) -> Option<Envelope> {
        let rebuild = self.rebuild.as_mut()?;
        while !rebuild.done {
            let Some(reader) = rebuild.reader.as_mut() else {
                // Opening creates a consumer on the server; a dropped `next` (the input task's
                // `select!`, or `Source::ready`, which polls it once) abandons it to the server's
                // inactivity cleanup, so attempts are paced rather than made on every poll.
                tokio::time::sleep_until(rebuild.open_at).await;
                rebuild.open_at = tokio::time::Instant::now() + REOPEN_PAUSE;
                match open_read(&self.stream, &self.subject, rebuild.next).await {
                    Ok(Some(reader)) => {
                        rebuild.reader = Some(reader);
                        rebuild.idle_at = tokio::time::Instant::now() + REBUILD_IDLE;
                    }
                    Ok(None) => {
                        if rebuild.next <= rebuild.through {
                            tracing::warn!(subject = %self.subject, next = rebuild.next, through = rebuild.through, "rebuild read: the rest up to the delivered sequence is no longer stored");
                        }
                        rebuild.done = true;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, subject = %self.subject, "opening a stream read for a rebuild failed; retrying");
                    }
                }
                continue;
            };
            match tokio::time::timeout_at(rebuild.idle_at, reader.next()).await {
                Ok(Some(Ok(message))) => {
                    rebuild.idle_at = tokio::time::Instant::now() + REBUILD_IDLE;
                    let Ok(info) = message.info() else { continue };
                    let (sequence, pending) = (info.stream_sequence, info.pending);
                    rebuild.next = sequence + 1;
                    if sequence > rebuild.through {
                        // The consumer delivers it: it is above the delivered sequence.
                        rebuild.done = true;
                        break;
                    }
                    if sequence == rebuild.through || pending == 0 {
                        rebuild.done = true;
                    }
                    let (mut envelope, _) = Envelope::jetstream(message, self.partition);
                    // Read, not delivered: its ack goes with the consumer's own redelivery later.
                    envelope.ack = None;
                    envelope.redelivered = sequence <= rebuild.handled_through;
                    return Some(envelope);
                }
                Ok(Some(Err(e))) => {
                    // The ordered consumer recreates itself after gaps and leader changes.
                    tracing::warn!(error = %e, subject = %self.subject, "reading the stream for a rebuild failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(None) | Err(_) => {
                    // Giving up here would hand on the revealing delivery with the rest unread:
                    // the later events of the streams open at the takeover, acknowledged by the
                    // previous owner, would never be applied. Reading again from here cannot
                    // lose them; it only waits while the stream cannot be read.
                    tracing::warn!(subject = %self.subject, next = rebuild.next, through = rebuild.through, "rebuild read idle; opening it again");
                    rebuild.reader = None;
                }
            }
        }
        let Rebuild { through, revealed, .. } = self.rebuild.take()?;
        tracing::info!(subject = %self.subject, through, "partition rebuilt; consuming");
        self.seen_through = self.seen_through.max(through);
        revealed.map(|envelope| self.mark(envelope))
    }

    /// Rebuild everything between the consumer's ack floor and its delivered sequence from the
    /// stream before handing on the delivery that revealed the loss, if one did. Dropped before
    /// it returns, it starts again on the next call ([`Recovery::loss`] stays in place).
    async fn start_rebuild(&mut self, consumer: &jetstream::consumer::PullConsumer) {
        let (floor, delivered) = loop {
            match consumer.get_info().await {
                Ok(info) => break (info.ack_floor.stream_sequence, info.delivered.stream_sequence),
                Err(e) => {
                    tracing::warn!(error = %e, subject = %self.subject, "consumer info for a rebuild failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        tracing::info!(subject = %self.subject, floor, delivered, "rebuilding the partition from the ack floor");
        self.rebuilt_through = self.rebuilt_through.max(delivered);
        let Some(Loss { revealed, handled_through }) = self.loss.take() else { return };
        self.rebuild = Some(Rebuild {
            reader: None,
            next: floor + 1,
            done: delivered <= floor,
            idle_at: tokio::time::Instant::now(),
            open_at: tokio::time::Instant::now(),
            through: delivered,
            revealed,
            handled_through,
        });
    }

    /// A delivery of a message already rebuilt counts as a redelivery, and as rebuilt (see
    /// [`Recovery`]). Any delivery handed on is processed here.
    fn mark(&mut self, mut envelope: Envelope) -> Envelope {
        self.seen_through = self.seen_through.max(envelope.sequence.unwrap_or(0));
        if envelope.sequence.is_some_and(|s| s <= self.rebuilt_through) {
            envelope.redelivered = true;
            envelope.rebuilt = true;
        }
        envelope
    }
}

impl Envelope {
    /// The envelope of a JetStream delivery from `partition`'s consumer, and the delivery's
    /// consumer sequence (0 when its ack subject does not say).
    fn jetstream(message: jetstream::Message, partition: u32) -> (Envelope, u64) {
        // Moved, not cloned: the message's own handle on the reply subject would only be dropped.
        let mut message = message.message;
        let ack = message.reply.take();
        let position = ack.as_deref().and_then(ack_position);
        let (sequence, delivered, delivery) =
            position.map_or((0, 1, 0), |p| (p.stream_sequence, p.delivered, p.consumer_sequence));
        let mut envelope = Envelope::core(message);
        envelope.ack = ack;
        envelope.sequence = Some(sequence);
        envelope.redelivered = delivered > 1;
        envelope.partition = partition;
        (envelope, delivery)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_byte_limit_must_leave_room_for_the_largest_message() {
        let mut cfg = crate::config::JetStreamConfig::default();
        assert!(check_pull_max_bytes(&cfg, 1 << 20).is_ok(), "0: no byte limit");
        cfg.pull_max_bytes = (1 << 20) + 4096;
        assert!(check_pull_max_bytes(&cfg, 1 << 20).is_ok());
        cfg.pull_max_bytes = 1 << 20;
        let err = check_pull_max_bytes(&cfg, 1 << 20).unwrap_err().to_string();
        assert!(err.contains("jetstream.pull_max_bytes") && err.contains("1048576"), "{err}");
    }

    #[test]
    fn pinned_client_is_refused_below_2_11_and_for_unknown_versions() {
        let mut config = Config::default();
        assert!(check_pinned_client_support(&config, "2.9.10").is_ok(), "off: any server");
        config.jetstream.pinned_client = true;
        for version in ["2.11.0", "v2.11.4", "2.12.0-RC.1", "2.15.1", "3.0.0"] {
            assert!(check_pinned_client_support(&config, version).is_ok(), "{version}");
        }
        for version in ["2.9.10", "2.10.25", "", "unknown"] {
            let err = check_pinned_client_support(&config, version).unwrap_err().to_string();
            assert!(err.contains("needs nats-server 2.11") && err.contains(&format!("{version:?}")), "{err}");
        }
    }
}
