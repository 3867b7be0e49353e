//! `structured-sink demo`: the main job in one command on a fresh machine.
//!
//! Uses the NATS server at `NATS_URL` when set; otherwise starts `nats-server` from `PATH` on a
//! free loopback port (and stops it at the end). Runs the service in-process, publishes the
//! bundled example conversation as an agent would (prose, a YAML block, a thinking section, a
//! tool call, one bad event), subscribes like a downstream handler, prints what arrives on each
//! subject, then the visible text as a user would read it, and exits.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;

use crate::codec::outbound::Publication;
use crate::config::Config;
use crate::replay::publication_json;
use crate::service::{RunningService, TYPE_HEADER};

/// The conversation the demo publishes.
pub const TRANSCRIPT: &str = include_str!("../examples/transcripts/conversation.jsonl");
/// The configuration the demo runs the service with (tags of the transcript).
pub const DEMO_TAGS: &str = include_str!("../examples/replay.toml");

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// No server URL and no `nats-server` binary.
    #[error(
        "no NATS server: set NATS_URL=nats://host:4222, or install one (Debian/Ubuntu: `apt-get install nats-server`; \
         or download it from https://nats.io/download) so that `nats-server` is on PATH"
    )]
    NoServer,
    /// The server did not start.
    #[error("nats-server did not start: {0}")]
    ServerStart(String),
    /// The service failed.
    #[error(transparent)]
    Service(#[from] crate::service::ServiceError),
    /// Talking to NATS failed.
    #[error("NATS: {0}")]
    Nats(String),
    /// Configuration of the demo is broken.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// A `nats-server` child process, stopped on drop.
struct LocalServer {
    child: Child,
    _store: tempfile::TempDir,
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find_nats_server() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        return Some(PathBuf::from(bin));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.is_file())
}

fn start_local_server() -> Result<(LocalServer, String), DemoError> {
    let binary = find_nats_server().ok_or(DemoError::NoServer)?;
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| DemoError::ServerStart(e.to_string()))?
        .port();
    let store = tempfile::TempDir::new().map_err(|e| DemoError::ServerStart(e.to_string()))?;
    let child = Command::new(&binary)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(store.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| DemoError::ServerStart(format!("{}: {e}", binary.display())))?;
    let server = LocalServer { child, _store: store };
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok((server, format!("nats://127.0.0.1:{port}")));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(DemoError::ServerStart(format!("{} did not accept connections on port {port}", binary.display())))
}

