//! End-to-end load tool: structured-sink against a plain relay, in the same run, on a real
//! `nats-server` on a loopback port.
//!
//! Run (release): `cargo bench --bench e2e -- [--streams N] [--events-per-stream M]
//! [--mode core|jetstream] [--quick] [--idle-streams N] [--idle-canonical] [--no-completion] [--window N]
//! [--rounds R] [--rate EVENTS_PER_S] [--paired EVENTS_PER_S]...` (`--help` lists the rest).
//! Without `--bench` on the command line (as under `cargo test --all-targets`) it runs a small
//! smoke configuration and fails if an output is missing.
//!
//! What it does:
//! * Starts `nats-server` (`NATS_SERVER_BIN`, else `nats-server` on `PATH`, else
//!   `/usr/sbin/nats-server`) on a free port of 127.0.0.1, with JetStream in a temporary directory
//!   for `--mode jetstream`; it is killed when the tool ends.
//! * Builds a workload of N synthetic agent streams (geppetto JSON as Go writes it, ~4-byte deltas
//!   of prose with `<thinking>`, YAML blocks, tool calls and citations mixed in, cumulative
//!   `completion`/`text` fields, 1 stream in 4 in the canonical vocabulary), interleaved
//!   round-robin over the streams in a shuffled order, published to subject `chat`.
//! * Predicts every output of the service by running the same processing offline (decode and
//!   `StreamTable::apply`, built from the same `Config`): for each stream, output `seq` n was caused
//!   by a known input event. This is how latency is measured without the service carrying a
//!   timestamp: the producer stores each event's publish time (ns since a process-wide epoch) in a
//!   table indexed by event; a downstream subscriber on `chat.>` reads `Nats-Msg-Id:
//!   <stream key>:<seq>` of every output, finds the event that caused it, and records receive time
//!   minus publish time. Every expected output is checked off exactly once (missing, duplicate
//!   and unexpected outputs are reported, and any wait of over a second between two outputs; a
//!   JetStream phase that stalls also prints each consumer as the server sees it). The relay
//!   forwards the producer's `Bench-Event: <index>` header unchanged, which identifies the event
//!   directly; the service never copies it.
//! * Phases, each with a fresh system under test: idle-stream memory (service only, first, so that
//!   freed workload memory cannot hide growth; in `--mode jetstream` each idle stream also holds
//!   its first event's acknowledgement), then per round relay and service at maximum rate,
//!   then service and relay paced at half the service's maximum rate. Maximum rate is a closed
//!   loop: the producer publishes as fast as it can while at most `--window` expected outputs are
//!   outstanding (below the 65,536-message client buffers, so nothing is dropped); the rate is
//!   events / (last output received - first event published). In `--mode jetstream` each round
//!   ends with a backlog phase per system: the workload is stored in a fresh stream first (every
//!   publish confirmed), then the system starts and drains it (the catch-up rate after an outage,
//!   apart from the cost of storing events at the same time; no latency). Each `--paired RATE`
//!   adds a phase in which relay and service consume the same input at once, paced at RATE: every
//!   service output is timed against its event's relay output, which left the producer in the
//!   same publish and crossed the same hops, so the difference is the service's own added latency
//!   per event, not a difference of two percentiles from two runs (the smoke run includes one).
//! * `--store-outputs` (with `--mode jetstream`): a stream (`BENCH_OUT`, fresh for each phase)
//!   stores the outputs of both systems, the durable set-up end to end. The service then confirms
//!   each output's storage before it acknowledges the stream's input (it finds the stream by
//!   itself); the relay does the same for each event, publishing through JetStream and
//!   acknowledging the input once the storage of its copy is confirmed, with up to
//!   [`RELAY_UNCONFIRMED`] copies unconfirmed at once.
//! * The service runs in this process (`RunningService::start`, default shard count unless
//!   `--shards`, HTTP off). The relay is one task on its own client made by the same `bus::connect`
//!   from the same `NatsConfig`. The producer runs on its own thread and client, and so does the
//!   subscriber: the runtime of the system under test (one worker thread per CPU unless
//!   `--worker-threads`) runs nothing else, so its CPU time is the system's own, and the
//!   subscriber's parsing of what the system publishes (three headers per service output, one per
//!   relay output) is the load generator's.
//! * `--service-bin PATH`: the service runs instead as that `structured-sink` binary's own
//!   process ([`ServiceProcess`]), as operators run it; its CPU figures are then that process's.
//!   This is how `deploy/pgo-build.sh` trains a binary built for profile-guided optimisation,
//!   and how the optimised binary is measured against a plain one. The smoke run includes one
//!   such phase, with the binary cargo built beside the bench.
//!
//! Every loop is bounded in count and time; only 127.0.0.1 is used.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use async_nats::jetstream::stream::StorageType;
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use structured_sink::bus::{self, round_trip, ConnectionEvent, NatsConfig};
use structured_sink::codec::inbound::decode;
use structured_sink::config::Config;
use structured_sink::service::RunningService;
use structured_sink::shard::table::{InputPosition, StreamTable, TableLimits};

/// The same global allocator as the `structured-sink` binary, for the service and the relay alike.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// ---------------------------------------------------------------------------------------------
// Command line.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Core,
    JetStream,
}

#[derive(Debug, Clone)]
struct Args {
    streams: usize,
    events_per_stream: usize,
    mode: Mode,
    quick: bool,
    idle_streams: usize,
    /// The idle streams are segments in the canonical vocabulary (`text-delta` naming a segment
    /// and a provider call, as geppetto sends since v0.11.23) rather than legacy `partial`s: each
    /// also holds its key, its segment id and a place in the index of its message's segments.
    idle_canonical: bool,
    cumulative: bool,
    window: u64,
    rounds: usize,
    shards: usize,
    smoke: bool,
    /// Only the service (or the relay) at maximum rate, `rounds` times, for a profiler or a
    /// counter of instructions; no report.
    profile: Option<System>,
    /// `--mode jetstream`: `jetstream.max_ack_pending` (default: the service's default).
    ack_pending: Option<i64>,
    /// The paced rate of the latency phases (default: half the service's maximum).
    rate: Option<f64>,
    /// Streams open at once (default: all of them, every stream open for the whole run).
    open_streams: Option<usize>,
    /// `--mode jetstream`: `jetstream.pull_batch` for both systems (default: the service's).
    pull_batch: Option<usize>,
    /// Rates of the paired phases (`--paired RATE`, repeatable): relay and service at once.
    paired: Vec<f64>,
    /// `--mode jetstream`: the storage of the input stream (`--storage file|memory`, default file).
    storage: StorageType,
    /// Worker threads of the runtime that runs the system under test (default: tokio's, one per
    /// CPU, as the service's own `main`).
    worker_threads: Option<usize>,
    /// How long the producer waits without any output before it stops a phase as stalled
    /// (`--stall-seconds`, default 10; longer to watch whether a stalled system recovers).
    stall: Duration,
    /// `--mode jetstream`: a stream stores the outputs (`--store-outputs`), see the module doc.
    store_outputs: bool,
    /// `--service-bin PATH`: the service runs as this `structured-sink` binary's own process
    /// ([`ServiceProcess`]), not in this one.
    service_bin: Option<PathBuf>,
}

const USAGE: &str = "usage: cargo bench --bench e2e -- [--streams N (1000)] [--events-per-stream M (300)] \
[--mode core|jetstream] [--quick] [--idle-streams N (100000)] [--idle-canonical] [--no-completion] [--window N (20000)] \
[--rounds R (1)] [--shards N (the service default)] [--rate EVENTS_PER_S (half the max)] [--ack-pending N (jetstream)] \
[--open-streams N (all)] [--pull-batch N (jetstream; the service default)] [--paired EVENTS_PER_S (repeatable)] \
[--storage file|memory (jetstream; file)] [--store-outputs (jetstream)] [--worker-threads N (one per CPU)] \
[--stall-seconds S (10)] [--service-bin PATH] [--profile-service | --profile-relay]";

