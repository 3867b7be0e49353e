//! The `structured-sink` binary as an operator runs it: demo, config, bad configuration, serve
//! with a signal, serve logging JSON, serve exporting its traces to an OTLP collector over HTTP
//! and HTTPS.

use std::process::{Command, Stdio};
use std::time::Duration;

use prost::Message as _;
use structured_sink::codec::proto;

use crate::support::{attribute, find_nats_server, free_ports, http_get, sigterm, NatsServer, OtlpCollector, TestPki};

fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_structured-sink"));
    command.env_remove("STRUCTURED_SINK_CONFIG").env_remove("NATS_URL").env_remove("RUST_LOG");
    command
}

#[test]
fn demo_runs_against_its_own_server() {
    let server = find_nats_server(std::env::var_os("NATS_SERVER_BIN"), std::env::var_os("PATH"), &[]).unwrap();
    let output = binary().arg("demo").env("NATS_SERVER_BIN", server).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("started nats-server at nats://127.0.0.1:"), "{stdout}");
    assert!(stdout.contains("chat.structured.myapp.ModeSwitch.v1"), "{stdout}");
    assert!(stdout.contains("chat.thinking"), "{stdout}");
    assert!(stdout.contains("chat.tools"), "{stdout}");
    assert!(stdout.contains("dead letter (missing_message_id)"), "{stdout}");
    let read = stdout.split("what the users read:").nth(1).expect("the readable part");
    assert!(read.contains("Switching now. \nNote that a < b and <b>bold</b> stay as text."), "{read}");
    assert!(!read.contains("new_mode"), "{read}");
}

#[test]
fn demo_uses_nats_url_when_set() {
    let server = NatsServer::start();
    let output = binary().arg("demo").env("NATS_URL", server.url()).env("PATH", "").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(!stdout.contains("started nats-server"));
    assert!(stdout.contains("Sources:  done."), "{stdout}");
}

#[test]
fn demo_without_a_server_says_how_to_get_one() {
    let output =
        binary().arg("demo").env("PATH", "").env("NATS_SERVER_BIN", "/nonexistent/nats-server").output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("nats-server did not start") || stderr.contains("apt-get install nats-server"), "{stderr}");
    let output = binary().arg("demo").env("PATH", "").output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !std::path::Path::new("/usr/sbin/nats-server").exists() {
        assert!(stderr.contains("apt-get install nats-server"), "{stderr}");
    }
}

#[test]
fn config_prints_effective_settings_with_secrets_masked() {
    let output = binary()
        .arg("config")
        .env("STRUCTURED_SINK__NATS__TOKEN", "very-secret-token")
        .args(["--set", "shards.count=3"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!stdout.contains("very-secret-token"), "{stdout}");
    assert!(stdout.contains("token = \"***\""), "{stdout}");
    assert!(stdout.contains("count = 3"), "{stdout}");
    // What the settings amount to, as comments: the printed text stays a valid configuration.
    assert!(
        stdout.contains("# shards.count = 3\n# per shard: max_streams = 33333, finished_memory = 3334\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("# tags: thinking (channel), think (channel), tool (tool_call), geppetto:citations:v1 (block)"),
        "{stdout}"
    );
    let reloaded = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(reloaded.path(), stdout.replace("\"***\"", "\"x\"")).unwrap();
    let again = binary().arg("--config").arg(reloaded.path()).arg("config").output().unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));

    let owned = binary()
        .args([
            "--set",
            "partitions.mode=subject",
            "--set",
            "partitions.count=8",
            "--set",
            "partitions.replica_count=3",
        ])
        .args(["--set", "partitions.replica_index=1", "config"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&owned.stdout).contains("# partitions owned (3 of 8): 1, 4, 7\n"));

    // A configuration start-up would refuse fails here too, after printing the settings.
    let refused = binary().args(["--set", "schemas.dirs=[\"/nonexistent\"]", "config"]).output().unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stdout).contains("[schemas]"));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("schemas.dirs"));
}

#[test]
fn bad_configuration_stops_start_up_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[shards]\nidle_timeout = 5\n").unwrap();
    let output = binary().arg("--config").arg(&file).arg("serve").output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("idle_timeout"));
    let output = binary().args(["--set", "input.subjects=[\"chat.>\"]", "serve"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("feedback loop"));
}

