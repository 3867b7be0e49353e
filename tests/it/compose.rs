//! The compose stack (`deploy/compose.yaml`) run for real: built and started by Docker Compose,
//! driven as agents and a downstream handler drive it, through one replica killed with SIGKILL
//! and the other restarted gracefully, and every output checked against
//! [`structured_sink::replay`] of the same events (the service's processing offline, with the
//! configuration the stack's replicas run: the defaults plus settings that do not change outputs).
//!
//! Needs a Docker daemon and Docker Compose 2.24.4 or later, so it is `#[ignore]`d: run it with
//! `cargo test --test it compose -- --ignored`, where a missing daemon or an older Compose fails
//! it with the reason (the plain `cargo test` lists it as ignored rather than passing without
//! having run). It adds an override file that replaces (`!override`) the stack's host ports with
//! free loopback ports and its image tag with a test tag, under a project name of its own, so it
//! neither collides with a local stack (nor with a NATS server on 4222) nor replaces its image.
//! The base images and `nats:2.11-alpine` must be pullable or present; where they cannot be
//! pulled, `deploy/image-check.sh --docker --stand-ins` makes stand-ins for the three of them, and
//! the override puts the runtime's and NATS's in place of the stack's when they are present (the
//! builder's stand-in takes the official name itself). The image is built plainly (`PGO=0`): one
//! release build, cached by BuildKit after the first run.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use structured_sink::config::Config;
use structured_sink::replay::message_json;
use structured_sink::service::TYPE_HEADER;

use crate::scale::replayed;
use crate::service::ByStream;
use crate::support::{docker_has_image, docker_with_daemon, free_ports, http_get, repo, STANDIN_NATS, STANDIN_RUNTIME};

/// Messages in the workload, published round-robin as many agents at once.
const MESSAGES: usize = 200;
/// The first Compose release that reads `!override` in an override file.
const COMPOSE_OVERRIDE_SINCE: (u32, u32, u32) = (2, 24, 4);
/// How long every final may take to arrive once the last event is published.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(180);

/// A Docker client whose daemon answers and whose Compose reads `!override`, or why not.
fn docker_with_compose() -> Result<PathBuf, String> {
    let docker = docker_with_daemon()?;
    let version = Command::new(&docker).args(["compose", "version", "--short"]).output();
    let version = version.ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let Some(version) = version else {
        return Err(format!("{}: no Compose v2 plugin (`docker compose version` failed)", docker.display()));
    };
    // "2.26.1", "v2.29.7" or a distribution's "2.26.1-4".
    let numbers: Vec<u32> = version
        .trim()
        .trim_start_matches('v')
        .split(['.', '-', '+'])
        .take(3)
        .map(|part| part.parse().unwrap_or(0))
        .collect();
    let found = (
        numbers.first().copied().unwrap_or(0),
        numbers.get(1).copied().unwrap_or(0),
        numbers.get(2).copied().unwrap_or(0),
    );
    if found < COMPOSE_OVERRIDE_SINCE {
        return Err(format!("Docker Compose {} is older than 2.24.4 (no `!override`)", version.trim()));
    }
    Ok(docker)
}

/// One compose project, taken down with its volume when dropped.
struct Stack {
    docker: PathBuf,
    project: String,
    dir: PathBuf,
    nats_port: u16,
    metrics_ports: [u16; 2],
}

