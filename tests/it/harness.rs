//! Tests of the test harness itself (real `nats-server` processes: one, restarted, a cluster),
//! and of `structured_sink::bus::connect` against them: each kind of authentication, TLS with
//! client certificates, and the connection events the bus reports.
//!
//! Every test starts its own server(s) on random loopback ports; none uses 127.0.0.1:4222.

use std::ffi::OsString;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage, stream};
use futures::StreamExt;
use structured_sink::bus::{self, BusError, ConnectionEvent, NatsConfig, TlsConfig};
use tokio::sync::mpsc;

use crate::support::{find_nats_server, jwt, NatsServer, TestPki};

/// Generous: a JetStream leader election in a cluster takes a few seconds on 2 cores.
const WAIT: Duration = Duration::from_secs(30);

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future).await.unwrap_or_else(|_| panic!("timed out after {WAIT:?} waiting for {what}"))
}

/// Settings for a test connection: quick to notice and to retry.
fn config_for(servers: Vec<String>) -> NatsConfig {
    NatsConfig { servers, connect_timeout_ms: 2_000, reconnect_delay_max_ms: 250, ..NatsConfig::default() }
}

/// A callback for `bus::connect` that forwards every event to the returned receiver.
fn event_channel() -> (impl Fn(ConnectionEvent) + Send + Sync + 'static, mpsc::UnboundedReceiver<ConnectionEvent>) {
    let (sender, receiver) = mpsc::unbounded_channel();
    (move |event| drop(sender.send(event)), receiver)
}

/// Waits for the first event that `wanted` accepts, skipping others.
async fn next_event(
    events: &mut mpsc::UnboundedReceiver<ConnectionEvent>,
    what: &str,
    wanted: impl Fn(&ConnectionEvent) -> bool,
) -> ConnectionEvent {
    within(what, async {
        loop {
            let event = events.recv().await.expect("the event channel stays open");
            if wanted(&event) {
                return event;
            }
        }
    })
    .await
}

/// Subscribes, publishes once and expects the message back.
async fn assert_round_trip(client: &async_nats::Client, subject: &str) {
    let mut subscription = client.subscribe(subject.to_owned()).await.expect("subscribe");
    client.publish(subject.to_owned(), "ping".into()).await.expect("publish");
    client.flush().await.expect("flush");
    let message = within("the published message", subscription.next()).await.expect("a message");
    assert_eq!(message.payload.as_ref(), b"ping");
}

async fn connect_ok(config: &NatsConfig) -> async_nats::Client {
    bus::connect(config, |_| {}).await.unwrap_or_else(|e| panic!("connect failed: {e}"))
}

fn fnv1a32(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |hash, byte| (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193))
}

#[tokio::test]
async fn server_starts_on_a_random_port_and_relays_messages() {
    let server = NatsServer::start();
    assert_ne!(server.port(), 4222, "tests never use the default port");
    assert_eq!(server.url(), format!("nats://127.0.0.1:{}", server.port()));
    assert!(server.version() >= (2, 9, 0), "version {}", server.version_string());

    let client = connect_ok(&config_for(vec![server.url()])).await;
    assert_eq!(bus::server_version(&client), Some(server.version()));
    assert_round_trip(&client, "harness.ping").await;
}

#[tokio::test]
async fn two_servers_get_different_ports() {
    let (first, second) = (NatsServer::start(), NatsServer::start());
    assert_ne!(first.port(), second.port());
    assert_ne!(first.store_dir(), second.store_dir());
}

#[tokio::test]
async fn config_text_reaches_the_server() {
    // The partition mapping of REFERENCE.md, checked against our own FNV-1a.
    let server = NatsServer::builder()
        .config("max_payload: 4096")
        .config(r#"mappings = { "harness.raw.*": "harness.raw.p.{{partition(8,1)}}.{{wildcard(1)}}" }"#)
        .start();
    let client = connect_ok(&config_for(vec![server.url()])).await;
    assert_eq!(client.server_info().max_payload, 4096);

    let mut subscription = client.subscribe("harness.raw.p.*.*").await.unwrap();
    let ids = ["3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071", "abc", "sess-1"];
    for id in ids {
        client.publish(format!("harness.raw.{id}"), "x".into()).await.unwrap();
    }
    client.flush().await.unwrap();
    for id in ids {
        let message = within("a mapped message", subscription.next()).await.unwrap();
        let expected = format!("harness.raw.p.{}.{id}", fnv1a32(id) % 8);
        assert_eq!(message.subject.as_str(), expected);
    }
}

#[tokio::test]
async fn jetstream_stores_and_returns_messages() {
    let server = NatsServer::start();
    let client = connect_ok(&config_for(vec![server.url()])).await;
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: "HARNESS".into(),
            subjects: vec!["harness.js.>".into()],
            ..Default::default()
        })
        .await
        .expect("create stream");
    for n in 1..=3 {
        let ack = js.publish(format!("harness.js.{n}"), format!("m{n}").into()).await.unwrap();
        assert_eq!(ack.await.expect("stored").sequence, n);
    }
    let message = stream.get_raw_message(2).await.expect("read back");
    assert_eq!(message.subject.as_str(), "harness.js.2");
    assert_eq!(message.payload.as_ref(), b"m2");
}