fn parse_args() -> Result<Args> {
    // (see USAGE)
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let bench = raw.iter().any(|a| a == "--bench");
    let mut args = Args {
        streams: 1000,
        events_per_stream: 300,
        mode: Mode::Core,
        quick: false,
        idle_streams: 100_000,
        idle_canonical: false,
        cumulative: true,
        window: 20_000,
        rounds: 1,
        shards: 0,
        smoke: !bench,
        profile: None,
        ack_pending: None,
        rate: None,
        open_streams: None,
        pull_batch: None,
        paired: Vec::new(),
        storage: StorageType::File,
        worker_threads: None,
        stall: Duration::from_secs(10),
        store_outputs: false,
        service_bin: None,
    };
    let (mut streams, mut events, mut idle) = (None, None, None);
    let mut it = raw.iter();
    let number = |flag: &str, v: Option<&String>| -> Result<usize> {
        let v = v.ok_or_else(|| anyhow!("{flag} needs a value\n{USAGE}"))?;
        v.replace('_', "").parse::<usize>().map_err(|_| anyhow!("{flag}: {v:?} is not a number\n{USAGE}"))
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bench" => {}
            "--streams" => streams = Some(number(a, it.next())?.max(1)),
            "--events-per-stream" => events = Some(number(a, it.next())?.max(2)),
            "--idle-streams" => idle = Some(number(a, it.next())?),
            "--window" => args.window = number(a, it.next())?.max(100) as u64,
            "--rounds" => args.rounds = number(a, it.next())?.clamp(1, 10),
            "--shards" => args.shards = number(a, it.next())?,
            "--quick" => args.quick = true,
            "--idle-canonical" => args.idle_canonical = true,
            "--store-outputs" => args.store_outputs = true,
            "--no-completion" => args.cumulative = false,
            "--profile-service" => args.profile = Some(System::Service),
            "--profile-relay" => args.profile = Some(System::Relay),
            "--rate" => args.rate = Some(number(a, it.next())?.max(100) as f64),
            "--ack-pending" => args.ack_pending = Some(number(a, it.next())?.max(1) as i64),
            "--open-streams" => args.open_streams = Some(number(a, it.next())?.max(1)),
            "--pull-batch" => args.pull_batch = Some(number(a, it.next())?.max(1)),
            "--paired" => args.paired.push(number(a, it.next())?.max(100) as f64),
            "--worker-threads" => args.worker_threads = Some(number(a, it.next())?.max(1)),
            "--stall-seconds" => args.stall = Duration::from_secs(number(a, it.next())?.max(1) as u64),
            "--service-bin" => {
                let path = it.next().ok_or_else(|| anyhow!("--service-bin needs a path\n{USAGE}"))?;
                args.service_bin = Some(PathBuf::from(path));
            }
            "--mode" => {
                args.mode = match it.next().map(String::as_str) {
                    Some("core") => Mode::Core,
                    Some("jetstream") => Mode::JetStream,
                    other => bail!("--mode: {other:?} is not core or jetstream\n{USAGE}"),
                }
            }
            "--storage" => {
                args.storage = match it.next().map(String::as_str) {
                    Some("file") => StorageType::File,
                    Some("memory") => StorageType::Memory,
                    other => bail!("--storage: {other:?} is not file or memory\n{USAGE}"),
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if args.store_outputs && args.mode != Mode::JetStream {
        bail!("--store-outputs needs --mode jetstream\n{USAGE}");
    }
    if args.smoke {
        // `cargo test --all-targets` runs bench binaries without `--bench`: a few seconds only.
        (args.streams, args.events_per_stream, args.idle_streams) = (20, 30, 2_000);
        // The paired accounting too (both systems' outputs checked off in one phase).
        if args.paired.is_empty() {
            args.paired.push(5_000.0);
        }
    } else if args.quick {
        (args.streams, args.events_per_stream, args.idle_streams) = (200, 100, 20_000);
    }
    args.streams = streams.unwrap_or(args.streams);
    args.events_per_stream = events.unwrap_or(args.events_per_stream);
    args.idle_streams = idle.unwrap_or(args.idle_streams);
    if args.service_bin.is_some() && args.idle_streams > 0 {
        // The idle-stream phase reads the service's metrics and this process's memory.
        bail!("--service-bin: the idle-stream phase measures a service in this process; add --idle-streams 0\n{USAGE}");
    }
    Ok(args)
}

// ---------------------------------------------------------------------------------------------
// Workload: `benches/workload`.

mod workload;
use workload::{legacy_meta, message_id, stream_events, Rng};

/// The stream index encoded in a stream key made by [`stream_events`]: the last group of the
/// message id it begins with. Parsed rather than looked up, so that the subscriber stays cheap
/// (the caller checks the key matches).
fn stream_of_id(key: &str) -> Option<usize> {
    let message = key.split_once('/').map_or(key, |(message, _)| message);
    usize::from_str_radix(message.get(message.len().checked_sub(12)?..)?, 16).ok()
}

/// Everything a phase needs to publish the workload and account for every output.
struct Workload {
    /// Event payloads by global event index (stream after stream).
    payloads: Vec<Bytes>,
    /// Publish order: global event indices, round-robin over the streams in a shuffled order.
    order: Vec<u32>,
    /// Stream keys (as in `Nats-Msg-Id`) by stream index.
    stream_ids: Vec<String>,
    /// Per stream, the global event index that causes output `seq` (at `seq - 1`).
    seq_event: Vec<Vec<u32>>,
    /// Per stream, where its outputs start in a flat numbering of all outputs.
    output_offset: Vec<u64>,
    /// Per publish position k: outputs the service will have emitted once `order[..=k]` is in.
    expected_after: Vec<u64>,
    /// Outputs the service emits for the whole workload.
    expected_outputs: u64,
    /// Expected outputs by subject family: filtered, structured, thinking, tools.
    by_subject: [u64; 4],
    payload_bytes: u64,
}

fn base_config(url: &str, args: &Args) -> Config {
    let mut config = Config::default();
    config.nats.servers = vec![url.to_owned()];
    config.http.enabled = false;
    config.shards.count = args.shards;
    // Room for the idle-stream measurement (the default, 100,000 per replica, is split over the
    // shards, and the hash does not split exactly evenly).
    config.shards.max_streams = (args.idle_streams * 2).max(100_000);
    config.service.shutdown_timeout_ms = 120_000;
    if let Some(batch) = args.pull_batch {
        config.jetstream.pull_batch = batch;
    }
    config
}

fn build_workload(args: &Args, config: &Config) -> Result<Workload> {
    let mut payloads = Vec::new();
    let mut stream_of = Vec::new();
    let mut first = Vec::with_capacity(args.streams);
    let mut stream_ids = Vec::with_capacity(args.streams);
    let mut payload_bytes = 0u64;
    for s in 0..args.streams {
        let (id, events) = stream_events(1, s, args.events_per_stream, args.cumulative);
        debug_assert_eq!(stream_of_id(&id), Some(s));
        stream_ids.push(id);
        first.push((payloads.len() as u32, events.len() as u32));
        for e in events {
            payload_bytes += e.len() as u64;
            payloads.push(Bytes::from(e));
            stream_of.push(s as u32);
        }
        if payload_bytes > 4 << 30 {
            bail!("the workload would exceed 4 GiB of payloads: use fewer streams or events, or --no-completion");
        }
    }
    // Round-robin over the open streams, in a shuffled order; a stream that ends makes room for
    // the next one. With every stream open at once (the default) all of them progress in lockstep
    // and end together; with fewer, streams start and end all along the run, as in a steady state.
    let mut rng = Rng(42);
    let mut streams: Vec<usize> = (0..args.streams).collect();
    for i in (1..streams.len()).rev() {
        streams.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let open = args.open_streams.unwrap_or(args.streams).clamp(1, args.streams.max(1));
    let mut waiting = streams.into_iter();
    let mut active: std::collections::VecDeque<(usize, u32)> = waiting.by_ref().take(open).map(|s| (s, 0)).collect();
    let mut order = Vec::with_capacity(payloads.len());
    while let Some((s, round)) = active.pop_front() {
        let (start, n) = first[s];
        order.push(start + round);
        if round + 1 < n {
            active.push_back((s, round + 1));
        } else if let Some(next) = waiting.next() {
            active.push_back((next, 0));
        }
    }

    // The service's outputs, predicted by the same processing.
    let registry = config.load_schemas()?;
    let (pipeline, encoder) = config.processing(&registry)?;
    let limits = TableLimits {
        idle_timeout: Duration::MAX,
        max_streams: usize::MAX,
        finished_memory: config.shards.finished_memory,
    };
    let mut table = StreamTable::new(pipeline, encoder, limits);
    let mut seq_event: Vec<Vec<u32>> = vec![Vec::new(); args.streams];
    let mut expected_after = Vec::with_capacity(order.len());
    let mut total = 0u64;
    let mut by_subject = [0u64; 4];
    let now = Instant::now();
    let (filtered, tools, thinking) =
        (&config.output.subjects.filtered, &config.output.subjects.tools, &config.output.subjects.thinking);
    for &g in &order {
        let event = decode(&payloads[g as usize], config.input.max_event_bytes)
            .map_err(|e| anyhow!("generated event {g} does not decode: {e}"))?;
        let s = stream_of[g as usize] as usize;
        let mut bad = None;
        table.apply(
            &event,
            InputPosition::default(),
            now,
            &mut |p| {
                let seq: u64 = p.msg_id.rsplit_once(':').and_then(|(_, n)| n.parse().ok()).unwrap_or(0);
                if seq != seq_event[s].len() as u64 + 1 {
                    bad = Some(p.msg_id.clone());
                }
                seq_event[s].push(g);
                let family = match p.subject.as_ref() {
                    x if x == filtered.as_str() => 0,
                    x if x == thinking.as_str() => 2,
                    x if x == tools.as_str() => 3,
                    _ => 1,
                };
                by_subject[family] += 1;
                total += 1;
            },
            &mut |_| {},
        );
        if let Some(id) = bad {
            bail!("unexpected output numbering: {id}");
        }
        expected_after.push(total);
    }
    let mut output_offset = Vec::with_capacity(args.streams);
    let mut acc = 0u64;
    for seqs in &seq_event {
        output_offset.push(acc);
        acc += seqs.len() as u64;
    }
    Ok(Workload {
        payloads,
        order,
        stream_ids,
        seq_event,
        output_offset,
        expected_after,
        expected_outputs: total,
        by_subject,
        payload_bytes,
    })
}

// ---------------------------------------------------------------------------------------------
// nats-server.

struct NatsServer {
    child: Child,
    url: String,
    _store: Option<tempfile::TempDir>,
}

fn find_nats_server() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        return Ok(PathBuf::from(bin));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("nats-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    let debian = PathBuf::from("/usr/sbin/nats-server");
    if debian.is_file() {
        return Ok(debian);
    }
    bail!("nats-server not found: install it (apt-get install nats-server) or set NATS_SERVER_BIN")
}

impl NatsServer {
    fn start(jetstream: bool) -> Result<NatsServer> {
        let bin = find_nats_server()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut cmd = Command::new(&bin);
        cmd.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
        let store = if jetstream {
            let dir = tempfile::tempdir()?;
            cmd.arg("-js").arg("-sd").arg(dir.path());
            Some(dir)
        } else {
            None
        };
        cmd.stdout(Stdio::null()).stderr(Stdio::null()).stdin(Stdio::null());
        let child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
        let _ = SERVER_PID.set(child.id());
        let server = NatsServer { child, url: format!("nats://127.0.0.1:{port}"), _store: store };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("nats-server did not listen on 127.0.0.1:{port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

fn loadavg() -> String {
    let l = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

static LOAD_AT_START: OnceLock<String> = OnceLock::new();

/// CPU time (user + system) in microseconds of a `/proc/.../stat` line.
fn stat_cpu_us(stat: &str) -> (String, u64) {
    // The name is in parentheses and may contain spaces; the fields after it are space separated.
    let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { return (String::new(), 0) };
    let name = stat[open + 1..close].to_owned();
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name and state.
    let ticks: u64 = [11, 12].iter().filter_map(|i| fields.get(*i)?.parse::<u64>().ok()).sum();
    // Linux reports clock ticks of 1/100 s (USER_HZ) on every common configuration.
    (name, ticks * 10_000)
}

/// CPU time of this process's tokio worker threads, in microseconds.
fn workers_cpu_us() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .map(|stat| stat_cpu_us(&stat))
        .filter(|(name, _)| name.starts_with("tokio-rt-worker"))
        .map(|(_, us)| us)
        .sum()
}

/// CPU time of the calling thread, in microseconds.
fn this_thread_cpu_us() -> u64 {
    std::fs::read_to_string("/proc/thread-self/stat").map_or(0, |s| stat_cpu_us(&s).1)
}

static SERVER_PID: OnceLock<u32> = OnceLock::new();

/// CPU time of the nats-server process, in microseconds.
fn server_cpu_us() -> u64 {
    SERVER_PID
        .get()
        .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .map_or(0, |s| stat_cpu_us(&s).1)
}

fn proc_status_kib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// A client with the service's own connection settings, counting slow-consumer events.
async fn connect(nats: &NatsConfig, name: &str, slow: Arc<AtomicU64>) -> Result<async_nats::Client> {
    let mut cfg = nats.clone();
    cfg.client_name = name.to_owned();
    bus::connect(&cfg, move |e| {
        if matches!(e, ConnectionEvent::SlowConsumer { .. }) {
            slow.fetch_add(1, Ordering::Relaxed);
        }
    })
    .await
    .map_err(|e| anyhow!("{name}: {e}"))
}

#[derive(Debug, Clone, Copy, Default)]
struct Percentiles {
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
}

/// Percentiles in microseconds of samples in nanoseconds (signed for differences).
fn percentiles<T: Ord + Copy + Into<i128>>(samples: &mut [T]) -> Percentiles {
    if samples.is_empty() {
        return Percentiles::default();
    }
    samples.sort_unstable();
    let us = |ns: T| Into::<i128>::into(ns) as f64 / 1000.0;
    let at = |q: f64| us(samples[((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1]);
    Percentiles { p50: at(0.50), p99: at(0.99), p999: at(0.999), max: us(samples[samples.len() - 1]) }
}

// ---------------------------------------------------------------------------------------------
// Systems under test.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum System {
    Relay,
    Service,
    /// Relay and service at once on the same input: every event's relay output times its service
    /// outputs (see [`added_latency`]).
    Paired,
}

const INPUT_SUBJECT: &str = "chat";
const RELAY_OUT: &str = "relay.out";
const EVENT_HEADER: &str = "Bench-Event";
/// The JetStream stream both systems consume in `--mode jetstream`.
const JS_STREAM: &str = "BENCH_CHAT";
const JS_RELAY_CONSUMER: &str = "bench-relay";

/// Where a phase's events come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    /// Published by the producer while the system runs.
    Live,
    /// `--mode jetstream` only: stored in the stream before the system starts ([`prefill`]).
    Backlog,
}

enum Running {
    Relay {
        task: tokio::task::JoinHandle<()>,
        stop: Arc<AtomicBool>,
    },
    Service(Box<RunningService>),
    /// `--service-bin`: the service's own process.
    Process(ServiceProcess),
    /// The service and the relay.
    Paired(Box<Running>, Box<Running>),
}

impl Running {
    async fn stop(self) -> Result<()> {
        match self {
            Running::Relay { task, stop } => {
                stop.store(true, Ordering::Relaxed);
                task.abort();
                let _ = task.await;
                Ok(())
            }
            Running::Service(service) => service.shutdown().await.map_err(|e| anyhow!("service shutdown: {e}")),
            Running::Process(process) => process.stop().await,
            Running::Paired(service, relay) => {
                Box::pin(relay.stop()).await?;
                Box::pin(service.stop()).await
            }
        }
    }

    fn service(&self) -> Option<&RunningService> {
        match self {
            Running::Service(s) => Some(s),
            Running::Paired(service, _) => service.service(),
            Running::Relay { .. } | Running::Process(_) => None,
        }
    }

    /// CPU time so far of a service running as its own process (0 if none does).
    fn process_cpu_us(&self) -> u64 {
        match self {
            Running::Process(process) => process.cpu_us(),
            Running::Paired(service, _) => service.process_cpu_us(),
            Running::Relay { .. } | Running::Service(_) => 0,
        }
    }
}

/// `--service-bin`: the `structured-sink` binary as operators run it, in its own process: `serve`
/// with the phase's configuration in a TOML file and HTTP on a free port of 127.0.0.1 (for
/// `/readyz`), logging warnings only, no `STRUCTURED_SINK__*` variable; stopped by SIGTERM, which
/// it must answer with a clean exit. A clean exit is also when a binary built with
/// `-Cprofile-generate` writes its profile, which is how `deploy/pgo-build.sh` trains the binary it
/// then optimises.
struct ServiceProcess {
    child: Child,
    /// Deleted when the process is gone.
    _config: tempfile::NamedTempFile,
    /// `service.shutdown_timeout_ms`, plus a margin, for the exit after SIGTERM.
    exit_within: Duration,
}

impl ServiceProcess {
    async fn start(bin: &Path, config: &Config) -> Result<ServiceProcess> {
        let mut config = config.clone();
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        config.http.enabled = true;
        config.http.listen = format!("127.0.0.1:{port}");
        config.telemetry.log_filter = "warn".into();
        let mut file = tempfile::Builder::new().prefix("e2e-service-").suffix(".toml").tempfile()?;
        file.write_all(toml::to_string(&config)?.as_bytes())?;
        file.flush()?;
        let mut command = Command::new(bin);
        command.arg("--config").arg(file.path()).arg("serve").env_remove("RUST_LOG");
        // The file is the whole configuration, the one the outputs were predicted from: no
        // `STRUCTURED_SINK__*` variable of this environment may override it.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("STRUCTURED_SINK__") {
                command.env_remove(name);
            }
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let exit_within = Duration::from_millis(config.service.shutdown_timeout_ms) + Duration::from_secs(10);
        let mut process = ServiceProcess { child, _config: file, exit_within };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = process.child.try_wait()? {
                bail!("{} exited while starting: {status}", bin.display());
            }
            if http_status(port, "/readyz").await == Some(200) {
                return Ok(process);
            }
            if Instant::now() > deadline {
                bail!("{} not ready within 10 s (GET /readyz on port {port})", bin.display());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The process's CPU time so far, all its threads, in microseconds.
    fn cpu_us(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).map_or(0, |s| stat_cpu_us(&s).1)
    }

    async fn stop(mut self) -> Result<()> {
        let pid = rustix::process::Pid::from_child(&self.child);
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)
            .with_context(|| format!("sending SIGTERM to the service process {}", self.child.id()))?;
        let deadline = Instant::now() + self.exit_within;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() { Ok(()) } else { bail!("the service process exited with {status}") };
            }
            if Instant::now() > deadline {
                bail!("the service process did not exit within {:?} of SIGTERM", self.exit_within);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for ServiceProcess {
    /// A phase that failed leaves no process behind.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The status code of `GET path` on 127.0.0.1:`port`, if an HTTP answer came within a second.
async fn http_status(port: u16, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.ok()?;
        let line = answer.split(|b| *b == b'\n').next()?;
        std::str::from_utf8(line).ok()?.split_whitespace().nth(1)?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(1), exchange).await.ok().flatten()
}

/// JetStream mode: both systems consume the same fresh stream over `chat`; the service creates
/// it from its configuration, the relay here.
fn jetstream_config(config: &mut Config, ack_pending: Option<i64>) {
    config.jetstream.enabled = true;
    config.jetstream.stream = JS_STREAM.into();
    config.jetstream.create_stream = true;
    config.jetstream.consumer_prefix = "bench-sink".into();
    // The service holds one ack per open stream (its first event), so the default limit covers
    // any workload here: 100,000 against at most 1,000 open streams and a pull batch in flight.
    if let Some(limit) = ack_pending {
        config.jetstream.max_ack_pending = limit;
    }
}

/// The stream over `chat` the relay creates and the backlog phase fills (the service creates the
/// same from its configuration when it does not exist and the storage is the default, file).
fn js_stream_config(storage: StorageType) -> async_nats::jetstream::stream::Config {
    async_nats::jetstream::stream::Config {
        name: JS_STREAM.into(),
        subjects: vec![INPUT_SUBJECT.into()],
        storage,
        ..Default::default()
    }
}

async fn delete_js_stream(admin: &async_nats::Client) {
    let js = async_nats::jetstream::new(admin.clone());
    let _ = js.delete_stream(JS_STREAM).await;
}

/// Replaces the bench stream with an empty one of `storage`.
async fn fresh_js_stream(
    admin: &async_nats::Client,
    storage: StorageType,
) -> Result<async_nats::jetstream::stream::Stream> {
    replace_stream(admin, js_stream_config(storage)).await
}

/// Replaces the stream `config` names (if any) with an empty one made from `config`.
async fn replace_stream(
    admin: &async_nats::Client,
    config: async_nats::jetstream::stream::Config,
) -> Result<async_nats::jetstream::stream::Stream> {
    let js = async_nats::jetstream::new(admin.clone());
    let _ = js.delete_stream(&config.name).await;
    let name = config.name.clone();
    js.create_stream(config).await.map_err(|e| anyhow!("stream {name}: {e}"))
}

/// The stream that stores both systems' outputs with `--store-outputs`.
const JS_OUT_STREAM: &str = "BENCH_OUT";

/// Replaces the outputs' stream (`--store-outputs`) with an empty one of `storage`: the service's
/// subjects (`chat.>`, which the input subject `chat` is not part of) and the relay's.
async fn fresh_output_stream(admin: &async_nats::Client, storage: StorageType) -> Result<()> {
    let config = async_nats::jetstream::stream::Config {
        name: JS_OUT_STREAM.into(),
        subjects: vec![format!("{INPUT_SUBJECT}.>"), RELAY_OUT.into()],
        storage,
        ..Default::default()
    };
    replace_stream(admin, config).await.map(drop)
}

/// `--store-outputs`: copies the relay publishes through JetStream whose storage it has not yet
/// awaited; as many as the service awaits at most per worker.
const RELAY_UNCONFIRMED: usize = 1024;

/// Publish acknowledgements awaited at most at once while filling the stream.
const PREFILL_IN_FLIGHT: usize = 2048;

/// Stores the whole workload (in publish order, each event with its `Bench-Event` header) in a
/// fresh stream before the system under test starts, with every publish confirmed, so that a
/// backlog phase measures how fast a system consumes stored events (catching up after an outage)
/// apart from the cost of storing them.
async fn prefill(admin: &async_nats::Client, workload: &Workload, storage: StorageType) -> Result<()> {
    use async_nats::jetstream;
    let mut st = fresh_js_stream(admin, storage).await?;
    let js = jetstream::new(admin.clone());
    let mut in_flight = std::collections::VecDeque::with_capacity(PREFILL_IN_FLIGHT);
    for &g in &workload.order {
        let mut headers = HeaderMap::new();
        headers.insert(EVENT_HEADER, g.to_string().as_str());
        let ack = js
            .publish_with_headers(INPUT_SUBJECT, headers, workload.payloads[g as usize].clone())
            .await
            .map_err(|e| anyhow!("backlog publish: {e}"))?;
        in_flight.push_back(ack);
        if in_flight.len() >= PREFILL_IN_FLIGHT {
            if let Some(ack) = in_flight.pop_front() {
                ack.await.map_err(|e| anyhow!("backlog publish: {e}"))?;
            }
        }
    }
    for ack in in_flight {
        ack.await.map_err(|e| anyhow!("backlog publish: {e}"))?;
    }
    let stored = st.info().await.map_err(|e| anyhow!("backlog stream: {e}"))?.state.messages;
    if stored != workload.order.len() as u64 {
        bail!("backlog stream holds {stored} events, not {}", workload.order.len());
    }
    Ok(())
}

/// How the systems of a phase start (from the command line).
#[derive(Debug, Clone, Copy)]
struct Setup<'a> {
    mode: Mode,
    storage: StorageType,
    store_outputs: bool,
    /// `--service-bin`: the service as this binary's process ([`ServiceProcess`]).
    service_bin: Option<&'a Path>,
}

impl Args {
    fn setup(&self) -> Setup<'_> {
        Setup {
            mode: self.mode,
            storage: self.storage,
            store_outputs: self.store_outputs,
            service_bin: self.service_bin.as_deref(),
        }
    }
}

/// Starts the system under test. In JetStream mode the stream is deleted first (each phase gets a
/// fresh one), unless `prefilled`: then both systems consume the backlog already stored in it. A
/// memory stream is created here, before either system, since the service would create a file one.
async fn start_system(
    system: System,
    setup: Setup<'_>,
    config: &Config,
    admin: &async_nats::Client,
    prefilled: bool,
) -> Result<Running> {
    let Setup { mode, storage, store_outputs, service_bin } = setup;
    if mode == Mode::JetStream && !prefilled {
        if storage == StorageType::Memory {
            fresh_js_stream(admin, storage).await?;
        } else {
            delete_js_stream(admin).await;
        }
    }
    match system {
        System::Paired => {
            // `prefilled`: the stream (JetStream mode) was reset above, once for both.
            let service = Box::pin(start_system(System::Service, setup, config, admin, true)).await?;
            let relay = Box::pin(start_system(System::Relay, setup, config, admin, true)).await?;
            Ok(Running::Paired(Box::new(service), Box::new(relay)))
        }
        System::Service => {
            if let Some(bin) = service_bin {
                return Ok(Running::Process(ServiceProcess::start(bin, config).await?));
            }
            let service = RunningService::start(config.clone()).await.map_err(|e| anyhow!("service start: {e}"))?;
            let deadline = Instant::now() + Duration::from_secs(10);
            while !service.is_ready() {
                if Instant::now() > deadline {
                    bail!("service not ready within 10 s");
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(Running::Service(Box::new(service)))
        }
        System::Relay => {
            let client = connect(&config.nats, "bench-relay", Arc::new(AtomicU64::new(0))).await?;
            let stop = Arc::new(AtomicBool::new(false));
            let task = match mode {
                Mode::Core => {
                    let mut sub = client.subscribe(INPUT_SUBJECT).await?;
                    round_trip(&client).await;
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        while let Some(m) = sub.next().await {
                            if stop.load(Ordering::Relaxed) {
                                break;
                            }
                            let _ =
                                client.publish_with_headers(RELAY_OUT, m.headers.unwrap_or_default(), m.payload).await;
                        }
                    })
                }
                Mode::JetStream => {
                    use async_nats::jetstream::{self, consumer::pull};
                    let js = jetstream::new(client.clone());
                    let st = js
                        .get_or_create_stream(js_stream_config(storage))
                        .await
                        .map_err(|e| anyhow!("relay stream: {e}"))?;
                    let consumer = st
                        .create_consumer(pull::Config {
                            durable_name: Some(JS_RELAY_CONSUMER.into()),
                            ack_policy: jetstream::consumer::AckPolicy::Explicit,
                            max_ack_pending: config.jetstream.max_ack_pending,
                            ack_wait: Duration::from_millis(config.jetstream.ack_wait_ms),
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| anyhow!("relay consumer: {e}"))?;
                    // The service's pull settings.
                    let mut pull = consumer.stream().max_messages_per_batch(config.jetstream.pull_batch);
                    if config.jetstream.pull_max_bytes > 0 {
                        pull = pull.max_bytes_per_batch(config.jetstream.pull_max_bytes);
                    }
                    let mut messages = pull
                        .heartbeat(Duration::from_secs(15))
                        .messages()
                        .await
                        .map_err(|e| anyhow!("relay consumer: {e}"))?;
                    let stop = stop.clone();
                    if store_outputs {
                        tokio::spawn(relay_storing(js, messages, stop))
                    } else {
                        tokio::spawn(async move {
                            while let Some(m) = messages.next().await {
                                if stop.load(Ordering::Relaxed) {
                                    break;
                                }
                                let Ok(m) = m else { continue };
                                let headers = m.message.headers.clone().unwrap_or_default();
                                let _ =
                                    client.publish_with_headers(RELAY_OUT, headers, m.message.payload.clone()).await;
                                let _ = m.ack().await;
                            }
                        })
                    }
                }
            };
            Ok(Running::Relay { task, stop })
        }
    }
}

/// The JetStream relay of `--store-outputs`: each event's copy is published through JetStream, and
/// the event acknowledged once the copy's storage is confirmed, oldest first, with at most
/// [`RELAY_UNCONFIRMED`] unconfirmed (and none left waiting while no event arrives).
async fn relay_storing(
    js: async_nats::jetstream::Context,
    mut messages: async_nats::jetstream::consumer::pull::Stream,
    stop: Arc<AtomicBool>,
) {
    use futures::FutureExt;
    let mut unconfirmed = std::collections::VecDeque::with_capacity(RELAY_UNCONFIRMED);
    loop {
        let next = match unconfirmed.is_empty() {
            true => messages.next().await,
            // Confirmations are awaited while no event is ready (the pull stream's `next` loses
            // nothing when dropped).
            false => match messages.next().now_or_never() {
                Some(next) => next,
                None => {
                    confirm_oldest(&mut unconfirmed).await;
                    continue;
                }
            },
        };
        let Some(m) = next else { break };
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let Ok(m) = m else { continue };
        let headers = m.message.headers.clone().unwrap_or_default();
        if let Ok(confirmation) = js.publish_with_headers(RELAY_OUT, headers, m.message.payload.clone()).await {
            unconfirmed.push_back((confirmation, m));
        }
        if unconfirmed.len() >= RELAY_UNCONFIRMED {
            confirm_oldest(&mut unconfirmed).await;
        }
    }
}

/// Awaits the oldest unconfirmed copy's storage, then acknowledges its event.
async fn confirm_oldest(
    unconfirmed: &mut std::collections::VecDeque<(
        async_nats::jetstream::context::PublishAckFuture,
        async_nats::jetstream::Message,
    )>,
) {
    if let Some((confirmation, m)) = unconfirmed.pop_front() {
        if confirmation.await.is_ok() {
            let _ = m.ack().await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One phase: publish the workload through a system and collect every output.

#[derive(Debug, Clone, Default)]
struct PhaseResult {
    label: String,
    events: u64,
    expected: u64,
    received: u64,
    missing: u64,
    duplicates: u64,
    unexpected: u64,
    dead_letters: u64,
    elapsed: f64,
    publish_elapsed: f64,
    in_rate: f64,
    out_rate: f64,
    target_rate: Option<f64>,
    max_lag_ms: f64,
    /// Publish to receive: of the service's outputs (the relay's in a relay phase).
    latency: Percentiles,
    /// Paired phases: publish to receive of the relay's outputs.
    relay_latency: Percentiles,
    /// Paired phases: the service's outputs against their events' relay outputs.
    added: Option<Added>,
    slow_consumers: u64,
    service_received: Option<u64>,
    service_published: Option<u64>,
    inbox_full: Option<u64>,
    rss_after_mib: f64,
    /// CPU µs per input event: tokio workers (the system under test; with `--service-bin`, plus
    /// the service's process, all its threads), the producer thread, nats-server, the subscriber
    /// thread.
    cpu_per_event: [f64; 4],
    timed_out: bool,
    /// The longest wait between two outputs of the phase, s: a stall the system recovered from
    /// shows here (reported when over [`GAP_REPORTED`]).
    longest_gap: f64,
    /// From the phase's start to the first output, s (a backlog phase's start includes the
    /// system's start-up).
    first_output: f64,
}

/// Gaps between outputs longer than this are reported in a phase's row.
const GAP_REPORTED: f64 = 1.0;

/// A paired phase's added latency: each service output's receive time minus that of its event's
/// relay output.
#[derive(Debug, Clone, Default)]
struct Added {
    at: Percentiles,
    /// Service outputs with a relay output to compare with.
    samples: u64,
    /// Of those, how many arrived before the relay's copy.
    earlier: u64,
}

struct ProducerStats {
    first_ns: u64,
    last_ns: u64,
    max_lag: Duration,
    aborted: bool,
    cpu_us: u64,
}

/// Publishes the workload from its own thread and client. `expected_after(k)` is the number of
/// outputs the system will have produced once the first k+1 events are in; at most `window` of
/// them may be outstanding. With `pace`, event k is due at start + k / pace.
#[allow(clippy::too_many_arguments)]
fn spawn_producer(
    nats: NatsConfig,
    workload: Arc<Workload>,
    system: System,
    window: u64,
    pace: Option<f64>,
    sent: Arc<Vec<AtomicU64>>,
    received: Arc<AtomicU64>,
    deadline: Instant,
    stall: Duration,
) -> std::thread::JoinHandle<Result<ProducerStats>> {
    on_own_thread("bench-producer", move || async move {
        let client = connect(&nats, "bench-producer", Arc::new(AtomicU64::new(0))).await?;
        let start = Instant::now();
        let first_ns = now_ns();
        let mut max_lag = Duration::ZERO;
        let mut aborted = false;
        for (k, &g) in workload.order.iter().enumerate() {
            let expect = match system {
                System::Relay => k as u64 + 1,
                System::Service => workload.expected_after[k],
                System::Paired => k as u64 + 1 + workload.expected_after[k],
            };
            if expect > received.load(Ordering::Acquire) + window {
                client.flush().await?;
                // Stop early when nothing arrives for `stall` (a stalled system).
                let (mut seen, mut since) = (received.load(Ordering::Acquire), Instant::now());
                while expect > seen + window && Instant::now() < deadline && since.elapsed() < stall {
                    std::thread::sleep(Duration::from_micros(100));
                    let now_seen = received.load(Ordering::Acquire);
                    if now_seen != seen {
                        (seen, since) = (now_seen, Instant::now());
                    }
                }
                if since.elapsed() >= stall {
                    eprintln!("  no output for {} s: stopping this phase", stall.as_secs());
                    aborted = true;
                    break;
                }
            }
            if Instant::now() >= deadline {
                aborted = true;
                break;
            }
            if let Some(rate) = pace {
                let due = start + Duration::from_secs_f64(k as f64 / rate);
                let now = Instant::now();
                if due > now + Duration::from_micros(20) {
                    // Ahead of schedule: send what is queued, then sleep (a thread sleep is far
                    // finer than tokio's 1 ms timer).
                    client.flush().await?;
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                } else if now > due {
                    max_lag = max_lag.max(now - due);
                }
            }
            let mut headers = HeaderMap::new();
            headers.insert(EVENT_HEADER, g.to_string().as_str());
            sent[g as usize].store(now_ns(), Ordering::Release);
            client.publish_with_headers(INPUT_SUBJECT, headers, workload.payloads[g as usize].clone()).await?;
        }
        client.flush().await?;
        let last_ns = now_ns();
        // Before the client closes: a flush only hands the events to the socket, and closing a
        // socket while input from the server is unread resets the connection, discarding what
        // the kernel has not sent yet (the server logged "Read Error" and the workload's tail
        // went missing, in about one smoke run in five). The server answers this request only
        // after reading everything before it.
        round_trip(&client).await;
        Ok(ProducerStats { first_ns, last_ns, max_lag, aborted, cpu_us: this_thread_cpu_us() })
    })
}

/// Runs the future `work` makes on a thread named `name`, in a one-thread runtime of its own: the
/// producer and the subscriber each run so, outside the runtime of the system under test.
fn on_own_thread<T, F>(name: &str, work: impl FnOnce() -> F + Send + 'static) -> std::thread::JoinHandle<Result<T>>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T>>,
{
    let spawned = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(work()));
    spawned.unwrap_or_else(|e| panic!("the {name} thread starts: {e}"))
}

struct Collected {
    /// Publish to receive, ns: of the service's outputs (the relay's in a relay phase).
    latencies: Vec<u64>,
    /// Paired phases: publish to receive of the relay's outputs.
    relay_latencies: Vec<u64>,
    /// Paired phases: for each service output, its receive time minus the receive time of its
    /// event's relay output, ns.
    added: Vec<i64>,
    last_ns: u64,
    /// The longest time between two consecutive outputs, ns.
    longest_gap_ns: u64,
    /// When the first valid output arrived (0: none).
    first_ns: u64,
    valid: u64,
    duplicates: u64,
    unexpected: u64,
    dead_letters: u64,
    timed_out: bool,
}

/// Where an output goes in the collector's accounting.
#[derive(Debug, Clone, Copy)]
enum Arrival {
    /// The relay's copy of event `g`.
    Relay { g: u64 },
    /// Service output number `slot` (flat numbering, see [`Workload::output_offset`]), caused by
    /// event `g`.
    Service { slot: u64, g: u64 },
}

/// Which output `message` is: the relay's (by its `Bench-Event` header) or the service's (by its
/// `Nats-Msg-Id`); `None` when it is neither.
fn arrival(message: &async_nats::Message, workload: &Workload) -> Option<Arrival> {
    let headers = message.headers.as_ref()?;
    if message.subject.as_str() == RELAY_OUT {
        let g = headers.get(EVENT_HEADER)?.as_str().parse::<u64>().ok()?;
        return (g < workload.order.len() as u64).then_some(Arrival::Relay { g });
    }
    let (id, seq) = headers.get(async_nats::header::NATS_MESSAGE_ID)?.as_str().rsplit_once(':')?;
    let s = stream_of_id(id).filter(|s| workload.stream_ids.get(*s).is_some_and(|x| x == id))?;
    let seq: usize = seq.parse().ok()?;
    let g = *workload.seq_event[s].get(seq.checked_sub(1)?)?;
    Some(Arrival::Service { slot: workload.output_offset[s] + seq as u64 - 1, g: u64::from(g) })
}

/// Ready once the subscriber's subscription is in place at the server (or with why it is not).
type Subscribed = tokio::sync::oneshot::Receiver<Result<()>>;

/// Subscribes to what `system` publishes from its own thread and client (as the producer
/// publishes from its own), then counts outputs ([`collect`]). The first handle is ready once the
/// subscription is in place at the server; the thread returns what it collected and its CPU time
/// from then on, µs.
fn spawn_subscriber(
    nats: NatsConfig,
    expectation: Expectation,
    slow: Arc<AtomicU64>,
) -> (Subscribed, std::thread::JoinHandle<Result<(Collected, u64)>>) {
    let (ready, subscribed) = tokio::sync::oneshot::channel();
    let thread = on_own_thread("bench-subscriber", move || async move {
        let subscribe = async {
            let client = connect(&nats, "bench-subscriber", slow).await?;
            let service_out = format!("{INPUT_SUBJECT}.>");
            let outputs: futures::stream::BoxStream<'static, async_nats::Message> = match expectation.system {
                System::Relay => client.subscribe(RELAY_OUT).await?.boxed(),
                System::Service => client.subscribe(service_out).await?.boxed(),
                System::Paired => {
                    futures::stream::select(client.subscribe(RELAY_OUT).await?, client.subscribe(service_out).await?)
                        .boxed()
                }
            };
            round_trip(&client).await;
            anyhow::Ok((client, outputs))
        };
        let (_client, outputs) = match subscribe.await {
            Ok(subscribed) => subscribed,
            Err(e) => {
                let _ = ready.send(Err(e));
                bail!("the subscriber did not subscribe");
            }
        };
        let _ = ready.send(Ok(()));
        let cpu_before = this_thread_cpu_us();
        let collected = collect(outputs, expectation).await;
        Ok((collected, this_thread_cpu_us().saturating_sub(cpu_before)))
    });
    (subscribed, thread)
}

/// What a phase's outputs are counted against, shared with its producer through the atomics.
struct Expectation {
    system: System,
    workload: Arc<Workload>,
    /// Publish time of each event, ns (0: not yet published), written by the producer.
    sent: Arc<Vec<AtomicU64>>,
    /// Outputs received so far, read by the producer for its window.
    received: Arc<AtomicU64>,
    producer_done: Arc<AtomicBool>,
    /// How many valid outputs complete the phase.
    expected: u64,
    deadline: Instant,
}

/// Counts outputs until every expected one is in, or the deadline, or 3 s without progress after
/// the producer finished.
async fn collect(
    mut outputs: futures::stream::BoxStream<'static, async_nats::Message>,
    expectation: Expectation,
) -> Collected {
    let Expectation { system, workload, sent, received, producer_done, expected, deadline } = expectation;
    let events = workload.order.len();
    // Flat numbering of what is expected: in a paired phase the relay's outputs (one per event)
    // come first.
    let service_offset = if system == System::Paired { events as u64 } else { 0 };
    let mut seen = vec![false; expected as usize];
    // Paired: when each event's relay output arrived, and each service output with its event.
    let mut relay_at = vec![0u64; if system == System::Paired { events } else { 0 }];
    let mut service_at: Vec<(u64, u32)> = Vec::new();
    let mut c = Collected {
        latencies: Vec::with_capacity(expected as usize),
        relay_latencies: Vec::new(),
        added: Vec::new(),
        last_ns: 0,
        longest_gap_ns: 0,
        first_ns: 0,
        valid: 0,
        duplicates: 0,
        unexpected: 0,
        dead_letters: 0,
        timed_out: false,
    };
    let mut last_progress = Instant::now();
    while c.valid < expected {
        let now = Instant::now();
        if now > deadline || (producer_done.load(Ordering::Acquire) && now - last_progress > Duration::from_secs(3)) {
            c.timed_out = true;
            break;
        }
        let message = match tokio::time::timeout(Duration::from_millis(200), outputs.next()).await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(_) => continue,
        };
        let at = now_ns();
        last_progress = Instant::now();
        received.fetch_add(1, Ordering::Release);
        if message.subject.as_str().ends_with(".dlq") {
            c.dead_letters += 1;
            continue;
        }
        let (slot, g, relayed) = match arrival(&message, &workload) {
            Some(Arrival::Relay { g }) if system != System::Service => (g, g, true),
            Some(Arrival::Service { slot, g }) if system != System::Relay => (service_offset + slot, g, false),
            _ => (expected, 0, false),
        };
        let Some(seen) = seen.get_mut(slot as usize) else {
            c.unexpected += 1;
            continue;
        };
        if std::mem::replace(seen, true) {
            c.duplicates += 1;
            continue;
        }
        c.valid += 1;
        if c.last_ns > 0 {
            c.longest_gap_ns = c.longest_gap_ns.max(at.saturating_sub(c.last_ns));
        } else {
            c.first_ns = at;
        }
        c.last_ns = at;
        let t = sent[g as usize].load(Ordering::Acquire);
        let latency = (t > 0 && at >= t).then(|| at - t);
        match (system, relayed) {
            (System::Paired, true) => {
                relay_at[g as usize] = at;
                c.relay_latencies.extend(latency);
            }
            (System::Paired, false) => {
                service_at.push((at, g as u32));
                c.latencies.extend(latency);
            }
            _ => c.latencies.extend(latency),
        }
    }
    c.added = added_latency(&relay_at, &service_at);
    c
}

/// For every service output whose event's relay output arrived too: how much later it arrived
/// than the relay's copy (negative when earlier), ns. Both copies of an event left the producer
/// in the same publish and crossed the same two NATS hops at the same moment, so the difference
/// is what the service's processing added for that event, free of the producer's and the
/// server's delays that both share.
fn added_latency(relay_at: &[u64], service_at: &[(u64, u32)]) -> Vec<i64> {
    service_at
        .iter()
        .filter_map(|&(at, g)| {
            let relayed = *relay_at.get(g as usize)?;
            (relayed > 0).then(|| at as i64 - relayed as i64)
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
async fn run_phase(
    label: &str,
    system: System,
    args: &Args,
    config: &Config,
    workload: &Arc<Workload>,
    pace: Option<f64>,
    admin: &async_nats::Client,
    slow: &Arc<AtomicU64>,
    input: Input,
) -> Result<PhaseResult> {
    if input == Input::Backlog {
        prefill(admin, workload, args.storage).await?;
    }
    if args.store_outputs {
        fresh_output_stream(admin, args.storage).await?;
    }
    let events = workload.order.len() as u64;
    let expected = match system {
        System::Relay => events,
        System::Service => workload.expected_outputs,
        System::Paired => events + workload.expected_outputs,
    };
    // Generous but bounded: 60 s (or the stall limit and 30 s more) plus 50 µs per event.
    let base = Duration::from_secs(60).max(args.stall + Duration::from_secs(30));
    let deadline = Instant::now() + base + Duration::from_micros(50 * events);
    let sent: Arc<Vec<AtomicU64>> = Arc::new((0..events).map(|_| AtomicU64::new(0)).collect());
    let received = Arc::new(AtomicU64::new(0));
    let producer_done = Arc::new(AtomicBool::new(false));
    let slow_before = slow.load(Ordering::Relaxed);
    // Subscribed before the system starts: draining a backlog, it publishes from its first moment.
    let expectation = Expectation {
        system,
        workload: workload.clone(),
        sent: sent.clone(),
        received: received.clone(),
        producer_done: producer_done.clone(),
        expected,
        deadline,
    };
    let (subscribed, subscriber) = spawn_subscriber(config.nats.clone(), expectation, slow.clone());
    subscribed.await.map_err(|_| anyhow!("the subscriber stopped before it subscribed"))??;
    let (workers_before, server_before) = (workers_cpu_us(), server_cpu_us());
    let started_ns = now_ns();
    let running = start_system(system, args.setup(), config, admin, input == Input::Backlog).await?;

    let stats = match input {
        Input::Live => {
            let producer = spawn_producer(
                config.nats.clone(),
                workload.clone(),
                system,
                args.window,
                pace,
                sent.clone(),
                received.clone(),
                deadline,
                args.stall,
            );
            tokio::task::spawn_blocking(move || producer.join()).await?.map_err(|_| anyhow!("producer panicked"))??
        }
        // Everything is in the stream already: the phase runs from the system's start (its
        // start-up included) to the last output; no publish times, so no latencies.
        Input::Backlog => ProducerStats {
            first_ns: started_ns,
            last_ns: started_ns,
            max_lag: Duration::ZERO,
            aborted: false,
            cpu_us: 0,
        },
    };
    producer_done.store(true, Ordering::Release);
    let (mut collected, subscriber_cpu_us) =
        tokio::task::spawn_blocking(move || subscriber.join()).await?.map_err(|_| anyhow!("subscriber panicked"))??;
    if (collected.timed_out || stats.aborted) && args.mode == Mode::JetStream {
        // Read before the system stops: whether the server still held a pull request
        // (`num_waiting`) and had messages for it (`num_pending`) tells a lost pull request from a
        // stuck client or a full ack window.
        print_consumers(admin).await;
    }

    let per_event = |us: u64| us as f64 / events.max(1) as f64;
    let cpu_per_event = [
        // A service process started after `workers_before`: all its CPU time is this phase's.
        per_event(workers_cpu_us().saturating_sub(workers_before) + running.process_cpu_us()),
        per_event(stats.cpu_us),
        per_event(server_cpu_us().saturating_sub(server_before)),
        per_event(subscriber_cpu_us),
    ];
    let snapshot = running.service().map(|s| s.metrics().snapshot());
    running.stop().await?;
    if args.store_outputs && !(collected.timed_out || stats.aborted) {
        check_stored(admin, expected + collected.dead_letters).await?;
    }

    let elapsed = (collected.last_ns.saturating_sub(stats.first_ns)) as f64 / 1e9;
    let publish_elapsed = (stats.last_ns.saturating_sub(stats.first_ns)) as f64 / 1e9;
    Ok(PhaseResult {
        label: label.to_owned(),
        events,
        expected,
        received: collected.valid,
        missing: expected - collected.valid,
        duplicates: collected.duplicates,
        unexpected: collected.unexpected,
        dead_letters: collected.dead_letters,
        elapsed,
        publish_elapsed,
        in_rate: events as f64 / elapsed.max(1e-9),
        out_rate: collected.valid as f64 / elapsed.max(1e-9),
        target_rate: pace,
        max_lag_ms: stats.max_lag.as_secs_f64() * 1e3,
        latency: percentiles(&mut collected.latencies),
        relay_latency: percentiles(&mut collected.relay_latencies),
        added: (system == System::Paired).then(|| Added {
            samples: collected.added.len() as u64,
            earlier: collected.added.iter().filter(|d| **d < 0).count() as u64,
            at: percentiles(&mut collected.added),
        }),
        slow_consumers: slow.load(Ordering::Relaxed) - slow_before,
        service_received: snapshot.as_ref().map(|s| s.events_received),
        service_published: snapshot.as_ref().map(|s| s.messages_published_total()),
        inbox_full: snapshot.as_ref().map(|s| s.shard_inbox_full),
        rss_after_mib: mib(proc_status_kib("VmRSS:")),
        cpu_per_event,
        timed_out: collected.timed_out || stats.aborted,
        longest_gap: collected.longest_gap_ns as f64 / 1e9,
        first_output: collected.first_ns.saturating_sub(stats.first_ns) as f64 / 1e9,
    })
}

/// `--store-outputs`: fails unless the outputs' stream holds exactly `expected` messages (every
/// output received stored once), waiting up to 10 s for storage still under way.
async fn check_stored(admin: &async_nats::Client, expected: u64) -> Result<()> {
    let js = async_nats::jetstream::new(admin.clone());
    let mut stream = js.get_stream(JS_OUT_STREAM).await.map_err(|e| anyhow!("stream {JS_OUT_STREAM}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stored = stream.info().await.map_err(|e| anyhow!("stream {JS_OUT_STREAM}: {e}"))?.state.messages;
        if stored == expected {
            return Ok(());
        }
        if stored > expected || Instant::now() > deadline {
            bail!("stream {JS_OUT_STREAM} stores {stored} outputs, not {expected}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Prints each consumer of the bench stream as the server sees it (to stderr, beside the stall
/// message); errors are printed, not returned: this is a diagnosis, not part of the run.
async fn print_consumers(admin: &async_nats::Client) {
    let js = async_nats::jetstream::new(admin.clone());
    let stream = match js.get_stream(JS_STREAM).await {
        Ok(stream) => stream,
        Err(e) => return eprintln!("  consumers: stream {JS_STREAM}: {e}"),
    };
    let mut consumers = stream.consumers();
    while let Some(info) = consumers.next().await {
        match info {
            Ok(i) => eprintln!(
                "  consumer {}: delivered stream sequence {}, ack floor {}, pending {}, ack pending {}, \
                 redelivered {}, waiting pull requests {}",
                i.name,
                i.delivered.stream_sequence,
                i.ack_floor.stream_sequence,
                i.num_pending,
                i.num_ack_pending,
                i.num_redelivered,
                i.num_waiting
            ),
            Err(e) => eprintln!("  consumers: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Idle streams: memory per open stream.

#[derive(Debug, Clone, Default)]
struct MemoryResult {
    streams: u64,
    open: u64,
    rss_before_kib: u64,
    rss_after_kib: u64,
    seconds: f64,
}

async fn idle_streams(args: &Args, config: &Config, admin: &async_nats::Client) -> Result<MemoryResult> {
    let n = args.idle_streams;
    let mut config = config.clone();
    if args.mode == Mode::JetStream {
        // Each idle stream holds its first event unacknowledged until it ends: room for all.
        let pending = i64::try_from(n).unwrap_or(i64::MAX).saturating_mul(2).max(100_000);
        jetstream_config(&mut config, Some(pending));
    }
    let setup = Setup { storage: StorageType::File, store_outputs: false, ..args.setup() };
    let running = start_system(System::Service, setup, &config, admin, false).await?;
    let service = running.service().expect("a service");
    let producer = connect(&config.nats, "bench-idle-producer", Arc::new(AtomicU64::new(0))).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_before_kib = proc_status_kib("VmRSS:");
    let start = Instant::now();
    let deadline = start + Duration::from_secs(180);
    let batch = 5_000;
    let mut published = 0u64;
    for i in 0..n {
        let mid = message_id(0x1d1e, i);
        let json = if args.idle_canonical {
            let call = format!("openai:inf-{i}:provider-call:0");
            format!(
                r#"{{"type":"text-delta","meta":{},"correlation":{{"provider_call_id":"{call}","segment_id":"{call}:msg_{i:x}:0:text"}},"delta":"Let me","text":"Let me"}}"#,
                legacy_meta(&mid, i)
            )
        } else {
            format!(r#"{{"type":"partial","meta":{},"delta":"Let me","completion":"Let me"}}"#, legacy_meta(&mid, i))
        };
        producer.publish(INPUT_SUBJECT, Bytes::from(json)).await?;
        published += 1;
        if published % batch == 0 {
            // Keep the service's subscription buffer far from full.
            producer.flush().await?;
            while service.metrics().snapshot().events_received + 2 * batch < published {
                if Instant::now() > deadline {
                    bail!("idle streams: the service fell behind for 180 s");
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }
    producer.flush().await?;
    let mut open = 0;
    while Instant::now() < deadline {
        open = service.metrics().snapshot().streams_open;
        if open >= n as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_after_kib = proc_status_kib("VmRSS:");
    let seconds = start.elapsed().as_secs_f64();
    running.stop().await?;
    Ok(MemoryResult { streams: n as u64, open, rss_before_kib, rss_after_kib, seconds })
}

// ---------------------------------------------------------------------------------------------
// Report.

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name").map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned()))
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").and_then(|r| r.trim().trim_end_matches("kB").trim().parse().ok()))
        .unwrap_or(0u64);
    format!("{cpus} CPUs ({model}), {:.0} GiB, Linux {}", mem_kib as f64 / 1048576.0, kernel.trim())
}

fn fmt_rate(r: f64) -> String {
    if r.is_nan() {
        return "not measured".into();
    }
    if r >= 1e6 {
        format!("{:.2} M/s", r / 1e6)
    } else {
        format!("{:.1} k/s", r / 1e3)
    }
}

impl PhaseResult {
    /// Every expected output arrived exactly once, nothing else, in time.
    fn complete(&self) -> bool {
        self.missing == 0 && self.duplicates == 0 && self.unexpected == 0 && self.dead_letters == 0 && !self.timed_out
    }
}

fn row(out: &mut String, p: &PhaseResult) {
    let rate = |r: f64| if p.complete() { fmt_rate(r) } else { "– (incomplete)".to_owned() };
    let gap = if p.longest_gap > GAP_REPORTED {
        format!(", **no output for {:.1} s once**", p.longest_gap)
    } else {
        String::new()
    };
    let check = if p.complete() {
        format!("ok{gap}")
    } else {
        format!(
            "**{} missing, {} dup, {} unexpected, {} dlq{}**{gap}",
            p.missing,
            p.duplicates,
            p.unexpected,
            p.dead_letters,
            if p.timed_out { ", timed out" } else { "" }
        )
    };
    let _ = writeln!(
        out,
        "| {} | {} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {}/{} {} |",
        p.label,
        rate(p.in_rate),
        rate(p.out_rate),
        p.elapsed,
        p.latency.p50,
        p.latency.p99,
        p.latency.p999,
        p.latency.max,
        p.received,
        p.expected,
        check
    );
}

/// The median: for an even count, the mean of the two middle values (the upper one alone
/// overstated two-round figures).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[allow(clippy::too_many_arguments)]
fn report(
    args: &Args,
    server_version: &str,
    workload: &Workload,
    memory: Option<&MemoryResult>,
    max: &[(PhaseResult, PhaseResult)],
    half: &[PhaseResult],
    paired: &[PhaseResult],
    backlog: &[(PhaseResult, PhaseResult)],
    wall: f64,
    peak_kib: u64,
    (js_ack_pending, js_pull_batch): (i64, usize),
) -> (String, bool) {
    let mut out = String::new();
    let mode = match args.mode {
        Mode::Core => "core NATS",
        Mode::JetStream => "JetStream (explicit acks)",
    };
    let events = workload.order.len();
    let _ = writeln!(out, "## End-to-end: structured-sink against a relay, {mode}\n");
    let _ = writeln!(
        out,
        "Machine: {}. nats-server {server_version} on 127.0.0.1; producer and subscriber (each on its own \
         thread and client), service (or relay) and server share the machine. {}\n",
        machine(),
        // `cargo test` runs this bench unoptimised, as a smoke test.
        if cfg!(debug_assertions) { "Debug build: the figures are not comparable." } else { "Release build." }
    );
    if let Some(bin) = &args.service_bin {
        let _ = writeln!(
            out,
            "The service is `{}` in its own process (`--service-bin`): its CPU figures are that \
             process's, all threads; the relay stays in this process.\n",
            bin.display()
        );
    }
    let [f, b, t, tl] = workload.by_subject;
    let _ = writeln!(
        out,
        "Workload: {} streams × ~{} events = {} events, mean {} B/event ({}cumulative `completion`/`text`), \
         published round-robin over {} to `{INPUT_SUBJECT}` with a `{EVENT_HEADER}` header; the service \
         emits {} outputs ({:.2} per event: {f} filtered, {b} block, {t} thinking, {tl} tool). Service: {} shard worker(s), \
         default configuration otherwise. Max rate: closed loop, at most {} outputs outstanding. Command: `cargo \
         bench --bench e2e -- {}`. Wall time {:.0} s; load average {} at the start, {} at the end (2 cores: \
         above 2 means other work was competing).\n",
        args.streams,
        args.events_per_stream,
        events,
        workload.payload_bytes / events.max(1) as u64,
        if args.cumulative { "with " } else { "no " },
        match args.open_streams {
            Some(open) if open < args.streams => format!("{open} open streams at a time (a stream that ends makes room for the next)"),
            _ => "all the streams at once".to_owned(),
        },
        workload.expected_outputs,
        workload.expected_outputs as f64 / events.max(1) as f64,
        {
            let mut effective = Config::default();
            effective.shards.count = args.shards;
            effective.shard_count()
        },
        args.window,
        std::env::args().skip(1).filter(|a| a != "--bench").collect::<Vec<_>>().join(" "),
        wall,
        LOAD_AT_START.get().map_or("?", String::as_str),
        loadavg()
    );

    if args.mode == Mode::JetStream {
        let storage = match args.storage {
            StorageType::Memory => "memory",
            StorageType::File => "file",
        };
        let _ = writeln!(
            out,
            "JetStream: a fresh stream `{JS_STREAM}` ({storage} storage) over `{INPUT_SUBJECT}` per phase; the producer \
             publishes with core NATS (no publish acks). Service: `jetstream.enabled`, one durable pull consumer, \
             explicit acks (each stream's first event held until the stream ends, the others acked once \
             applied), `jetstream.max_ack_pending` = {js_ack_pending}, \
             `jetstream.pull_batch` = {js_pull_batch}. Relay: a durable \
             pull consumer with the same limit and pull batch that republishes each message and then acks it.\n"
        );
        if args.store_outputs {
            let _ = writeln!(
                out,
                "Outputs stored (`--store-outputs`): a fresh stream `{JS_OUT_STREAM}` ({storage} storage) over \
                 `{INPUT_SUBJECT}.>` and `{RELAY_OUT}` per phase. The service confirms each output's storage before \
                 acknowledging its stream's input; the relay publishes each copy through JetStream and acks the \
                 event once the copy's storage is confirmed (at most {RELAY_UNCONFIRMED} unconfirmed).\n"
            );
        }
    }
    let header =
        "| phase | events in | outputs out | seconds | p50 µs | p99 µs | p99.9 µs | max µs | outputs received |\n\
                  |---|---|---|---|---|---|---|---|---|";
    let _ = writeln!(out, "### Maximum rate\n\n{header}");
    for (relay, service) in max {
        row(&mut out, relay);
        row(&mut out, service);
    }
    // Complete phases only: the rate of a phase that stalled means nothing.
    let relay_in = median(max.iter().filter(|(r, _)| r.complete()).map(|(r, _)| r.in_rate).collect());
    let service_in = median(max.iter().filter(|(_, s)| s.complete()).map(|(_, s)| s.in_rate).collect());
    let ratio = service_in / relay_in.max(1e-9);
    let _ = writeln!(
        out,
        "\n**Throughput ratio service / relay (events in/s{}): {:.2}** ({} against {}).\n",
        if max.len() > 1 { ", medians" } else { "" },
        ratio,
        fmt_rate(service_in),
        fmt_rate(relay_in)
    );
    let cpu = |f: fn(&(PhaseResult, PhaseResult)) -> &PhaseResult, i: usize| {
        median(max.iter().filter(|x| f(x).complete()).map(|x| f(x).cpu_per_event[i]).collect())
    };
    let (service_cpu, relay_cpu) = (cpu(|x| &x.1, 0), cpu(|x| &x.0, 0));
    let _ = writeln!(
        out,
        "CPU per input event in the tokio workers (the system under test alone) at maximum rate: \
         {service_cpu:.1} µs for the service against {relay_cpu:.1} µs for the relay ({:.2} ×); nats-server: {:.1} \
         against {:.1} µs; producer: {:.1} against {:.1} µs; subscriber: {:.1} against {:.1} µs.\n",
        service_cpu / relay_cpu.max(1e-9),
        cpu(|x| &x.1, 2),
        cpu(|x| &x.0, 2),
        cpu(|x| &x.1, 1),
        cpu(|x| &x.0, 1),
        cpu(|x| &x.1, 3),
        cpu(|x| &x.0, 3),
    );
    let _ = writeln!(
        out,
        "Latency at maximum rate is mostly time spent queued in the window, not a property of either system.\n"
    );

    let mut p99_service = f64::NAN;
    if half.is_empty() {
        let _ = writeln!(
            out,
            "### Latency

Not measured: the service did not complete a maximum-rate phase.\n"
        );
    }
    if let [service, relay] = half {
        let _ = writeln!(
            out,
            "### Latency at {} ({} events/s, paced)\n\n{header}",
            if args.rate.is_some() { "a fixed rate (--rate)" } else { "half the service's maximum rate" },
            service.target_rate.unwrap_or(0.0).round()
        );
        row(&mut out, service);
        row(&mut out, relay);
        let l = |f: fn(&Percentiles) -> f64| (f(&service.latency), f(&relay.latency));
        let (s50, r50) = l(|p| p.p50);
        let (s99, r99) = l(|p| p.p99);
        let (s999, r999) = l(|p| p.p999);
        if service.complete() {
            p99_service = s99;
        }
        let _ = writeln!(
            out,
            "\n| latency | service | relay | ratio service / relay | added by the service |\n|---|---|---|---|---|\n\
             | p50 | {s50:.0} µs | {r50:.0} µs | {:.2} | {:.0} µs |\n| p99 | {s99:.0} µs | {r99:.0} µs | {:.2} | {:.0} µs |\n\
             | p99.9 | {s999:.0} µs | {r999:.0} µs | {:.2} | {:.0} µs |\n",
            s50 / r50.max(1e-9),
            s50 - r50,
            s99 / r99.max(1e-9),
            s99 - r99,
            s999 / r999.max(1e-9),
            s999 - r999,
        );
        let _ = writeln!(
            out,
            "Latency: producer publish (just before `publish`) to the subscriber's receive, through two NATS hops \
             either way. Producer lag behind schedule at most {:.1} ms (service) and {:.1} ms (relay).\n",
            service.max_lag_ms, relay.max_lag_ms
        );
    }

    if !paired.is_empty() {
        paired_report(&mut out, paired);
    }

    let backlog_in = median(backlog.iter().filter(|(_, s)| s.complete()).map(|(_, s)| s.in_rate).collect());
    if !backlog.is_empty() {
        let relay_backlog = median(backlog.iter().filter(|(r, _)| r.complete()).map(|(r, _)| r.in_rate).collect());
        let _ = writeln!(
            out,
            "### Backlog: draining a stream that already holds the workload\n\nThe whole workload is stored in a fresh \
             stream first (every publish confirmed), then the system starts and consumes it; the rate is events / \
             (last output received - system start, start-up included). This is the catch-up rate after an outage, \
             without the cost of storing events at the same time. No latency: events were stored before the system \
             ran.\n\n{header}"
        );
        for (relay, service) in backlog {
            row(&mut out, relay);
            row(&mut out, service);
        }
        let _ = writeln!(
            out,
            "\n**Backlog ratio service / relay (events in/s{}): {:.2}** ({} against {}).\n",
            if backlog.len() > 1 { ", medians" } else { "" },
            backlog_in / relay_backlog.max(1e-9),
            fmt_rate(backlog_in),
            fmt_rate(relay_backlog)
        );
    }

    let _ = writeln!(
        out,
        "### CPU, counters and memory per phase\n\nCPU time per input event from /proc (10 ms ticks), less sensitive \
         to other load on the machine than rates are.\n"
    );
    let _ = writeln!(
        out,
        "| phase | CPU µs/event: tokio workers (system) | producer | nats-server | subscriber | producer publish rate | service events received | service messages published | shard inbox waits | slow consumer events (subscriber) | process VmRSS after |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let phases = || {
        max.iter()
            .flat_map(|(r, s)| [r, s])
            .chain(half.iter())
            .chain(paired.iter())
            .chain(backlog.iter().flat_map(|(r, s)| [r, s]))
    };
    for p in phases() {
        let opt = |v: Option<u64>| v.map_or("–".to_owned(), |v| v.to_string());
        let publish_rate = if p.publish_elapsed > 0.0 {
            fmt_rate(p.events as f64 / p.publish_elapsed)
        } else {
            "– (stored before)".to_owned()
        };
        let _ = writeln!(
            out,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {:.0} MiB |",
            p.label,
            p.cpu_per_event[0],
            p.cpu_per_event[1],
            p.cpu_per_event[2],
            p.cpu_per_event[3],
            publish_rate,
            opt(p.service_received),
            opt(p.service_published),
            opt(p.inbox_full),
            p.slow_consumers,
            p.rss_after_mib
        );
    }

    let mut per_10k_mib = f64::NAN;
    if let Some(m) = memory {
        let delta = m.rss_after_kib.saturating_sub(m.rss_before_kib);
        per_10k_mib = mib(delta) * 10_000.0 / m.streams.max(1) as f64;
        let _ = writeln!(
            out,
            "\n### Open idle streams\n\n{} streams ({}, {}), one 6-byte delta each and no final (streams_open \
             reached {} in {:.1} s), in a fresh service started first in this process.\n\n| VmRSS before | VmRSS after | growth | \
             per 10,000 streams | per stream | projected for 100,000 |\n|---|---|---|---|---|---|\n| {:.1} MiB | {:.1} \
             MiB | {:.1} MiB | {:.2} MiB | {:.0} B | {:.0} MiB |\n",
            m.streams,
            if args.idle_canonical { "canonical segments, `--idle-canonical`" } else { "legacy `partial`s" },
            if args.mode == Mode::JetStream {
                "JetStream input: each holds its first event's acknowledgement"
            } else {
                "core NATS input"
            },
            m.open,
            m.seconds,
            mib(m.rss_before_kib),
            mib(m.rss_after_kib),
            mib(delta),
            per_10k_mib,
            delta as f64 * 1024.0 / m.streams.max(1) as f64,
            per_10k_mib * 10.0
        );
    }
    let _ = writeln!(
        out,
        "Peak RSS (VmHWM) of the whole bench process: {:.0} MiB; it includes the pre-generated workload ({:.0} MiB \
         of payloads, plus per-event bookkeeping) and the subscriber's buffers, not only the service.\n",
        mib(peak_kib),
        workload.payload_bytes as f64 / 1048576.0
    );

    let js = args.mode == Mode::JetStream;
    let _ = writeln!(out, "### Targets (issue 6)\n\n| target | measured | met |\n|---|---|---|");
    let yes = |b: bool| if b { "yes" } else { "**no** (or not measured)" };
    if js {
        let _ = writeln!(
            out,
            "| JetStream, explicit acks: ≥ 150,000 events/s, events published while the service runs | {} | {} |",
            fmt_rate(service_in),
            yes(service_in >= 150_000.0)
        );
        let _ = writeln!(
            out,
            "| JetStream, explicit acks: ≥ 150,000 events/s, draining a stored backlog | {} | {} |",
            fmt_rate(backlog_in),
            yes(backlog_in >= 150_000.0)
        );
    } else {
        let _ = writeln!(out, "| events/s ≥ 0.8 × relay, same run | {ratio:.2} × | {} |", yes(ratio >= 0.8));
    }
    let _ = writeln!(
        out,
        "| added latency p99 ≤ 1 ms at half the max rate (end to end through the service) | {p99_service:.0} µs | {} |",
        yes(p99_service <= 1000.0)
    );
    if memory.is_some() {
        let projected = per_10k_mib * 10.0;
        let _ = writeln!(
            out,
            "| 100,000 open idle streams ≤ 200 MiB RSS | {projected:.0} MiB (projected from the growth) | {} |",
            yes(projected <= 200.0)
        );
    }
    let complete = phases().all(PhaseResult::complete);
    if !complete {
        let _ = writeln!(out, "\n**Some phase lost, duplicated or dead-lettered outputs, or timed out: see above.**");
    }
    (out, complete)
}

/// The paired phases: the service's delay per output against its event's relay output.
fn paired_report(out: &mut String, paired: &[PhaseResult]) {
    let _ = writeln!(
        out,
        "### Added latency, paired (`--paired`)\n\n\
         Relay and service run at once on the same input: each event is published once, and each service \
         output is timed against its event's relay output, which left the producer in the same publish and \
         crossed the same two hops. The difference is what the service added to that event. Both systems \
         load the machine at once, so a paired phase at a rate costs more CPU than either system alone.\n\n\
         | rate | service p50 / p99 µs | relay p50 / p99 µs | added p50 µs | added p99 µs | added p99.9 µs | added max µs | earlier than the relay | outputs received |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    for p in paired {
        let Some(added) = &p.added else { continue };
        let check = if p.complete() { "ok".to_owned() } else { format!("**{} missing**", p.missing) };
        let _ = writeln!(
            out,
            "| {} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}% | {}/{} {check} |",
            p.target_rate.map_or_else(|| "–".to_owned(), fmt_rate),
            p.latency.p50,
            p.latency.p99,
            p.relay_latency.p50,
            p.relay_latency.p99,
            added.at.p50,
            added.at.p99,
            added.at.p999,
            added.at.max,
            100.0 * added.earlier as f64 / added.samples.max(1) as f64,
            p.received,
            p.expected,
        );
    }
    let _ = writeln!(out);
}

// ---------------------------------------------------------------------------------------------

fn main() -> Result<()> {
    let _ = epoch();
    let _ = LOAD_AT_START.set(loadavg());
    let args = parse_args()?;
    if let Ok(filter) = std::env::var("RUST_LOG") {
        // Opt in: the service's logs on stderr, to see why a phase stalls.
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let wall = Instant::now();
    let server = NatsServer::start(args.mode == Mode::JetStream)?;
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.worker_threads {
        runtime.worker_threads(threads);
    }
    let rt = runtime.enable_all().build()?;
    let result = rt.block_on(run(&args, &server.url, wall));
    drop(rt);
    drop(server);
    let complete = result?;
    if !complete && args.smoke {
        bail!("smoke run incomplete");
    }
    Ok(())
}

async fn run(args: &Args, url: &str, wall: Instant) -> Result<bool> {
    let mut config = base_config(url, args);
    let slow = Arc::new(AtomicU64::new(0));
    let admin = connect(&config.nats, "bench-admin", Arc::new(AtomicU64::new(0))).await?;
    let server_version = admin.server_info().version.clone();
    eprintln!(
        "nats-server {server_version} at {url}; mode {:?}; {} streams × {} events",
        args.mode, args.streams, args.events_per_stream
    );

    // Idle streams first, before the workload exists (freed memory would hide the growth).
    let memory = if args.idle_streams > 0 {
        eprintln!("idle streams: opening {} ...", args.idle_streams);
        let m = idle_streams(args, &config, &admin).await?;
        eprintln!(
            "idle streams: {} open, VmRSS {:.1} -> {:.1} MiB",
            m.open,
            mib(m.rss_before_kib),
            mib(m.rss_after_kib)
        );
        Some(m)
    } else {
        None
    };

    eprintln!("generating the workload and predicting the service's outputs ...");
    let workload = Arc::new(build_workload(args, &config)?);
    if args.mode == Mode::JetStream {
        jetstream_config(&mut config, args.ack_pending);
    }
    eprintln!(
        "{} events, {} MiB, {} expected outputs",
        workload.order.len(),
        workload.payload_bytes >> 20,
        workload.expected_outputs
    );

    if args.smoke {
        // The shipped binary itself, as its own process, over the same workload: every output
        // checked off as in the other phases.
        let args = Args { service_bin: Some(PathBuf::from(env!("CARGO_BIN_EXE_structured-sink"))), ..args.clone() };
        let label = "structured-sink binary, max rate";
        let p = run_phase(label, System::Service, &args, &config, &workload, None, &admin, &slow, Input::Live).await?;
        eprintln!("{label}: {}/{} outputs, {} missing, {} duplicates", p.received, p.expected, p.missing, p.duplicates);
        if !p.complete() {
            bail!("smoke run: the binary's outputs were incomplete");
        }
    }
    if let Some(system) = args.profile {
        for round in 1..=args.rounds {
            let p = run_phase("profile", system, args, &config, &workload, None, &admin, &slow, Input::Live).await?;
            eprintln!("round {round}: {:.0} events/s in, {}/{} outputs", p.in_rate, p.received, p.expected);
            if !p.complete() {
                // A profile of a run that lost or duplicated outputs would train on a broken run.
                bail!(
                    "round {round} incomplete: {} missing, {} duplicates, {} unexpected, {} dead letters{}",
                    p.missing,
                    p.duplicates,
                    p.unexpected,
                    p.dead_letters,
                    if p.timed_out { ", timed out" } else { "" }
                );
            }
        }
        return Ok(true);
    }

    let mut max = Vec::new();
    for round in 1..=args.rounds {
        let suffix = if args.rounds > 1 { format!(" (round {round})") } else { String::new() };
        let max_rate = |system: System, name: &'static str| {
            let label = format!("{name}, max rate{suffix}");
            let (config, workload, admin, slow) = (&config, &workload, &admin, &slow);
            async move {
                eprintln!("{label} ...");
                let p = run_phase(&label, system, args, config, workload, None, admin, slow, Input::Live).await?;
                eprintln!("  {} events/s", p.in_rate.round());
                anyhow::Ok(p)
            }
        };
        let relay = max_rate(System::Relay, "relay").await?;
        let service = max_rate(System::Service, "structured-sink").await?;
        max.push((relay, service));
    }
    let service_max = median(max.iter().filter(|(_, s)| s.complete()).map(|(_, s)| s.in_rate).collect());
    let half_rate = args.rate.unwrap_or((service_max / 2.0).max(100.0));
    if half_rate.is_nan() {
        eprintln!("the service completed no maximum-rate phase: no latency phases");
    }
    let half = if half_rate.is_nan() {
        Vec::new()
    } else {
        eprintln!("service and relay at {} events/s ...", half_rate.round());
        let paced = |system: System, label: &'static str| {
            run_phase(label, system, args, &config, &workload, Some(half_rate), &admin, &slow, Input::Live)
        };
        let service_label = if args.rate.is_some() { "structured-sink, paced" } else { "structured-sink, half rate" };
        let service_half = paced(System::Service, service_label).await?;
        let relay_half = paced(System::Relay, "relay, same rate").await?;
        vec![service_half, relay_half]
    };
    let mut paired = Vec::new();
    for &rate in &args.paired {
        eprintln!("relay and service at once, {} events/s ...", rate.round());
        let p = run_phase(
            "relay + structured-sink, paired",
            System::Paired,
            args,
            &config,
            &workload,
            Some(rate),
            &admin,
            &slow,
            Input::Live,
        )
        .await?;
        paired.push(p);
    }
    let mut backlog = Vec::new();
    if args.mode == Mode::JetStream {
        for round in 1..=args.rounds {
            let suffix = if args.rounds > 1 { format!(" (round {round})") } else { String::new() };
            let drain = |system: System, name: &'static str| {
                let label = format!("{name}, backlog{suffix}");
                let (config, workload, admin, slow) = (&config, &workload, &admin, &slow);
                async move {
                    eprintln!("{label}: storing the workload, then draining it ...");
                    let p =
                        run_phase(&label, system, args, config, workload, None, admin, slow, Input::Backlog).await?;
                    eprintln!(
                        "  {} events/s (first output after {:.0} ms, longest wait between outputs {:.0} ms)",
                        p.in_rate.round(),
                        p.first_output * 1e3,
                        p.longest_gap * 1e3
                    );
                    anyhow::Ok(p)
                }
            };
            let relay = drain(System::Relay, "relay").await?;
            let service = drain(System::Service, "structured-sink").await?;
            backlog.push((relay, service));
        }
        delete_js_stream(&admin).await;
    }
    let peak = proc_status_kib("VmHWM:");
    let (text, complete) = report(
        args,
        &server_version,
        &workload,
        memory.as_ref(),
        &max,
        &half,
        &paired,
        &backlog,
        wall.elapsed().as_secs_f64(),
        peak,
        (config.jetstream.max_ack_pending, config.jetstream.pull_batch),
    );
    println!("{text}");
    Ok(complete)
}
