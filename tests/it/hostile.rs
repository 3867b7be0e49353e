//! Hostile input against a real server: oversized, deep and malformed events, ids that are not
//! subject tokens, blocks that never close or outgrow their limit, a flood of abandoned streams,
//! and payload text that must never reach a log line or a metric label. Every test runs a healthy
//! stream alongside and checks it is unaffected.

use std::io::Read as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use prost::Message as _;
use serde_json::{json, Value};
use structured_sink::codec::proto;
use structured_sink::service::RunningService;

use crate::service::{collect, test_config};
use crate::support::{sigterm, NatsServer, OtlpCollector};

fn partial(id: &str, delta: &str) -> String {
    json!({"type": "partial", "meta": {"message_id": id}, "delta": delta}).to_string()
}

fn final_event(id: &str) -> String {
    json!({"type": "final", "meta": {"message_id": id}}).to_string()
}

fn error_header(m: &async_nats::Message) -> String {
    m.headers.as_ref().and_then(|h| h.get("Structured-Sink-Error")).map(|v| v.to_string()).unwrap_or_default()
}

fn texts(ms: &[async_nats::Message]) -> Vec<proto::FilteredText> {
    ms.iter().map(|m| proto::FilteredText::decode(m.payload.clone()).unwrap()).collect()
}