#[tokio::test]
async fn restart_keeps_port_and_store_and_the_client_reconnects() {
    let mut server = NatsServer::start();
    let port = server.port();
    let (on_event, mut events) = event_channel();
    let client = bus::connect(&config_for(vec![server.url()]), on_event).await.unwrap();
    next_event(&mut events, "connected", |e| *e == ConnectionEvent::Connected).await;

    let js = jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: "RESTART".into(),
        subjects: vec!["harness.kept".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish("harness.kept", "before".into()).await.unwrap().await.unwrap();
    let mut subscription = client.subscribe("harness.after").await.unwrap();
    client.flush().await.unwrap();

    server.restart();
    assert_eq!(server.port(), port, "a restart keeps the port");
    assert!(server.is_running());

    next_event(&mut events, "disconnected", |e| *e == ConnectionEvent::Disconnected).await;
    next_event(&mut events, "reconnected", |e| *e == ConnectionEvent::Connected).await;
    // The subscription made before the restart is restored by the client.
    client.publish("harness.after", "after".into()).await.unwrap();
    client.flush().await.unwrap();
    let message = within("a message after reconnect", subscription.next()).await.unwrap();
    assert_eq!(message.payload.as_ref(), b"after");

    let stream = js.get_stream("RESTART").await.expect("the stream survived the restart");
    let kept = stream.get_raw_message(1).await.unwrap();
    assert_eq!(kept.payload.as_ref(), b"before");
}

#[tokio::test]
async fn stopped_server_refuses_connections_until_restarted() {
    let mut server = NatsServer::start();
    let url = server.url();
    server.stop();
    assert!(!server.is_running());
    let error = bus::connect(&config_for(vec![url.clone()]), |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::Connect { .. }), "{error}");
    assert!(error.to_string().contains(&url), "the error names the server: {error}");
    server.restart();
    assert_round_trip(&connect_ok(&config_for(vec![url])).await, "harness.back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_r3_stream_survives_losing_its_leader() {
    let mut cluster = NatsServer::cluster(3);
    let urls = cluster.urls();
    assert_eq!(urls.len(), 3);
    assert!(urls.iter().all(|url| !url.ends_with(":4222")));
    let names: Vec<&str> = cluster.nodes().iter().map(NatsServer::name).collect();
    assert_eq!(names, ["n0", "n1", "n2"]);

    let client = connect_ok(&config_for(urls)).await;
    let js = jetstream::new(client);
    let mut stream = within(
        "an R3 stream",
        js.create_stream(stream::Config {
            name: "CLUSTERED".into(),
            subjects: vec!["harness.cluster.>".into()],
            num_replicas: 3,
            ..Default::default()
        }),
    )
    .await
    .expect("create R3 stream");

    // Deterministic message ids let a retried publish be deduplicated by JetStream.
    let publish = |n: u32| {
        let js = js.clone();
        async move {
            for attempt in 1.. {
                let message = PublishMessage::build().payload(format!("m{n}").into()).message_id(format!("id-{n}"));
                let error = match js.send_publish(format!("harness.cluster.{n}"), message).await {
                    Ok(ack) => match ack.await {
                        Ok(_) => return,
                        Err(error) => error.to_string(),
                    },
                    Err(error) => error.to_string(),
                };
                // During the leader election the stream does not answer for a few seconds.
                if attempt == 1 {
                    eprintln!("publish {n} failed, retrying until acknowledged: {error}");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    for n in 1..=5 {
        within("publish before the stop", publish(n)).await;
    }

    let info = stream.info().await.unwrap();
    let leader = info.cluster.as_ref().and_then(|c| c.leader.clone()).expect("a stream leader");
    let leader_index = cluster.index_of(&leader).expect("the leader is one of our nodes");
    cluster.stop_node(leader_index);

    for n in 6..=10 {
        within("publish after the leader stopped", publish(n)).await;
    }
    let messages = within("all 10 messages stored once", async {
        loop {
            match stream.info().await {
                Ok(info) if info.state.messages == 10 => return info.state.messages,
                Ok(info) => panic!("expected 10 messages, found {}", info.state.messages),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    })
    .await;
    assert_eq!(messages, 10);
    for n in 1..=10u32 {
        let message = stream.get_raw_message(u64::from(n)).await.unwrap();
        assert_eq!(message.payload, format!("m{n}").as_bytes());
    }

    // The stopped node comes back on its ports and catches up (restart waits for /healthz).
    cluster.restart_node(leader_index);
    assert_eq!(cluster.node(leader_index).name(), leader);
}

#[tokio::test]
async fn lame_duck_mode_is_reported() {
    let mut server = NatsServer::start();
    let (on_event, mut events) = event_channel();
    let _client = bus::connect(&config_for(vec![server.url()]), on_event).await.unwrap();
    next_event(&mut events, "connected", |e| *e == ConnectionEvent::Connected).await;
    server.lame_duck();
    next_event(&mut events, "lame duck mode", |e| *e == ConnectionEvent::LameDuckMode).await;
}

#[tokio::test]
async fn slow_consumer_is_reported() {
    let server = NatsServer::start();
    let config = NatsConfig { subscription_capacity: 8, ..config_for(vec![server.url()]) };
    let (on_event, mut events) = event_channel();
    let client = bus::connect(&config, on_event).await.unwrap();
    let _unread = client.subscribe("harness.flood").await.unwrap();
    client.flush().await.unwrap();
    let publisher = connect_ok(&config_for(vec![server.url()])).await;
    for _ in 0..200 {
        publisher.publish("harness.flood", "x".into()).await.unwrap();
    }
    publisher.flush().await.unwrap();
    let event = next_event(&mut events, "a slow consumer", |e| matches!(e, ConnectionEvent::SlowConsumer { .. })).await;
    assert_eq!(event.kind(), "slow_consumer");
}

#[tokio::test]
async fn permission_violation_is_reported() {
    let server = NatsServer::builder()
        .config(
            r#"authorization { users = [
                { user: "svc", password: "pw",
                  permissions: { publish: { deny: ["harness.forbidden.>"] } } }
            ] }"#,
        )
        .start();
    let config = NatsConfig { user: Some("svc".into()), password: Some("pw".into()), ..config_for(vec![server.url()]) };
    let (on_event, mut events) = event_channel();
    let client = bus::connect(&config, on_event).await.unwrap();
    client.publish("harness.forbidden.x", "no".into()).await.unwrap();
    client.flush().await.unwrap();
    let event = next_event(&mut events, "a permissions violation", |e| {
        matches!(e, ConnectionEvent::PermissionViolation { .. })
    })
    .await;
    let ConnectionEvent::PermissionViolation { message } = event else { unreachable!() };
    assert!(message.contains("harness.forbidden.x"), "{message}");
}

#[tokio::test]
async fn token_authentication() {
    let server = NatsServer::builder().config(r#"authorization { token: "s3cret-token" }"#).start();
    let good = NatsConfig { token: Some("s3cret-token".into()), ..config_for(vec![server.url()]) };
    assert_round_trip(&connect_ok(&good).await, "harness.token").await;

    let wrong = NatsConfig { token: Some("guessed-token".into()), ..good.clone() };
    let error = bus::connect(&wrong, |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::AuthorizationViolation { .. }), "{error}");
    let missing = NatsConfig { token: None, ..good };
    let error = bus::connect(&missing, |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::AuthorizationViolation { .. }), "{error}");
    assert!(!error.to_string().contains("s3cret"), "{error}");
}

#[tokio::test]
async fn user_and_password_authentication() {
    let server = NatsServer::builder().config(r#"authorization { user: "sink", password: "correct-horse" }"#).start();
    let good = NatsConfig {
        user: Some("sink".into()),
        password: Some("correct-horse".into()),
        ..config_for(vec![server.url()])
    };
    assert_round_trip(&connect_ok(&good).await, "harness.userpass").await;

    let wrong = NatsConfig { password: Some("battery-staple".into()), ..good };
    let error = bus::connect(&wrong, |_| {}).await.map(|_| ()).unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, BusError::AuthorizationViolation { .. }), "{message}");
    assert!(message.contains("authorization violation"), "{message}");
    assert!(message.contains(&server.url()), "names the server: {message}");
    assert!(message.contains("check user/password"), "says what to check: {message}");
    assert!(!message.contains("battery-staple"), "never echoes the password: {message}");
}

#[tokio::test]
async fn nkey_authentication() {
    // A published test pair (NATS client test suites): seed and the public key it derives.
    const SEED: &str = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU";
    const PUBLIC: &str = "UCK5N7N66OBOINFXAYC2ACJQYFSOD4VYNU6APEJTAVFZB2SVHLKGEW7L";
    let server =
        NatsServer::builder().config(format!(r#"authorization {{ users = [ {{ nkey: "{PUBLIC}" }} ] }}"#)).start();
    let good = NatsConfig { nkey_seed: Some(SEED.into()), ..config_for(vec![server.url()]) };
    assert_round_trip(&connect_ok(&good).await, "harness.nkey").await;

    let without = NatsConfig { nkey_seed: None, ..good };
    let error = bus::connect(&without, |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::AuthorizationViolation { .. }), "{error}");
}

/// Decentralized authentication, as NGS and operator-mode deployments use it: a credentials
/// file (user JWT and seed) issued under the operator the server trusts connects; one whose
/// account the server does not know is refused as an authorization violation.
#[tokio::test]
async fn credentials_file_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let operator = jwt::Operator::generate();
    let server = NatsServer::builder().config(operator.server_config(dir.path())).jetstream(false).start();
    let creds = operator.user_credentials(dir.path(), "sink");
    let good = NatsConfig { credentials_file: Some(creds), ..config_for(vec![server.url()]) };
    assert_round_trip(&connect_ok(&good).await, "harness.creds").await;

    let stranger = operator.stranger_credentials(dir.path(), "stranger");
    let refused = NatsConfig { credentials_file: Some(stranger), ..good };
    let error = bus::connect(&refused, |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::AuthorizationViolation { .. }), "{error}");
}

#[tokio::test]
async fn tls_with_a_private_ca_and_client_certificates() {
    let pki = TestPki::generate();
    let server = NatsServer::builder().config(pki.server_tls_config(true)).start();
    let tls = TlsConfig {
        required: true,
        ca_file: Some(pki.ca_file()),
        cert_file: Some(pki.client_cert_file()),
        key_file: Some(pki.client_key_file()),
    };
    let good = NatsConfig { tls: tls.clone(), ..config_for(vec![server.url()]) };
    assert_round_trip(&connect_ok(&good).await, "harness.tls").await;

    // The server verifies clients: no client certificate, no connection.
    let no_client_cert =
        NatsConfig { tls: TlsConfig { cert_file: None, key_file: None, ..tls.clone() }, ..good.clone() };
    let error = bus::connect(&no_client_cert, |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::Connect { .. }), "{error}");

    // A CA that did not sign the server's certificate: verification fails.
    let wrong_ca = NatsConfig { tls: TlsConfig { ca_file: Some(pki.other_ca_file()), ..tls }, ..good };
    let error = bus::connect(&wrong_ca, |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::Connect { .. }), "{error}");
}

