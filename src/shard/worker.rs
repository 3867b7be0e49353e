//! Shards and the tasks that drive them.
//!
//! A [`Shard`] is one [`StreamTable`], the sink its outputs go to and its expiry tick: it applies
//! events in the order it is given them and publishes what they produce. Something must own it
//! and feed it, and there are two owners:
//!
//! * a worker task of a [`ShardSet`]: the set routes every event by a hash of its message id into
//!   the bounded inbox of one worker, so all events of a message are handled in order by one task
//!   and no lock is taken on the hot path. A full inbox makes [`ShardSet::route`] wait:
//!   backpressure reaches the subscription (and, past the client's buffer, shows up as a counted
//!   slow consumer). Each worker selects between the expiry tick and its inbox (taking up to 64
//!   queued events at once); when the inbox closes (shutdown) it finishes what is queued and then
//!   the shard.
//! * the task that reads the only input, when there is one input and one shard: it applies each
//!   event as it decodes it, with no hand-off between tasks (see `service::input`).
//!
//! Finishing a shard closes every open stream with reason `shutdown` (or, for JetStream input,
//! leaves them unacknowledged for the next owner) and flushes its sink.
//!
//! This module knows tokio but not NATS: events arrive decoded, with an opaque envelope `E` (the
//! caller's message, for pass-through, dead letters and trace context), and leave through a
//! [`ShardSink`]. To cross into a worker task they travel detached from their payload (their
//! strings are positions in it, so crossing copies none of them).

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Interval, MissedTickBehavior};

use super::table::{Disposition, InputPosition, StreamTable, TableStats};
use crate::codec::inbound::{DetachedEvent, InboundEvent};
use crate::codec::outbound::Publication;
use crate::pipeline::PipelineStats;

/// Where a shard's results go. One instance per shard.
pub trait ShardSink: Send + 'static {
    /// The caller's message that each event arrives in.
    type Envelope: Send + Sync + 'static;
    /// Publishes one output. `cause` is the envelope of the event that produced it, absent for
    /// outputs of expiry, eviction and shutdown.
    fn publish(&mut self, publication: Publication, cause: Option<&Self::Envelope>) -> impl Future<Output = ()> + Send;
    /// Forwards an event that is not text, unchanged.
    fn pass_through(&mut self, envelope: Self::Envelope) -> impl Future<Output = ()> + Send;
    /// Sends an event that cannot be applied to the dead-letter subject with a reason code.
    fn dead_letter(&mut self, envelope: Self::Envelope, reason: &'static str) -> impl Future<Output = ()> + Send;
    /// Where the event sits in the input: its partition (for giving a partition up) and its input
    /// sequence, when the input has one (for duplicate detection).
    fn position(&self, envelope: &Self::Envelope) -> InputPosition;
    /// The event was applied to stream `key` (or was a duplicate of one applied): its outputs are
    /// published. The sink may hold the envelope (to acknowledge it when the stream ends);
    /// `standing` says whether it can be the lowest input of its stream. `shared` is the stream
    /// table's own copy of the key, given when the stream is open and the event may be its lowest
    /// input: a sink that keeps the key while the stream is open clones it instead of copying it.
    fn applied(
        &mut self,
        key: &str,
        shared: Option<&Arc<str>>,
        envelope: Self::Envelope,
        standing: Standing,
    ) -> impl Future<Output = ()> + Send;
    /// The stream ended and its last outputs are published.
    fn stream_closed(&mut self, key: &str) -> impl Future<Output = ()> + Send;
    /// The stream was given up without closing it (its input is another replica's now, which
    /// rebuilds it from what is unacknowledged): whatever the sink holds for it is dropped unsent.
    fn stream_abandoned(&mut self, key: &str);
    /// A stream opened because of the event with `cause`: its span may take a parent from it.
    fn stream_opened(&mut self, span: &tracing::Span, cause: &Self::Envelope);
    /// Reports counters after a change: once per batch of events (a worker's batch, or a burst of
    /// events the input task applies itself) and after expiry, so it must be cheap when nothing
    /// changed.
    fn report(&mut self, shard: usize, open_streams: usize, table: TableStats, pipeline: PipelineStats);
    /// Makes sure everything published so far has left the process.
    fn flush(&mut self) -> impl Future<Output = ()> + Send;
}

/// Where an applied event stands among the inputs of its stream, as far as this shard knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// It opened its stream here.
    Opened,
    /// It followed inputs of its open stream applied here; its input sequence, when it has one,
    /// is above all of theirs. A sink holding a stream's lowest input back need not look at it.
    Following,
    /// It repeats an input its open stream already applied (a redelivery: its input sequence is
    /// not above the last one applied); it may be lower than any of them.
    Duplicate,
    /// It repeats an input of a stream that is not open here: the `error` or `interrupt` that
    /// ended its message, delivered again after segments of the message that followed it opened
    /// (it ends none of them). No stream of its own can hold it back.
    Orphaned,
}

/// One shard: its streams, the sink their outputs go to, and its expiry tick.
pub struct Shard<S> {
    index: usize,
    table: StreamTable,
    sink: S,
    /// Outputs of the event being applied, handed to the sink once it is applied (reused).
    outputs: Vec<Publication>,
    /// Where the key of the event being applied is written (reused).
    key_scratch: String,
    tick: Interval,
    /// At [`Shard::finish`]: close open streams with reason `shutdown` (core NATS input), or leave
    /// them unacknowledged, to be rebuilt by the next owner (JetStream input).
    close_on_shutdown: bool,
}

