//! Horizontal scale and durability against real servers: partitions over three replicas, and
//! JetStream input surviving a `kill -9` of the replica, a server restart and a cluster node loss.
//! Every check compares what downstream receives with the offline `replay` of the same input.
//! Durability checks read downstream from a JetStream stream, so "received" means stored.

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, message::PublishMessage};
use futures::StreamExt;
use prost::Message as _;
use serde_json::Value;
use structured_sink::codec::subject::escape_token;
use structured_sink::config::{Config, PartitionMode};
use structured_sink::service::RunningService;

use crate::service::{as_json, test_config, ByStream};
use crate::support::NatsServer;

/// The server mapping of `chat.raw.<id>` to `chat.raw.p.<partition>.<id>`.
pub(crate) fn mapping(partitions: u32) -> String {
    format!("mappings = {{ \"chat.raw.*\": \"chat.raw.p.{{{{partition({partitions},1)}}}}.{{{{wildcard(1)}}}}\" }}\n")
}

/// `streams` interleaved synthetic conversations: prose, a block, thinking; then a final each.
fn conversation(streams: usize, deltas: usize) -> Vec<(String, String)> {
    let mut events = Vec::new();
    let text = |s: usize, d: usize| match d % 7 {
        2 => format!("<myapp:ModeSwitch:v1>\nnew_mode: m{s}\n</myapp:ModeSwitch:v1>"),
        4 => "<thinking>hm</thinking>".to_owned(),
        _ => format!("s{s}d{d} "),
    };
    for d in 0..deltas {
        for s in 0..streams {
            let id = format!("msg-{s:04}");
            let event = serde_json::json!({"type": "partial", "meta": {"message_id": id}, "delta": text(s, d)});
            events.push((id, event.to_string()));
        }
    }
    for s in 0..streams {
        let id = format!("msg-{s:04}");
        let event = serde_json::json!({"type": "final", "meta": {"message_id": id}});
        events.push((id, event.to_string()));
    }
    events
}

/// What `replay` publishes for `events`, per stream, in order: (subject, message JSON). Every
/// event must be one replay accepts.
pub(crate) fn replayed(config: &Config, events: &[(String, String)]) -> ByStream {
    let input: String = events.iter().map(|(_, e)| format!("{e}\n")).collect();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let summary = structured_sink::replay::replay(config, input.as_bytes(), &mut out, &mut err).unwrap();
    assert_eq!(summary.rejected, 0, "replay rejected input: {}", String::from_utf8_lossy(&err));
    let mut map = ByStream::new();
    for line in String::from_utf8(out).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let stream = v["message"]["stream"]["stream_id"].as_str().unwrap().to_owned();
        map.entry(stream).or_default().push((v["subject"].as_str().unwrap().to_owned(), v["message"].clone()));
    }
    map
}

pub(crate) fn group(messages: &[async_nats::Message]) -> ByStream {
    let mut map = ByStream::new();
    for m in messages {
        let json = as_json(m);
        let stream = json["stream"]["stream_id"].as_str().unwrap().to_owned();
        map.entry(stream).or_default().push((m.subject.to_string(), json));
    }
    map
}

/// Like [`group`], each stream's outputs in `seq` order: after a server restart or a node loss an
/// output whose storage was not confirmed is published again and may be stored after later
/// outputs of its stream (consumers order by `seq`).
fn group_by_seq(messages: &[async_nats::Message]) -> ByStream {
    let mut map = group(messages);
    for outputs in map.values_mut() {
        outputs.sort_by_key(|(_, m)| m["seq"].as_str().and_then(|s| s.parse::<u64>().ok()));
    }
    map
}

fn partitioned(url: &str, count: u32, index: u32, replicas: u32) -> Config {
    let mut config = test_config(url);
    config.http.enabled = false;
    config.partitions.mode = PartitionMode::Subject;
    config.partitions.count = count;
    config.partitions.replica_index = index;
    config.partitions.replica_count = replicas;
    config
}

#[tokio::test]
async fn three_replicas_split_the_streams_and_match_replay() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let mut replicas = Vec::new();
    for index in 0..3 {
        replicas.push(RunningService::start(partitioned(&server.url(), 8, index, 3)).await.unwrap());
    }
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut outputs = client.subscribe("chat.>").await.unwrap();
    client.flush().await.unwrap();

    let events = conversation(300, 8);
    for (id, event) in &events {
        client.publish(format!("chat.raw.{}", escape_token(id)), event.clone().into()).await.unwrap();
    }
    let expected = replayed(&test_config(&server.url()), &events);
    let total: usize = expected.values().map(Vec::len).sum();
    let is_output = |m: &async_nats::Message| !m.subject.starts_with("chat.raw.");
    let got = crate::service::collect(&mut outputs, Duration::from_secs(10), |ms| {
        ms.iter().filter(|m| is_output(m)).count() >= total
    })
    .await;
    let got: Vec<async_nats::Message> = got.into_iter().filter(is_output).collect();

    let opened: Vec<u64> = replicas.iter().map(|r| r.metrics().snapshot().streams_opened).collect();
    for replica in replicas {
        replica.shutdown().await.unwrap();
    }
    assert_eq!(opened.iter().sum::<u64>(), 300, "each stream opened by exactly one replica: {opened:?}");
    assert!(opened.iter().all(|&n| n > 50), "the partitions spread the load: {opened:?}");
    let ids: Vec<String> =
        got.iter().map(|m| m.headers.as_ref().unwrap().get("Nats-Msg-Id").unwrap().to_string()).collect();
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "no output twice");
    assert_eq!(group(&got), expected);
}

/// Subject mode: an event published straight to a partition subject must carry its message id as
/// the last token and that id's partition before it; otherwise two replicas could each keep a
/// stream of that id. Only the last token was checked: one in the wrong partition was applied.
#[tokio::test]
async fn subject_mode_dead_letters_an_event_on_another_partitions_subject() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let service = RunningService::start(partitioned(&server.url(), 8, 0, 1)).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut dlq = client.subscribe("chat.dlq").await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    let own = structured_sink::codec::subject::partition_of("m", 8);
    let event = r#"{"type":"partial","meta":{"message_id":"m"},"delta":"x"}"#;
    for subject in
        [format!("chat.raw.p.{}.m", (own + 1) % 8), "chat.raw.p.0.other".to_owned(), format!("chat.raw.p.{own}.m")]
    {
        client.publish(subject, event.into()).await.unwrap();
    }
    let dead = crate::service::collect(&mut dlq, Duration::from_secs(10), |ms| ms.len() == 2).await;
    let out = crate::service::collect(&mut filtered, Duration::from_secs(10), |ms| !ms.is_empty()).await;
    service.shutdown().await.unwrap();
    let reasons: Vec<(String, String)> = dead
        .iter()
        .map(|m| {
            let reason = m.headers.as_ref().unwrap().get("Structured-Sink-Error").unwrap().to_string();
            (m.subject.to_string(), reason)
        })
        .collect();
    let expected = ("chat.dlq".to_owned(), "invalid_message_id".to_owned());
    assert_eq!(reasons, [expected.clone(), expected]);
    assert_eq!(out.len(), 1, "only the event on its own partition's subject is applied");
}