#[tokio::test]
async fn tls_required_refuses_a_plain_server() {
    let server = NatsServer::start();
    let config =
        NatsConfig { tls: TlsConfig { required: true, ..TlsConfig::default() }, ..config_for(vec![server.url()]) };
    let error = bus::connect(&config, |_| {}).await.map(|_| ()).unwrap_err();
    assert!(matches!(error, BusError::Connect { .. }), "{error}");
}

#[test]
fn a_missing_binary_is_reported_with_install_advice() {
    let error = find_nats_server(Some(OsString::from("/nonexistent/nats-server")), None, &[]).unwrap_err();
    assert!(error.contains("NATS_SERVER_BIN=/nonexistent/nats-server"), "{error}");
    assert!(error.contains("apt-get install nats-server"), "{error}");

    let empty = tempfile::tempdir().unwrap();
    let error = find_nats_server(None, Some(empty.path().into()), &[]).unwrap_err();
    assert!(error.contains("apt-get install nats-server"), "{error}");
    assert!(error.contains("NATS_SERVER_BIN"), "{error}");

    let fake = empty.path().join("nats-server");
    std::fs::write(&fake, "").unwrap();
    assert_eq!(find_nats_server(None, Some(empty.path().into()), &[]).unwrap(), fake);
    assert_eq!(find_nats_server(Some(OsString::new()), Some(empty.path().into()), &[]).unwrap(), fake);
}