impl<S: ShardSink> Shard<S> {
    /// Shard number `index` (for metrics), over `table`, publishing to `sink`, looking for idle
    /// streams every `expiry_tick`. Must be called inside a tokio runtime (the tick is a timer).
    pub fn new(index: usize, table: StreamTable, sink: S, expiry_tick: Duration, close_on_shutdown: bool) -> Self {
        let mut tick = tokio::time::interval(expiry_tick);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Shard { index, table, sink, outputs: Vec::new(), key_scratch: String::new(), tick, close_on_shutdown }
    }

    /// Waits for the next expiry tick and returns its time, for [`Shard::expire`]. Cancel-safe:
    /// meant for one branch of a `select!`.
    pub async fn next_tick(&mut self) -> Instant {
        self.tick.tick().await.into_std()
    }

    /// Applies one event at `now` and publishes what it produced, then closes the streams it
    /// ended.
    pub async fn apply(&mut self, event: &InboundEvent<'_>, envelope: S::Envelope, now: Instant) {
        let Shard { index, table, sink, outputs, key_scratch, .. } = self;
        let input = sink.position(&envelope);
        let mut opening = false;
        let opened = &mut |span: &tracing::Span| {
            opening = true;
            sink.stream_opened(span, &envelope);
        };
        // A bug must cost one stream, not the shard: a panic while applying an event discards that
        // stream's (possibly half-updated) state and dead-letters the event, and the shard goes on
        // with its other streams. Outputs the event had produced for its own stream are dropped
        // with it; those of a stream it closed first (evicted to make room) are published, since
        // that stream is closed and its input acknowledged.
        // The event's own stream (the one discarded if applying the event fails).
        let own = event.stream.key(key_scratch);
        // Whether the failure came while closing the event's own stream (a final).
        let mut own_close_failed = false;
        let applied = loop {
            let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                table.apply_keyed(event, own, input, now, &mut |p| outputs.push(p), opened)
            }));
            if attempt.is_err() {
                match table.recover_failed_close() {
                    Some(id) if id.as_ref() == own => own_close_failed = true,
                    // Closing another stream failed: one evicted to make room, or a segment the
                    // event ended with its message or provider call. That costs that stream only,
                    // and the event is applied again. Eviction comes before the event's stream
                    // opens, so the event touched nothing yet, and there is room now; the
                    // segments the event already ended are closed and delisted, so it ends the
                    // others (an `error` whose failed segment was the last then ends the stream
                    // of its own id, as when none is open). Each retry has one stream fewer open,
                    // so this ends.
                    Some(other) => {
                        outputs.retain(|p| p.stream_key() != other.as_ref());
                        tracing::error!(shard = *index, stream.key = %other, "closing a stream failed; it was discarded");
                        continue;
                    }
                    None => {}
                }
            }
            break attempt;
        };
        match applied {
            Ok(disposition @ (Disposition::Applied | Disposition::Duplicate)) => {
                // The table's key only where a sink may keep one: a following event's is never
                // kept, and a lookup per event would cost one more hash.
                let (standing, shared) = match disposition {
                    Disposition::Duplicate => match table.shared_key(own) {
                        Some(shared) => (Standing::Duplicate, Some(shared)),
                        None => (Standing::Orphaned, None),
                    },
                    _ if opening => (Standing::Opened, table.shared_key(own)),
                    _ => (Standing::Following, None),
                };
                for p in outputs.drain(..) {
                    // The last outputs of a stream evicted to make room come first; the event did
                    // not cause them (they must not carry its trace context). Only an event that
                    // opened its stream can have evicted one: the others skip the comparison.
                    let cause = (!opening || p.stream_key() == own).then_some(&envelope);
                    sink.publish(p, cause).await;
                }
                sink.applied(own, shared, envelope, standing).await;
            }
            Ok(Disposition::PassThrough) => {
                // The last outputs of segments the event ended (`provider-call-finished`), before
                // the event itself is forwarded.
                for p in outputs.drain(..) {
                    sink.publish(p, Some(&envelope)).await;
                }
                sink.pass_through(envelope).await
            }
            Ok(Disposition::Late) => sink.dead_letter(envelope, "stream_finished").await,
            Err(_) => {
                // Only streams that did close (a failure while closing the event's own stream has
                // closed it already, without its last outputs).
                outputs.retain(|p| {
                    let key = p.stream_key();
                    key != own && table.has_closed(key)
                });
                if !own_close_failed {
                    table.discard(own);
                }
                tracing::error!(shard = *index, stream.key = %own, "processing an event failed; the stream was discarded");
                for p in outputs.drain(..) {
                    sink.publish(p, None).await;
                }
                sink.dead_letter(envelope, "internal_error").await;
            }
        }
        self.publish_closed().await;
    }

    /// Closes the streams idle at `now` and publishes their last outputs.
    pub async fn expire(&mut self, now: Instant) {
        let Shard { index, table, outputs, .. } = self;
        close_contained(*index, table, outputs, |table, outputs| {
            table.expire(now, &mut |p| outputs.push(p));
        });
        self.publish_unprompted().await;
    }

    /// Gives up the open streams of input partition `partition`, without outputs or acks (see
    /// [`StreamTable::abandon_partition`]); returns how many.
    pub fn abandon(&mut self, partition: u32) -> usize {
        let ids = self.table.abandon_partition(partition);
        for id in &ids {
            self.sink.stream_abandoned(id);
        }
        if !ids.is_empty() {
            tracing::info!(
                shard = self.index,
                open = ids.len(),
                "gave up open streams, unacknowledged, to another replica"
            );
        }
        ids.len()
    }

    /// Reports the shard's counters to its sink.
    pub fn report(&mut self) {
        let (table, pipeline) = (self.table.stats(), self.table.pipeline_stats());
        self.sink.report(self.index, self.table.len(), table, pipeline);
    }

    /// Shutdown, once no more events will come: closes every open stream with reason `shutdown`
    /// (or abandons them, see [`Shard::new`]), reports and flushes the sink.
    pub async fn finish(mut self) {
        if self.close_on_shutdown {
            let Shard { index, table, outputs, .. } = &mut self;
            close_contained(*index, table, outputs, |table, outputs| {
                table.close_all("shutdown", &mut |p| outputs.push(p));
            });
            self.publish_unprompted().await;
        } else {
            let open = self.table.abandon_all();
            tracing::info!(shard = self.index, open, "left open streams unacknowledged for the next owner");
        }
        self.report();
        self.sink.flush().await;
    }

    /// Publishes outputs no event caused (expiry, eviction, shutdown), then the closed streams.
    async fn publish_unprompted(&mut self) {
        for p in self.outputs.drain(..) {
            self.sink.publish(p, None).await;
        }
        self.publish_closed().await;
    }

    async fn publish_closed(&mut self) {
        for id in self.table.take_closed() {
            self.sink.stream_closed(&id).await;
        }
    }
}