#[tokio::test]
async fn filter_mode_agrees_with_the_server_partitions() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let mut replicas = Vec::new();
    for index in 0..2 {
        let mut config = partitioned(&server.url(), 8, index, 2);
        config.partitions.mode = PartitionMode::Filter;
        replicas.push(RunningService::start(config).await.unwrap());
    }
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    // What the server's mapping says about each id: the partition subject it lands on.
    let mut mapped = client.subscribe("chat.raw.p.*.*").await.unwrap();
    client.flush().await.unwrap();
    let events = conversation(100, 1);
    for (id, event) in &events {
        client.publish("chat", event.clone().into()).await.unwrap();
        client.publish(format!("chat.raw.{}", escape_token(id)), "".into()).await.unwrap();
    }
    let got = crate::service::collect(&mut filtered, Duration::from_secs(10), |ms| {
        ms.iter().filter(|m| as_json(m)["final"] == true).count() == 100
    })
    .await;
    let server_partition: BTreeMap<String, u32> =
        crate::service::collect(&mut mapped, Duration::from_secs(5), |ms| ms.len() == 200)
            .await
            .iter()
            .map(|m| {
                let tokens: Vec<&str> = m.subject.split('.').collect();
                (tokens[4].to_owned(), tokens[3].parse().unwrap())
            })
            .collect();
    let opened: Vec<u64> = replicas.iter().map(|r| r.metrics().snapshot().streams_opened).collect();
    for replica in replicas {
        replica.shutdown().await.unwrap();
    }
    assert_eq!(opened.iter().sum::<u64>(), 100, "{opened:?}");
    // Replica 0 owns the even partitions: exactly the ids the server put in even partitions.
    let even = server_partition.values().filter(|p| *p % 2 == 0).count() as u64;
    assert_eq!(opened[0], even);
    assert_eq!(got.len(), 200);
}

#[tokio::test]
async fn start_up_stops_when_the_server_has_no_partition_mapping() {
    let server = NatsServer::start();
    let error = RunningService::start(partitioned(&server.url(), 8, 0, 1)).await.err().expect("no mapping");
    assert!(error.to_string().contains("chat.raw.p.{{partition(8,1)}}"), "{error}");
}

/// The tags of [`test_config`], as a configuration file for a replica process.
const TAGS_TOML: &str = r#"
[[tags]]
name = "thinking"
kind = "channel"
[[tags]]
name = "tool"
kind = "tool_call"
[[tags]]
name = "myapp:ModeSwitch:v1"
kind = "block"
[[tags]]
name = "geppetto:citations:v1"
kind = "block"
"#;

/// A `structured-sink serve` process in JetStream mode, owning all 8 partitions.
fn spawn_replica(url: &str, dir: &std::path::Path) -> Child {
    replica_command(url, dir).spawn().unwrap()
}

/// A `structured-sink serve` process in JetStream mode with `jetstream.pinned_client` and
/// `shards` shard workers: replica `index` of 2 owns the partitions `p % 2 == index` of
/// `partitions` and stands by for the others.
fn spawn_pinned_replica(url: &str, dir: &std::path::Path, index: u32, partitions: u32, shards: u32) -> Child {
    replica_command(url, dir)
        .env("STRUCTURED_SINK__PARTITIONS__COUNT", partitions.to_string())
        .env("STRUCTURED_SINK__SHARDS__COUNT", shards.to_string())
        .env("STRUCTURED_SINK__PARTITIONS__REPLICA_INDEX", index.to_string())
        .env("STRUCTURED_SINK__PARTITIONS__REPLICA_COUNT", "2")
        .env("STRUCTURED_SINK__JETSTREAM__PINNED_CLIENT", "true")
        .env("STRUCTURED_SINK__JETSTREAM__PINNED_TTL_MS", PINNED_TTL_MS.to_string())
        // Short, so that the test also sees the killed replica's messages redelivered to the
        // standby after its takeover read them from the stream (and acknowledged as duplicates).
        .env("STRUCTURED_SINK__JETSTREAM__ACK_WAIT_MS", "10000")
        .spawn()
        .unwrap()
}

/// The pin TTL of [`spawn_pinned_replica`]: the takeover delay after a `kill -9`.
const PINNED_TTL_MS: u64 = 3_000;