impl Stack {
    fn new(docker: PathBuf) -> Stack {
        let project = format!("structured-sink-test-{}", std::process::id());
        let dir = std::env::temp_dir().join(&project);
        std::fs::create_dir_all(&dir).unwrap();
        let ports = free_ports(3);
        let (nats_port, metrics_ports) = (ports[0], [ports[1], ports[2]]);
        let image = format!("structured-sink:{project}");
        let (runtime_standin, nats_standin) =
            (docker_has_image(&docker, STANDIN_RUNTIME), docker_has_image(&docker, STANDIN_NATS));
        let mut override_file = format!("services:\n  nats:\n    ports: !override [\"127.0.0.1:{nats_port}:4222\"]\n");
        if nats_standin {
            override_file += &format!("    image: {STANDIN_NATS}\n");
        }
        for (replica, port) in metrics_ports.iter().enumerate() {
            override_file +=
                &format!("  sink-{replica}:\n    image: {image}\n    ports: !override [\"127.0.0.1:{port}:9464\"]\n");
            if runtime_standin {
                override_file += &format!("    build:\n      args:\n        RUNTIME_IMAGE: {STANDIN_RUNTIME}\n");
            }
        }
        let standins: Vec<&str> = [(runtime_standin, STANDIN_RUNTIME), (nats_standin, STANDIN_NATS)]
            .into_iter()
            .filter_map(|(used, name)| used.then_some(name))
            .collect();
        if !standins.is_empty() {
            eprintln!("compose: stand-ins in place of the stack's images: {}", standins.join(", "));
        }
        std::fs::write(dir.join("override.yaml"), override_file).unwrap();
        Stack { docker, project, dir, nats_port, metrics_ports }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.docker);
        command
            .args(["compose", "-p", &self.project, "-f"])
            .arg(repo().join("deploy/compose.yaml"))
            .arg("-f")
            .arg(self.dir.join("override.yaml"))
            .args(args)
            .env("PGO", "0")
            .env_remove("OTLP_ENDPOINT");
        command
    }

    /// Runs `docker compose ARGS` and returns its output; fails the test when it fails. Blocks
    /// only this worker thread: the subscriber keeps reading meanwhile.
    fn run(&self, args: &[&str]) -> Output {
        let output = tokio::task::block_in_place(|| self.command(args).output()).unwrap();
        assert!(
            output.status.success(),
            "docker compose {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }

    fn counter(&self, replica: usize, name: &str) -> f64 {
        let (status, body) = http_get(self.metrics_ports[replica], "/metrics").expect("the replica serves /metrics");
        assert_eq!(status, 200);
        body.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{name} missing from replica {replica}'s metrics"))
            .parse()
            .unwrap()
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = self.command(&["down", "--volumes", "--remove-orphans"]).output();
        let image = format!("structured-sink:{}", self.project);
        let _ = Command::new(&self.docker).args(["image", "rm", &image]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Message `i`'s text: prose around a thinking channel, a typed block, a tool call and citations.
fn text_of(i: usize) -> String {
    format!(
        "Answer {i}: let me check.\n<thinking>The user wants research {i}.</thinking>\n\
         <pinocchio:agent_mode_switch:v1>\n```yaml\nmode_switch:\n  analysis: reason {i}\n  new_mode: research\n```\n\
         </pinocchio:agent_mode_switch:v1>\nSwitching. <tool>{{\"tool_name\": \"search\", \"arguments\": \
         {{\"query\": \"q{i}\"}}}}</tool>\nSources: <geppetto:citations:v1>\ncitations:\n  - title: T{i}\n    \
         authors: [A]\n</geppetto:citations:v1> done {i}."
    )
}

/// Message `i`'s events, 4-character deltas: even messages in the legacy vocabulary
/// (`start`/`partial`/`final`), odd ones in the canonical one (`text-delta`/`text-segment-finished`).
fn events_of(i: usize, message_id: &str) -> Vec<Value> {
    let text = text_of(i);
    let chars: Vec<char> = text.chars().collect();
    let deltas: Vec<String> = chars.chunks(4).map(|c| c.iter().collect()).collect();
    let mut events = Vec::new();
    let mut so_far = String::new();
    if i % 2 == 0 {
        let meta = json!({"message_id": message_id, "session_id": format!("s{i}")});
        events.push(json!({"type": "start", "meta": meta}));
        for delta in deltas {
            so_far.push_str(&delta);
            events.push(json!({"type": "partial", "meta": meta, "delta": delta, "completion": so_far}));
        }
        let mut meta = meta;
        meta["stop_reason"] = "stop".into();
        events.push(json!({"type": "final", "meta": meta, "text": text}));
    } else {
        let segment = format!("run-{i}:provider-call:0:msg:0:text");
        let correlation = json!({"session_id": format!("s{i}"), "run_id": format!("run-{i}"), "segment_id": segment});
        for (n, delta) in deltas.into_iter().enumerate() {
            so_far.push_str(&delta);
            events.push(json!({"type": "text-delta", "meta": {"message_id": message_id}, "correlation": correlation,
                "delta": delta, "text": so_far, "sequence": n + 1}));
        }
        events.push(json!({"type": "text-segment-finished", "meta": {"message_id": message_id},
            "correlation": {"segment_id": segment}, "text": text, "finish_reason": "stop"}));
    }
    events
}

/// An output message's stream field `name` (`message_id`, `stream_id`).
fn stream_field(message: &Value, name: &str) -> String {
    message["stream"][name].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Docker daemon and Docker Compose 2.24.4+: cargo test --test it compose -- --ignored"]
async fn compose_stack_delivers_what_replay_predicts_through_a_kill_and_a_restart() {
    let docker = docker_with_compose().unwrap_or_else(|why| panic!("{why}: the compose stack cannot run"));
    let stack = Stack::new(docker);
    stack.run(&["up", "--build", "--detach", "--wait"]);

    // The workload, and what replay predicts for it in publish order.
    let ids: Vec<String> = (0..MESSAGES).map(|i| format!("compose-{i:04}-{}", std::process::id())).collect();
    let per_message: Vec<Vec<Value>> = ids.iter().enumerate().map(|(i, id)| events_of(i, id)).collect();
    let longest = per_message.iter().map(Vec::len).max().unwrap();
    let order: Vec<(String, String)> = (0..longest)
        .flat_map(|k| {
            ids.iter().zip(&per_message).filter_map(move |(id, events)| Some((id.clone(), events.get(k)?.to_string())))
        })
        .collect();
    let config = Config::default();
    let expected = replayed(&config, &order);
    let expected_total: usize = expected.values().map(Vec::len).sum();
    let pool = config.load_schemas().unwrap().descriptor_pool().clone();

    // A downstream handler: one subscription over every output subject, so that a stream's
    // outputs arrive in publish order whatever their subjects. Republished outputs (a rebuilt
    // stream's, after the kill and the restart) carry their first copy's `Nats-Msg-Id`: a
    // JetStream stream would drop them, and so does this handler, after checking they are equal.
    let client = async_nats::connect(format!("nats://127.0.0.1:{}", stack.nats_port)).await.unwrap();
    let mut outputs = client.subscribe("chat.>").await.unwrap();
    client.flush().await.unwrap();
    let handler = tokio::spawn(async move {
        let mut received = ByStream::new();
        let mut first_copies: HashMap<String, (String, Value)> = HashMap::new();
        let (mut republished, mut finals) = (0usize, BTreeSet::new());
        let reading = async {
            while let Some(message) = outputs.next().await {
                if message.subject.starts_with("chat.raw.") {
                    continue;
                }
                let headers = message.headers.as_ref().expect("outputs carry headers");
                let type_name = headers.get(TYPE_HEADER).expect("the type header").as_str();
                let id = headers.get("Nats-Msg-Id").expect("a message id").as_str().to_owned();
                let json = message_json(&pool, type_name, &message.payload).expect("an output replay can show");
                let output = (message.subject.to_string(), json);
                if let Some(first) = first_copies.get(&id) {
                    assert_eq!(first, &output, "a republished output differs from its first copy ({id})");
                    republished += 1;
                    continue;
                }
                if output.0 == "chat.filtered" && output.1["final"] == true {
                    finals.insert(stream_field(&output.1, "message_id"));
                }
                received.entry(stream_field(&output.1, "stream_id")).or_default().push(output.clone());
                first_copies.insert(id, output);
                if finals.len() == MESSAGES {
                    break;
                }
            }
        };
        let complete = tokio::time::timeout(DELIVERY_TIMEOUT, reading).await.is_ok();
        (received, republished, finals.len(), complete)
    });

    // The agents, at a pace that lets the kill and the restart land mid-stream.
    for (k, (id, event)) in order.iter().enumerate() {
        client.publish(format!("chat.raw.{id}"), event.clone().into()).await.unwrap();
        if k % 2000 == 1999 {
            client.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if k == order.len() / 3 {
            client.flush().await.unwrap();
            stack.run(&["kill", "--signal", "SIGKILL", "sink-1"]);
            stack.run(&["up", "--detach", "--wait", "sink-1"]);
        }
        if k == 2 * order.len() / 3 {
            client.flush().await.unwrap();
            stack.run(&["restart", "sink-0"]);
        }
    }
    client.flush().await.unwrap();
    let (received, republished, finals, complete) = handler.await.unwrap();
    let received_total: usize = received.values().map(Vec::len).sum();
    eprintln!(
        "compose: {} events of {MESSAGES} messages; {received_total} of {expected_total} predicted outputs received, \
         {republished} republished copies dropped, {finals} finals",
        order.len()
    );
    assert!(complete, "only {finals} of {MESSAGES} finals within {DELIVERY_TIMEOUT:?}");
    assert_eq!(received.len(), expected.len(), "streams");
    for (stream, outputs) in &expected {
        assert_eq!(received.get(stream), Some(outputs), "stream {stream:?}: outputs differ from replay's");
    }

    // Both replicas took part (each owns half the partitions), and both stop cleanly.
    for replica in 0..2 {
        let events = stack.counter(replica, "structured_sink_events_received_total");
        assert!(events > 0.0, "replica {replica} received no event");
    }
    stack.run(&["stop"]);
    let states = stack.run(&["ps", "--all", "--format", "{{.Service}} {{.ExitCode}}"]);
    let states = String::from_utf8(states.stdout).unwrap();
    for replica in ["sink-0", "sink-1"] {
        let code = states.lines().find_map(|l| l.strip_prefix(replica)?.trim().parse::<i32>().ok());
        assert_eq!(code, Some(0), "{replica} exit code on SIGTERM: {states}");
    }
}