/// One event for a worker task: the decoded event, detached from its payload (so its strings are
/// not copied to cross into the worker), the payload, and the caller's envelope.
pub struct ShardEvent<E> {
    event: DetachedEvent,
    payload: Bytes,
    envelope: E,
}

impl<E> ShardEvent<E> {
    /// `event`, decoded from `payload`, with the caller's message (handed back for pass-through,
    /// dead letters and trace context). Strings of `event` that do not borrow from `payload` are
    /// copied.
    pub fn new(event: InboundEvent<'_>, payload: &Bytes, envelope: E) -> Self {
        ShardEvent { event: event.detach(payload), payload: payload.clone(), envelope }
    }
}

/// What a worker's inbox carries, in the order the worker must handle it.
// Events go through the inbox by value: boxing them would cost an allocation per event, for the
// sake of a variant that comes once per partition handed over.
#[allow(clippy::large_enum_variant)]
enum Work<E> {
    Event(ShardEvent<E>),
    /// Give up the open streams of this input partition, after the events queued before.
    Abandon(u32),
}

/// Events a worker takes from its inbox at once.
const BATCH: usize = 64;

/// Settings of a shard set.
#[derive(Debug, Clone, Copy)]
pub struct ShardSettings {
    /// Number of workers.
    pub count: usize,
    /// Events queued per worker.
    pub inbox_capacity: usize,
    /// How often workers close idle streams.
    pub expiry_tick: Duration,
    /// At shutdown, close open streams with reason `shutdown` (core NATS input). Off for
    /// JetStream input: open streams are left unacknowledged, to be rebuilt by the next owner.
    pub close_on_shutdown: bool,
}

/// The workers and the senders that feed them.
pub struct ShardSet<E> {
    inboxes: Vec<mpsc::Sender<Work<E>>>,
    workers: Vec<JoinHandle<()>>,
}

/// Why an event could not be routed.
#[derive(Debug, thiserror::Error)]
#[error("shard {0} has stopped")]
pub struct ShardStopped(pub usize);