fn replica_command(url: &str, dir: &std::path::Path) -> Command {
    let config = dir.join("replica.toml");
    std::fs::write(&config, TAGS_TOML).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_structured-sink"));
    command
        .arg("--config")
        .arg(&config)
        .arg("serve")
        .env_remove("STRUCTURED_SINK_CONFIG")
        .env("STRUCTURED_SINK__NATS__SERVERS", format!("[\"{url}\"]"))
        .env("STRUCTURED_SINK__HTTP__ENABLED", "false")
        .env("STRUCTURED_SINK__PARTITIONS__MODE", "subject")
        .env("STRUCTURED_SINK__PARTITIONS__COUNT", "8")
        .env("STRUCTURED_SINK__JETSTREAM__ENABLED", "true")
        .env("STRUCTURED_SINK__JETSTREAM__ACK_WAIT_MS", "60000")
        .env("STRUCTURED_SINK__SHARDS__COUNT", "2")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

/// A client of `url`, its JetStream context, and a downstream JetStream stream over every output
/// subject, deduplicating by `Nats-Msg-Id`.
pub(crate) async fn downstream(url: &str) -> (async_nats::Client, jetstream::Context, jetstream::stream::Stream) {
    let client = async_nats::connect(url).await.unwrap();
    let js = jetstream::new(client.clone());
    let out = js
        .get_or_create_stream(jetstream::stream::Config {
            name: "OUT".into(),
            subjects: vec![
                "chat.filtered".into(),
                "chat.structured.>".into(),
                "chat.thinking".into(),
                "chat.tools".into(),
            ],
            duplicate_window: Duration::from_secs(300),
            ..Default::default()
        })
        .await
        .unwrap();
    (client, js, out)
}

/// Waits until `stream` holds `total` messages (or a deadline), then reads every stored message
/// by its stream sequence, in order. Each JetStream API call is retried: after a node loss the
/// stream may be electing a leader. (An ordered consumer read with a 5 s timeout per message
/// stopped early after a node loss: 2,014 of 2,200 stored outputs read, the rest reported as
/// missing.)
pub(crate) async fn read_all(stream: &mut jetstream::stream::Stream, total: usize) -> Vec<async_nats::Message> {
    // Bounds, not timing assertions: a loaded machine may need long.
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut state = None;
    while Instant::now() < deadline {
        if let Ok(info) = stream.info().await {
            let complete = info.state.messages as usize >= total;
            state = Some(info.state.clone());
            if complete {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let state = state.expect("the downstream stream answers");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got = Vec::new();
    for sequence in state.first_sequence..=state.last_sequence {
        loop {
            match stream.get_raw_message(sequence).await {
                Ok(m) => {
                    got.push(async_nats::Message {
                        subject: m.subject,
                        reply: None,
                        length: m.payload.len(),
                        payload: m.payload,
                        headers: Some(m.headers),
                        status: None,
                        description: None,
                    });
                    break;
                }
                // A deleted message leaves a gap in the sequence (nothing deletes here).
                Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => break,
                Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(e) => panic!("cannot read message {sequence} of the downstream stream: {e}"),
            }
        }
    }
    got
}

/// Publishes `events[range]` durably: each a JetStream publish with the `Nats-Msg-Id`
/// `input-<index>`, retried until the server acknowledges it. The id matters when a server stops:
/// an event stored just before its acknowledgement was lost is published again, and without the
/// id the stream would store it twice, so the service would apply its text twice.
pub(crate) async fn publish_inputs(js: &jetstream::Context, events: &[(String, String)], range: Range<usize>) {
    for index in range {
        let (id, event) = &events[index];
        let subject = format!("chat.raw.{}", escape_token(id));
        let mut stored = false;
        for _ in 0..100 {
            let message = PublishMessage::build().payload(event.clone().into()).message_id(format!("input-{index}"));
            if let Ok(ack) = js.send_publish(subject.clone(), message).await {
                if ack.await.is_ok() {
                    stored = true;
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(stored, "input {index} not stored");
    }
}

/// [`jetstream_config`] over one partition.
pub(crate) fn one_partition_config(url: &str) -> Config {
    let mut config = jetstream_config(url);
    config.partitions.count = 1;
    config
}

/// A consumer that exists but cannot be read at start-up (here the account may not ask for its
/// info) stops the start. Taken for "no consumer" before, the start went on to create it, which
/// the server accepts when it exists with the same configuration: the replica resumed where the
/// old consumer stood, past events of open streams it had acknowledged, not at its ack floor.
#[tokio::test]
async fn a_consumer_that_cannot_be_read_at_start_up_stops_the_start() {
    let users = r#"authorization { users = [
        { user: "full", password: "pw" },
        { user: "svc", password: "pw", permissions: { publish: { deny: ["$JS.API.CONSUMER.INFO.>"] } } }
    ] }"#;
    let server = NatsServer::builder().config(format!("{}{users}\n", mapping(1))).start();
    let mut config = one_partition_config(&server.url());
    config.nats.user = Some("full".into());
    config.nats.password = Some("pw".into());
    let first = RunningService::start(config.clone()).await.unwrap();
    first.shutdown().await.unwrap();
    config.nats.user = Some("svc".into());
    let refused = RunningService::start(config).await;
    let error = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("reading consumer structured-sink-p0"), "the start must fail: {error:?}");
}

/// A downstream stream that takes smaller messages than the server (`max_msg_size` 2,048) and a
/// stream whose final is larger. Known at start-up, the stream's limit bounds its subject's
/// outputs: the final goes without its cumulative text. Created after start-up, the stream
/// refuses the final for good; it was published again round after round, holding the shard's
/// worker, so that no later stream's outputs were stored: it is now reported and given up.
#[tokio::test]
async fn an_output_too_large_for_its_downstream_stream_is_trimmed_or_given_up() {
    for stream_first in [true, false] {
        let server = NatsServer::builder().config(mapping(1)).start();
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client.clone());
        let out_config = jetstream::stream::Config {
            name: "OUT".into(),
            subjects: vec!["chat.filtered".into()],
            max_message_size: 2048,
            ..Default::default()
        };
        if stream_first {
            js.create_stream(out_config.clone()).await.unwrap();
        }
        let mut config = one_partition_config(&server.url());
        config.shards.count = 1;
        let service = RunningService::start(config).await.unwrap();
        let mut out = match stream_first {
            true => js.get_stream("OUT").await.unwrap(),
            false => js.create_stream(out_config).await.unwrap(),
        };
        let event = |id: &str, body: String| (id.to_owned(), body);
        let partial = |id: &str, delta: &str| {
            event(id, serde_json::json!({"type": "partial", "meta": {"message_id": id}, "delta": delta}).to_string())
        };
        let last = |id: &str| event(id, format!(r#"{{"type":"final","meta":{{"message_id":"{id}"}}}}"#));
        // `big`'s final carries 3,000 bytes of visible text; `small` comes after it.
        let mut events: Vec<(String, String)> = (0..10).map(|_| partial("big", &"word ".repeat(60))).collect();
        events.push(last("big"));
        events.extend([partial("small", "hello"), last("small")]);
        publish_inputs(&js, &events, 0..events.len()).await;
        // big's ten deltas (and its final when trimmed), small's delta and final.
        let stored = read_all(&mut out, if stream_first { 13 } else { 12 }).await;
        let metrics = service.metrics().snapshot();
        service.shutdown().await.unwrap();
        let id = |m: &async_nats::Message| m.headers.as_ref().unwrap().get("Nats-Msg-Id").unwrap().to_string();
        let ids: Vec<String> = stored.iter().map(id).collect();
        assert!(ids.contains(&"small:2".to_owned()), "{stream_first}: the next stream's final was stored: {ids:?}");
        let big_final = stored.iter().find(|m| id(m) == "big:11");
        match stream_first {
            true => {
                let message = big_final.expect("the final, trimmed, was stored");
                let text = structured_sink::codec::proto::FilteredText::decode(message.payload.clone()).unwrap();
                assert!(text.r#final && text.text_omitted && text.text.is_empty(), "{text:?}");
                assert_eq!((metrics.publish_errors_total(), metrics.outputs_trimmed), (0, 1));
            }
            false => {
                assert!(big_final.is_none(), "refused: {ids:?}");
                assert_eq!((metrics.publish_errors_total(), metrics.outputs_trimmed), (1, 0));
            }
        }
    }
}

/// An operator deletes a partition's consumer. async-nats opens a pull stream on a consumer that
/// is gone without a word, so the replica pulled from nothing for good while `/healthz` said it
/// was alive. It now fails `/healthz`, naming why (a restart creates the consumer again).
#[tokio::test]
async fn a_deleted_consumer_fails_liveness() {
    let server = NatsServer::builder().config(mapping(1)).start();
    let service = RunningService::start(one_partition_config(&server.url())).await.unwrap();
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    assert_eq!(service.not_alive_reason(), None);
    js.get_stream("CHAT_RAW").await.unwrap().delete_consumer("structured-sink-p0").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while service.not_alive_reason().is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(service.not_alive_reason(), Some("a JetStream consumer of this replica no longer exists"));
    service.shutdown().await.unwrap();
}

fn jetstream_config(url: &str) -> Config {
    let mut config = partitioned(url, 8, 0, 1);
    config.jetstream.enabled = true;
    config.jetstream.ack_wait_ms = 60_000;
    config
}

#[tokio::test]
async fn jetstream_survives_kill_9_of_the_replica() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut replica = spawn_replica(&server.url(), dir.path());

    let events = conversation(1000, 6);
    let expected = replayed(&test_config(&server.url()), &events);
    let total: usize = expected.values().map(Vec::len).sum();
    let half = events.len() / 2;
    publish_inputs(&js, &events, 0..half).await;
    // Let it get some way through, then kill it without warning.
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.info().await.unwrap().state.messages < (total / 4) as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    replica.kill().unwrap();
    replica.wait().unwrap();
    let before = out.info().await.unwrap().state.messages;
    assert!(before > 0 && before < total as u64, "killed mid-run: {before} of {total}");
    let mut replica = spawn_replica(&server.url(), dir.path());
    publish_inputs(&js, &events, half..events.len()).await;
    let got = read_all(&mut out, total).await;
    replica.kill().unwrap();
    let _ = replica.wait();
    assert_eq!(got.len(), total, "every output once after deduplication");
    assert_eq!(group(&got), expected);
}

#[tokio::test]
async fn jetstream_loses_nothing_when_the_server_restarts() {
    jetstream_server_restart(8, 2).await;
}

/// One partition and one shard: the input task applies events itself (acks held by its shard).
#[tokio::test]
async fn jetstream_loses_nothing_when_the_server_restarts_with_one_partition_and_one_shard() {
    jetstream_server_restart(1, 1).await;
}

async fn jetstream_server_restart(partitions: u32, shards: usize) {
    let mut server = NatsServer::builder().config(mapping(partitions)).start();
    let mut config = jetstream_config(&server.url());
    config.partitions.count = partitions;
    config.shards.count = shards;
    let service = RunningService::start(config).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let events = conversation(200, 6);
    let expected = replayed(&test_config(&server.url()), &events);
    let total: usize = expected.values().map(Vec::len).sum();
    let half = events.len() / 2;
    publish_inputs(&js, &events, 0..half).await;
    server.restart();
    publish_inputs(&js, &events, half..events.len()).await;
    let got = read_all(&mut out, total).await;
    service.shutdown().await.unwrap();
    assert_eq!(got.len(), total);
    assert_eq!(group_by_seq(&got), expected);
}

/// A rolling update: a JetStream replica stopped gracefully leaves its open streams to the next
/// replica, without `shutdown` finals and with their input unacknowledged (counted as
/// `handed_over`); the next replica rebuilds them from their input and finishes them. Its
/// republished outputs carry the same `Nats-Msg-Id`s, so the downstream stream stores each once.
#[tokio::test]
async fn a_graceful_shutdown_hands_the_open_streams_over_to_the_next_replica() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let config = jetstream_config(&server.url());
    let service = RunningService::start(config.clone()).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let events = conversation(20, 6);
    let expected = replayed(&test_config(&server.url()), &events);
    let total: usize = expected.values().map(Vec::len).sum();
    // Three deltas of each stream (the third one a block); every stream stays open.
    let half = 3 * 20;
    publish_inputs(&js, &events, 0..half).await;
    let input = js.get_stream("CHAT_RAW").await.unwrap();
    let input = &input;
    let delivered = settle(
        move || async move {
            let (mut pending, mut undelivered) = (0, 0);
            for partition in 0..8 {
                let (_, p, u) = consumer_state(input, partition).await;
                (pending, undelivered) = (pending + p, undelivered + u);
            }
            (pending, undelivered)
        },
        |&state| state == (20, 0),
    )
    .await;
    assert_eq!(delivered, (20, 0), "all delivered; each open stream holds its first event");
    let metrics = service.metrics().clone();
    service.shutdown().await.unwrap();
    let stopped = metrics.snapshot();
    assert_eq!(stopped.streams_closed["handed_over"], 20);
    assert_eq!(stopped.streams_closed_total(), 20, "no stream closed otherwise: {:?}", stopped.streams_closed);

    let next = RunningService::start(config).await.unwrap();
    publish_inputs(&js, &events, half..events.len()).await;
    let got = read_all(&mut out, total).await;
    let metrics = next.metrics().clone();
    next.shutdown().await.unwrap();
    assert_eq!(metrics.snapshot().streams_closed["finished"], 20);
    assert_eq!(got.len(), total, "every output once after deduplication");
    assert_eq!(group(&got), expected);
}

/// The scenario of a node loss that used to lose outputs: the node that leads the downstream R3
/// stream stops mid-run. Until the stream has a new leader, nothing listens on its subjects and
/// every output publish is answered "no responders", which the service took for "no stream
/// captures this subject" and acknowledged the input of outputs never stored. Stopping the
/// leader (rather than a fixed node, which leads it in one run of three) makes every run take
/// that path; the service's own connection and the input consumers' leaders land on the stopped
/// node in some runs, which the service must ride out as well.
#[tokio::test]
async fn a_three_node_cluster_loses_nothing_when_a_node_stops() {
    let mut cluster = NatsServer::builder().config(mapping(8)).cluster(3);
    let urls = cluster.urls();
    let mut config = jetstream_config(&urls[0]);
    config.nats.servers = urls.clone();
    config.jetstream.stream_replicas = 3;
    let service = RunningService::start(config).await.unwrap();
    let options = async_nats::ConnectOptions::new().retry_on_initial_connect();
    let client = options.connect(urls.clone()).await.unwrap();
    let js = jetstream::new(client.clone());
    let mut out = js
        .get_or_create_stream(jetstream::stream::Config {
            name: "OUT".into(),
            subjects: vec!["chat.filtered".into(), "chat.structured.>".into(), "chat.thinking".into()],
            duplicate_window: Duration::from_secs(300),
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .unwrap();
    let events = conversation(200, 6);
    let expected = replayed(&test_config(&urls[0]), &events);
    let total: usize = expected.values().map(Vec::len).sum();
    let half = events.len() / 2;
    publish_inputs(&js, &events, 0..half).await;
    let info = out.info().await.unwrap();
    let leader = info.cluster.as_ref().and_then(|c| c.leader.clone()).expect("the downstream stream has a leader");
    cluster.stop_node(cluster.index_of(&leader).expect("the leader is a node of the cluster"));
    publish_inputs(&js, &events, half..events.len()).await;
    let got = read_all(&mut out, total).await;
    service.shutdown().await.unwrap();
    assert_eq!(got.len(), total, "every output stored, once");
    assert_eq!(group_by_seq(&got), expected);
}

/// With JetStream input and no stream over the output subjects (downstream subscribes with core
/// NATS), no output publish is ever confirmed (subscribers do not answer; without them the server
/// answers "no responders"): the service must find out that no stream captures the subjects, so
/// that it acknowledges the input instead of publishing the outputs again forever.
#[tokio::test]
async fn jetstream_input_is_acknowledged_when_no_stream_stores_the_outputs() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let service = RunningService::start(jetstream_config(&server.url())).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut outputs = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    let js = jetstream::new(client.clone());
    // A core subscriber listens on the output subject, so a JetStream publish there gets no
    // "no responders": its confirmation can only time out. Before the service asked the
    // JetStream API which output subjects a stream stores, thousands of such confirmations
    // outstanding (100 streams open at once) stalled the workers for good.
    let events = conversation(100, 30);
    publish_inputs(&js, &events, 0..events.len()).await;
    let (mut finals, mut seen) = (0, 0);
    crate::service::collect(&mut outputs, Duration::from_secs(20), |ms| {
        finals += ms[seen..].iter().filter(|m| as_json(m)["final"] == true).count();
        seen = ms.len();
        finals == 100
    })
    .await;
    assert_eq!(finals, 100);
    let mut input = js.get_stream("CHAT_RAW").await.unwrap();
    let last = input.info().await.unwrap().state.last_sequence;
    let input = &input;
    let unacknowledged = settle(
        move || async move {
            let mut unacknowledged = 0;
            for partition in 0..8 {
                let (_, pending, undelivered) = consumer_state(input, partition).await;
                unacknowledged += pending + undelivered as usize;
            }
            unacknowledged
        },
        |&unacknowledged| unacknowledged == 0,
    )
    .await;
    service.shutdown().await.unwrap();
    assert_eq!(unacknowledged, 0, "every input acknowledged (the stream's last sequence is {last})");
}

/// The consumer's state for partition `partition` of `input`: (ack floor, acks pending,
/// messages not yet delivered).
pub(crate) async fn consumer_state(input: &jetstream::stream::Stream, partition: u32) -> (u64, usize, u64) {
    let mut consumer: jetstream::consumer::PullConsumer =
        input.get_consumer(&format!("structured-sink-p{partition}")).await.unwrap();
    let info = consumer.info().await.unwrap();
    (info.ack_floor.stream_sequence, info.num_ack_pending, info.num_pending)
}

/// Polls `state` until `done` holds or a bound passes (not a timing assertion: a loaded machine
/// may need long), and returns the last state.
pub(crate) async fn settle<T, F: std::future::Future<Output = T>>(
    mut state: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = state().await;
        if done(&now) || Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Only the first event of an open stream stays unacknowledged: the ack floor stays below it (so
/// a restart or takeover still reads the whole stream again), and a stream far longer than
/// `max_ack_pending` flows. When every event of an open stream was held, delivery stalled once a
/// partition's open streams had `max_ack_pending` events.
#[tokio::test]
async fn an_open_stream_holds_only_its_first_event_unacknowledged() {
    let server = NatsServer::builder().config(mapping(1)).start();
    let mut config = one_partition_config(&server.url());
    config.jetstream.max_ack_pending = 8;
    let service = RunningService::start(config).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    // Three streams of 40 deltas each, interleaved: stream sequences 1, 2, 3 are their first
    // events. Streams 0 and 1 end; stream 2 stays open until its final, published last.
    let events = conversation(3, 40);
    let expected = replayed(&test_config(&server.url()), &events);
    let total: usize = expected.values().map(Vec::len).sum();
    let (last_final, open_first) = (events.len() - 1, 3);
    assert!(events[last_final].1.contains("final") && events[open_first - 1].0 == "msg-0002");
    publish_inputs(&js, &events, 0..last_final).await;
    let input = js.get_stream("CHAT_RAW").await.unwrap();
    let open =
        settle(|| consumer_state(&input, 0), |&(_, pending, undelivered)| pending == 1 && undelivered == 0).await;
    assert_eq!(
        open,
        (open_first as u64 - 1, 1, 0),
        "everything delivered; only the open stream's first event pending, the floor just below it"
    );
    publish_inputs(&js, &events, last_final..events.len()).await;
    let last = events.len() as u64;
    let ended = settle(|| consumer_state(&input, 0), |&(floor, _, _)| floor == last).await;
    let got = read_all(&mut out, total).await;
    service.shutdown().await.unwrap();
    assert_eq!(ended, (last, 0, 0), "every event acknowledged once its stream ended");
    assert_eq!(got.len(), total);
    assert_eq!(group(&got), expected);
}

/// With JetStream input, an `error` naming no segment (the legacy shape the canonical vocabulary
/// keeps) ends the open segments of its message at once, and so does the end of a provider call
/// those of the call, as the offline replay does, and every input event is acknowledged. Before,
/// the segments held their first events unacknowledged until idle expiry, and the error opened
/// and ended a stream of the message id.
#[tokio::test]
async fn an_error_or_a_call_end_ends_open_segments_and_every_event_is_acknowledged() {
    let server = NatsServer::builder().config(mapping(1)).start();
    let service = RunningService::start(one_partition_config(&server.url())).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let delta = |segment: &str, text: &str| {
        format!(
            r#"{{"type":"text-delta","meta":{{"message_id":"m-1"}},"correlation":{{"segment_id":"{segment}"}},"delta":"{text}"}}"#
        )
    };
    let error = r#"{"type":"error","error":{},"meta":{"message_id":"m-1"},"error_string":"provider failed"}"#;
    let mut events: Vec<(String, String)> =
        [delta("m-1:a", "Looking "), delta("m-1:b", "up"), delta("m-1:a", "more"), error.to_owned()]
            .into_iter()
            .map(|event| ("m-1".to_owned(), event))
            .collect();
    // A provider call cancelled with its segment open: its end ends the segment.
    let segment = r#"{"type":"text-delta","meta":{"message_id":"m-2"},"correlation":{"segment_id":"m-2:a","provider_call_id":"pc"},"delta":"Half"}"#;
    let end = r#"{"type":"provider-call-finished","meta":{"message_id":"m-2"},"correlation":{"provider_call_id":"pc"},"finish_class":"cancelled"}"#;
    events.extend([segment, end].map(|event| ("m-2".to_owned(), event.to_owned())));
    let expected = replayed(&test_config(&server.url()), &events);
    publish_inputs(&js, &events, 0..events.len()).await;
    let input = js.get_stream("CHAT_RAW").await.unwrap();
    let last = events.len() as u64;
    let state = settle(|| consumer_state(&input, 0), |&(floor, _, _)| floor == last).await;
    let got = group(&read_all(&mut out, expected.values().map(Vec::len).sum()).await);
    service.shutdown().await.unwrap();
    assert_eq!(state, (last, 0, 0), "every event acknowledged");
    assert_eq!(got.keys().collect::<Vec<_>>(), ["m-1:a", "m-1:b", "m-2:a"], "no stream of a message id: {got:?}");
    for (segment, outputs) in &got {
        let end = &outputs.last().unwrap().1;
        let (reason, error) = if segment.starts_with("m-1") { ("error", "provider failed") } else { ("cancelled", "") };
        assert_eq!((&end["final"], &end["finish_reason"]), (&true.into(), &reason.into()), "{segment}: {end}");
        assert_eq!(end["error"].as_str().unwrap_or_default(), error, "{segment}: {end}");
    }
    assert_eq!(got, expected);
}

/// With the server gone, a JetStream replica's shutdown does not wait out a confirmation timeout
/// and a JetStream API timeout (about 4 s) for every stream it closes: once one stream's outputs
/// went unconfirmed after stopping began, the server is taken for gone and the others' are not
/// awaited (their input stays unacknowledged for the next owner either way); the last flush
/// gives up too. Eight streams expire while the server is down; the shutdown must end within its
/// timeout, which eight such waits exceed (it took about 6 s, against 15 s and more before).
#[tokio::test]
async fn shutdown_with_the_server_gone_does_not_wait_for_each_closing_stream() {
    let mut server = NatsServer::builder().config(mapping(1)).start();
    let mut config = one_partition_config(&server.url());
    config.shards.count = 1;
    config.shards.idle_timeout_ms = 1_000;
    config.shards.expiry_tick_ms = 200;
    config.service.shutdown_timeout_ms = 15_000;
    let service = RunningService::start(config).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let events: Vec<(String, String)> = (0..8)
        .map(|s| {
            let id = format!("msg-{s:04}");
            let event = serde_json::json!({"type": "partial", "meta": {"message_id": id}, "delta": format!("s{s} ")});
            (id, event.to_string())
        })
        .collect();
    publish_inputs(&js, &events, 0..events.len()).await;
    // Each delta's visible text is stored downstream before the server goes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.info().await.unwrap().state.messages < 8 {
        assert!(Instant::now() < deadline, "the deltas' outputs were stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.stop();
    // The streams expire; the first one's final waits for a confirmation that cannot come.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    let stopped = service.shutdown().await;
    assert!(stopped.is_ok(), "stopped within the shutdown timeout: {stopped:?} after {:?}", started.elapsed());
}

/// Each worker awaits its outputs' storage confirmations once it has 1,024 unawaited (or when a
/// stream ends). async-nats bounds the confirmations in flight per JetStream context (5,000), and
/// all workers shared one context: with eight workers and thousands of open streams, every worker
/// waited for a slot that only another worker's awaiting could free, and the service stopped for
/// good at 5,000 outputs. Eight thousand streams of one delta each must all come out.
#[tokio::test]
async fn many_workers_with_many_open_streams_do_not_exhaust_the_confirmations_in_flight() {
    let server = NatsServer::builder().config(mapping(1)).start();
    let mut config = one_partition_config(&server.url());
    config.shards.count = 8;
    config.service.shutdown_timeout_ms = 5_000;
    let service = RunningService::start(config).await.unwrap();
    let (_client, js, mut out) = downstream(&server.url()).await;
    let streams = 8_000;
    // Confirmed a thousand at a time: `publish_inputs` waits for each one.
    for chunk in (0..streams).collect::<Vec<usize>>().chunks(1_000) {
        let mut acks = Vec::new();
        for &s in chunk {
            let id = format!("msg-{s:05}");
            let event = serde_json::json!({"type": "partial", "meta": {"message_id": id}, "delta": "hello "});
            let message = PublishMessage::build().payload(event.to_string().into()).message_id(format!("input-{s}"));
            acks.push(js.send_publish(format!("chat.raw.{id}"), message).await.unwrap());
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stored = 0;
    while stored < streams as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        stored = out.info().await.unwrap().state.messages;
    }
    assert_eq!(stored, streams as u64, "every stream's delta stored downstream");
    service.shutdown().await.unwrap();
}

/// The pin of each partition consumer's priority group: `None` while no replica is pinned.
pub(crate) async fn pins(stream: &jetstream::stream::Stream, partitions: u32) -> Vec<Option<String>> {
    let mut pins = Vec::new();
    for partition in 0..partitions {
        let mut consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer(&format!("structured-sink-p{partition}")).await.unwrap();
        let info = consumer.info().await.unwrap();
        pins.push(info.priority_groups.iter().find_map(|g| g.pinned_client_id.clone()));
    }
    pins
}

/// `jetstream.pinned_client`: two replicas, each owning half of the partitions and standing by
/// for the other half. Replica 0 is killed with `kill -9` mid-run, while hundreds of streams are
/// open; once its pins lapse (`pinned_ttl_ms`) the server pins its partitions to replica 1, which
/// rebuilds the open streams from the consumers' ack floors. Downstream (deduplicated by
/// `Nats-Msg-Id`) must hold exactly what `replay` gives.
///
/// Needs a server with priority groups (2.11 or later; `NATS_SERVER_BIN` selects the binary).
/// With an older server the test checks instead that start-up refuses `pinned_client` with a
/// clear error, before creating anything.
#[tokio::test]
async fn pinned_client_standby_takes_over_after_kill_9() {
    pinned_takeover(8, 2).await;
}

/// The same with one partition and one shard worker: the survivor owns nothing, so its one
/// source feeds its one shard directly and the input task's `select!` shares it with the expiry
/// tick, which drops the source's `next` once per tick. The standby's wait before its first pull
/// (1 s) is as long as the tick (1 s): while the wait restarted with every `next`, the standby
/// never pulled and the partition stalled for good after the kill.
#[tokio::test]
async fn pinned_client_standby_owning_nothing_with_one_shard_takes_over() {
    pinned_takeover(1, 1).await;
}

/// `jetstream.pinned_client` reuses a partition's consumer, which the other replicas pull from.
/// Settings changed since it was created (`pinned_ttl_ms`, `ack_wait_ms`, `max_ack_pending`) were
/// never applied to it, so the server's pin timeout and the replica's pull renewals (a third of
/// its own setting) could disagree and the pin lapse between pulls. A restart applies them.
#[tokio::test]
async fn a_pinned_consumer_takes_changed_settings_at_restart() {
    let server = NatsServer::builder().priority_groups().config(mapping(1)).start();
    if lacks_priority_groups(&server).await {
        return;
    }
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let mut config = one_partition_config(&server.url());
    config.jetstream.pinned_client = true;
    let settings = |config: &mut Config, ttl_ms: u64, ack_wait_ms: u64, max_ack_pending: i64| {
        config.jetstream.pinned_ttl_ms = ttl_ms;
        config.jetstream.ack_wait_ms = ack_wait_ms;
        config.jetstream.max_ack_pending = max_ack_pending;
    };
    for (ttl_ms, ack_wait_ms, max_ack_pending) in [(3_000, 60_000, 5_000), (9_000, 90_000, 7_000)] {
        settings(&mut config, ttl_ms, ack_wait_ms, max_ack_pending);
        let service = RunningService::start(config.clone()).await.unwrap();
        let stream = js.get_stream("CHAT_RAW").await.unwrap();
        let mut consumer: jetstream::consumer::PullConsumer = stream.get_consumer("structured-sink-p0").await.unwrap();
        let applied = consumer.info().await.unwrap().config.clone();
        service.shutdown().await.unwrap();
        assert_eq!(
            (applied.priority_timeout, applied.ack_wait, applied.max_ack_pending),
            (Duration::from_millis(ttl_ms), Duration::from_millis(ack_wait_ms), max_ack_pending)
        );
    }
}

/// `jetstream.pinned_client`: a replica stopped gracefully releases its pin only once its shards
/// have drained. Released first, as it was, the events still queued for its shard workers were
/// processed and acknowledged after a standby could take the partition over, and the standby,
/// reading the partition from the ack floor, published their outputs a second time: none of the
/// acknowledgements may come after the unpin request.
#[tokio::test]
async fn a_graceful_shutdown_releases_the_pin_after_the_last_acknowledgement() {
    let Some(stop) = stop_while_acknowledging(None, 4_096).await else { return };
    stop.stopped.unwrap();
    assert_eq!(stop.unpins, 1, "the pin released once");
    assert!(stop.acks > 2_500, "events acknowledged while stopping: {}", stop.acks);
    assert_eq!(stop.acks_after_unpin, 0, "acknowledgements after the pin was released");
}

/// A shutdown that runs out of time (here while the shard workers work through their queues)
/// stops them where they are, as a crash would, and only then releases the pin: a standby takes
/// the partition over at once instead of after `pinned_ttl_ms`, and reads from the ack floor what
/// the stopped workers left unacknowledged. Before, the timed-out shutdown left the workers
/// running (acknowledging on) and the pin held until it lapsed.
#[tokio::test]
async fn a_shutdown_that_times_out_stops_its_workers_then_releases_the_pin() {
    // Far less than the queued events take, and than the input task, blocked on full shard
    // inboxes, takes to see the shutdown: it is stopped while it holds the pin, which is released
    // all the same. (Before it was recorded on delivery, the pin was handed over only by an input
    // task that had stopped pulling, and this one never did.)
    let Some(stop) = stop_while_acknowledging(Some(1), 4).await else { return };
    assert!(
        matches!(stop.stopped, Err(structured_sink::service::ServiceError::ShutdownTimeout(_))),
        "the shutdown timed out: {:?}",
        stop.stopped
    );
    assert_eq!(stop.unpins, 1, "the pin released once");
    assert_eq!(stop.acks_after_unpin, 0, "acknowledgements after the pin was released");
    assert!(stop.acks < stop.events, "the workers were stopped before they acknowledged everything: {}", stop.acks);
}

/// What a watcher of the server's JetStream traffic saw of a replica stopped while it worked
/// through a backlog.
struct StopSeen {
    stopped: Result<(), structured_sink::service::ServiceError>,
    /// Events in the backlog.
    events: usize,
    acks: usize,
    acks_after_unpin: usize,
    unpins: usize,
}

/// Starts a pinned-client replica (two shard workers, each with an inbox of `inbox_capacity`
/// events) on a backlog of 10,000 events and shuts it down (within `shutdown_timeout_ms`, when
/// given) once it has acknowledged 2,500, while its shard inboxes still hold events; `None` on a
/// server without priority groups. A watcher sees
/// the replica's acknowledgements and its unpin request in the order the server read them from
/// the replica's connection.
async fn stop_while_acknowledging(shutdown_timeout_ms: Option<u64>, inbox_capacity: usize) -> Option<StopSeen> {
    let server = NatsServer::builder().priority_groups().config(mapping(1)).start();
    if lacks_priority_groups(&server).await {
        return None;
    }
    let mut config = one_partition_config(&server.url());
    config.jetstream.pinned_client = true;
    config.shards.count = 2;
    config.shards.inbox_capacity = inbox_capacity;
    // A first start creates the input stream and the consumer; the events wait for the second.
    RunningService::start(config.clone()).await.unwrap().shutdown().await.unwrap();
    // Outputs stored downstream: an event's acknowledgement waits for its outputs' confirmations,
    // so the workers, not the input, set the pace.
    let (_client, js, _out) = downstream(&server.url()).await;
    // Stopped a millisecond after it started, that replica may have been pinned without learning
    // it (no delivery told it its pin), and the pin would keep the partition from the next start
    // until it lapsed (`pinned_ttl_ms`, 30 s).
    let stream = js.get_stream("CHAT_RAW").await.unwrap();
    let _ = stream.unpin_consumer("structured-sink-p0", "sink").await;
    // Few streams, many events each: all but each stream's first are acknowledged as applied.
    let events = conversation(20, 500);
    publish_inputs(&js, &events, 0..events.len()).await;

    let watcher = async_nats::connect(server.url()).await.unwrap();
    let mut seen = watcher.subscribe("$JS.>").await.unwrap();
    watcher.flush().await.unwrap();
    if let Some(ms) = shutdown_timeout_ms {
        config.service.shutdown_timeout_ms = ms;
    }
    let mut service = Some(RunningService::start(config).await.unwrap());
    let mut stopping: Option<tokio::task::JoinHandle<Result<(), _>>> = None;
    let (mut acks, mut acks_after_unpin, mut unpins) = (0, 0, 0);
    // Until the service has stopped and been quiet for a while (starting, it reads the backlog
    // from the stream first, which the watcher does not see).
    loop {
        let quiet = Duration::from_secs(if stopping.is_some() { 3 } else { 60 });
        let message = match tokio::time::timeout(quiet, seen.next()).await {
            Ok(Some(message)) => message,
            _ if stopping.as_ref().is_some_and(|stopping| !stopping.is_finished()) => continue,
            _ => break,
        };
        let subject = message.subject.as_str();
        if subject.starts_with("$JS.ACK.") {
            acks += 1;
            acks_after_unpin += usize::from(unpins > 0);
            // Stopped with the backlog being worked through: the shard inboxes hold events.
            if acks == 2_500 {
                stopping = service.take().map(|service| tokio::spawn(service.shutdown()));
            }
        } else if subject.starts_with("$JS.API.CONSUMER.UNPIN.") {
            unpins += 1;
        }
    }
    let stopped = stopping.expect("stopped while acknowledging").await.unwrap();
    Some(StopSeen { stopped, events: events.len(), acks, acks_after_unpin, unpins })
}

/// `jetstream.pinned_client` against the usual test server (the pinned-client tests take
/// `NATS_SERVER_PINNED_BIN` when set): refused at start-up when it is older than 2.11, accepted
/// otherwise.
#[tokio::test]
async fn pinned_client_is_refused_on_a_server_without_priority_groups() {
    let server = NatsServer::builder().config(mapping(1)).start();
    if !lacks_priority_groups(&server).await {
        let mut config = one_partition_config(&server.url());
        config.jetstream.pinned_client = true;
        RunningService::start(config).await.unwrap().shutdown().await.unwrap();
    }
}

/// Whether `server` is older than 2.11, without pinned-client priority groups; if so, having
/// checked that start-up refuses `jetstream.pinned_client` there (a pinned-client test ends
/// with that check).
pub(crate) async fn lacks_priority_groups(server: &NatsServer) -> bool {
    let older = server.version() < (2, 11, 0);
    if older {
        assert_pinned_client_refused(server).await;
    }
    older
}

/// With a server older than 2.11, start-up refuses `jetstream.pinned_client` with a clear error,
/// before creating anything.
async fn assert_pinned_client_refused(server: &NatsServer) {
    let mut config = jetstream_config(&server.url());
    config.jetstream.pinned_client = true;
    let error = RunningService::start(config).await.err().expect("pinned_client refused before 2.11");
    let message = error.to_string();
    assert!(message.contains("pinned_client needs nats-server 2.11"), "{message}");
    assert!(message.contains(server.version_string()), "{message}");
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    assert!(js.get_stream("CHAT_RAW").await.is_err(), "nothing created before refusing");
}

/// Two pinned replicas over `partitions` partitions with `shards` shard workers each; replica 0 is
/// killed mid-run (see [`pinned_client_standby_takes_over_after_kill_9`]).
async fn pinned_takeover(partitions: u32, shards: u32) {
    let server = NatsServer::builder().priority_groups().config(mapping(partitions)).start();
    if lacks_priority_groups(&server).await {
        return;
    }
    let (client, js, mut out) = downstream(&server.url()).await;
    let mut dead_letters = client.subscribe("chat.dlq").await.unwrap();
    client.flush().await.unwrap();
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let mut doomed = spawn_pinned_replica(&server.url(), dirs[0].path(), 0, partitions, shards);
    let mut survivor = spawn_pinned_replica(&server.url(), dirs[1].path(), 1, partitions, shards);

    let events = conversation(300, 6);
    let expected = replayed(&test_config(&server.url()), &events);
    let total: usize = expected.values().map(Vec::len).sum();
    let half = events.len() / 2;
    // Wait for both replicas' consumers (and their pins) before publishing.
    let deadline = Instant::now() + Duration::from_secs(30);
    let input = loop {
        if let Ok(mut stream) = js.get_stream("CHAT_RAW").await {
            if stream.info().await.is_ok_and(|i| i.state.consumer_count >= partitions as usize) {
                break stream;
            }
        }
        assert!(Instant::now() < deadline, "the replicas created their consumers");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    publish_inputs(&js, &events, 0..half).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.info().await.unwrap().state.messages < (total / 4) as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = pins(&input, partitions).await;
    assert!(before.iter().all(Option::is_some), "every partition pinned: {before:?}");
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    let stored = out.info().await.unwrap().state.messages;
    assert!(stored > 0 && stored < total as u64, "killed mid-run: {stored} of {total}");
    publish_inputs(&js, &events, half..events.len()).await;
    let got = read_all(&mut out, total).await;
    let after = pins(&input, partitions).await;
    // The messages the takeover read from the stream carry no ack of their own: they are
    // acknowledged when the consumer redelivers them (after ack_wait), as duplicates.
    let deadline = Instant::now() + Duration::from_secs(90);
    let unacknowledged = loop {
        let mut unacknowledged = 0;
        for partition in 0..partitions {
            let mut consumer: jetstream::consumer::PullConsumer =
                input.get_consumer(&format!("structured-sink-p{partition}")).await.unwrap();
            let info = consumer.info().await.unwrap();
            unacknowledged += info.num_ack_pending + info.num_pending as usize;
        }
        if unacknowledged == 0 || Instant::now() >= deadline {
            break unacknowledged;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Redeliveries processed after the comparison must not have produced new outputs.
    let stored_later = out.info().await.unwrap().state.messages as usize - got.len();
    // A redelivery of a rebuilt message whose stream has ended is a duplicate, not a late event.
    let dead_letters =
        crate::service::collect(&mut dead_letters, Duration::from_millis(500), |ms| !ms.is_empty()).await;
    survivor.kill().unwrap();
    let _ = survivor.wait();
    // Replica 0 owned the even partitions: each must have a new pin (the standby's).
    for partition in (0..partitions as usize).step_by(2) {
        assert!(
            after[partition].is_some() && after[partition] != before[partition],
            "partition {partition} taken over: {before:?} -> {after:?}"
        );
    }
    assert_eq!(&after[1..].iter().step_by(2).collect::<Vec<_>>(), &before[1..].iter().step_by(2).collect::<Vec<_>>());
    assert_eq!(got.len(), total, "every output once after deduplication");
    assert_eq!(group(&got), expected);
    assert_eq!(unacknowledged, 0, "every input acknowledged in the end, redeliveries included");
    assert_eq!(stored_later, 0, "no new output from the redeliveries");
    assert_eq!(dead_letters.len(), 0, "nothing dead-lettered");
}

/// The input messages of the 8 partition consumers not acknowledged yet.
async fn input_ack_pending(input: &jetstream::stream::Stream) -> usize {
    let mut pending = 0;
    for partition in 0..8 {
        let mut consumer: jetstream::consumer::PullConsumer =
            input.get_consumer(&format!("structured-sink-p{partition}")).await.unwrap();
        pending += consumer.info().await.unwrap().num_ack_pending;
    }
    pending
}

/// An event passed through and one dead-lettered, as (message id, payload).
const FORWARDED_EVENTS: [(&str, &str); 2] =
    [("m-pass", r#"{"type":"tool-call","meta":{"message_id":"m-pass"}}"#), ("m-dead", "not json")];

/// A JetStream replica that passes non-text events through to `chat.passthrough`, and its input
/// stream.
async fn forwarding_replica(
    server: &NatsServer,
    js: &jetstream::Context,
) -> (RunningService, jetstream::stream::Stream) {
    let mut config = jetstream_config(&server.url());
    config.input.pass_through_subject = "chat.passthrough".into();
    let service = RunningService::start(config).await.unwrap();
    (service, js.get_stream("CHAT_RAW").await.unwrap())
}

/// JetStream input whose dead letters and pass-through events a stream stores: an input event is
/// acknowledged only once that stream has confirmed storing it. The stream first takes one
/// message only (`discard = new`), so the second forwarded event is refused: its input must stay
/// unacknowledged (it was acknowledged before being published, and lost). Once the stream has
/// room, the service's retry stores it and the input is acknowledged. Each carries
/// `Nats-Msg-Id: CHAT_RAW:<input sequence>`, so copies published again are dropped, and each copy
/// counts in `outputs_republished_total` under its kind.
#[tokio::test]
async fn forwarded_input_events_are_acknowledged_once_a_stream_stores_them() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let forwarded_config = |max_messages| jetstream::stream::Config {
        name: "FORWARDED".into(),
        subjects: vec!["chat.passthrough".into(), "chat.dlq".into()],
        max_messages,
        discard: jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    let mut forwarded = js.create_stream(forwarded_config(1)).await.unwrap();
    let (service, input) = forwarding_replica(&server, &js).await;
    for (id, payload) in FORWARDED_EVENTS {
        js.publish(format!("chat.raw.{id}"), payload.into()).await.unwrap().await.unwrap();
    }
    let stored = |stream: &mut jetstream::stream::Stream| {
        let mut stream = stream.clone();
        async move { stream.info().await.unwrap().state.messages }
    };
    // Both events handled: one stored and acknowledged, the other refused and held.
    let deadline = Instant::now() + Duration::from_secs(30);
    while (stored(&mut forwarded).await < 1 || input_ack_pending(&input).await != 1) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And it stays so: the refused publish is retried every 100 ms to 1 s meanwhile, and a
    // wrong acknowledgement would show here.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(stored(&mut forwarded).await, 1, "the stream refuses the second");
    assert_eq!(input_ack_pending(&input).await, 1, "the refused event's input is not acknowledged");

    js.update_stream(forwarded_config(10)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while (stored(&mut forwarded).await < 2 || input_ack_pending(&input).await > 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(input_ack_pending(&input).await, 0, "acknowledged once stored");
    let got = read_all(&mut forwarded, 2).await;
    // The refused one, published again round after round, is counted under its own kind.
    let republished = service.metrics().snapshot().outputs_republished;
    service.shutdown().await.unwrap();
    let forwarded_kinds = republished["dead_letter"] + republished["pass_through"];
    assert!(forwarded_kinds >= 1 && forwarded_kinds == republished.values().sum::<u64>(), "{republished:?}");
    assert_eq!(got.len(), 2);
    let mut ids: Vec<(String, String)> = got
        .iter()
        .map(|m| {
            let headers = m.headers.as_ref().unwrap();
            (m.subject.to_string(), headers.get("Nats-Msg-Id").unwrap().to_string())
        })
        .collect();
    ids.sort();
    let sequence_of = |id: &str| {
        let subject = format!("chat.raw.p.{}.{id}", structured_sink::codec::subject::partition_of(id, 8));
        let input = input.clone();
        async move { input.get_last_raw_message_by_subject(&subject).await.unwrap().sequence }
    };
    let expected = vec![
        ("chat.dlq".to_owned(), format!("CHAT_RAW:{}", sequence_of("m-dead").await)),
        ("chat.passthrough".to_owned(), format!("CHAT_RAW:{}", sequence_of("m-pass").await)),
    ];
    assert_eq!(ids, expected);
}

/// A producer's JetStream publish controls (here `Nats-Expected-Stream: CHAT_RAW`) are stored with
/// its input event. Forwarded as they were, they made the stream that stores dead letters and
/// pass-through events refuse the copy, for good: the retries held the input unacknowledged (and
/// its partition stalled). The copies leave them behind and keep every other header.
#[tokio::test]
async fn forwarded_input_events_leave_the_producers_publish_controls_behind() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let subjects = vec!["chat.passthrough".into(), "chat.dlq".into()];
    let mut forwarded = js
        .create_stream(jetstream::stream::Config { name: "FORWARDED".into(), subjects, ..Default::default() })
        .await
        .unwrap();
    let (service, input) = forwarding_replica(&server, &js).await;
    for (id, payload) in FORWARDED_EVENTS {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Expected-Stream", "CHAT_RAW");
        headers.insert("App-Id", id);
        js.publish_with_headers(format!("chat.raw.{id}"), headers, payload.into()).await.unwrap().await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while (forwarded.info().await.unwrap().state.messages < 2 || input_ack_pending(&input).await > 0)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(input_ack_pending(&input).await, 0, "both inputs acknowledged: their copies were stored");
    let got = read_all(&mut forwarded, 2).await;
    service.shutdown().await.unwrap();
    let mut kept: Vec<(String, Option<String>, bool)> = got
        .iter()
        .map(|m| {
            let headers = m.headers.as_ref().unwrap();
            let app = headers.get("App-Id").map(|v| v.to_string());
            (m.subject.to_string(), app, headers.get("Nats-Expected-Stream").is_some())
        })
        .collect();
    kept.sort();
    let expected = [("chat.dlq", "m-dead"), ("chat.passthrough", "m-pass")]
        .map(|(s, id)| (s.to_owned(), Some(id.to_owned()), false));
    assert_eq!(kept, expected);
}

/// An input stream that deletes acknowledged messages (work-queue or interest retention) would
/// rebuild an open stream after a restart or takeover with its middle missing: the service acknowledges
/// all but each open stream's first event at once. Start-up refuses it, naming the retention,
/// before creating a consumer.
#[tokio::test]
async fn an_input_stream_that_deletes_acknowledged_events_is_refused() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    for retention in [jetstream::stream::RetentionPolicy::WorkQueue, jetstream::stream::RetentionPolicy::Interest] {
        let name = "CHAT_RAW".to_owned();
        let _ = js.delete_stream(&name).await;
        let subjects = vec!["chat.raw.p.*.*".into()];
        js.create_stream(jetstream::stream::Config { name, subjects, retention, ..Default::default() }).await.unwrap();
        let error = RunningService::start(jetstream_config(&server.url())).await.err().expect("refused");
        let message = error.to_string();
        assert!(message.contains(&format!("{retention:?} retention")), "{message}");
        let stream = js.get_stream("CHAT_RAW").await.unwrap();
        assert_eq!(stream.cached_info().state.consumer_count, 0, "no consumer created");
    }
}

/// A start-up that fails (here: the HTTP port is taken) fails before anything consumes input: no
/// stream or consumer is created, and no task is left behind to acknowledge events.
#[tokio::test]
async fn a_failed_start_consumes_nothing() {
    let server = NatsServer::builder().config(mapping(8)).start();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut config = jetstream_config(&server.url());
    config.http.enabled = true;
    config.http.listen = taken.local_addr().unwrap().to_string();
    let error = RunningService::start(config).await.err().expect("the port is taken");
    assert!(error.to_string().contains(&taken.local_addr().unwrap().to_string()), "{error}");
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    assert!(js.get_stream("CHAT_RAW").await.is_err(), "no input stream (nor consumers) created");
}
