//! The service end to end against a real nats-server: outputs equal the offline replay, order per
//! message, pass-through, dead letters, expiry, shutdown, reconnect, discovery, health.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use prost::Message as _;
use serde_json::Value;
use structured_sink::codec::proto;
use structured_sink::config::{Config, TagConfig};
use structured_sink::pipeline::TagKind;
use structured_sink::service::{RunningService, TYPE_HEADER};

use crate::support::NatsServer;

/// A configuration for tests: the server, the demo tags, an ephemeral HTTP port, two shards (so
/// events cross from the input task to worker tasks; tests of the input task applying events
/// itself set one).
pub fn test_config(url: &str) -> Config {
    let mut config = Config::default();
    config.nats.servers = vec![url.to_owned()];
    config.http.listen = "127.0.0.1:0".into();
    config.shards.count = 2;
    config.service.shutdown_timeout_ms = 5_000;
    config.tags = vec![
        TagConfig::new("thinking", TagKind::Channel),
        TagConfig::new("tool", TagKind::ToolCall),
        TagConfig::new("myapp:ModeSwitch:v1", TagKind::Block),
        TagConfig::new("geppetto:citations:v1", TagKind::Block),
    ];
    config
}

/// A service running on a server of its own, as `configure` leaves [`test_config`]. Bind every
/// field: the server stops when dropped.
pub struct Running {
    pub server: NatsServer,
    pub service: RunningService,
    pub client: async_nats::Client,
}

/// Starts a server, the service on it (configured by `configure`) and a client subscribed to
/// each of `subjects`, flushed so that the server has the subscriptions before anything is
/// published.
pub async fn running<const N: usize>(
    configure: impl FnOnce(&mut Config),
    subjects: [&str; N],
) -> (Running, [async_nats::Subscriber; N]) {
    let server = NatsServer::start();
    let mut config = test_config(&server.url());
    configure(&mut config);
    let service = RunningService::start(config).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut subscribers = Vec::with_capacity(N);
    for subject in subjects {
        subscribers.push(client.subscribe(subject.to_owned()).await.unwrap());
    }
    client.flush().await.unwrap();
    let subscribers = subscribers.try_into().unwrap_or_else(|_| unreachable!("one per subject"));
    (Running { server, service, client }, subscribers)
}

/// Publishes `event` from a client of its own and returns what that client then received on
/// `chat.filtered`, once something came or ten seconds passed without.
async fn filtered_outputs_of(url: &str, event: &'static str) -> Vec<async_nats::Message> {
    let client = async_nats::connect(url).await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    client.publish("chat", event.into()).await.unwrap();
    collect(&mut filtered, Duration::from_secs(10), |ms| !ms.is_empty()).await
}

/// Collects every message on `subject` until `done` says stop or `timeout` passes without one.
pub async fn collect(
    sub: &mut async_nats::Subscriber,
    timeout: Duration,
    mut done: impl FnMut(&[async_nats::Message]) -> bool,
) -> Vec<async_nats::Message> {
    let mut got = Vec::new();
    while !done(&got) {
        match tokio::time::timeout(timeout, sub.next()).await {
            Ok(Some(m)) => got.push(m),
            _ => break,
        }
    }
    got
}

/// The proto3 JSON of an output message, as `replay` prints it.
pub fn as_json(m: &async_nats::Message) -> Value {
    let type_name = m.headers.as_ref().and_then(|h| h.get(TYPE_HEADER)).expect("type header");
    let registry = structured_sink::typed::SchemaRegistry::builtin();
    structured_sink::replay::message_json(registry.descriptor_pool(), type_name.as_str(), &m.payload).unwrap()
}