impl<E: Send + Sync + 'static> ShardSet<E> {
    /// Starts `settings.count` workers; `make` builds each worker's table and sink.
    pub fn start<S, F>(settings: ShardSettings, mut make: F) -> Self
    where
        S: ShardSink<Envelope = E>,
        F: FnMut(usize) -> (StreamTable, S),
    {
        let count = settings.count.max(1);
        let mut inboxes = Vec::with_capacity(count);
        let mut workers = Vec::with_capacity(count);
        for index in 0..count {
            let (tx, rx) = mpsc::channel(settings.inbox_capacity.max(1));
            let (table, sink) = make(index);
            let shard = Shard::new(index, table, sink, settings.expiry_tick, settings.close_on_shutdown);
            workers.push(tokio::spawn(run_worker(shard, rx)));
            inboxes.push(tx);
        }
        ShardSet { inboxes, workers }
    }

    /// The worker that owns `message_id`.
    pub fn shard_of(&self, message_id: &str) -> usize {
        shard_index(message_id, self.inboxes.len())
    }

    /// Queues `event` for its worker; waits while the inbox is full. Returns whether it had to
    /// wait (for the backpressure counter).
    pub async fn route(&self, event: ShardEvent<E>) -> Result<bool, ShardStopped> {
        let shard = self.shard_of(&event.event.message_id(&event.payload));
        let inbox = &self.inboxes[shard];
        match inbox.try_send(Work::Event(event)) {
            Ok(()) => Ok(false),
            Err(mpsc::error::TrySendError::Full(work)) => {
                inbox.send(work).await.map_err(|_| ShardStopped(shard))?;
                Ok(true)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ShardStopped(shard)),
        }
    }

    /// Tells every worker to give up the open streams of input partition `partition`, once it has
    /// applied the events queued before; waits while an inbox is full.
    pub async fn abandon(&self, partition: u32) -> Result<(), ShardStopped> {
        for (shard, inbox) in self.inboxes.iter().enumerate() {
            inbox.send(Work::Abandon(partition)).await.map_err(|_| ShardStopped(shard))?;
        }
        Ok(())
    }

    /// Closes the inboxes and waits for every worker to finish its queue, close its streams and
    /// flush.
    pub async fn shutdown(mut self) {
        self.drain().await;
    }

    /// [`ShardSet::shutdown`] in place: a worker leaves the set once it has finished, so that a
    /// drain cut short (a shutdown that timed out) leaves the others to [`ShardSet::abort`].
    pub async fn drain(&mut self) {
        self.inboxes.clear();
        while let Some(worker) = self.workers.first_mut() {
            if let Err(e) = worker.await {
                tracing::error!(error = %e, "shard worker failed");
            }
            self.workers.remove(0);
        }
    }

    /// Stops the workers still running where they are, as a crash would: what they hold is
    /// neither published nor acknowledged (JetStream delivers it again to the partition's next
    /// owner). Returns once they have stopped.
    pub async fn abort(&mut self) {
        self.inboxes.clear();
        for worker in &self.workers {
            worker.abort();
        }
        for worker in self.workers.drain(..) {
            // Cancelled, or ended before the abort reached it.
            let _ = worker.await;
        }
    }
}

/// The shard of `message_id` among `count`: stable across processes of the same build.
pub fn shard_index(message_id: &str, count: usize) -> usize {
    // FNV-1a: fast, no per-process seed (so a test can predict it), good enough spread for ids.
    let mut hasher = Fnv1a::default();
    message_id.hash(&mut hasher);
    (hasher.finish() % count.max(1) as u64) as usize
}

/// 64-bit FNV-1a.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// A worker task: applies queued events in order and expires idle streams on the tick until the
/// inbox closes, then finishes the shard.
async fn run_worker<S: ShardSink>(mut shard: Shard<S>, mut inbox: mpsc::Receiver<Work<S::Envelope>>) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        tokio::select! {
            // The tick first: it is ready once per period, so this costs one poll per batch, and
            // expiry does not wait for the inbox to empty (or for tokio's cooperative budget to
            // force a yield) under constant input.
            biased;
            now = shard.next_tick() => shard.expire(now).await,
            received = inbox.recv_many(&mut batch, BATCH) => {
                if received == 0 {
                    break;
                }
                // Events queued together arrived within moments of each other: one clock read.
                let now = tokio::time::Instant::now().into_std();
                for work in batch.drain(..) {
                    match work {
                        Work::Event(ShardEvent { event, payload, envelope }) => {
                            shard.apply(&event.attach(&payload), envelope, now).await;
                        }
                        Work::Abandon(partition) => {
                            shard.abandon(partition);
                        }
                    }
                }
            }
        }
        // Once per batch rather than per event: the counters are read by scrapes, not per event.
        shard.report();
    }
    shard.finish().await;
}