/// The final `FilteredText` of stream `id` among `ms`, if it arrived.
fn final_of(ms: &[async_nats::Message], id: &str) -> Option<proto::FilteredText> {
    texts(ms).into_iter().find(|t| t.r#final && t.stream.as_ref().is_some_and(|s| s.message_id == id))
}

/// The visible text of stream `id`: its deltas joined.
fn visible(ms: &[async_nats::Message], id: &str) -> String {
    texts(ms).into_iter().filter(|t| t.stream.as_ref().is_some_and(|s| s.message_id == id)).map(|t| t.delta).collect()
}

#[tokio::test]
async fn oversized_deep_and_long_id_events_are_dead_lettered_while_a_ten_mib_delta_passes() {
    let server = NatsServer::builder().config("max_payload: 16777216\n").start();
    let mut config = test_config(&server.url());
    config.input.max_event_bytes = 11 << 20;
    let service = RunningService::start(config).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut dlq = client.subscribe("chat.dlq").await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();

    let ten_mib = "a".repeat(10 << 20);
    let twelve_mib = partial("too-big", &"b".repeat(12 << 20));
    // Nesting far beyond any parser's recursion limit, in a field the service reads and as the
    // whole event: refused without recursing. (In a field the service ignores, deep nesting is
    // skipped without recursion and the event is processed.)
    let deep_field = format!(
        r#"{{"type":"partial","meta":{{"message_id":"deep"}},"delta":{}{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let deep_event = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_ignored = format!(
        r#"{{"type":"partial","meta":{{"message_id":"healthy"}},"delta":"between ","extra":{}1{}}}"#,
        "{\"a\":".repeat(100_000),
        "}".repeat(100_000)
    );
    let long_id = partial(&"m".repeat(10 * 1024), "x");
    // Every output of a stream carries its session id: a huge one is refused, by name.
    let long_session = format!(
        r#"{{"type":"partial","meta":{{"message_id":"long-session","session_id":"{}"}},"delta":"x"}}"#,
        "s".repeat(10 * 1024)
    );
    client.publish("chat", partial("healthy", "before ").into()).await.unwrap();
    for bad in [&twelve_mib, &deep_field, &deep_event, &long_id, &long_session] {
        client.publish("chat", bad.clone().into()).await.unwrap();
    }
    client.publish("chat", deep_ignored.into()).await.unwrap();
    client.publish("chat", partial("huge", &ten_mib).into()).await.unwrap();
    client.publish("chat", final_event("huge").into()).await.unwrap();
    client.publish("chat", partial("healthy", "after").into()).await.unwrap();
    client.publish("chat", final_event("healthy").into()).await.unwrap();

    let dead = collect(&mut dlq, Duration::from_secs(10), |ms| ms.len() == 5).await;
    let out = collect(&mut filtered, Duration::from_secs(10), |ms| {
        final_of(ms, "healthy").is_some() && final_of(ms, "huge").is_some()
    })
    .await;
    assert!(service.is_ready(), "hostile input never stops the service");
    let metrics = service.metrics().snapshot();
    service.shutdown().await.unwrap();

    let reasons: Vec<String> = dead.iter().map(error_header).collect();
    assert_eq!(reasons, ["too_large", "wrong_field_type", "not_an_object", "invalid_message_id", "field_too_long"]);
    assert_eq!(dead[0].payload.len(), twelve_mib.len(), "the dead letter carries the event unchanged");
    assert_eq!(dead[1].payload.as_ref(), deep_field.as_bytes());
    assert_eq!(visible(&out, "healthy"), "before between after");
    assert_eq!(visible(&out, "huge").len(), 10 << 20, "a 10 MiB delta under the limit is delivered whole");
    let huge = final_of(&out, "huge").unwrap();
    assert!(huge.text_omitted, "10 MiB is over pipeline.max_text_bytes: the final omits the whole text");
    assert_eq!(metrics.events_dead_lettered["too_large"], 1);
    assert_eq!(metrics.events_dead_lettered["field_too_long"], 1);
    let detail = dead[4].headers.as_ref().and_then(|h| h.get("Structured-Sink-Error-Detail")).map(|v| v.to_string());
    assert_eq!(detail.as_deref(), Some("meta.session_id is longer than 256 bytes"));
}

#[tokio::test]
async fn message_ids_with_subject_syntax_are_processed_and_never_reach_a_subject() {
    let server = NatsServer::start();
    let service = RunningService::start(test_config(&server.url())).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    // Every subject anything is published on, service API traffic included.
    let mut everything = client.subscribe(">").await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();

    let ids = ["a.b", "a*", "a>", "a b", "x.>.*", "%2E", "tab\u{3000}wide", "é.€"];
    for id in ids {
        let text = format!("hi <myapp:ModeSwitch:v1>new_mode: x</myapp:ModeSwitch:v1> {id}");
        client.publish("chat", partial(id, &text).into()).await.unwrap();
        client.publish("chat", final_event(id).into()).await.unwrap();
    }
    let out =
        collect(&mut filtered, Duration::from_secs(5), |ms| ids.iter().all(|id| final_of(ms, id).is_some())).await;
    let seen = collect(&mut everything, Duration::from_millis(500), |_| false).await;
    service.shutdown().await.unwrap();

    for id in ids {
        assert_eq!(visible(&out, id), format!("hi  {id}"), "stream {id:?}");
    }
    let subjects: std::collections::BTreeSet<&str> = seen.iter().map(|m| m.subject.as_str()).collect();
    for subject in &subjects {
        let allowed = ["chat", "chat.filtered", "chat.structured.myapp.ModeSwitch.v1"].contains(subject)
            || subject.starts_with("$SRV.")
            || subject.starts_with("_INBOX.")
            || subject.starts_with("_STRUCTURED_SINK.");
        assert!(allowed, "unexpected subject {subject:?}");
    }
    assert!(subjects.contains("chat.structured.myapp.ModeSwitch.v1"));
}

/// A running service whose filtered text a JetStream stream stores (deduplicating by
/// `Nats-Msg-Id`, as every stream does), with subscriptions to its dead letters and filtered text.
struct Deduplicating {
    server: NatsServer,
    service: RunningService,
    client: async_nats::Client,
    stored: async_nats::jetstream::stream::Stream,
    dead: async_nats::Subscriber,
    filtered: async_nats::Subscriber,
}

async fn deduplicating() -> Deduplicating {
    let server = NatsServer::start();
    let service = RunningService::start(test_config(&server.url())).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let stored = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "FILTERED".into(),
            subjects: vec!["chat.filtered".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let dead = client.subscribe("chat.dlq").await.unwrap();
    let filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    Deduplicating { server, service, client, stored, dead, filtered }
}

/// A downstream JetStream stream drops an output whose `Nats-Msg-Id` it stored within its
/// duplicate window, and the server reads a header value without its leading spaces: the outputs
/// of message ` a` (ids ` a:1`, ` a:2`) took those of message `a` (`a:1`, `a:2`), and whichever
/// came second was dropped, as if published twice. An id that begins with a space is refused
/// (`invalid_message_id`) instead, and `a` keeps all of its outputs.
#[tokio::test]
async fn an_id_beginning_with_a_space_is_refused_not_taken_for_another() {
    let Deduplicating { server: _server, service, client, mut stored, mut dead, mut filtered } = deduplicating().await;
    for id in [" a", "a"] {
        client.publish("chat", partial(id, "hello").into()).await.unwrap();
        client.publish("chat", final_event(id).into()).await.unwrap();
    }
    client.flush().await.unwrap();
    let out = collect(&mut filtered, Duration::from_secs(5), |ms| final_of(ms, "a").is_some()).await;
    let dead = collect(&mut dead, Duration::from_secs(1), |ms| ms.len() == 2).await;
    service.shutdown().await.unwrap();

    let streams: Vec<String> = texts(&out).into_iter().map(|t| t.stream.unwrap_or_default().message_id).collect();
    assert_eq!(streams, ["a", "a"], "only `a` is processed");
    assert_eq!(dead.iter().map(error_header).collect::<Vec<_>>(), ["invalid_message_id", "invalid_message_id"]);
    let info = stored.info().await.unwrap();
    assert_eq!(info.state.messages, 2, "both outputs of `a` stored, none dropped as a duplicate");
}

/// A segment id is unique only within its message's inference: geppetto numbers a provider call
/// from its caller's index, 0 when none is set, so each call of such a tool loop (each under a
/// message id of its own) names its segment as the previous call did, and any producer may name
/// another's. Keyed by segment id alone, the second call's deltas were taken for late events of
/// the first (dead-lettered, `stream_finished`), an end sent under another message id ended an
/// open segment, and outputs shared `Nats-Msg-Id`s, which a deduplicating stream drops. A stream's
/// key now holds its message id: each message's segment is its own.
#[tokio::test]
async fn a_segment_id_reused_by_another_message_names_another_stream() {
    let Deduplicating { server: _server, service, client, mut stored, mut dead, mut filtered } = deduplicating().await;
    let correlation = json!({"provider_call_id": "gemini:inf-1:provider-call:0",
        "segment_id": "gemini:inf-1:provider-call:0:segment:0:text"});
    let delta = |id: &str, delta: &str| {
        json!({"type": "text-delta", "meta": {"message_id": id}, "correlation": correlation, "delta": delta})
            .to_string()
    };
    let finished = |id: &str| {
        json!({"type": "text-segment-finished", "meta": {"message_id": id}, "correlation": correlation,
            "finish_reason": "stop"})
        .to_string()
    };
    let events = [
        delta("call-1", "Looking "),
        delta("call-1", "it up."),
        finished("call-1"),
        delta("call-2", "Found "),
        // Another message's end of the same segment id, while call-2's segment is open.
        finished("intruder"),
        delta("call-2", "it."),
        finished("call-2"),
    ];
    for event in events {
        client.publish("chat", event.into()).await.unwrap();
    }
    client.flush().await.unwrap();
    let ids = ["call-1", "call-2", "intruder"];
    let out =
        collect(&mut filtered, Duration::from_secs(5), |ms| ids.iter().all(|id| final_of(ms, id).is_some())).await;
    let dead = collect(&mut dead, Duration::from_secs(1), |ms| !ms.is_empty()).await;
    service.shutdown().await.unwrap();

    assert!(dead.is_empty(), "dead-lettered: {:?}", dead.iter().map(error_header).collect::<Vec<_>>());
    assert_eq!(visible(&out, "call-1"), "Looking it up.");
    assert_eq!(visible(&out, "call-2"), "Found it.");
    for (id, text) in [("call-1", "Looking it up."), ("call-2", "Found it."), ("intruder", "")] {
        let last = final_of(&out, id).unwrap();
        assert_eq!((last.text.as_str(), last.finish_reason.as_str()), (text, "stop"), "{id}");
    }
    assert_eq!(texts(&out).iter().filter(|t| t.r#final).count(), 3, "one final per message");
    let info = stored.info().await.unwrap();
    assert_eq!(info.state.messages, out.len() as u64, "every output stored, none dropped as a duplicate");
}

#[tokio::test]
async fn blocks_that_overflow_or_never_close_fail_and_the_stream_goes_on() {
    let server = NatsServer::start();
    let mut config = test_config(&server.url());
    config.pipeline.max_capture_bytes = 1024;
    config.shards.idle_timeout_ms = 500;
    config.shards.expiry_tick_ms = 50;
    let service = RunningService::start(config).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    let mut blocks = client.subscribe("chat.structured.>").await.unwrap();
    client.flush().await.unwrap();

    // Over its capture limit: 200 KiB of payload in 4 KiB deltas.
    client.publish("chat", partial("over", "before <myapp:ModeSwitch:v1>").into()).await.unwrap();
    let line = format!("k: {}\n", "v".repeat(4093));
    for _ in 0..50 {
        client.publish("chat", partial("over", &line).into()).await.unwrap();
    }
    client.publish("chat", partial("over", "</myapp:ModeSwitch:v1> after").into()).await.unwrap();
    client.publish("chat", final_event("over").into()).await.unwrap();
    // Never closed, then a final.
    client.publish("chat", partial("open", "a <myapp:ModeSwitch:v1>new_mode: x").into()).await.unwrap();
    client.publish("chat", final_event("open").into()).await.unwrap();
    // Never closed and never finished: it expires.
    client.publish("chat", partial("abandoned", "b <myapp:ModeSwitch:v1>new_mode: y").into()).await.unwrap();
    // A final for a stream never seen: the whole text is filtered as one stream.
    let whole = json!({"type": "final", "meta": {"message_id": "final-only"},
        "text": "c <myapp:ModeSwitch:v1>new_mode: z</myapp:ModeSwitch:v1> d"});
    client.publish("chat", whole.to_string().into()).await.unwrap();
    client.publish("chat", partial("healthy", "fine").into()).await.unwrap();
    client.publish("chat", final_event("healthy").into()).await.unwrap();

    let ids = ["over", "open", "abandoned", "final-only", "healthy"];
    let out =
        collect(&mut filtered, Duration::from_secs(10), |ms| ids.iter().all(|id| final_of(ms, id).is_some())).await;
    let events = collect(&mut blocks, Duration::from_secs(2), |ms| {
        ms.iter().filter(|m| matches!(block(m).event, Some(proto::block_event::Event::Completed(_)))).count() == 4
    })
    .await;
    let metrics = service.metrics().snapshot();
    service.shutdown().await.unwrap();

    assert_eq!(visible(&out, "over"), "before  after", "the stream continues after the close tag");
    assert_eq!(visible(&out, "open"), "a ");
    assert_eq!(visible(&out, "abandoned"), "b ");
    assert_eq!(final_of(&out, "abandoned").unwrap().finish_reason, "expired");
    assert_eq!(visible(&out, "final-only"), "c  d");
    assert_eq!(visible(&out, "healthy"), "fine");

    let completed: Vec<(String, proto::BlockCompleted)> = events
        .iter()
        .filter_map(|m| {
            let event = block(m);
            let stream = event.stream.map(|s| s.message_id).unwrap_or_default();
            match event.event {
                Some(proto::block_event::Event::Completed(c)) => Some((stream, c)),
                _ => None,
            }
        })
        .collect();
    let outcome = |id: &str| completed.iter().find(|(s, _)| s == id).map(|(_, c)| (c.success, c.error.clone()));
    assert_eq!(outcome("over"), Some((false, "payload exceeds 1024 bytes".into())));
    assert_eq!(outcome("open"), Some((false, "missing close tag </myapp:ModeSwitch:v1>".into())));
    assert_eq!(outcome("abandoned"), Some((false, "missing close tag </myapp:ModeSwitch:v1>".into())));
    assert_eq!(outcome("final-only"), Some((true, String::new())));
    let over = completed.iter().find(|(s, _)| s == "over").unwrap();
    assert_eq!(over.1.raw.len(), 1024, "exactly the limit is kept");
    assert_eq!(metrics.captures_overflowed, 1);
    assert_eq!(metrics.captures_unclosed, 2);
    assert_eq!(metrics.streams_closed["expired"], 1);
}

fn block(m: &async_nats::Message) -> proto::BlockEvent {
    proto::BlockEvent::decode(m.payload.clone()).unwrap()
}

/// Starts the real binary against `url` with `env` settings; its stderr goes to `log`.
fn spawn_serve(url: &str, env: &[(&str, &str)], log: &std::path::Path) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_structured-sink"));
    command
        .arg("serve")
        .env_remove("STRUCTURED_SINK_CONFIG")
        .env_remove("RUST_LOG")
        .env("STRUCTURED_SINK__NATS__SERVERS", format!("[\"{url}\"]"))
        .env("STRUCTURED_SINK__HTTP__ENABLED", "false")
        .env("STRUCTURED_SINK__SHARDS__COUNT", "2")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    for (key, value) in env {
        command.env(key, value);
    }
    command.spawn().unwrap()
}

/// The replica's counters, from its `structured-sink.status` endpoint, once it answers.
async fn status(client: &async_nats::Client) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match client.request("structured-sink.status", "".into()).await {
            Ok(reply) => return serde_json::from_slice(&reply.payload).unwrap(),
            Err(e) if Instant::now() > deadline => panic!("no status: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Polls the status until `done` holds; panics after a minute.
async fn wait_for(client: &async_nats::Client, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = status(client).await;
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Resident set size of `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn stop(mut child: Child) {
    let _ = sigterm(&child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "serve did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn a_hundred_thousand_abandoned_streams_are_bounded_expire_and_their_memory_is_reused() {
    const STREAMS: usize = 100_000;
    const MAX_STREAMS: u64 = 20_000;
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let max_streams = MAX_STREAMS.to_string();
    let env = [
        ("STRUCTURED_SINK__SHARDS__MAX_STREAMS", max_streams.as_str()),
        ("STRUCTURED_SINK__SHARDS__IDLE_TIMEOUT_MS", "10000"),
        ("STRUCTURED_SINK__SHARDS__EXPIRY_TICK_MS", "100"),
    ];
    let child = spawn_serve(&server.url(), &env, &dir.path().join("serve.log"));
    let client = async_nats::connect(server.url()).await.unwrap();
    status(&client).await;

    let mut rss_after = Vec::new();
    let mut peak = 0;
    for wave in 0..2u64 {
        let received = |s: &Value| s["events_received"].as_u64().unwrap_or(0);
        let base = received(&status(&client).await);
        for batch in 0..(STREAMS / 5_000) {
            for i in 0..5_000 {
                let id = format!("w{wave}-{}", batch * 5_000 + i);
                client.publish("chat", partial(&id, "an abandoned stream holding <myapp:Mode").into()).await.unwrap();
            }
            // Batches wait for the replica, so its subscription never overflows.
            let want = base + (batch as u64 + 1) * 5_000;
            let s = wait_for(&client, "events received", |s| received(s) >= want).await;
            assert!(s["streams_open"].as_u64().unwrap() <= MAX_STREAMS, "over shards.max_streams: {s}");
            peak = peak.max(rss(child.id()));
        }
        let s = wait_for(&client, "every stream expired", |s| s["streams_open"] == 0).await;
        assert_eq!(s["streams_opened"].as_u64(), Some((wave + 1) * STREAMS as u64));
        // Every stream is accounted for: closed by the open-stream limit (counted) or expired.
        let (evicted, expired) =
            (s["streams_closed"]["evicted"].as_u64().unwrap(), s["streams_closed"]["expired"].as_u64().unwrap());
        assert_eq!(evicted + expired, (wave + 1) * STREAMS as u64, "{s}");
        // 100,000 streams arrive well within the idle timeout, so the limit must have acted.
        assert!(evicted >= (wave + 1) * (STREAMS as u64 / 2), "evicted {evicted}: {s}");
        rss_after.push(rss(child.id()));
    }
    // A healthy stream after the flood.
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    client.publish("chat", partial("healthy", "fine").into()).await.unwrap();
    client.publish("chat", final_event("healthy").into()).await.unwrap();
    let out = collect(&mut filtered, Duration::from_secs(5), |ms| final_of(ms, "healthy").is_some()).await;
    stop(child);

    assert_eq!(visible(&out, "healthy"), "fine");
    assert!(peak < 400 << 20, "peak RSS {} MiB with {MAX_STREAMS} open streams", peak >> 20);
    // The second wave reuses the memory the first one freed: no growth beyond allocator noise.
    assert!(
        rss_after[1] < rss_after[0] + (32 << 20),
        "RSS grew from {} MiB to {} MiB across identical waves",
        rss_after[0] >> 20,
        rss_after[1] >> 20
    );
}

#[tokio::test]
async fn payload_text_never_reaches_logs_spans_or_metric_labels() {
    const MARKER: &str = "ZQX-payload-marker-7731";
    let server = NatsServer::start();
    // The spans go to a collector, to be searched as the logs are.
    let collector = OtlpCollector::start();
    let endpoint = collector.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let config = dir.path().join("tags.toml");
    std::fs::write(
        &config,
        "[[tags]]\nname = \"myapp:ModeSwitch:v1\"\nkind = \"block\"\n\
         [[tags]]\nname = \"myapp:Json:v1\"\nkind = \"block\"\npayload = \"json\"\n\
         [[tags]]\nname = \"thinking\"\nkind = \"channel\"\n[[tags]]\nname = \"tool\"\nkind = \"tool_call\"\n",
    )
    .unwrap();
    let env = [
        ("RUST_LOG", "trace"),
        ("STRUCTURED_SINK_CONFIG", config.to_str().unwrap()),
        ("STRUCTURED_SINK__INPUT__PASS_THROUGH_SUBJECT", "chat.other"),
        ("STRUCTURED_SINK__INPUT__MAX_EVENT_BYTES", "4096"),
        ("STRUCTURED_SINK__PIPELINE__MAX_CAPTURE_BYTES", "64"),
        ("STRUCTURED_SINK__TELEMETRY__OTLP_ENDPOINT", endpoint.as_str()),
        ("NO_PROXY", "127.0.0.1"),
    ];
    let child = spawn_serve(&server.url(), &env, &log);
    let client = async_nats::connect(server.url()).await.unwrap();
    status(&client).await;
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();

    let m = MARKER;
    let events = [
        partial("s1", &format!("prose {m} <thinking>thought {m}</thinking>")),
        partial("s1", &format!("<myapp:ModeSwitch:v1>new_mode: {m}\n</myapp:ModeSwitch:v1>")),
        partial("s1", &format!("<myapp:ModeSwitch:v1>[{m}: {{ - </myapp:ModeSwitch:v1>")),
        partial("s1", &format!("<myapp:Json:v1>{{\"{m}\": [1, {m}</myapp:Json:v1>")),
        partial("s1", &format!("<myapp:ModeSwitch:v1>{}</myapp:ModeSwitch:v1>", m.repeat(10))),
        partial("s1", &format!("<tool>{{\"tool_name\": \"{m}\", \"arguments\": {{\"q\": \"{m}\"}}}}</tool>")),
        partial("s1", &format!("<tool>not json {m}</tool> <myapp:ModeSwitch:v1>{m}")),
        json!({"type": "final", "meta": {"message_id": "s1"}, "text": format!("diverging {m}")}).to_string(),
        partial("s1", &format!("late {m}")),
        format!("{{\"type\": \"partial\", {m}"),
        json!({"type": "partial", "meta": {"message_id": "s2"}, "delta": [m]}).to_string(),
        json!({"type": m, "meta": {"message_id": "s3"}, "delta": m}).to_string(),
        json!({"type": "partial", "meta": {"message_id": "s4"}, "delta": m.repeat(500)}).to_string(),
        json!({"type": "partial", "meta": {"message_id": "s5"}, "delta": format!("\u{0}{m}\u{1b}[2J")}).to_string(),
        json!({"type": "final", "meta": {"message_id": "s5"}}).to_string(),
    ];
    for event in &events {
        client.publish("chat", event.clone().into()).await.unwrap();
    }
    let out = collect(&mut filtered, Duration::from_secs(10), |ms| {
        final_of(ms, "s1").is_some() && final_of(ms, "s5").is_some()
    })
    .await;
    assert!(visible(&out, "s1").contains(m), "the marker travels in the outputs, where it belongs");
    let counters = status(&client).await.to_string();
    stop(child);

    let mut text = String::new();
    std::fs::File::open(&log).unwrap().read_to_string(&mut text).unwrap();
    // async-nats is capped at INFO whatever the filter; the service's own DEBUG lines show the
    // filter was open.
    assert!(text.contains("DEBUG structured_sink"), "trace logging was on:\n{text}");
    assert!(text.contains("dead-lettering an event"), "the bad events were logged about:\n{text}");
    let leaks: Vec<&str> = text.lines().filter(|l| l.contains(m)).collect();
    assert!(leaks.is_empty(), "payload text in {} log lines:\n{}", leaks.len(), leaks.join("\n"));
    assert!(!counters.contains(m), "payload text in the metrics: {counters}");
    // The spans of the two streams that opened (the others' events were dead-lettered) were
    // exported by the graceful shutdown at the latest, and neither holds it.
    for id in ["s1", "s5"] {
        assert_eq!(collector.spans_where("messaging.message.id", id).len(), 1, "no span for stream {id}");
    }
    let spans = format!("{:?}", collector.spans());
    assert!(!spans.contains(m), "payload text in the exported spans: {spans}");
}

#[tokio::test]
async fn a_publish_the_account_may_not_make_is_counted_and_the_rest_flows() {
    let server = NatsServer::builder()
        .config(
            r#"authorization { users = [
                { user: "svc", password: "pw", permissions: { publish: { deny: ["chat.structured.>"] } } },
                { user: "app", password: "pw" }
            ] }"#,
        )
        .start();
    let url = server.url();
    let mut config = test_config(&url);
    config.nats.user = Some("svc".into());
    config.nats.password = Some("pw".into());
    let service = RunningService::start(config).await.unwrap();
    let client = async_nats::ConnectOptions::with_user_and_password("app".into(), "pw".into())
        .connect(url.as_str())
        .await
        .unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();

    let text = "a <myapp:ModeSwitch:v1>new_mode: x</myapp:ModeSwitch:v1> b";
    client.publish("chat", partial("denied", text).into()).await.unwrap();
    client.publish("chat", final_event("denied").into()).await.unwrap();
    let out = collect(&mut filtered, Duration::from_secs(5), |ms| final_of(ms, "denied").is_some()).await;
    // The violation comes back asynchronously from the server.
    let deadline = Instant::now() + Duration::from_secs(10);
    while service.metrics().snapshot().nats_connection_events["permission_violation"] == 0 {
        assert!(Instant::now() < deadline, "the permission violation was never counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(service.is_ready(), "a denied publish does not stop the service");
    service.shutdown().await.unwrap();
    assert_eq!(visible(&out, "denied"), "a  b", "allowed outputs still flow");
}