#[tokio::test]
async fn serve_stops_on_sigterm_and_closes_open_streams() {
    let server = NatsServer::start();
    let (client, mut filtered) = watching_filtered(&server).await;
    let child = serve(&server.url()).spawn().unwrap();
    let ready = answers(&client, &mut filtered).await;
    assert!(ready, "the service never answered");
    client
        .publish("chat", r#"{"type":"partial","meta":{"message_id":"open"},"delta":"unfinished"}"#.into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = stop(child).await;
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let mut last = None;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(2), futures::StreamExt::next(&mut filtered)).await
    {
        let t = proto::FilteredText::decode(m.payload).unwrap();
        if t.stream.as_ref().unwrap().message_id == "open" && t.r#final {
            last = Some(t);
            break;
        }
    }
    let last = last.expect("the open stream was closed at shutdown");
    assert_eq!((last.finish_reason.as_str(), last.text.as_str()), ("shutdown", "unfinished"));
    assert!(String::from_utf8_lossy(&status.stderr).contains("stopped"));
}

/// A SIGTERM while `serve` is still starting (here waiting for its first server, with
/// `nats.retry_on_initial_connect`) is kept: the process finishes starting once the server is
/// there, then shuts down gracefully and exits 0, instead of dying of the signal.
#[tokio::test]
async fn serve_stops_gracefully_on_a_sigterm_during_start_up() {
    let mut server = NatsServer::start();
    server.stop();
    let http = free_ports(1)[0];
    let mut child = serve(&server.url())
        .env("STRUCTURED_SINK__NATS__RETRY_ON_INITIAL_CONNECT", "true")
        .env("STRUCTURED_SINK__HTTP__ENABLED", "true")
        .env("STRUCTURED_SINK__HTTP__LISTEN", format!("127.0.0.1:{http}"))
        .spawn()
        .unwrap();
    // Its HTTP endpoint answers while start-up waits for the server.
    let mut probes = 0;
    while http_get(http, "/healthz").is_none() {
        probes += 1;
        assert!(probes < 200, "the service never opened its HTTP endpoint");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sigterm(&child).expect("SIGTERM to serve");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(child.try_wait().unwrap().is_none(), "the signal ended the process during start-up");
    server.restart();
    let output = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{logs}");
    assert!(logs.contains("structured-sink is running") && logs.contains("stopped"), "{logs}");
}

/// Credentials in a server URL authenticate the service and never reach the logs, at any level:
/// not in the "connected" line, not in the NATS client's own debug lines (which print each server
/// address it tries).
#[tokio::test]
async fn serve_never_logs_the_credentials_in_a_server_url() {
    let server = NatsServer::builder().config(r#"authorization { user: "sink", password: "pw-s3cret" }"#).start();
    let port = server.url().rsplit(':').next().unwrap().to_owned();
    let url = format!("nats://sink:pw-s3cret@127.0.0.1:{port}");
    // async-nats itself ignores credentials in a URL: the service reads them (tested here too).
    let client = async_nats::ConnectOptions::with_user_and_password("sink".into(), "pw-s3cret".into())
        .connect(server.url())
        .await
        .unwrap();
    let mut filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    let child = serve(&url).env("RUST_LOG", "trace").spawn().unwrap();
    let ready = answers(&client, &mut filtered).await;
    let output = stop(child).await;
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(ready, "the service never answered: {logs}");
    assert!(logs.contains("connected to NATS"), "{logs}");
    assert!(!logs.contains("pw-s3cret"), "the password is logged: {logs}");
}

/// `telemetry.log_format = "json"`: every line `serve` writes to stderr, its own and the NATS
/// client's, from start to shutdown, is one JSON object with a level, a target and the event's
/// fields, as a log collector expects.
#[tokio::test]
async fn serve_logs_one_json_object_per_line() {
    let server = NatsServer::start();
    let (client, mut filtered) = watching_filtered(&server).await;
    let child = serve(&server.url()).env("STRUCTURED_SINK__TELEMETRY__LOG_FORMAT", "json").spawn().unwrap();
    let ready = answers(&client, &mut filtered).await;
    let output = stop(child).await;
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(ready && output.status.success(), "{logs}");
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON object ({e}): {line}")))
        .collect();
    for line in &lines {
        assert!(line["level"].is_string() && line["target"].is_string(), "{line}");
        assert!(line["fields"]["message"].is_string(), "{line}");
    }
    let message = |m: &str| lines.iter().find(|line| line["fields"]["message"] == m).cloned();
    let running = message("structured-sink is running").unwrap_or_else(|| panic!("no start line: {logs}"));
    assert_eq!(running["level"], "INFO");
    assert_eq!(running["fields"]["version"], env!("CARGO_PKG_VERSION"));
    assert!(message("stopped").is_some(), "no shutdown line: {logs}");
    assert!(lines.iter().any(|line| line["target"].as_str().unwrap().starts_with("async_nats")), "{logs}");
}

/// With `telemetry.otlp_endpoint` set, `serve` exports one span per stream over OTLP/HTTP to the
/// collector: the span joins the trace of its input's `traceparent`, names the message and how
/// the stream ended, carries the configured service name, never the text, and is flushed by the
/// graceful shutdown at the latest.
#[tokio::test]
async fn serve_exports_one_span_per_stream_to_an_otlp_collector() {
    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PARENT_SPAN_ID: &str = "00f067aa0ba902b7";
    let collector = OtlpCollector::start();
    let server = NatsServer::start();
    let (client, mut filtered) = watching_filtered(&server).await;
    let child = serve_exporting_spans(&server.url(), &collector.endpoint())
        .env("STRUCTURED_SINK__TELEMETRY__SERVICE_NAME", "sink-under-test")
        // How a collector's credentials reach the exporter: OpenTelemetry's own variable.
        .env("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-token=sesame")
        .spawn()
        .unwrap();
    let ready = answers(&client, &mut filtered).await;
    assert!(ready, "the service never answered");

    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01").as_str());
    for event in [
        r#"{"type":"partial","meta":{"message_id":"traced"},"delta":"hush "}"#,
        r#"{"type":"partial","meta":{"message_id":"traced"},"delta":"hush"}"#,
        r#"{"type":"final","meta":{"message_id":"traced"},"text":"hush hush"}"#,
    ] {
        client.publish_with_headers("chat", headers.clone(), event.into()).await.unwrap();
    }
    client.flush().await.unwrap();
    let mut last = None;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut filtered)).await
    {
        let t = proto::FilteredText::decode(m.payload.clone()).unwrap();
        if t.stream.as_ref().unwrap().message_id == "traced" {
            let traceparent = m.headers.as_ref().and_then(|h| h.get("traceparent")).map(|v| v.to_string());
            assert_eq!(traceparent.as_deref(), Some(format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01").as_str()));
            if t.r#final {
                last = Some(t);
                break;
            }
        }
    }
    let last = last.expect("the traced stream's final output");

    let output = stop(child).await;
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{logs}");
    assert!(!logs.contains("telemetry shutdown"), "the exporter did not flush cleanly: {logs}");

    let spans = collector.spans();
    let traced = collector.spans_where("messaging.message.id", "traced");
    assert_eq!(traced.len(), 1, "one span for the stream of three events: {spans:?}");
    let (resource, span) = &traced[0];
    assert_eq!(span.name, "stream");
    assert_eq!(hex(&span.trace_id), TRACE_ID, "the span joins the input's trace");
    assert_eq!(hex(&span.parent_span_id), PARENT_SPAN_ID, "the input's span is its parent");
    assert_eq!(span.span_id.len(), 8);
    assert_ne!(hex(&span.span_id), PARENT_SPAN_ID);
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano && span.start_time_unix_nano > 0);
    assert_eq!(attribute(&span.attributes, "messaging.system").as_deref(), Some("nats"));
    assert_eq!(attribute(&span.attributes, "stream.id"), Some(last.stream.as_ref().unwrap().stream_id.clone()));
    assert_eq!(attribute(&span.attributes, "stream.finish_reason"), Some(last.finish_reason.clone()));
    assert_eq!(attribute(&span.attributes, "stream.outputs"), Some(last.seq.to_string()));
    assert_eq!(attribute(resource, "service.name").as_deref(), Some("sink-under-test"));
    assert_eq!(attribute(resource, "service.version").as_deref(), Some(env!("CARGO_PKG_VERSION")));
    assert!(!format!("{spans:?}").contains("hush"), "payload text reached a span: {spans:?}");
    let token = ("x-collector-token".to_owned(), "sesame".to_owned());
    assert!(collector.request_headers().iter().all(|headers| headers.contains(&token)));
    // A stream whose input carried no trace context starts a trace of its own.
    let probe = collector.spans_where("messaging.message.id", "probe");
    assert!(!probe.is_empty(), "the probe streams' spans: {spans:?}");
    assert!(probe.iter().all(|(_, span)| span.parent_span_id.is_empty() && hex(&span.trace_id) != TRACE_ID));
}