/// Runs `close` (expiry or shutdown: streams closed one after another) so that a bug while closing
/// one stream costs that stream only, as in [`Shard::apply`]: the stream is closed without its last
/// outputs (its state is gone), counted as failed, and the others are closed as if nothing
/// happened. A panic outside any stream's close (none is known) ends the round; the next tick or
/// call goes on.
fn close_contained(
    index: usize,
    table: &mut StreamTable,
    outputs: &mut Vec<Publication>,
    mut close: impl FnMut(&mut StreamTable, &mut Vec<Publication>),
) {
    while std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| close(table, outputs))).is_err() {
        let Some(failed) = table.recover_failed_close() else { return };
        outputs.retain(|p| p.stream_key() != &*failed);
        tracing::error!(shard = index, stream.key = %failed, "closing a stream failed; it was discarded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::inbound::decode;
    use crate::codec::outbound::{OutputEncoder, OutputSubjects};
    use crate::pipeline::{Pipeline, PipelineLimits, TagKind, TagSpec};
    use crate::shard::table::TableLimits;
    use std::sync::{Arc, Mutex};

    /// Records what a worker sends, in order, into a shared log (and each publication's id and
    /// payload into a second one).
    #[derive(Clone, Default)]
    #[allow(clippy::type_complexity)]
    struct Recorder(Arc<Mutex<Vec<String>>>, Arc<Mutex<Vec<(String, Bytes)>>>);

    impl ShardSink for Recorder {
        type Envelope = u32;
        async fn publish(&mut self, p: Publication, cause: Option<&u32>) {
            self.0.lock().unwrap().push(format!("{} {} {:?}", p.subject, p.msg_id, cause));
            self.1.lock().unwrap().push((p.msg_id, p.payload));
        }
        async fn pass_through(&mut self, envelope: u32) {
            self.0.lock().unwrap().push(format!("pass {envelope}"));
        }
        async fn dead_letter(&mut self, envelope: u32, reason: &'static str) {
            self.0.lock().unwrap().push(format!("dead {envelope} {reason}"));
        }
        fn stream_opened(&mut self, _: &tracing::Span, _: &u32) {}
        /// The envelope's number is its input sequence, plus 1,000 times its input partition.
        fn position(&self, envelope: &u32) -> InputPosition {
            InputPosition { partition: *envelope / 1000, sequence: Some(u64::from(*envelope % 1000)) }
        }
        async fn applied(&mut self, id: &str, shared: Option<&Arc<str>>, envelope: u32, standing: Standing) {
            let shared = if shared.is_some_and(|shared| shared.as_ref() == id) { " shared" } else { "" };
            self.0.lock().unwrap().push(format!("applied {id} {envelope} {standing:?}{shared}"));
        }
        fn stream_abandoned(&mut self, id: &str) {
            self.0.lock().unwrap().push(format!("abandoned {id}"));
        }
        async fn stream_closed(&mut self, id: &str) {
            self.0.lock().unwrap().push(format!("closed {id}"));
        }
        fn report(&mut self, _: usize, _: usize, _: TableStats, _: PipelineStats) {}
        async fn flush(&mut self) {
            self.0.lock().unwrap().push("flush".into());
        }
    }

    /// One shard worker over `table`, recording into `log`.
    fn one_shard(table: StreamTable, log: &Recorder) -> ShardSet<u32> {
        let mut table = Some(table);
        ShardSet::start(settings(1), |_| (table.take().expect("one shard"), log.clone()))
    }

    /// Where `line` is in `log`; panics, showing the log, when it is not there.
    fn at(log: &[String], line: &str) -> usize {
        log.iter().position(|l| l == line).unwrap_or_else(|| panic!("{line:?} in {log:?}"))
    }

    /// The `applied` lines of `log`, in order.
    fn applied_lines(log: &Recorder) -> Vec<String> {
        log.0.lock().unwrap().iter().filter(|l| l.starts_with("applied ")).cloned().collect()
    }

    fn table(idle: Duration) -> StreamTable {
        limited_table(idle, 100)
    }

    /// A table that holds one open stream at most (opening another evicts it).
    fn one_stream_table() -> StreamTable {
        limited_table(Duration::from_secs(60), 1)
    }

    fn limited_table(idle_timeout: Duration, max_streams: usize) -> StreamTable {
        let tags = vec![TagSpec::new("core:x:v1", TagKind::Block)];
        let pipeline = Pipeline::new(tags, PipelineLimits::default()).unwrap();
        let encoder = OutputEncoder::new(&pipeline, &OutputSubjects::default());
        StreamTable::new(pipeline, encoder, TableLimits { idle_timeout, max_streams, finished_memory: 10 })
    }

    fn event(json: &str, envelope: u32) -> ShardEvent<u32> {
        let payload = Bytes::from(json.to_owned());
        ShardEvent::new(decode(&payload, 1 << 20).unwrap(), &payload, envelope)
    }

    /// A `partial` of message `id`.
    fn delta(id: &str, text: &str, envelope: u32) -> ShardEvent<u32> {
        event(&format!(r#"{{"type":"partial","meta":{{"message_id":"{id}"}},"delta":"{text}"}}"#), envelope)
    }

    /// A `final` of message `id`, without text.
    fn fin(id: &str, envelope: u32) -> ShardEvent<u32> {
        event(&format!(r#"{{"type":"final","meta":{{"message_id":"{id}"}}}}"#), envelope)
    }

    fn settings(count: usize) -> ShardSettings {
        ShardSettings { count, inbox_capacity: 2, expiry_tick: Duration::from_millis(100), close_on_shutdown: true }
    }

    #[tokio::test]
    async fn events_of_one_message_stay_in_order_and_shutdown_closes_streams() {
        let log = Recorder::default();
        let set = ShardSet::start(settings(3), |_| (table(Duration::from_secs(60)), log.clone()));
        for i in 0..20u32 {
            let json = format!(r#"{{"type":"partial","meta":{{"message_id":"m{}"}},"delta":"d{i} "}}"#, i % 4);
            set.route(event(&json, i)).await.unwrap();
        }
        let json = r#"{"type":"tool-call","meta":{"message_id":"m1"}}"#;
        set.route(event(json, 99)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        assert!(log.contains(&"pass 99".to_owned()));
        for m in 0..4 {
            let seqs: Vec<u64> = log
                .iter()
                .filter_map(|l| l.split(' ').nth(1))
                .filter_map(|id| id.strip_prefix(&format!("m{m}:")))
                .map(|s| s.parse().unwrap())
                .collect();
            assert_eq!(seqs, (1..=6).collect::<Vec<_>>(), "m{m}: five deltas then the shutdown final");
        }
        assert_eq!(log.iter().filter(|l| *l == "flush").count(), 3, "every worker flushes");
    }

    /// Giving up a partition's streams publishes nothing for them and releases nothing: they are
    /// forgotten after the events queued before, and a later event of one opens it afresh (not
    /// late). Streams of other partitions are untouched.
    #[tokio::test]
    async fn given_up_streams_leave_without_outputs_or_acks_and_may_open_again() {
        let log = Recorder::default();
        let set = ShardSet::start(settings(2), |_| (table(Duration::from_secs(60)), log.clone()));
        // "gone" arrives from partition 1 (envelopes 1001...), "kept" from partition 0.
        set.route(delta("gone", "a ", 1001)).await.unwrap();
        set.route(delta("kept", "b ", 2)).await.unwrap();
        set.route(delta("gone", "c ", 1003)).await.unwrap();
        set.abandon(1).await.unwrap();
        set.route(delta("gone", "d ", 1004)).await.unwrap();
        set.route(fin("gone", 1005)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        let gone: Vec<&String> = log.iter().filter(|l| l.contains("gone")).collect();
        let expected = [
            "chat.filtered gone:1 Some(1001)",
            "applied gone 1001 Opened shared",
            "chat.filtered gone:2 Some(1003)",
            "applied gone 1003 Following",
            "abandoned gone",
            // Opened again: numbered from 1, as the next owner's rebuild would number it.
            "chat.filtered gone:1 Some(1004)",
            "applied gone 1004 Opened shared",
            "chat.filtered gone:2 Some(1005)",
            "applied gone 1005 Following",
            "closed gone",
        ];
        assert_eq!(gone, expected, "{log:#?}");
        assert!(log.contains(&"closed kept".to_owned()), "the other stream is untouched: {log:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_streams_expire_on_the_tick() {
        let log = Recorder::default();
        let set = ShardSet::start(settings(1), |_| (table(Duration::from_secs(5)), log.clone()));
        let json = r#"{"type":"partial","meta":{"message_id":"idle"},"delta":"x <core:x:v1>half"}"#;
        set.route(event(json, 1)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(6)).await;
        let expired = log.0.lock().unwrap().clone();
        assert!(expired.iter().any(|l| l.starts_with("chat.filtered idle:5 None")), "{expired:?}");
        assert!(expired.iter().any(|l| l.starts_with("chat.structured.core.x.v1 idle:4 None")), "{expired:?}");
        // An event after expiry is late: dead-lettered, no new stream with repeated seq numbers.
        set.route(event(json, 2)).await.unwrap();
        set.shutdown().await;
        assert!(log.0.lock().unwrap().contains(&"dead 2 stream_finished".to_owned()));
    }

    #[tokio::test]
    async fn a_failure_inside_one_stream_costs_that_stream_only() {
        let log = Recorder::default();
        let mut failing = table(Duration::from_secs(60));
        failing.panic_on_delta = Some("boom");
        let set = one_shard(failing, &log);
        set.route(delta("bad", "before ", 1)).await.unwrap();
        set.route(delta("good", "a ", 2)).await.unwrap();
        set.route(delta("bad", "boom", 3)).await.unwrap();
        set.route(delta("bad", "after", 4)).await.unwrap();
        set.route(delta("good", "b", 5)).await.unwrap();
        set.route(fin("good", 6)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        assert!(at(&log, "dead 3 internal_error") < at(&log, "closed bad"), "{log:?}");
        assert!(log.contains(&"dead 4 stream_finished".to_owned()), "later events of it are late: {log:?}");
        let good: Vec<&String> = log.iter().filter(|l| l.contains(" good:")).collect();
        assert_eq!(good.len(), 3, "the other stream is untouched: {log:?}");
        assert!(log.contains(&"closed good".to_owned()));
        assert!(!log.iter().any(|l| l.contains(" bad:2 ")), "nothing of the failed event is published: {log:?}");
    }

    #[tokio::test]
    async fn a_failure_leaves_nothing_of_its_stream_for_the_next_one() {
        use prost::Message as _;
        let log = Recorder::default();
        let mut failing = table(Duration::from_secs(60));
        failing.panic_on_output = Some("boom");
        let set = one_shard(failing, &log);
        // The block's payload is gathered in the pipeline's scratch, shared by the shard's
        // streams; emitting it fails.
        set.route(delta("bad", "hi <core:x:v1>secret boom", 1)).await.unwrap();
        set.route(delta("good", "hello", 2)).await.unwrap();
        set.route(fin("good", 3)).await.unwrap();
        set.shutdown().await;
        assert!(log.0.lock().unwrap().contains(&"dead 1 internal_error".to_owned()));
        let payloads = log.1.lock().unwrap().clone();
        let good: Vec<crate::codec::proto::FilteredText> = payloads
            .iter()
            .filter(|(id, _)| id.starts_with("good:"))
            .map(|(_, payload)| crate::codec::proto::FilteredText::decode(payload.clone()).unwrap())
            .collect();
        assert_eq!(good.len(), 2, "{good:?}");
        assert_eq!((good[0].delta.as_str(), good[1].text.as_str()), ("hello", "hello"), "{good:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_while_closing_one_stream_costs_that_stream_only() {
        let log = Recorder::default();
        let mut failing = table(Duration::from_secs(5));
        // Held back as a possible tag, so only a final outputs it.
        failing.panic_on_output = Some("<core:x");
        let set = one_shard(failing, &log);
        set.route(delta("bad", "x <core:x", 1)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        set.route(delta("good", "y ", 2)).await.unwrap();
        // `bad` expires, and closing it fails; the shard goes on.
        tokio::time::sleep(Duration::from_secs(3)).await;
        set.route(delta("good", "z ", 3)).await.unwrap();
        set.route(delta("late", "w <core:x", 4)).await.unwrap();
        set.route(delta("other", "v ", 5)).await.unwrap();
        set.route(delta("bad", "again", 6)).await.unwrap();
        // Closing `late` at shutdown fails too; `good` and `other` still get their finals.
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        for line in ["chat.filtered good:3 None", "closed good", "chat.filtered other:2 None", "closed other"] {
            assert!(log.iter().any(|l| l.starts_with(line)), "{line:?} in {log:?}");
        }
        for id in ["bad", "late"] {
            assert!(log.contains(&format!("closed {id}")), "its held input is released: {log:?}");
            assert!(!log.iter().any(|l| l.contains(&format!(" {id}:2 "))), "no final of {id}: {log:?}");
        }
        assert!(log.contains(&"dead 6 stream_finished".to_owned()), "later events of it are late: {log:?}");
    }

    #[tokio::test]
    async fn a_failure_after_an_eviction_still_publishes_the_evicted_streams_last_outputs() {
        let log = Recorder::default();
        let mut failing = one_stream_table();
        failing.panic_on_delta = Some("boom");
        let set = one_shard(failing, &log);
        set.route(delta("old", "a <core:x:v1>half", 1)).await.unwrap();
        // Opening `new` evicts `old` (one stream at most), then processing `new`'s delta fails.
        set.route(delta("new", "boom", 2)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        // `old`'s block completes and its final text goes out, before `old` is closed (acknowledged).
        let evicted: Vec<usize> = log
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains(" old:") && l.ends_with(" None"))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(evicted.len(), 2, "the block's completion and the final text: {log:?}");
        assert!(evicted.iter().all(|&i| i < at(&log, "closed old")), "{log:?}");
        assert!(at(&log, "dead 2 internal_error") < at(&log, "closed new"), "{log:?}");
        assert!(!log.iter().any(|l| l.contains(" new:")), "nothing of the failed stream is published: {log:?}");
    }

    #[tokio::test]
    async fn the_outputs_of_a_stream_evicted_by_an_event_are_not_caused_by_it() {
        let log = Recorder::default();
        let set = ShardSet::start(settings(1), |_| (one_stream_table(), log.clone()));
        set.route(delta("old", "a <core:x:v1>half", 1)).await.unwrap();
        // Opening `new` evicts `old` (one stream at most): `old`'s last outputs are not `new`'s
        // event's (they must not carry its trace context).
        set.route(delta("new", "hello", 2)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        let old: Vec<&String> = log.iter().filter(|l| l.contains(" old:")).collect();
        let evicted: Vec<&&String> = old.iter().filter(|l| l.ends_with(" None")).collect();
        // The text, the block's start and its content, then its completion and the final text
        // after the eviction.
        assert_eq!((old.len(), evicted.len()), (5, 2), "{log:?}");
        assert!(old[..3].iter().all(|l| l.ends_with(" Some(1)")), "{log:?}");
        let new: Vec<&String> = log.iter().filter(|l| l.contains(" new:")).collect();
        assert!(!new.is_empty() && new[..new.len() - 1].iter().all(|l| l.ends_with(" Some(2)")), "{log:?}");
    }

    #[tokio::test]
    async fn a_failure_while_evicting_a_stream_costs_the_evicted_stream_not_the_event() {
        let log = Recorder::default();
        let mut failing = one_stream_table();
        // Held back as a possible tag, so only closing `old` outputs it.
        failing.panic_on_output = Some("<core:x");
        let set = one_shard(failing, &log);
        set.route(delta("old", "a <core:x", 1)).await.unwrap();
        // Opening `new` evicts `old` (one stream at most), and closing `old` fails.
        set.route(delta("new", "hello", 2)).await.unwrap();
        set.route(fin("new", 3)).await.unwrap();
        set.route(delta("old", "more", 4)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        assert!(log.contains(&"applied old 1 Opened shared".to_owned()), "{log:?}");
        assert!(!log.iter().any(|l| l.contains(" old:2 ")), "no final of the broken stream: {log:?}");
        assert!(log.contains(&"closed old".to_owned()), "its held input is released: {log:?}");
        assert!(log.contains(&"applied new 2 Opened shared".to_owned()), "{log:?}");
        assert!(!log.iter().any(|l| l.starts_with("dead 2")), "the event that made room is applied: {log:?}");
        let new: Vec<&String> = log.iter().filter(|l| l.contains(" new:")).collect();
        assert_eq!(new.len(), 2, "its delta and its final: {log:?}");
        assert!(at(&log, "applied new 3 Following") < at(&log, "closed new"), "{log:?}");
        assert!(
            log.contains(&"dead 4 stream_finished".to_owned()),
            "later events of the broken stream are late: {log:?}"
        );
    }

    #[tokio::test]
    async fn a_failure_while_an_error_ends_its_messages_segments_costs_that_segment_only() {
        let log = Recorder::default();
        let mut failing = table(Duration::from_secs(60));
        // Held back as a possible tag, so only closing `m:s1` outputs it.
        failing.panic_on_output = Some("<core:x");
        let set = one_shard(failing, &log);
        let segment = |id: &str, text: &str, envelope| {
            let json = format!(
                r#"{{"type":"text-delta","meta":{{"message_id":"m"}},"correlation":{{"segment_id":"{id}"}},"delta":"{text}"}}"#
            );
            event(&json, envelope)
        };
        set.route(segment("m:s1", "a <core:x", 1)).await.unwrap();
        set.route(segment("m:s2", "b", 2)).await.unwrap();
        // No correlation: it ends both segments, and closing the first fails.
        set.route(event(r#"{"type":"error","meta":{"message_id":"m"},"error_string":"boom"}"#, 3)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        assert!(!log.iter().any(|l| l.contains(" m/m:s1:2 ")), "no final of the broken segment: {log:?}");
        assert!(log.contains(&"closed m/m:s1".to_owned()), "its held input is released: {log:?}");
        let final_of_s2 =
            log.iter().position(|l| l.contains(" m/m:s2:2 Some(3)")).expect("s2's final, caused by the error");
        assert!(final_of_s2 < at(&log, "applied m 3 Following"), "{log:?}");
        assert!(at(&log, "applied m 3 Following") < at(&log, "closed m/m:s2"), "{log:?}");
        assert!(
            !log.iter().any(|l| l.contains(" m:1 ") || l.starts_with("dead 3")),
            "no stream of the message id: {log:?}"
        );
    }

    #[tokio::test]
    async fn segments_a_provider_call_end_leaves_open_are_published_before_it_is_forwarded() {
        let log = Recorder::default();
        let set = ShardSet::start(settings(1), |_| (table(Duration::from_secs(60)), log.clone()));
        let delta = r#"{"type":"text-delta","meta":{"message_id":"m"},"correlation":{"segment_id":"s","provider_call_id":"p"},"delta":"hi"}"#;
        set.route(event(delta, 1)).await.unwrap();
        let end = r#"{"type":"provider-call-finished","meta":{"message_id":"m"},"correlation":{"provider_call_id":"p"},"finish_class":"failed"}"#;
        set.route(event(end, 2)).await.unwrap();
        set.shutdown().await;
        let log = log.0.lock().unwrap().clone();
        let final_of_s =
            log.iter().position(|l| l == "chat.filtered m/s:2 Some(2)").expect("s's final, caused by the end");
        assert!(final_of_s < at(&log, "pass 2") && at(&log, "pass 2") < at(&log, "closed m/s"), "{log:?}");
    }

    /// And it is handed the table's own copy of its stream's key when it may be kept: not for a
    /// following event, nor for a stream that closed at once (the table keeps no key for it).
    #[tokio::test]
    async fn each_applied_event_is_told_whether_it_opened_followed_or_repeated() {
        let log = Recorder::default();
        let set = ShardSet::start(settings(1), |_| (table(Duration::from_secs(60)), log.clone()));
        for routed in [
            delta("a", "d ", 10),
            delta("a", "d ", 11),
            delta("b", "d ", 12),
            delta("a", "d ", 11), // a redelivery of the last one applied
            delta("a", "d ", 7),  // lower than any applied: a redelivery from before a takeover
            delta("a", "d ", 13),
            fin("a", 14),
            fin("c", 15), // opens and ends its stream at once
        ] {
            set.route(routed).await.unwrap();
        }
        set.shutdown().await;
        let applied = applied_lines(&log);
        let expected = [
            "a 10 Opened shared",
            "a 11 Following",
            "b 12 Opened shared",
            "a 11 Duplicate shared",
            "a 7 Duplicate shared",
            "a 13 Following",
            "a 14 Following",
            "c 15 Opened",
        ];
        assert_eq!(applied, expected.map(|e| format!("applied {e}")));
    }

    /// An `error` that ended its message, delivered again after a segment of the message that
    /// followed it opened, ends nothing and has no open stream of its own: orphaned, not a
    /// duplicate that a sink would hold for a stream.
    #[tokio::test]
    async fn a_repeated_message_end_with_no_open_stream_is_orphaned() {
        let log = Recorder::default();
        let set = ShardSet::start(settings(1), |_| (table(Duration::from_secs(60)), log.clone()));
        let segment = |id: &str, envelope| {
            let json = format!(
                r#"{{"type":"text-delta","meta":{{"message_id":"m"}},"correlation":{{"segment_id":"{id}"}},"delta":"d"}}"#
            );
            event(&json, envelope)
        };
        let error = |envelope| event(r#"{"type":"error","meta":{"message_id":"m"},"error_string":"boom"}"#, envelope);
        for routed in [segment("s1", 1), error(2), segment("s2", 3), error(2)] {
            set.route(routed).await.unwrap();
        }
        set.shutdown().await;
        let applied = applied_lines(&log);
        let expected = ["m/s1 1 Opened shared", "m 2 Following", "m/s2 3 Opened shared", "m 2 Orphaned"];
        assert_eq!(applied, expected.map(|e| format!("applied {e}")));
    }

    #[test]
    fn shard_index_is_stable_and_spread() {
        assert_eq!(shard_index("abc", 8), shard_index("abc", 8));
        let mut hits = [0usize; 4];
        for i in 0..4000 {
            hits[shard_index(&format!("3f2a9c1e-{i:04}-4e8a"), 4)] += 1;
        }
        assert!(hits.iter().all(|&h| h > 800), "{hits:?}");
    }
}
