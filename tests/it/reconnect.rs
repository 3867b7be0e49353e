//! JetStream input across a lost connection. The service pulls from a durable consumer with
//! explicit acks; a delivery the server sent just before the connection dropped, and which the
//! client never read, counts as delivered on the server and comes back only after `ack_wait`.
//! The client reconnects and keeps pulling meanwhile, so the next event of the same stream
//! arrives first. It must not be applied before the lost one: the lost delta has to be in the
//! outputs, in order, without waiting for the redelivery; and when nothing is delivered after it,
//! the replica has to ask the consumer. (The server may also send an event published just after
//! the cut into the old connection before it notices the close, so every test here meets that
//! case now and then.) A TCP proxy between the service and the server loses the delivery on
//! purpose: it discards what the server sends, then cuts the connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use prost::Message as _;
use serde_json::json;
use structured_sink::codec::proto;
use structured_sink::codec::subject::partition_of;
use structured_sink::config::Config;
use structured_sink::service::RunningService;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::scale::{
    consumer_state, downstream, group, mapping, one_partition_config, publish_inputs, read_all, replayed, settle,
};
use crate::service::{test_config, ByStream};
use crate::support::{NatsServer, NatsServerBuilder};

/// One proxied connection: its forwarding task, whether it drops the server's bytes, and whether
/// it drops the client's JetStream acknowledgements.
struct Connection {
    discard: Arc<AtomicBool>,
    drop_acks: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

/// A TCP proxy on 127.0.0.1 in front of a NATS server. Its connections can be told to discard
/// everything the server sends (the client sees a silent connection, the server sees its writes
/// succeed), or the acknowledgements the client sends, and cut. Connections accepted after a cut
/// (the client's reconnects) forward normally.
struct Proxy {
    url: String,
    connections: Arc<Mutex<Vec<Connection>>>,
    /// While set, new connections are closed at once (the server looks unreachable).
    refuse: Arc<AtomicBool>,
    /// While set, every connection drops the client's pull requests to consumers other than the
    /// service's durable ones: a recovery's stream read gets nothing, on a connection that works.
    drop_reads: Arc<AtomicBool>,
    /// The pull requests dropped so.
    reads_dropped: Arc<AtomicU64>,
    /// While set, no byte goes either way on any connection (a network that stalls, with no
    /// connection lost); the bytes wait.
    hold: Arc<AtomicBool>,
    /// Milliseconds every read from the server waits before it is passed on (a slow server).
    delay: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(server: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("nats://{}", listener.local_addr().unwrap());
        let connections: Arc<Mutex<Vec<Connection>>> = Arc::default();
        let accepted = connections.clone();
        let refuse = Arc::new(AtomicBool::new(false));
        let refusing = refuse.clone();
        let hold = Arc::new(AtomicBool::new(false));
        let holding = hold.clone();
        let delay = Arc::new(AtomicU64::new(0));
        let delaying = delay.clone();
        let reads = Reads::default();
        let dropping = reads.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                // Refusing by closing: the client retries, as it would with a server down.
                if refusing.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(server) = TcpStream::connect(server).await else { continue };
                let (discard, drop_acks) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
                let task = tokio::spawn(forward(
                    client,
                    server,
                    [discard.clone(), drop_acks.clone()],
                    dropping.clone(),
                    holding.clone(),
                    delaying.clone(),
                ));
                accepted.lock().unwrap().push(Connection { discard, drop_acks, task });
            }
        });
        let Reads { drop: drop_reads, dropped: reads_dropped } = reads;
        Proxy { url, connections, refuse, drop_reads, reads_dropped, hold, delay, accept }
    }

    /// Drops (`true`) or passes (`false`) the pull requests of recovery reads on every connection,
    /// current and later ones (the pull requests of consumers other than the service's durable
    /// ones, see [`pass_client`]).
    fn drop_reads(&self, drop: bool) {
        self.drop_reads.store(drop, Ordering::SeqCst);
    }

    /// The recovery reads' pull requests dropped so far.
    fn reads_dropped(&self) -> u64 {
        self.reads_dropped.load(Ordering::SeqCst)
    }

    /// Delays every read from the server by `ms` milliseconds, on every connection.
    fn delay(&self, ms: u64) {
        self.delay.store(ms, Ordering::SeqCst);
    }

    /// Stops every byte both ways, without closing anything (`false`: lets them go on).
    fn hold(&self, hold: bool) {
        self.hold.store(hold, Ordering::SeqCst);
    }

    /// Cuts the current connections and refuses new ones (`false`: accepts them again).
    fn cut_off(&self, refuse: bool) {
        self.refuse.store(refuse, Ordering::SeqCst);
        if refuse {
            self.cut();
        }
    }

    /// From now on, the current connections drop every byte the server sends.
    fn discard_server_bytes(&self) {
        for connection in self.connections.lock().unwrap().iter() {
            connection.discard.store(true, Ordering::SeqCst);
        }
    }

    /// From now on, the current connections drop the JetStream acknowledgements the client sends
    /// (publishes to `$JS.ACK.>`); everything else goes through.
    fn drop_acks(&self) {
        for connection in self.connections.lock().unwrap().iter() {
            connection.drop_acks.store(true, Ordering::SeqCst);
        }
    }

    /// Closes the current connections on both sides (dropping a task drops its sockets).
    fn cut(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.task.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Whether the proxy drops recovery reads' pull requests, and how many it dropped (shared by all
/// its connections).
#[derive(Clone, Default)]
struct Reads {
    drop: Arc<AtomicBool>,
    dropped: Arc<AtomicU64>,
}

/// Copies bytes both ways until either side closes, none while `hold` is set; the server's bytes
/// only while `discard[0]` is unset, the client's acknowledgements only while `discard[1]` is,
/// its recovery reads' pull requests only while `reads` says so.
async fn forward(
    client: TcpStream,
    server: TcpStream,
    discard: [Arc<AtomicBool>; 2],
    reads: Reads,
    hold: Arc<AtomicBool>,
    delay: Arc<AtomicU64>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let [discard, drop_acks] = discard;
    tokio::select! {
        () = pass_client(&mut client_read, &mut server_write, &drop_acks, &reads, &hold) => {}
        () = pass(&mut server_read, &mut client_write, &discard, &hold, &delay) => {}
    }
}

/// Copies the client's operations to the server until either closes, whole operations at a time:
/// publishes to `$JS.ACK.>` are dropped while `drop_acks` is set, pull requests of consumers other
/// than the service's durable ones (`structured-sink-p<n>`) while `reads.drop` is; waits while
/// `hold` is set.
async fn pass_client(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    drop_acks: &AtomicBool,
    reads: &Reads,
    hold: &AtomicBool,
) {
    let mut buffer = vec![0; 64 * 1024];
    // Bytes read and not yet passed on: an operation cut short by a read's end.
    let mut pending = Vec::new();
    loop {
        held(hold).await;
        let Some(n) = read_some(from, &mut buffer).await else { break };
        pending.extend_from_slice(&buffer[..n]);
        let (drop_acks, drop_reads) = (drop_acks.load(Ordering::SeqCst), reads.drop.load(Ordering::SeqCst));
        let passed = whole_operations(&mut pending, |subject| {
            if drop_acks && subject.starts_with(b"$JS.ACK.") {
                return true;
            }
            let dropped = drop_reads && is_recovery_read(subject);
            if dropped {
                reads.dropped.fetch_add(1, Ordering::SeqCst);
            }
            dropped
        });
        if to.write_all(&passed).await.is_err() {
            break;
        }
    }
}

/// Whether `subject` is a pull request of a consumer other than the service's durable ones
/// (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, the durable ones `structured-sink-p<n>`).
fn is_recovery_read(subject: &[u8]) -> bool {
    subject
        .strip_prefix(b"$JS.API.CONSUMER.MSG.NEXT.")
        .is_some_and(|rest| !rest.split(|&b| b == b'.').nth(1).unwrap_or_default().starts_with(b"structured-sink-p"))
}

/// Waits while `hold` is set.
async fn held(hold: &AtomicBool) {
    while hold.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads what `from` has into `buffer`: how many bytes, or `None` once it is closed or failed.
async fn read_some(from: &mut (impl tokio::io::AsyncRead + Unpin), buffer: &mut [u8]) -> Option<usize> {
    match from.read(buffer).await {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(n),
    }
}

/// Takes the whole client operations at the start of `pending` (a line, and for `PUB` and `HPUB`
/// the payload the line announces), without the publishes whose subject `dropped` picks.
fn whole_operations(pending: &mut Vec<u8>, mut dropped: impl FnMut(&[u8]) -> bool) -> Vec<u8> {
    let mut passed = Vec::new();
    while let Some(line_end) = pending.windows(2).position(|w| w == b"\r\n") {
        let line = &pending[..line_end];
        let publish = line.starts_with(b"PUB ") || line.starts_with(b"HPUB ");
        let payload = match publish {
            // The last token is the payload's size (for HPUB, headers and body together).
            true => std::str::from_utf8(line).unwrap().rsplit(' ').next().unwrap().parse::<usize>().unwrap() + 2,
            false => 0,
        };
        let end = line_end + 2 + payload;
        if pending.len() < end {
            break;
        }
        if !(publish && line.split(|&b| b == b' ').nth(1).is_some_and(&mut dropped)) {
            passed.extend_from_slice(&pending[..end]);
        }
        pending.drain(..end);
    }
    passed
}

/// Copies bytes from `from` to `to` until either closes: dropped while `discard` is set, waiting
/// while `hold` is.
async fn pass(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    discard: &AtomicBool,
    hold: &AtomicBool,
    delay: &AtomicU64,
) {
    let mut buffer = vec![0; 64 * 1024];
    loop {
        held(hold).await;
        let Some(n) = read_some(from, &mut buffer).await else { break };
        held(hold).await;
        match delay.load(Ordering::SeqCst) {
            0 => {}
            ms => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
        if !discard.load(Ordering::SeqCst) && to.write_all(&buffer[..n]).await.is_err() {
            break;
        }
    }
}

/// A server with one partition, a proxy in front of it, and the configuration of a JetStream
/// replica with one shard worker that connects through the proxy (and reconnects quickly).
async fn proxied() -> (NatsServer, Proxy, Config) {
    proxied_over(1).await
}

/// The same with `partitions` partitions.
async fn proxied_over(partitions: u32) -> (NatsServer, Proxy, Config) {
    proxied_to(NatsServer::builder(), partitions).await
}

/// [`proxied_over`] with a server that has pinned-client priority groups when the test run has
/// one ([`NatsServerBuilder::priority_groups`]).
async fn pinned_proxied_over(partitions: u32) -> (NatsServer, Proxy, Config) {
    proxied_to(NatsServer::builder().priority_groups(), partitions).await
}

async fn proxied_to(server: NatsServerBuilder, partitions: u32) -> (NatsServer, Proxy, Config) {
    let server = server.config(mapping(partitions)).start();
    let proxy = Proxy::start(SocketAddr::from(([127, 0, 0, 1], server.port()))).await;
    let mut config = one_partition_config(&proxy.url);
    config.partitions.count = partitions;
    config.shards.count = 1;
    config.nats.reconnect_delay_max_ms = 200;
    (server, proxy, config)
}

/// Waits until `out` holds `count` messages or more, for at most `limit` (a bound, not a timing
/// assertion: a loaded machine may need long).
async fn stored(out: &mut jetstream::stream::Stream, count: u64, limit: Duration) -> u64 {
    let deadline = Instant::now() + limit;
    loop {
        let messages = out.info().await.unwrap().state.messages;
        if messages >= count || Instant::now() >= deadline {
            return messages;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Loses the delivery of `events[index]`, the next input: it is published while the proxy
/// discards what the server sends, the server delivers it (and counts it as delivered), then the
/// connection is cut. The client reconnects through the proxy, which forwards normally again.
async fn lose_delivery(proxy: &Proxy, js: &jetstream::Context, events: &[(String, String)], index: usize) {
    let mut input = js.get_stream("CHAT_RAW").await.unwrap();
    let mut consumer: jetstream::consumer::PullConsumer = input.get_consumer("structured-sink-p0").await.unwrap();
    proxy.discard_server_bytes();
    publish_inputs(js, events, index..index + 1).await;
    let lost = input.info().await.unwrap().state.last_sequence;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut delivered = 0;
    while delivered < lost && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        delivered = consumer.info().await.unwrap().delivered.stream_sequence;
    }
    assert_eq!(delivered, lost, "the server delivered input {index} into the discarding connection");
    proxy.cut();
}

/// The events of stream `m`: a `partial` per delta, then a `final`.
fn stream_m(deltas: &[&str]) -> Vec<(String, String)> {
    stream_of("m", deltas)
}

/// The events of stream `id`: a `partial` per delta, then a `final`.
fn stream_of(id: &str, deltas: &[&str]) -> Vec<(String, String)> {
    deltas.iter().map(|delta| partial(id, delta)).chain([final_of(id)]).collect()
}

/// A `partial` of message `id` with `delta`, as (message id, event JSON).
fn partial(id: &str, delta: &str) -> (String, String) {
    (id.to_owned(), json!({"type": "partial", "meta": {"message_id": id}, "delta": delta}).to_string())
}

/// A `final` of message `id`, without text.
fn final_of(id: &str) -> (String, String) {
    (id.to_owned(), json!({"type": "final", "meta": {"message_id": id}}).to_string())
}

/// `dead` is one dead letter: a late delta ("late "), with reason `stream_finished`.
fn assert_one_late_dead_letter(dead: &[async_nats::Message]) {
    assert_eq!(dead.len(), 1, "the late event dead-lettered once: {dead:?}");
    let reason = dead[0].headers.as_ref().and_then(|h| h.get("Structured-Sink-Error")).map(|v| v.to_string());
    assert_eq!(reason.as_deref(), Some("stream_finished"));
    assert!(dead[0].payload.windows(5).any(|w| w == b"late "), "{:?}", dead[0].payload);
}

/// What replay gives for `events`, and what `out` holds (deduplicated by `Nats-Msg-Id`) once it
/// holds as many outputs, both grouped by stream.
async fn replayed_and_stored(
    server: &NatsServer,
    out: &mut jetstream::stream::Stream,
    events: &[(String, String)],
) -> (ByStream, ByStream) {
    let expected = replayed(&test_config(&server.url()), events);
    let total: usize = expected.values().map(Vec::len).sum();
    let got = read_all(out, total).await;
    (expected, group(&got))
}

/// The `FilteredText` stored last on `chat.filtered` in `out`, if any.
async fn last_filtered(out: &jetstream::stream::Stream) -> Option<proto::FilteredText> {
    let message = out.get_last_raw_message_by_subject("chat.filtered").await.ok()?;
    Some(proto::FilteredText::decode(message.payload).unwrap())
}

/// Stream `m`: "A " is applied; "B " is delivered into a connection that discards it and is then
/// cut; "C " and the final come after the reconnect. The final text must be "A B C " (it was
/// "A C ": "B " came back after `ack_wait`, as a late duplicate).
#[tokio::test]
async fn a_delivery_lost_with_the_connection_is_applied_in_order() {
    let default_tick = structured_sink::config::Config::default().shards.expiry_tick_ms;
    a_delivery_lost_with_the_connection_is_applied_in_order_with(default_tick, 0).await;
}

/// The same with a server that answers slower (30 ms) than the expiry tick (10 ms): the input
/// task applies events itself here (one source, one shard), and its tick dropped the source's
/// wait, API call and all, so the recovery's consumer lookup started again every tick and never
/// finished: the partition stalled.
#[tokio::test]
async fn a_delivery_lost_with_the_connection_is_applied_in_order_when_the_server_is_slower_than_the_tick() {
    a_delivery_lost_with_the_connection_is_applied_in_order_with(10, 30).await;
}

async fn a_delivery_lost_with_the_connection_is_applied_in_order_with(expiry_tick_ms: u64, server_delay_ms: u64) {
    let (server, proxy, mut config) = proxied().await;
    config.shards.expiry_tick_ms = expiry_tick_ms;
    let service = RunningService::start(config).await.unwrap();
    proxy.delay(server_delay_ms);
    // The test's own clients talk to the server directly.
    let (_client, js, mut out) = downstream(&server.url()).await;
    let events = stream_m(&["A ", "B ", "C "]);

    publish_inputs(&js, &events, 0..1).await;
    let before = stored(&mut out, 1, Duration::from_secs(30)).await;
    assert_eq!(before, 1, "the output of \"A \" stored before the drop");
    // "B " stays pending on the server until ack_wait (60 s), which the test does not wait for.
    lose_delivery(&proxy, &js, &events, 1).await;
    publish_inputs(&js, &events, 2..events.len()).await;

    let text = final_text(&out, Duration::from_secs(90)).await;
    assert_eq!(text.as_deref(), Some("A B C "), "the final text of m, every delta in order");

    // Everything stored downstream (deduplicated by Nats-Msg-Id) is what replay gives.
    let (expected, got) = replayed_and_stored(&server, &mut out, &events).await;
    service.shutdown().await.unwrap();
    assert_eq!(got, expected);
}

/// The text of the final `FilteredText` stored in `out`, once there is one, or `None` after
/// `limit`.
async fn final_text(out: &jetstream::stream::Stream, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(last) = last_filtered(out).await.filter(|t| t.r#final) {
            return Some(last.text);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Stream `m` as in [`a_delivery_lost_with_the_connection_is_applied_in_order`], with the
/// recovery's read of the stream stalled on a connection that works: the proxy drops the read's
/// pull request, so the read gets neither messages nor heartbeats. After five seconds without a
/// message (`REBUILD_IDLE`) the replica opens the read again, and the rebuild ends. Left to
/// itself, the client's ordered read recovers only once it has missed two 15 s heartbeats and
/// recreates its consumer (the test took 61 s with `REBUILD_IDLE` raised to two minutes): the
/// bound here, 20 s after the proxy lets reads through again, lies between the two.
#[tokio::test]
async fn a_recovery_read_that_stalls_is_opened_again() {
    let (server, proxy, config) = proxied().await;
    let service = RunningService::start(config).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let events = stream_m(&["A ", "B ", "C "]);

    publish_inputs(&js, &events, 0..1).await;
    assert_eq!(stored(&mut out, 1, Duration::from_secs(30)).await, 1, "the output of \"A \" stored first");
    proxy.drop_reads(true);
    lose_delivery(&proxy, &js, &events, 1).await;
    // The delivery of "C " shows the loss of "B ": the recovery opens its read of the stream.
    publish_inputs(&js, &events, 2..events.len()).await;
    let dropped = settle(|| async { proxy.reads_dropped() }, |&n| n > 0).await;
    assert!(dropped > 0, "the recovery's read sent a pull request, which the proxy dropped");
    proxy.drop_reads(false);

    let text = final_text(&out, Duration::from_secs(20)).await;
    assert_eq!(text.as_deref(), Some("A B C "), "the final text of m, once the read was opened again");
    let (expected, got) = replayed_and_stored(&server, &mut out, &events).await;
    service.shutdown().await.unwrap();
    assert_eq!(got, expected);
}

/// Message `m` in segments: `s1` opens, an `error` naming no segment ends it with the message,
/// then `s2` of the same message opens. The replica's acknowledgements are lost from the error on
/// (the proxy drops them until it cuts the connection), so the server delivers the three events
/// again after `ack_wait`. The error's redelivery ends nothing (`s2` applied later input) and its own
/// stream (`m`) is not open: it was held as if it anchored an open stream, in an entry nothing
/// ever released (one more per such redelivery), and acknowledged only by a delivery after `s2`
/// had ended (late by then), one `ack_wait` later.
#[tokio::test]
async fn a_repeated_message_end_whose_stream_is_not_open_is_acknowledged() {
    let (server, proxy, mut config) = proxied().await;
    config.jetstream.ack_wait_ms = 1_000;
    let service = RunningService::start(config).await.unwrap();
    let (_client, js, _out) = downstream(&server.url()).await;
    let segment = |id: &str, rest: &str| {
        let json = format!(r#"{{"meta":{{"message_id":"m"}},"correlation":{{"segment_id":"{id}"}},{rest}}}"#);
        ("m".to_owned(), json)
    };
    let events = [
        segment("s1", r#""type":"text-delta","delta":"a ""#),
        ("m".to_owned(), r#"{"type":"error","meta":{"message_id":"m"},"error_string":"boom"}"#.to_owned()),
        segment("s2", r#""type":"text-delta","delta":"b ""#),
        segment("s2", r#""type":"text-segment-finished","text":"b ""#),
    ];
    let input = js.get_stream("CHAT_RAW").await.unwrap();
    let metrics = service.metrics();
    let received = |count: u64| {
        let metrics = metrics.clone();
        async move {
            let received = settle(|| async { metrics.snapshot().events_received }, |&n| n >= count).await;
            assert!(received >= count, "{count} events received, not {received}");
        }
    };
    publish_inputs(&js, &events, 0..1).await;
    received(1).await;
    proxy.drop_acks();
    publish_inputs(&js, &events, 1..3).await;
    received(3).await;
    // The client reconnects, through a connection that drops nothing.
    proxy.cut();
    // Delivered again after `ack_wait`: s1's delta (late, acknowledged), the error, s2's delta.
    received(6).await;
    // (ack floor, acks pending) once they are `expected`, or as they stand after a bound.
    let acknowledged = |expected: (u64, usize)| {
        let input = &input;
        async move {
            let state = settle(|| consumer_state(input, 0), |&(floor, pending, _)| (floor, pending) == expected).await;
            (state.0, state.1)
        }
    };
    assert_eq!(acknowledged((2, 1)).await, (2, 1), "while s2 is open, only its first event is unacknowledged");
    publish_inputs(&js, &events, 3..4).await;
    assert_eq!(acknowledged((4, 0)).await, (4, 0), "every input acknowledged once s2 ended");
    service.shutdown().await.unwrap();
}

/// Stream `m`: "A " is applied; "B ", the last input for now, is delivered into a connection that
/// discards it and is then cut. No later delivery shows the gap, so the replica must ask the
/// consumer once the partition goes quiet after the reconnect: "B " is applied without waiting for
/// the redelivery (after `ack_wait_ms`, ten minutes here, beyond the test's bound).
#[tokio::test]
async fn a_delivery_lost_with_the_connection_at_the_end_of_the_input_is_applied() {
    let (server, proxy, mut config) = proxied().await;
    config.jetstream.ack_wait_ms = 600_000;
    let service = RunningService::start(config).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let events = stream_m(&["A ", "B "]);

    publish_inputs(&js, &events, 0..1).await;
    assert_eq!(stored(&mut out, 1, Duration::from_secs(30)).await, 1, "the output of \"A \" stored before the drop");
    lose_delivery(&proxy, &js, &events, 1).await;
    let after = stored(&mut out, 2, Duration::from_secs(60)).await;
    assert_eq!(after, 2, "the output of the lost \"B \" stored without a later delivery or a redelivery");
    assert_eq!(last_filtered(&out).await.map(|t| t.delta).as_deref(), Some("B "));

    publish_inputs(&js, &events, 2..3).await;
    let (expected, got) = replayed_and_stored(&server, &mut out, &events).await;
    service.shutdown().await.unwrap();
    assert_eq!(got, expected);
}

/// `jetstream.pinned_client`: replica 0 owns the one partition and reaches the server through the
/// proxy; replica 1 stands by. Replica 0 applies "A " of stream `m`, then is cut off for longer
/// than `pinned_ttl_ms`: the server pins the partition to replica 1, which rebuilds `m` from the
/// ack floor. When replica 0 is back, it must find the pin gone and give `m` up: before, it kept
/// `m` open and closed it after `shards.idle_timeout_ms` as expired, with a final under the id of
/// replica 1's next output of `m` ("m:2"), which downstream deduplication then kept in place of
/// replica 1's "B ". (Needs nats-server 2.11 or later; with an older one, start-up must refuse
/// `pinned_client`.)
#[tokio::test]
async fn a_replica_that_lost_its_pin_while_cut_off_gives_up_its_open_streams() {
    lose_the_pin(1, |proxy, off| proxy.cut_off(off)).await;
}

/// The same with two partitions, replica 1 owning partition 1, where the stream is: the streams
/// given up are those of the partition whose pin was lost, as its consumer delivered them (an
/// event not tagged with its partition would look like partition 0's).
#[tokio::test]
async fn a_replica_that_lost_the_pin_of_its_partition_1_gives_up_that_partitions_streams() {
    lose_the_pin(2, |proxy, off| proxy.cut_off(off)).await;
}

/// The same when the network only stalls: nothing goes either way for longer than
/// `pinned_ttl_ms`, and then everything held up arrives, on the same connection. No reconnect
/// tells replica 0 anything: it must look at the pin after `pinned_ttl_ms` without a delivery.
#[tokio::test]
async fn a_replica_whose_pin_lapsed_without_a_reconnect_gives_up_its_open_streams() {
    lose_the_pin(1, |proxy, off| proxy.hold(off)).await;
}

/// The replica owning the last of `partitions` partitions (replica 0 of the one partition,
/// replica 1 of partition 1 of two) loses its pin while `isolate(proxy, true)` keeps it from the
/// server (see [`a_replica_that_lost_its_pin_while_cut_off_gives_up_its_open_streams`]); the
/// stream is in that partition.
async fn lose_the_pin(partitions: u32, isolate: impl Fn(&Proxy, bool)) {
    assert!((1..=2).contains(&partitions), "one replica per partition, two at most");
    let (server, proxy, mut config) = pinned_proxied_over(partitions).await;
    if crate::scale::lacks_priority_groups(&server).await {
        return;
    }
    let partition = partitions - 1;
    config.jetstream.pinned_client = true;
    // Both replicas stand by for that partition only: the owner must hold no pin of another one
    // (with two partitions, it would otherwise pull partition 0 too, and could lose a pin there
    // as well; giving partition 0 up would then hide an event tagged with the wrong partition).
    config.jetstream.standby = vec![partition.to_string()];
    config.jetstream.pinned_ttl_ms = 2_000;
    config.partitions.replica_count = 2;
    config.partitions.replica_index = partition;
    // Long enough for the owner to be back and find the pin gone before the stream would expire.
    config.shards.idle_timeout_ms = 15_000;
    let mut standby = config.clone();
    standby.nats.servers = vec![server.url()];
    standby.partitions.replica_index = 1 - partition;
    let owner = RunningService::start(config).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let id = std::iter::once("m".to_owned())
        .chain((0..).map(|i| format!("m{i}")))
        .find(|id| partition_of(id, partitions) == partition)
        .expect("some id is in every partition");
    let events = stream_of(&id, &["A ", "B "]);

    publish_inputs(&js, &events, 0..1).await;
    assert_eq!(stored(&mut out, 1, Duration::from_secs(30)).await, 1, "\"A \" applied by the owner");
    let applied = Instant::now();
    // Only now: the owner holds the pin, whatever the timing of the standby's first pull.
    let standby = RunningService::start(standby).await.unwrap();
    let input = js.get_stream("CHAT_RAW").await.unwrap();
    let pin = |pins: Vec<Option<String>>| pins[partition as usize].clone();
    let pinned = pin(crate::scale::pins(&input, partitions).await);
    assert!(pinned.is_some(), "the owner holds the pin");
    // The owner may look at the consumer once after its first pull stream opens and the
    // partition goes quiet (a second or two): let that pass, so that only what follows the
    // isolation can tell it the pin has moved.
    tokio::time::sleep(Duration::from_secs(3)).await;
    isolate(&proxy, true);
    let deadline = Instant::now() + Duration::from_secs(30);
    while pin(crate::scale::pins(&input, partitions).await) == pinned {
        assert!(Instant::now() < deadline, "the owner's pin lapsed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    isolate(&proxy, false);
    // Past the moment the owner would have expired the stream (the idle timeout and a tick of 1 s).
    tokio::time::sleep_until((applied + Duration::from_millis(15_000 + 3_000)).into()).await;
    publish_inputs(&js, &events, 1..3).await;

    let (expected, got) = replayed_and_stored(&server, &mut out, &events).await;
    let given_up = owner.metrics().snapshot().streams_closed["handed_over"];
    standby.shutdown().await.unwrap();
    owner.shutdown().await.unwrap();
    assert_eq!(got, expected, "the standby's outputs of {id}, none of the owner's after the takeover");
    assert_eq!(given_up, 1, "the owner handed {id} over");
}

/// A pass-through event lost the same way is forwarded once: by the read of the partition that
/// the gap starts, not again when the consumer redelivers it (after `ack_wait_ms`, here 2 s;
/// beyond a downstream duplicate window in a deployment).
#[tokio::test]
async fn a_pass_through_event_lost_with_the_connection_is_forwarded_once() {
    let (server, proxy, mut config) = proxied().await;
    config.jetstream.ack_wait_ms = 2_000;
    config.input.pass_through_subject = "chat.passthrough".into();
    let service = RunningService::start(config).await.unwrap();
    let (client, js, mut out) = downstream(&server.url()).await;
    let mut passed = client.subscribe("chat.passthrough").await.unwrap();
    client.flush().await.unwrap();
    let input = js.get_stream("CHAT_RAW").await.unwrap();
    let mut consumer: jetstream::consumer::PullConsumer = input.get_consumer("structured-sink-p0").await.unwrap();

    let event = |e: serde_json::Value| ("m".to_owned(), e.to_string());
    let events = [
        event(json!({"type": "partial", "meta": {"message_id": "m"}, "delta": "A "})),
        event(json!({"type": "tool-call", "meta": {"message_id": "m"}, "name": "search"})),
        event(json!({"type": "final", "meta": {"message_id": "m"}, "text": "A "})),
    ];
    publish_inputs(&js, &events, 0..1).await;
    stored(&mut out, 1, Duration::from_secs(30)).await;
    lose_delivery(&proxy, &js, &events, 1).await;
    publish_inputs(&js, &events, 2..3).await;
    // Until everything is acknowledged, the lost event's redelivery included.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let info = consumer.info().await.unwrap();
        if info.ack_floor.stream_sequence == 3 && info.num_ack_pending == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "every input acknowledged: {info:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let forwarded = crate::service::collect(&mut passed, Duration::from_millis(500), |_| false).await;
    service.shutdown().await.unwrap();
    assert_eq!(forwarded.len(), 1, "forwarded once: {forwarded:?}");
}

/// A late event (its stream had already finished here) lost the same way is dead-lettered, as it
/// would have been on arrival: the read takes what was lost on the way as first deliveries, and
/// only what this replica had processed itself as redeliveries.
#[tokio::test]
async fn a_late_event_lost_with_the_connection_is_dead_lettered() {
    let (server, proxy, config) = proxied().await;
    let service = RunningService::start(config).await.unwrap();
    let (client, js, mut out) = downstream(&server.url()).await;
    let mut dead_letters = client.subscribe("chat.dlq").await.unwrap();
    client.flush().await.unwrap();

    let events = [partial("m", "A "), final_of("m"), partial("m", "late "), partial("n", "B ")];
    publish_inputs(&js, &events, 0..2).await;
    // `m`'s delta and final.
    stored(&mut out, 2, Duration::from_secs(30)).await;
    lose_delivery(&proxy, &js, &events, 2).await;
    publish_inputs(&js, &events, 3..4).await;
    // `n`'s delta: the gap has been seen and the partition read again.
    stored(&mut out, 3, Duration::from_secs(90)).await;
    let dead = crate::service::collect(&mut dead_letters, Duration::from_secs(2), |_| false).await;
    service.shutdown().await.unwrap();
    assert_one_late_dead_letter(&dead);
}

/// `jetstream.pinned_client`: a late event that the previous owner never processed is
/// dead-lettered by the replica that takes the partition over. Replica 0 applies `o`'s first
/// delta (held unacknowledged, so the ack floor stays below everything after it) and `m` to its
/// final; a late delta of `m` is then delivered into its connection, which discards it, and
/// replica 0 is cut off until the pin moves. Replica 1's takeover read finds the late delta after
/// `m`'s final. Before the fix it acknowledged it without a dead letter, taking every message
/// read at a takeover for one the previous owner had processed: the late event was in no dead
/// letter. (Needs
/// nats-server 2.11 or later; with an older one, start-up must refuse `pinned_client`.)
#[tokio::test]
async fn a_late_event_the_previous_owner_never_processed_is_dead_lettered_at_the_takeover() {
    let (server, proxy, mut config) = pinned_proxied_over(1).await;
    if crate::scale::lacks_priority_groups(&server).await {
        return;
    }
    config.jetstream.pinned_client = true;
    config.jetstream.pinned_ttl_ms = 2_000;
    config.partitions.replica_count = 2;
    let mut standby = config.clone();
    standby.nats.servers = vec![server.url()];
    standby.partitions.replica_index = 1;
    let owner = RunningService::start(config).await.unwrap();
    let (client, js, mut out) = downstream(&server.url()).await;
    let mut dead_letters = client.subscribe("chat.dlq").await.unwrap();
    client.flush().await.unwrap();
    let events = [partial("o", "x "), partial("m", "A "), final_of("m"), partial("m", "late "), partial("n", "B ")];
    publish_inputs(&js, &events, 0..3).await;
    assert_eq!(stored(&mut out, 3, Duration::from_secs(30)).await, 3, "o's delta, m's delta and final");
    let standby = RunningService::start(standby).await.unwrap();
    let input = js.get_stream("CHAT_RAW").await.unwrap();
    let pinned = crate::scale::pins(&input, 1).await[0].clone();
    assert!(pinned.is_some(), "replica 0 holds the pin");

    // The late delta goes into replica 0's connection and no further; then replica 0 is cut off.
    let mut consumer: jetstream::consumer::PullConsumer = input.get_consumer("structured-sink-p0").await.unwrap();
    proxy.discard_server_bytes();
    publish_inputs(&js, &events, 3..4).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while consumer.info().await.unwrap().delivered.stream_sequence < 4 {
        assert!(Instant::now() < deadline, "the late delta delivered into replica 0's connection");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.cut_off(true);
    let deadline = Instant::now() + Duration::from_secs(30);
    while crate::scale::pins(&input, 1).await[0] == pinned {
        assert!(Instant::now() < deadline, "replica 0's pin lapsed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Replica 1's first delivery, under its new pin, starts the takeover read.
    publish_inputs(&js, &events, 4..5).await;
    assert_eq!(stored(&mut out, 4, Duration::from_secs(60)).await, 4, "n's delta, from replica 1");
    let dead = crate::service::collect(&mut dead_letters, Duration::from_secs(2), |_| false).await;
    proxy.cut_off(false);
    standby.shutdown().await.unwrap();
    owner.shutdown().await.unwrap();
    // By replica 1: replica 0 never read it.
    assert_one_late_dead_letter(&dead);
}