/// An `https://` collector: the exporter verifies the collector's certificate against the
/// system's roots (here `SSL_CERT_FILE`, the test CA) and delivers the spans over TLS; against a
/// CA that did not sign the certificate it refuses the collector and delivers nothing.
#[tokio::test]
async fn serve_exports_spans_to_an_https_collector_it_trusts_only() {
    let pki = TestPki::generate();
    for (ca, trusted) in [(pki.ca_file(), true), (pki.other_ca_file(), false)] {
        let collector = OtlpCollector::start_tls(&pki.server_cert_file(), &pki.server_key_file());
        let server = NatsServer::start();
        let (client, mut filtered) = watching_filtered(&server).await;
        let child = serve_exporting_spans(&server.url(), &collector.endpoint())
            .env("SSL_CERT_FILE", &ca)
            .env_remove("SSL_CERT_DIR")
            .spawn()
            .unwrap();
        let ready = answers(&client, &mut filtered).await;
        assert!(ready, "the service never answered");
        let output = stop(child).await;
        let logs = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{logs}");
        let probes = collector.spans_where("messaging.message.id", "probe").len();
        if trusted {
            assert!(probes > 0, "no span arrived over TLS: {logs}");
            assert_eq!(collector.refused(), 0);
        } else {
            assert_eq!(probes, 0, "spans went to a collector the service must not trust");
            assert!(collector.refused() > 0, "the exporter never tried the collector: {logs}");
        }
    }
}