fn is_final(m: &async_nats::Message) -> bool {
    m.subject.as_str() == "chat.filtered" && proto::FilteredText::decode(m.payload.clone()).is_ok_and(|t| t.r#final)
}

fn finals(ms: &[async_nats::Message]) -> usize {
    ms.iter().filter(|m| is_final(m)).count()
}

/// Outputs by stream id, each stream's in order: (subject, message JSON as `replay` prints it).
pub(crate) type ByStream = BTreeMap<String, Vec<(String, Value)>>;

/// Groups records by stream id, keeping order.
fn by_stream(records: impl IntoIterator<Item = (String, Value)>) -> ByStream {
    let mut map = ByStream::new();
    for (subject, message) in records {
        let stream = message["stream"]["stream_id"].as_str().unwrap_or_default().to_owned();
        map.entry(stream).or_default().push((subject, message));
    }
    map
}

#[tokio::test]
async fn outputs_equal_the_offline_replay_with_headers_in_worker_tasks() {
    outputs_equal_the_offline_replay_with_headers(2).await;
}

#[tokio::test]
async fn outputs_equal_the_offline_replay_with_headers_in_the_input_task() {
    outputs_equal_the_offline_replay_with_headers(1).await;
}

async fn outputs_equal_the_offline_replay_with_headers(shards: usize) {
    let server = NatsServer::start();
    let mut config = test_config(&server.url());
    config.shards.count = shards;
    let service = RunningService::start(config.clone()).await.unwrap();
    assert!(service.is_ready());
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut outputs = client.subscribe("chat.>").await.unwrap();
    client.flush().await.unwrap();

    let transcript = include_str!("../../examples/transcripts/conversation.jsonl");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    for line in transcript.lines() {
        client.publish_with_headers("chat", headers.clone(), line.as_bytes().to_vec().into()).await.unwrap();
    }
    let got = collect(&mut outputs, Duration::from_secs(5), |ms| finals(ms) == 2).await;
    service.shutdown().await.unwrap();

    // The dead letter of the transcript's bad line arrives with its reason.
    let dead: Vec<_> = got.iter().filter(|m| m.subject.as_str() == "chat.dlq").collect();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].headers.as_ref().unwrap().get("Structured-Sink-Error").unwrap().as_str(), "missing_message_id");

    let outputs: Vec<_> = got.iter().filter(|m| m.subject.as_str() != "chat.dlq").collect();
    for m in &outputs {
        let h = m.headers.as_ref().expect("headers");
        assert_eq!(h.get("Content-Type").unwrap().as_str(), "application/x-protobuf");
        let json = as_json(m);
        // The stream's key: its message id, then its own stream id when it has one.
        let (message, stream) =
            (json["stream"]["message_id"].as_str().unwrap(), json["stream"]["stream_id"].as_str().unwrap());
        let key = if stream == message { message.to_owned() } else { format!("{message}/{stream}") };
        let expected_id = format!("{key}:{}", json["seq"].as_str().unwrap());
        assert_eq!(h.get("Nats-Msg-Id").unwrap().as_str(), expected_id);
        assert_eq!(h.get("traceparent").unwrap().as_str(), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    }

    // Same messages as `replay`, stream by stream, in the same order.
    let mut replayed = Vec::new();
    structured_sink::replay::replay(&config, transcript.as_bytes(), &mut replayed, std::io::sink()).unwrap();
    let expected = by_stream(String::from_utf8(replayed).unwrap().lines().map(|l| {
        let v: Value = serde_json::from_str(l).unwrap();
        (v["subject"].as_str().unwrap().to_owned(), v["message"].clone())
    }));
    let actual = by_stream(outputs.iter().map(|m| (m.subject.to_string(), as_json(m))));
    assert_eq!(actual.len(), 2);
    assert_eq!(actual, expected);
}

#[tokio::test]
async fn many_interleaved_streams_keep_their_order_in_worker_tasks() {
    many_interleaved_streams_keep_their_order(2).await;
}

#[tokio::test]
async fn many_interleaved_streams_keep_their_order_in_the_input_task() {
    many_interleaved_streams_keep_their_order(1).await;
}