/// Runs the demo, writing a readable account to standard output.
pub async fn run(base: Config) -> Result<(), DemoError> {
    let (_server, url) = match std::env::var("NATS_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let (server, url) = start_local_server()?;
            println!("started nats-server at {url}");
            (Some(server), url)
        }
    };
    let demo_tags: Config = toml_tags(DEMO_TAGS)?;
    let mut config = base;
    config.nats.servers = vec![url.clone()];
    config.http.enabled = false;
    config.tags = demo_tags.tags;
    let registry = config.load_schemas()?;
    let service = RunningService::start(config.clone()).await?;
    println!("structured-sink is running (subscribed to {:?})\n", config.input.subjects);

    let client = async_nats::connect(&url).await.map_err(|e| DemoError::Nats(e.to_string()))?;
    let subjects = config.output.subjects.clone();
    let mut outputs = futures::stream::select_all([
        subscribe(&client, &subjects.filtered).await?,
        subscribe(&client, &format!("{}.>", subjects.structured_prefix)).await?,
        subscribe(&client, &subjects.thinking).await?,
        subscribe(&client, &subjects.tools).await?,
        subscribe(&client, &config.input.dead_letter_subject).await?,
    ]);
    client.flush().await.map_err(|e| DemoError::Nats(e.to_string()))?;

    let input = config.input.subjects[0].clone();
    println!("agent: publishing {} events on {input:?}", TRANSCRIPT.lines().count());
    for line in TRANSCRIPT.lines() {
        client
            .publish(input.clone(), line.as_bytes().to_vec().into())
            .await
            .map_err(|e| DemoError::Nats(e.to_string()))?;
    }
    client.flush().await.map_err(|e| DemoError::Nats(e.to_string()))?;

    let streams =
        TRANSCRIPT.lines().filter(|l| l.contains(r#""type":"final""#) || l.contains("segment-finished")).count();
    let mut finals = 0;
    let mut visible: BTreeMap<String, String> = BTreeMap::new();
    println!("\ndownstream: what arrives on each subject\n");
    // Subjects are separate subscriptions, so after the last final a few messages of other
    // subjects may still be on their way: wait briefly for them.
    loop {
        let wait = if finals < streams { Duration::from_secs(10) } else { Duration::from_millis(300) };
        let message = match tokio::time::timeout(wait, outputs.next()).await {
            Ok(Some(message)) => message,
            _ => break,
        };
        let subject = message.subject.to_string();
        let type_name = message.headers.as_ref().and_then(|h| h.get(TYPE_HEADER)).map(|v| v.to_string());
        let Some(type_name) = type_name else {
            let reason = message.headers.as_ref().and_then(|h| h.get("Structured-Sink-Error")).map(|v| v.to_string());
            println!("{subject:<44} dead letter ({})", reason.unwrap_or_default());
            continue;
        };
        let type_name: &'static str = match type_name.as_str() {
            crate::codec::outbound::GEPPETTO_EVENT_TYPE => crate::codec::outbound::GEPPETTO_EVENT_TYPE,
            crate::codec::proto::names::FILTERED_TEXT => crate::codec::proto::names::FILTERED_TEXT,
            crate::codec::proto::names::BLOCK_EVENT => crate::codec::proto::names::BLOCK_EVENT,
            crate::codec::proto::names::THINKING_TEXT => crate::codec::proto::names::THINKING_TEXT,
            _ => crate::codec::proto::names::TOOL_CALL,
        };
        let publication = Publication {
            subject: subject.as_str().into(),
            type_name,
            content_type: "",
            payload: message.payload,
            msg_id: String::new(),
        };
        let json =
            publication_json(&publication, registry.descriptor_pool()).map_err(|e| DemoError::Nats(e.to_string()))?;
        let mut body = json.clone();
        if let Some(map) = body.as_object_mut() {
            map.remove("stream");
        }
        println!("{subject:<44} {}", body);
        if type_name == crate::codec::proto::names::FILTERED_TEXT {
            let stream = json["stream"]["stream_id"].as_str().unwrap_or_default().to_owned();
            visible.entry(stream).or_default().push_str(json["delta"].as_str().unwrap_or_default());
            if json["final"] == true {
                finals += 1;
            }
        } else if type_name == crate::codec::outbound::GEPPETTO_EVENT_TYPE {
            let stream = json["meta"]["message_id"].as_str().unwrap_or_default().to_owned();
            visible.entry(stream).or_default().push_str(json["delta"].as_str().unwrap_or_default());
            if matches!(json["type"].as_str(), Some("final" | "text-segment-finished")) {
                finals += 1;
            }
        }
    }
    println!("\nwhat the users read:");
    for (stream, text) in &visible {
        println!("\n[{stream}]\n{text}");
    }
    service.shutdown().await?;
    Ok(())
}

async fn subscribe(client: &async_nats::Client, subject: &str) -> Result<async_nats::Subscriber, DemoError> {
    client.subscribe(subject.to_owned()).await.map_err(|e| DemoError::Nats(e.to_string()))
}

fn toml_tags(text: &str) -> Result<Config, DemoError> {
    use figment::providers::{Format, Serialized, Toml};
    figment::Figment::from(Serialized::defaults(Config::default()))
        .merge(Toml::string(text))
        .extract()
        .map_err(|e| DemoError::Config(e.into()))
}