/// A collector that cannot be reached costs only the spans: the service publishes every output,
/// says in its logs that the export failed, and still stops cleanly on SIGTERM.
#[tokio::test]
async fn serve_keeps_publishing_when_the_otlp_collector_is_unreachable() {
    let server = NatsServer::start();
    let (client, mut filtered) = watching_filtered(&server).await;
    // A port that was free a moment ago: connections to it are refused.
    let closed = free_ports(1)[0];
    let child = serve_exporting_spans(&server.url(), &format!("http://127.0.0.1:{closed}")).spawn().unwrap();
    let ready = answers(&client, &mut filtered).await;
    assert!(ready, "the service never answered");
    for id in 0..20 {
        let event = format!(r#"{{"type":"final","meta":{{"message_id":"m{id}"}},"text":"answer {id}"}}"#);
        client.publish("chat", event.into()).await.unwrap();
    }
    client.flush().await.unwrap();
    let mut answered = std::collections::BTreeSet::new();
    while answered.len() < 20 {
        let next = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut filtered)).await;
        let Ok(Some(m)) = next else { break };
        let t = proto::FilteredText::decode(m.payload).unwrap();
        let id = t.stream.unwrap().message_id;
        if id != "probe" {
            assert_eq!(t.text, format!("answer {}", &id[1..]));
            answered.insert(id);
        }
    }
    assert_eq!(answered.len(), 20, "every stream's output arrives: {answered:?}");
    let output = stop(child).await;
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{logs}");
    assert!(logs.contains("stopped"), "{logs}");
    // The failed export is an error line of the OpenTelemetry SDK, not silence.
    let reported = logs.lines().any(|line| line.contains("ERROR") && line.contains("opentelemetry"));
    assert!(reported, "no export error in the logs: {logs}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A client of `server` subscribed to `chat.filtered`, the subscription known to the server.
async fn watching_filtered(server: &NatsServer) -> (async_nats::Client, async_nats::Subscriber) {
    let client = async_nats::connect(server.url()).await.unwrap();
    let filtered = client.subscribe("chat.filtered").await.unwrap();
    client.flush().await.unwrap();
    (client, filtered)
}

/// Stops `serve` with SIGTERM, as an orchestrator does, and waits for it: its exit and output.
async fn stop(child: std::process::Child) -> std::process::Output {
    sigterm(&child).expect("SIGTERM to serve");
    tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap()
}

/// Publishes a probe event until the service under test answers on `filtered` (it is ready once
/// it has subscribed), for about 10 s at most; whether it did.
async fn answers(client: &async_nats::Client, filtered: &mut async_nats::Subscriber) -> bool {
    for _ in 0..100 {
        client.publish("chat", r#"{"type":"final","meta":{"message_id":"probe"},"text":"x"}"#.into()).await.unwrap();
        if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), futures::StreamExt::next(filtered)).await
        {
            return true;
        }
    }
    false
}

/// `structured-sink serve` against the server at `url`, HTTP off, its logs piped.
fn serve(url: &str) -> Command {
    let mut command = binary();
    command
        .arg("serve")
        .env("STRUCTURED_SINK__NATS__SERVERS", format!("[\"{url}\"]"))
        .env("STRUCTURED_SINK__HTTP__ENABLED", "false")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

/// [`serve`] exporting its spans to the OTLP collector at `endpoint`, on loopback.
fn serve_exporting_spans(url: &str, endpoint: &str) -> Command {
    let mut command = serve(url);
    command
        .env("STRUCTURED_SINK__TELEMETRY__OTLP_ENDPOINT", endpoint)
        // The exporter's HTTP client honours proxy settings from the environment: not for loopback.
        .env("NO_PROXY", "127.0.0.1");
    command
}