async fn many_interleaved_streams_keep_their_order(shards: usize) {
    let server = NatsServer::start();
    let mut config = test_config(&server.url());
    config.shards.count = shards;
    config.shards.inbox_capacity = 8;
    let service = RunningService::start(config).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();

    let streams = 200;
    let deltas = 20;
    for d in 0..deltas {
        for s in 0..streams {
            let text =
                if d == 5 { "<myapp:ModeSwitch:v1>x: 1</myapp:ModeSwitch:v1>".to_owned() } else { format!("{d},") };
            let event = serde_json::json!({"type": "partial", "meta": {"message_id": format!("m-{s}")}, "delta": text});
            client.publish("chat", event.to_string().into()).await.unwrap();
        }
    }
    for s in 0..streams {
        let event = serde_json::json!({"type": "final", "meta": {"message_id": format!("m-{s}")}});
        client.publish("chat", event.to_string().into()).await.unwrap();
    }
    let got = collect(&mut filtered, Duration::from_secs(10), |ms| finals(ms) == streams).await;
    service.shutdown().await.unwrap();

    let mut per_stream: BTreeMap<String, Vec<proto::FilteredText>> = BTreeMap::new();
    for m in &got {
        let t = proto::FilteredText::decode(m.payload.clone()).unwrap();
        per_stream.entry(t.stream.as_ref().unwrap().message_id.clone()).or_default().push(t);
    }
    assert_eq!(per_stream.len(), streams);
    let expected: String = (0..deltas).filter(|d| *d != 5).map(|d| format!("{d},")).collect();
    for (id, texts) in per_stream {
        let seqs: Vec<u64> = texts.iter().map(|t| t.seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{id}: {seqs:?}");
        let joined: String = texts.iter().map(|t| t.delta.as_str()).collect();
        assert_eq!(joined, expected, "{id}");
        assert_eq!(texts.last().unwrap().text, expected);
    }
}

#[tokio::test]
async fn pass_through_and_every_bad_input_case_in_worker_tasks() {
    pass_through_and_every_bad_input_case(2).await;
}

#[tokio::test]
async fn pass_through_and_every_bad_input_case_in_the_input_task() {
    pass_through_and_every_bad_input_case(1).await;
}

/// An input that just fits the server's `max_payload` does not fit once the dead letter's or the
/// pass-through copy's headers are added: the copy could never be published, and the event was
/// lost (counted as a publish error). It now goes without its payload, with its size in
/// `Structured-Sink-Payload-Omitted`; smaller ones keep theirs.
#[tokio::test]
async fn a_forwarded_copy_too_large_for_the_server_goes_without_its_payload() {
    let server = NatsServer::builder().config("max_payload: 4096\n").start();
    let mut config = test_config(&server.url());
    config.input.pass_through_subject = "chat.other".into();
    let service = RunningService::start(config).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut dlq = client.subscribe("chat.dlq").await.unwrap();
    let mut other = client.subscribe("chat.other").await.unwrap();
    client.flush().await.unwrap();
    let invalid = |size: usize| format!("not json {}", "x".repeat(size - 9));
    let tool = |size: usize| {
        let head = r#"{"type":"tool-call","meta":{"message_id":"t"},"pad":""#;
        format!("{head}{}\"}}", "x".repeat(size - head.len() - 2))
    };
    for payload in [invalid(4090), invalid(100)] {
        client.publish("chat", payload.into()).await.unwrap();
    }
    for payload in [tool(4090), tool(100)] {
        client.publish("chat", payload.into()).await.unwrap();
    }
    let dead = collect(&mut dlq, Duration::from_secs(10), |ms| ms.len() == 2).await;
    let passed = collect(&mut other, Duration::from_secs(10), |ms| ms.len() == 2).await;
    let metrics = service.metrics().snapshot();
    service.shutdown().await.unwrap();
    for (copies, what) in [(&dead, "dead letters"), (&passed, "pass-through events")] {
        let sizes: Vec<(usize, Option<String>)> = copies
            .iter()
            .map(|m| {
                (
                    m.payload.len(),
                    m.headers.as_ref().unwrap().get("Structured-Sink-Payload-Omitted").map(|v| v.to_string()),
                )
            })
            .collect();
        assert_eq!(sizes, [(0, Some("4090".to_owned())), (100, None)], "{what}");
    }
    assert_eq!(dead[0].headers.as_ref().unwrap().get("Structured-Sink-Error").unwrap().as_str(), "invalid_json");
    assert_eq!((metrics.payloads_omitted, metrics.publish_errors_total()), (2, 0));
}

/// Outputs grow past what any one input brings: a final carries the whole visible text, a
/// completed block its whole payload parsed twice over. Over the server's `max_payload` their
/// publish failed for good (counted as a publish error) and the stream had no final, the block no
/// `completed`, while the input was taken. They now go with their bulk left out.
#[tokio::test]
async fn outputs_too_large_for_the_server_go_with_their_bulk_left_out() {
    let server = NatsServer::builder().config("max_payload: 16384\n").start();
    let service = RunningService::start(test_config(&server.url())).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    let mut blocks = client.subscribe("chat.structured.>").await.unwrap();
    client.flush().await.unwrap();
    let partial =
        |delta: &str| serde_json::json!({"type": "partial", "meta": {"message_id": "big"}, "delta": delta}).to_string();
    let prose = "word ".repeat(40);
    // 20,000 bytes of visible text; a block of 300 entries (7.8 KB raw, 17 KB with its value).
    let mut deltas = vec![prose.clone(); 100];
    deltas.push("<myapp:ModeSwitch:v1>\n".to_owned());
    deltas.extend((0..300).map(|i| format!("key_{i}: value number {i}\n")));
    deltas.push("</myapp:ModeSwitch:v1>".to_owned());
    for delta in &deltas {
        client.publish("chat", partial(delta).into()).await.unwrap();
    }
    let last = r#"{"type":"final","meta":{"message_id":"big","stop_reason":"stop"}}"#;
    client.publish("chat", last.into()).await.unwrap();
    let texts = collect(&mut filtered, Duration::from_secs(10), |ms| {
        ms.last().is_some_and(|m| proto::FilteredText::decode(m.payload.clone()).unwrap().r#final)
    })
    .await;
    let block_events = collect(&mut blocks, Duration::from_secs(5), |ms| {
        ms.iter().any(|m| {
            matches!(
                proto::BlockEvent::decode(m.payload.clone()).unwrap().event,
                Some(proto::block_event::Event::Completed(_))
            )
        })
    })
    .await;
    let metrics = service.metrics().snapshot();
    service.shutdown().await.unwrap();

    let last = proto::FilteredText::decode(texts.last().expect("outputs").payload.clone()).unwrap();
    assert!(last.r#final, "the stream's final arrived");
    assert!(last.text_omitted && last.text.is_empty(), "{:?}", (last.text_omitted, last.text.len()));
    let completed = block_events
        .iter()
        .find_map(|m| match proto::BlockEvent::decode(m.payload.clone()).unwrap().event {
            Some(proto::block_event::Event::Completed(completed)) => Some(completed),
            _ => None,
        })
        .expect("the block completed");
    assert!(completed.payload_omitted && !completed.success && completed.value.is_none(), "{completed:?}");
    assert!(completed.raw.trim_start().starts_with("key_0: value number 0\n"), "the raw payload fits: kept");
    assert_eq!(metrics.publish_errors_total(), 0);
    assert!(metrics.outputs_trimmed >= 2, "{}", metrics.outputs_trimmed);
}

async fn pass_through_and_every_bad_input_case(shards: usize) {
    let server = NatsServer::start();
    let mut config = test_config(&server.url());
    config.shards.count = shards;
    config.input.pass_through_subject = "chat.other".into();
    config.input.max_event_bytes = 4096;
    let service = RunningService::start(config).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut dlq = client.subscribe("chat.dlq").await.unwrap();
    let mut other = client.subscribe("chat.other").await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();

    let big = format!(r#"{{"type":"partial","meta":{{"message_id":"big"}},"delta":"{}"}}"#, "x".repeat(5000));
    // Under the event limit, over the id limit.
    let long_id = format!(r#"{{"type":"partial","meta":{{"message_id":"{}"}},"delta":"x"}}"#, "m".repeat(3000));
    let cases: Vec<(String, &str)> = vec![
        ("not json".into(), "invalid_json"),
        ("[1,2,3]".into(), "not_an_object"),
        (r#"{"type":"partial","meta":{},"delta":"x"}"#.into(), "missing_message_id"),
        (r#"{"type":"partial","meta":{"message_id":""},"delta":"x"}"#.into(), "missing_message_id"),
        (r#"{"type":"partial","meta":{"message_id":"w"},"delta":42}"#.into(), "wrong_field_type"),
        (r#"{"type":"partial","meta":{"message_id":"w"},"delta":"\ud800"}"#.into(), "invalid_json"),
        (big, "too_large"),
        (long_id, "invalid_message_id"),
    ];
    for (payload, _) in &cases {
        client.publish("chat", payload.clone().into()).await.unwrap();
    }
    let tool = r#"{"type":"tool-call","meta":{"message_id":"ok-1"},"tool_call":{"id":"t1","name":"x","input":"{}"}}"#;
    client.publish("chat", tool.into()).await.unwrap();
    // A healthy stream alongside: unaffected.
    client.publish("chat", r#"{"type":"partial","meta":{"message_id":"ok-1"},"delta":"fine"}"#.into()).await.unwrap();
    client.publish("chat", r#"{"type":"final","meta":{"message_id":"ok-1"}}"#.into()).await.unwrap();
    // An event after the final: late, dead-lettered.
    client.publish("chat", r#"{"type":"partial","meta":{"message_id":"ok-1"},"delta":"late"}"#.into()).await.unwrap();

    let dead = collect(&mut dlq, Duration::from_secs(5), |ms| ms.len() == cases.len() + 1).await;
    let passed = collect(&mut other, Duration::from_secs(5), |ms| !ms.is_empty()).await;
    let texts = collect(&mut filtered, Duration::from_secs(5), |ms| finals(ms) == 1).await;
    assert!(service.is_ready(), "bad input never stops the service");
    let metrics = service.metrics().render();
    service.shutdown().await.unwrap();

    let reasons: Vec<String> =
        dead.iter().map(|m| m.headers.as_ref().unwrap().get("Structured-Sink-Error").unwrap().to_string()).collect();
    let mut expected: Vec<String> = cases.iter().map(|(_, r)| (*r).to_owned()).collect();
    expected.push("stream_finished".into());
    assert_eq!(reasons, expected);
    for (m, (payload, _)) in dead.iter().zip(&cases) {
        assert_eq!(m.payload.as_ref(), payload.as_bytes(), "dead letters carry the event unchanged");
        assert_eq!(m.headers.as_ref().unwrap().get("Structured-Sink-Source-Subject").unwrap().as_str(), "chat");
    }
    assert_eq!(passed.len(), 1);
    assert_eq!(passed[0].payload.as_ref(), tool.as_bytes());
    let last = proto::FilteredText::decode(texts.last().unwrap().payload.clone()).unwrap();
    assert_eq!(last.text, "fine");
    assert!(metrics.contains("structured_sink_events_dead_lettered_total{reason=\"too_large\"} 1"), "{metrics}");
}

/// Core NATS input with the server gone: async-nats handles the subscription's drain only while
/// connected, so the subscription never ended and the shutdown waited out its whole timeout and
/// failed, without closing the open streams. It must end in time, in both routings.
#[tokio::test]
async fn core_shutdown_with_the_server_gone_ends_in_time() {
    for shards in [1, 2] {
        let mut server = NatsServer::start();
        let mut config = test_config(&server.url());
        config.shards.count = shards;
        config.service.shutdown_timeout_ms = 15_000;
        let service = RunningService::start(config).await.unwrap();
        let client = async_nats::connect(server.url()).await.unwrap();
        let mut filtered = client.subscribe("chat.filtered").await.unwrap();
        client.flush().await.unwrap();
        client.publish("chat", r#"{"type":"partial","meta":{"message_id":"m"},"delta":"open "}"#.into()).await.unwrap();
        let out = collect(&mut filtered, Duration::from_secs(10), |ms| !ms.is_empty()).await;
        assert_eq!(out.len(), 1, "the stream is open");
        server.stop();
        wait_until(Duration::from_secs(20), "the service saw the connection go", || !service.is_ready()).await;
        let started = std::time::Instant::now();
        let stopped = service.shutdown().await;
        assert!(
            stopped.is_ok(),
            "{shards} shard(s): stopped within the timeout: {stopped:?} after {:?}",
            started.elapsed()
        );
    }
}

/// Readiness asks the client for its state (the client may drop its connection events): it
/// follows the server away and back, and the service works again afterwards.
#[tokio::test]
async fn readiness_follows_the_connection_across_a_server_restart() {
    let mut server = NatsServer::start();
    let service = RunningService::start(test_config(&server.url())).await.unwrap();
    assert!(service.is_ready());
    server.stop();
    wait_until(Duration::from_secs(20), "not ready without a server", || !service.is_ready()).await;
    server.restart();
    wait_until(Duration::from_secs(20), "ready once reconnected", || service.is_ready()).await;
    let out =
        filtered_outputs_of(&server.url(), r#"{"type":"partial","meta":{"message_id":"m"},"delta":"back"}"#).await;
    assert_eq!(out.len(), 1, "the input subscription is restored");
    service.shutdown().await.unwrap();
}

async fn wait_until(limit: Duration, what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn idle_streams_expire_and_shutdown_closes_the_rest_in_worker_tasks() {
    idle_streams_expire_and_shutdown_closes_the_rest(2).await;
}

#[tokio::test]
async fn idle_streams_expire_and_shutdown_closes_the_rest_in_the_input_task() {
    idle_streams_expire_and_shutdown_closes_the_rest(1).await;
}

async fn idle_streams_expire_and_shutdown_closes_the_rest(shards: usize) {
    let server = NatsServer::start();
    let mut config = test_config(&server.url());
    config.shards.count = shards;
    config.shards.idle_timeout_ms = 300;
    config.shards.expiry_tick_ms = 50;
    let service = RunningService::start(config.clone()).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    let mut blocks = client.subscribe("chat.structured.>").await.unwrap();
    client.flush().await.unwrap();
    client
        .publish("chat", r#"{"type":"partial","meta":{"message_id":"idle"},"delta":"hello <"}"#.into())
        .await
        .unwrap();
    let got = collect(&mut filtered, Duration::from_secs(5), |ms| finals(ms) == 1).await;
    let last = proto::FilteredText::decode(got.last().unwrap().payload.clone()).unwrap();
    assert_eq!((last.finish_reason.as_str(), last.delta.as_str(), last.text.as_str()), ("expired", "<", "hello <"));
    service.shutdown().await.unwrap();

    // Shutdown mid-stream: held bytes released, the open block completed, reason `shutdown`.
    config.shards.idle_timeout_ms = 60_000;
    let service = RunningService::start(config).await.unwrap();
    client
        .publish(
            "chat",
            r#"{"type":"partial","meta":{"message_id":"cut"},"delta":"a <myapp:ModeSwitch:v1>x: 1"}"#.into(),
        )
        .await
        .unwrap();
    // A round trip through the server (its "no responders" answer): the event has been routed
    // to the service before shutdown begins. (`flush` only empties the local write buffer.)
    let fence = client.request("test.fence", "".into()).await;
    assert!(fence.is_err_and(|e| e.kind() == async_nats::client::RequestErrorKind::NoResponders));
    // The event is on its way; shutdown must still process it.
    service.shutdown().await.unwrap();
    let got = collect(&mut filtered, Duration::from_secs(5), |ms| finals(ms) == 1).await;
    let last = proto::FilteredText::decode(got.last().unwrap().payload.clone()).unwrap();
    assert_eq!((last.finish_reason.as_str(), last.text.as_str()), ("shutdown", "a "));
    let events = collect(&mut blocks, Duration::from_secs(5), |ms| ms.len() == 3).await;
    let completed = proto::BlockEvent::decode(events[2].payload.clone()).unwrap();
    match completed.event {
        Some(proto::block_event::Event::Completed(c)) => {
            assert!(!c.success);
            assert_eq!(c.error, "missing close tag </myapp:ModeSwitch:v1>");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn reconnects_after_the_server_restarts() {
    let mut server = NatsServer::start();
    let service = RunningService::start(test_config(&server.url())).await.unwrap();
    server.restart();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    // Publish until the service has resubscribed and answers.
    let mut got = Vec::new();
    for attempt in 0..50 {
        let event =
            serde_json::json!({"type": "final", "meta": {"message_id": format!("after-{attempt}")}, "text": "back"});
        client.publish("chat", event.to_string().into()).await.unwrap();
        got = collect(&mut filtered, Duration::from_millis(200), |ms| !ms.is_empty()).await;
        if !got.is_empty() {
            break;
        }
    }
    assert!(!got.is_empty(), "no output after the restart");
    let text = proto::FilteredText::decode(got[0].payload.clone()).unwrap();
    assert_eq!(text.text, "back");
    assert!(service
        .metrics()
        .render()
        .contains("structured_sink_nats_connection_events_total{event=\"disconnected\"} 1"));
    service.shutdown().await.unwrap();
}

#[tokio::test]
async fn replicas_are_discoverable_and_report_health() {
    let server = NatsServer::start();
    let service = RunningService::start(test_config(&server.url())).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();

    let ping = client.request("$SRV.PING.structured-sink", "".into()).await.unwrap();
    let ping: Value = serde_json::from_slice(&ping.payload).unwrap();
    assert_eq!(ping["name"], "structured-sink");
    assert_eq!(ping["version"], env!("CARGO_PKG_VERSION"));
    let stats = client.request("$SRV.STATS.structured-sink", "".into()).await.unwrap();
    let stats: Value = serde_json::from_slice(&stats.payload).unwrap();
    assert!(stats["endpoints"][0]["data"]["events_received"].is_u64(), "{stats}");

    let address = service.http_address().unwrap();
    let get = |path: &'static str| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    };
    assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
    assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
    let metrics = get("/metrics").await;
    assert!(metrics.contains("structured_sink_events_received_total"), "{metrics}");
    service.shutdown().await.unwrap();
}

/// Text as geppetto events (`output.format = "geppetto-json"`).
fn geppetto_json(config: &mut Config) {
    config.output.format = structured_sink::config::OutputFormat::GeppettoJson;
}

#[tokio::test]
async fn geppetto_json_output_keeps_each_streams_vocabulary() {
    let (Running { server: _server, service, client }, [mut filtered, mut blocks]) =
        running(geppetto_json, ["chat.filtered", "chat.structured.>"]).await;
    for line in include_str!("../../examples/transcripts/conversation.jsonl").lines() {
        client.publish("chat", line.as_bytes().to_vec().into()).await.unwrap();
    }
    let is_end = |m: &async_nats::Message| {
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        matches!(v["type"].as_str(), Some("final" | "text-segment-finished"))
    };
    let got = collect(&mut filtered, Duration::from_secs(5), |ms| ms.iter().filter(|m| is_end(m)).count() == 2).await;
    let block = collect(&mut blocks, Duration::from_secs(5), |ms| !ms.is_empty()).await;
    service.shutdown().await.unwrap();

    let events: Vec<Value> = got.iter().map(|m| serde_json::from_slice(&m.payload).unwrap()).collect();
    for m in &got {
        assert_eq!(m.headers.as_ref().unwrap().get("Content-Type").unwrap().as_str(), "application/json");
    }
    let legacy: Vec<&Value> =
        events.iter().filter(|e| e["meta"]["message_id"] == "3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071").collect();
    assert!(legacy[..legacy.len() - 1].iter().all(|e| e["type"] == "partial"));
    let mut completion = String::new();
    for e in &legacy[..legacy.len() - 1] {
        completion.push_str(e["delta"].as_str().unwrap());
        assert_eq!(e["completion"].as_str().unwrap(), completion, "completion is the cumulative filtered text");
    }
    let last = legacy.last().unwrap();
    assert_eq!(last["type"], "final");
    assert_eq!(last["meta"]["stop_reason"], "stop");
    assert!(!last["text"].as_str().unwrap().contains("<myapp:ModeSwitch:v1>"));

    let canonical: Vec<&Value> =
        events.iter().filter(|e| e["meta"]["message_id"] == "9b1d7f00-0000-4000-8000-000000000002").collect();
    assert!(canonical[..canonical.len() - 1].iter().all(|e| e["type"] == "text-delta"));
    assert_eq!(canonical.last().unwrap()["type"], "text-segment-finished");
    assert_eq!(canonical.last().unwrap()["text"], "Sources:  done.");
    // Typed events stay protobuf.
    assert_eq!(block[0].headers.as_ref().unwrap().get("Content-Type").unwrap().as_str(), "application/x-protobuf");
}

/// An upstream `error` ends its stream with the error's text, and an `interrupt` as an interrupt:
/// in the protobuf final (`error`, `finish_reason`) and, in geppetto-json, as the same event type
/// the agent sent, each with the text held back until the end.
#[tokio::test]
async fn upstream_errors_and_interrupts_end_their_streams_with_what_they_said() {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let events = [
        r#"{"type":"partial","meta":{"message_id":"err-1"},"delta":"Checking \u003cmy","completion":"Checking \u003cmy"}"#,
        r#"{"type":"error","error":{},"meta":{"message_id":"err-1"},"error_string":"rate limit \u003cexceeded\u003e"}"#,
        r#"{"type":"text-delta","meta":{"message_id":"int-1"},"correlation":{"segment_id":"seg-1"},"delta":"Stop","text":"Stop","sequence":1}"#,
        r#"{"type":"interrupt","meta":{"message_id":"int-1"},"correlation":{"segment_id":"seg-1"},"text":"Stop"}"#,
    ];
    for format in [structured_sink::config::OutputFormat::Protobuf, structured_sink::config::OutputFormat::GeppettoJson]
    {
        let mut config = test_config(&server.url());
        config.output.format = format;
        let service = RunningService::start(config).await.unwrap();
        let mut filtered = client.subscribe("chat.filtered").await.unwrap();
        client.flush().await.unwrap();
        for event in events {
            client.publish("chat", event.into()).await.unwrap();
        }
        client.flush().await.unwrap();
        let got = collect(&mut filtered, Duration::from_secs(5), |ms| ms.len() == 4).await;
        service.shutdown().await.unwrap();
        assert_eq!(got.len(), 4, "{format:?}");
        let last_of = |id: &str| -> Value {
            let of_stream: Vec<Value> = got
                .iter()
                .map(|m| match format {
                    structured_sink::config::OutputFormat::Protobuf => as_json(m),
                    _ => serde_json::from_slice(&m.payload).unwrap(),
                })
                .filter(|v| v["stream"]["message_id"] == id || v["meta"]["message_id"] == id)
                .collect();
            assert_eq!(of_stream.len(), 2, "{id}: {of_stream:?}");
            of_stream[1].clone()
        };
        let (error, interrupt) = (last_of("err-1"), last_of("int-1"));
        match format {
            structured_sink::config::OutputFormat::Protobuf => {
                assert_eq!(error["finish_reason"], "error", "{error}");
                assert_eq!(error["error"], "rate limit <exceeded>", "{error}");
                assert_eq!((&error["delta"], &error["text"]), (&"<my".into(), &"Checking <my".into()), "{error}");
                assert_eq!(interrupt["finish_reason"], "interrupt", "{interrupt}");
                assert!(interrupt.get("error").is_none(), "{interrupt}");
            }
            _ => {
                assert_eq!(error["type"], "error", "{error}");
                assert_eq!(error["error_string"], "rate limit <exceeded>", "{error}");
                assert_eq!((&error["delta"], &error["text"]), (&"<my".into(), &"Checking <my".into()), "{error}");
                assert_eq!(interrupt["type"], "interrupt", "{interrupt}");
                assert_eq!(interrupt["text"], "Stop", "{interrupt}");
                assert_eq!(interrupt["correlation"]["segment_id"], "seg-1", "{interrupt}");
            }
        }
    }
}

/// geppetto keeps `error` and `interrupt` in their legacy shape in the canonical vocabulary: they
/// name no segment, and may come while a text segment is open (a provider error in the middle of
/// one). Such an event ends every open segment of its message, each as that event type with the
/// segment's own filtered text, at once. Before, the segments stayed open until idle expiry (their
/// last text held back) and the event opened and ended a stream of the message id instead.
#[tokio::test]
async fn an_error_or_interrupt_naming_no_segment_ends_the_open_segments_of_its_message() {
    let (Running { server: _server, service, client }, [mut filtered]) =
        running(geppetto_json, ["chat.filtered"]).await;
    let delta = |message: &str, segment: &str, text: &str| {
        format!(
            r#"{{"type":"text-delta","meta":{{"message_id":"{message}"}},"correlation":{{"segment_id":"{segment}"}},"delta":"{text}"}}"#
        )
    };
    for event in [
        delta("fail-1", "fail-1:a", r"Looking \u003cmy"),
        delta("stop-1", "stop-1:a", "Halfway"),
        delta("fail-1", "fail-1:b", "Also"),
        r#"{"type":"error","error":{},"meta":{"message_id":"fail-1"},"error_string":"provider failed"}"#.to_owned(),
        r#"{"type":"interrupt","meta":{"message_id":"stop-1"},"text":"Halfway there"}"#.to_owned(),
    ] {
        client.publish("chat", event.into()).await.unwrap();
    }
    client.flush().await.unwrap();
    let ends = |ms: &[async_nats::Message]| {
        ms.iter().filter(|m| !serde_json::from_slice::<Value>(&m.payload).unwrap()["type"].eq("text-delta")).count()
    };
    // The idle timeout is minutes: only the events' own effect ends the segments this soon.
    let got = collect(&mut filtered, Duration::from_secs(10), |ms| ends(ms) == 3).await;
    service.shutdown().await.unwrap();
    let mut last: BTreeMap<String, Value> = BTreeMap::new();
    for m in &got {
        let event: Value = serde_json::from_slice(&m.payload).unwrap();
        last.insert(event["correlation"]["segment_id"].as_str().expect("every output names its segment").into(), event);
    }
    assert_eq!(last.keys().collect::<Vec<_>>(), ["fail-1:a", "fail-1:b", "stop-1:a"], "{got:?}");
    for (segment, text) in [("fail-1:a", "Looking <my"), ("fail-1:b", "Also")] {
        let end = &last[segment];
        assert_eq!((&end["type"], &end["error_string"]), (&"error".into(), &"provider failed".into()), "{end}");
        assert_eq!(end["text"], text, "the segment's own text, held-back bytes released: {end}");
    }
    let stop = &last["stop-1:a"];
    assert_eq!((&stop["type"], &stop["text"]), (&"interrupt".into(), &"Halfway".into()), "{stop}");
}

/// geppetto sends `provider-call-finished` after a provider call's last event. A segment still
/// open then was cut short: geppetto's OpenAI Responses engine finishes no segment when the call
/// is cancelled or its connection fails. The segment ends at once with the call's
/// `finish_class`, and the event is forwarded unchanged, as before. Before, the segment stayed
/// open until idle expiry.
#[tokio::test]
async fn the_end_of_a_provider_call_ends_its_open_segments_and_is_forwarded() {
    let pass_through = |config: &mut Config| config.input.pass_through_subject = "chat.other".into();
    let (Running { server: _server, service, client }, [mut filtered, mut other]) =
        running(pass_through, ["chat.filtered", "chat.other"]).await;
    let delta = r#"{"type":"text-delta","meta":{"message_id":"c-1"},"correlation":{"segment_id":"c-1:a","provider_call_id":"pc-1"},"delta":"Half an \u003cmy"}"#;
    let end = r#"{"type":"provider-call-finished","meta":{"message_id":"c-1"},"correlation":{"provider_call_id":"pc-1"},"stop_reason":"cancelled","finish_class":"cancelled"}"#;
    for event in [delta, end] {
        client.publish("chat", event.into()).await.unwrap();
    }
    client.flush().await.unwrap();
    // The idle timeout is minutes: only the event's own effect ends the segment this soon.
    let got =
        collect(&mut filtered, Duration::from_secs(10), |ms| ms.iter().any(|m| as_json(m)["final"] == true)).await;
    let forwarded = collect(&mut other, Duration::from_secs(10), |ms| !ms.is_empty()).await;
    service.shutdown().await.unwrap();
    let end_of_segment = as_json(got.last().expect("outputs"));
    assert_eq!(end_of_segment["final"], true, "{end_of_segment}");
    assert_eq!(end_of_segment["stream"]["stream_id"], "c-1:a");
    assert_eq!(end_of_segment["finish_reason"], "cancelled");
    assert_eq!(end_of_segment["text"], "Half an <my", "held-back bytes released");
    assert_eq!(forwarded.len(), 1);
    assert_eq!(forwarded[0].payload.as_ref(), end.as_bytes(), "forwarded unchanged");
}

/// `nats.retry_on_initial_connect`: with no server reachable, start-up waits for one, alive
/// (`/healthz` answers) but not ready (`/readyz` 503); once a server is up it completes, becomes
/// ready and processes events.
#[tokio::test]
async fn with_retry_on_initial_connect_start_up_waits_for_a_server_alive_but_not_ready() {
    let mut server = NatsServer::start();
    let url = server.url();
    server.stop();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut config = test_config(&url);
    config.nats.retry_on_initial_connect = true;
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{port}");
    let starting = tokio::spawn(RunningService::start(config));
    let get = |path: &'static str| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        Some(response)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while get("/healthz").await.is_none() {
        assert!(std::time::Instant::now() < deadline, "the HTTP endpoint came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(get("/healthz").await.unwrap().starts_with("HTTP/1.1 200"));
    assert!(get("/readyz").await.unwrap().starts_with("HTTP/1.1 503"), "not ready without a server");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!starting.is_finished(), "start-up waits for the server");
    assert!(get("/readyz").await.unwrap().starts_with("HTTP/1.1 503"));

    server.restart();
    let service =
        tokio::time::timeout(Duration::from_secs(60), starting).await.expect("start-up completes").unwrap().unwrap();
    assert!(get("/readyz").await.unwrap().starts_with("HTTP/1.1 200"), "ready once started");
    let out =
        filtered_outputs_of(&server.url(), r#"{"type":"final","meta":{"message_id":"late"},"text":"hello"}"#).await;
    assert_eq!(out.len(), 1, "events flow once connected");
    service.shutdown().await.unwrap();
}

/// With `nats.max_reconnects`, a connection the client gave up on is gone for good: `/healthz`
/// fails, so an orchestrator restarts the process instead of keeping a replica that serves
/// nothing.
#[tokio::test]
async fn a_connection_given_up_on_fails_the_liveness_probe() {
    let mut server = NatsServer::start();
    let mut config = test_config(&server.url());
    config.nats.max_reconnects = Some(1);
    config.http.enabled = true;
    config.http.listen = "127.0.0.1:0".into();
    let service = RunningService::start(config).await.unwrap();
    let address = service.http_address().unwrap();
    let get = |path: &'static str| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    };
    assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
    server.stop();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let health = loop {
        let health = get("/healthz").await;
        if !health.starts_with("HTTP/1.1 200") || std::time::Instant::now() > deadline {
            break health;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(health.starts_with("HTTP/1.1 503") && health.contains("closed for good"), "{health}");
    assert!(get("/readyz").await.starts_with("HTTP/1.1 503"));
    let _ = service.shutdown().await;
}

/// `nats.retry_on_initial_connect` with `nats.max_reconnects`: once the client gives up, start-up
/// fails with a clear error instead of waiting forever.
#[tokio::test]
async fn waiting_for_a_first_connection_ends_when_the_client_gives_up() {
    let mut server = NatsServer::start();
    let url = server.url();
    server.stop();
    let mut config = test_config(&url);
    config.nats.retry_on_initial_connect = true;
    config.nats.max_reconnects = Some(2);
    let started = tokio::time::timeout(Duration::from_secs(60), RunningService::start(config)).await;
    let error = started.expect("start-up ends").err().expect("no server ever accepted");
    assert!(error.to_string().contains("max_reconnects"), "{error}");
}
