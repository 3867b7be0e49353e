//! The one typed configuration tree, its defaults, its layering and its validation.
//!
//! Layers, later wins: built-in defaults → an optional TOML file → environment variables
//! `STRUCTURED_SINK__SECTION__KEY` → command-line `--set section.key=value` flags. Every field's
//! `///` doc is the operator's documentation (the README's configuration reference mirrors it).
//! Unknown keys and invalid values stop start-up with an error that names the key.
//!
//! This module knows the shape of the settings and how they combine; it knows nothing of how they
//! are used.

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::bus::NatsConfig;
use crate::codec::outbound::OutputEncoder;
use crate::codec::outbound::{OutputSubjects, TextEncoding};
use crate::codec::subject::{is_valid_publish_subject, patterns_overlap};
use crate::payload::PayloadFormat;
use crate::pipeline::{CumulativeText, MalformedPolicy, Pipeline, PipelineLimits, TagKind, TagSpec};
use crate::shard::table::TableLimits;
use crate::typed::SchemaRegistry;

/// The prefix of environment variables; `__` separates nested keys.
pub const ENV_PREFIX: &str = "STRUCTURED_SINK__";

/// Keys whose values from the environment (and, unless TOML strings, from `--set`) are taken
/// exactly as written. figment reads environment values as TOML-like data, which would turn a
/// password `0042` into the number 42 and unquote `"x"`: a secret must arrive unchanged.
const VERBATIM_KEYS: [&str; 4] = ["nats.token", "nats.user", "nats.password", "nats.nkey_seed"];

/// Why the configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer could not be read or a key is unknown or of the wrong type (figment names the key
    /// and the layer it came from). Values of the `nats` section are masked in it, as everywhere
    /// (see [`ConfigError::from`]).
    #[error("configuration: {0}")]
    Load(Box<figment::Error>),
    /// A value is out of range or inconsistent with another.
    #[error("configuration key `{key}`: {reason}")]
    Invalid {
        /// The dotted key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl From<figment::Error> for ConfigError {
    /// Keeps figment's message, whose wrong-type errors quote the value given, but masks the
    /// values of `nats` keys: a server URL given as one string where a list was expected would
    /// otherwise print its password, and a secret given with the wrong type would print itself.
    fn from(error: figment::Error) -> Self {
        use figment::error::{Actual, Kind};
        let mask = |path: &[String], actual: &mut Actual| {
            if path.first().map(String::as_str) != Some("nats") {
                return;
            }
            *actual = match actual {
                Actual::Str(text) if path.get(1).map(String::as_str) == Some("servers") => {
                    Actual::Str(crate::bus::mask_url_secret(text))
                }
                Actual::Str(_) | Actual::Char(_) | Actual::Bytes(_) => Actual::Str(crate::bus::MASK.to_owned()),
                _ => return,
            };
        };
        let mut masked: Option<figment::Error> = None;
        // The chain is rebuilt in its order: the first error yielded is the last chained.
        let errors: Vec<figment::Error> = error.into_iter().collect();
        for mut error in errors.into_iter().rev() {
            if let Kind::InvalidType(actual, _) | Kind::InvalidValue(actual, _) = &mut error.kind {
                mask(&error.path, actual);
            }
            masked = Some(match masked {
                Some(earlier) => earlier.chain(error),
                None => error,
            });
        }
        ConfigError::Load(Box::new(masked.expect("figment errors hold one error at least")))
    }
}

impl ConfigError {
    fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid { key: key.into(), reason: reason.into() }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Connection to NATS.
    pub nats: NatsConfig,
    /// What the service consumes.
    pub input: InputConfig,
    /// What the service publishes.
    pub output: OutputConfig,
    /// Stream-wide filtering rules and limits.
    pub pipeline: PipelineConfig,
    /// The registered tags. This list replaces the default list as a whole: to disable a default
    /// tag (thinking, tool calls), leave it out. Every block type declared in a loaded `.proto`
    /// file (see `schemas`) is registered too, unless listed here.
    pub tags: Vec<TagConfig>,
    /// Block types declared in `.proto` files.
    pub schemas: SchemasConfig,
    /// Horizontal scale: which message ids this replica owns.
    pub partitions: PartitionConfig,
    /// Durable input through JetStream.
    pub jetstream: JetStreamConfig,
    /// Per-stream state and its workers.
    pub shards: ShardConfig,
    /// Metrics and health endpoints.
    pub http: HttpConfig,
    /// Logs and traces.
    pub telemetry: TelemetryConfig,
    /// Process lifecycle.
    pub service: ServiceConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            nats: NatsConfig::default(),
            input: InputConfig::default(),
            output: OutputConfig::default(),
            pipeline: PipelineConfig::default(),
            tags: default_tags(),
            schemas: SchemasConfig::default(),
            partitions: PartitionConfig::default(),
            jetstream: JetStreamConfig::default(),
            shards: ShardConfig::default(),
            http: HttpConfig::default(),
            telemetry: TelemetryConfig::default(),
            service: ServiceConfig::default(),
        }
    }
}

/// The tags registered when the configuration names none.
pub fn default_tags() -> Vec<TagConfig> {
    // The built-in block types (`geppetto:citations:v1`, `pinocchio:agent_mode_switch:v1`) come
    // from their `.proto` declarations.
    vec![
        TagConfig::new("thinking", TagKind::Channel),
        TagConfig::new("think", TagKind::Channel),
        TagConfig::new("tool", TagKind::ToolCall),
    ]
}

/// Where block types are declared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchemasConfig {
    /// Directories searched recursively for `.proto` files. Every message with the
    /// `(structuredsink.v1.block) = { tag: "p:t:v" }` option becomes a block type: its payload is
    /// converted into that message and published as `google.protobuf.Any`. The built-in types are
    /// always loaded. A schema error stops start-up naming the file and line.
    pub dirs: Vec<std::path::PathBuf>,
    /// How deep messages may nest in a typed payload (the root message is level 1). A deeper
    /// payload completes with `success=false` and is counted in
    /// `blocks_failed_total{reason="too_deep"}`; it bounds the recursion a crafted payload
    /// against a recursive message type can cause. A payload nesting deeper than 30 arrays or
    /// objects fails before conversion (the outputs' own bound), so for most types a value above
    /// 30 changes nothing.
    pub max_depth: usize,
}

impl Default for SchemasConfig {
    fn default() -> Self {
        SchemasConfig { dirs: Vec::new(), max_depth: crate::typed::MAX_NESTING_DEPTH }
    }
}

/// What the service consumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InputConfig {
    /// Subjects (patterns allowed) carrying geppetto event JSON, one event per message. They may
    /// not overlap the service's own output subjects.
    pub subjects: Vec<String>,
    /// Events larger than this are dead-lettered with reason `too_large`.
    pub max_event_bytes: usize,
    /// Where events that are not text (tool calls, usage, logs, ...) are forwarded unchanged.
    /// Empty: they are dropped (and counted).
    pub pass_through_subject: String,
    /// Where undecodable events go, unchanged, with a `Structured-Sink-Error` header.
    pub dead_letter_subject: String,
}

impl Default for InputConfig {
    fn default() -> Self {
        InputConfig {
            subjects: vec!["chat".into()],
            max_event_bytes: 1024 * 1024,
            pass_through_subject: String::new(),
            dead_letter_subject: "chat.dlq".into(),
        }
    }
}

/// How outputs are encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputFormat {
    /// Schema v1 protobuf messages (`proto/structuredsink/v1`).
    #[default]
    Protobuf,
    /// The filtered text re-encoded as geppetto event JSON (`partial`/`final` or the canonical
    /// names, whichever the stream used), so an existing geppetto UI only changes its subject.
    GeppettoJson,
}

/// What the service publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputConfig {
    /// `protobuf` or `geppetto-json`.
    pub format: OutputFormat,
    /// The subjects published to.
    pub subjects: OutputSubjects,
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig { format: OutputFormat::Protobuf, subjects: OutputSubjects::default() }
    }
}

/// Stream-wide filtering rules and limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineConfig {
    /// What happens to a block still open at the end of its stream: `drop` removes its text,
    /// `restore` puts the open tag and captured bytes back into the visible text. Either way the
    /// block completes with `success=false`.
    pub malformed: MalformedPolicy,
    /// Payload bytes captured per block (overridable per tag). At the limit the block completes
    /// with `success=false` and the rest of it is dropped; the stream continues after its close
    /// tag.
    pub max_capture_bytes: usize,
    /// Decode `\n`, `\"`, `\uXXXX`, ... in deltas before scanning, for upstreams that
    /// double-escape text.
    pub unescape_text: bool,
    /// When the whole visible text is attached to `FilteredText.text`: `final` (default),
    /// `every` message (quadratic bandwidth), or `never` (nothing is retained).
    pub cumulative_text: CumulativeText,
    /// Visible text retained per stream for `text`; beyond it the final reports `text_omitted`.
    pub max_text_bytes: usize,
    /// Live-snapshot parse work allowed per payload byte received. An attempt that would exceed
    /// it is skipped and counted in `snapshots_skipped_total`; 0 turns snapshots off. The final
    /// value of a block never depends on it.
    pub snapshot_budget: usize,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        let limits = PipelineLimits::default();
        PipelineConfig {
            malformed: limits.malformed,
            max_capture_bytes: limits.max_capture_bytes,
            unescape_text: limits.unescape_text,
            cumulative_text: limits.cumulative_text,
            max_text_bytes: limits.max_text_bytes,
            snapshot_budget: limits.snapshot_budget,
        }
    }
}

impl PipelineConfig {
    /// The core's view of these settings.
    pub fn limits(&self) -> PipelineLimits {
        PipelineLimits {
            max_capture_bytes: self.max_capture_bytes,
            max_text_bytes: self.max_text_bytes,
            malformed: self.malformed,
            unescape_text: self.unescape_text,
            cumulative_text: self.cumulative_text,
            snapshot_budget: self.snapshot_budget,
        }
    }
}

/// One registered tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagConfig {
    /// The text between `<` and `>`: `package:type:version` for blocks (three non-empty parts of
    /// `[A-Za-z0-9_.-]`), a plain word such as `thinking` or `tool` otherwise.
    pub name: String,
    /// `block`, `channel` (thinking text) or `tool_call`.
    pub kind: TagKind,
    /// Overrides `pipeline.max_capture_bytes` for this tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_capture_bytes: Option<usize>,
    /// Blocks: how the payload is decoded: `yaml` (default), `json` or `raw`. The first fenced
    /// code block is used when there is one.
    #[serde(default)]
    pub payload: PayloadFormat,
    /// Blocks: publish live `snapshot` events of the value parsed so far (default true).
    #[serde(default = "default_true")]
    pub snapshots: bool,
}

fn default_true() -> bool {
    true
}

impl TagConfig {
    /// A tag with default settings.
    pub fn new(name: &str, kind: TagKind) -> Self {
        TagConfig { name: name.into(), kind, max_capture_bytes: None, payload: PayloadFormat::Yaml, snapshots: true }
    }

    /// The core's view of this tag.
    pub fn spec(&self) -> TagSpec {
        TagSpec {
            name: self.name.clone(),
            kind: self.kind,
            max_capture_bytes: self.max_capture_bytes,
            payload: self.payload,
            snapshots: self.snapshots,
        }
    }
}

/// How message ids are spread over replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionMode {
    /// One replica (or several that each see everything): no partitioning.
    #[default]
    None,
    /// Producers publish to `<subject_prefix>.<message_id>`; the NATS server maps that to
    /// `<subject_prefix>.p.<partition>.<message_id>` (see `deploy/nats.conf`) and each replica
    /// subscribes only to its partitions. `input.subjects` is not used.
    Subject,
    /// Producers publish on unkeyed `input.subjects`; every replica receives everything and keeps
    /// the message ids whose partition it owns (the same hash as the server: FNV-1a 32-bit of the
    /// id, modulo `count`). Costs every replica the decoding of every event.
    Filter,
}

/// Which partitions of the message-id space this replica owns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PartitionConfig {
    /// `none`, `subject` or `filter`.
    pub mode: PartitionMode,
    /// The number of partitions P. Must match the server's `partition(P, 1)` mapping in subject
    /// mode. Changing it moves message ids between partitions: drain first.
    pub count: u32,
    /// Owned partitions as numbers or inclusive ranges, such as `["0-15", "32"]`. Empty: decided by
    /// `replica_index`/`replica_count`, or all partitions when `replica_count` is 0.
    pub owned: Vec<String>,
    /// With `replica_count` > 0: this replica owns every partition p with
    /// `p % replica_count == replica_index` (a StatefulSet ordinal fits here).
    pub replica_index: u32,
    /// The number of replicas sharing the partitions by `replica_index`; 0 turns this off.
    pub replica_count: u32,
    /// Subject mode: the prefix producers publish under (`<prefix>.<message_id>`).
    pub subject_prefix: String,
    /// Subject mode: at start-up, publish a probe through the server's mapping and stop with an
    /// error if it does not arrive on the partition subject the hash predicts.
    pub verify_mapping: bool,
}

impl Default for PartitionConfig {
    fn default() -> Self {
        PartitionConfig {
            mode: PartitionMode::None,
            count: 64,
            owned: Vec::new(),
            replica_index: 0,
            replica_count: 0,
            subject_prefix: "chat.raw".into(),
            verify_mapping: true,
        }
    }
}

impl PartitionConfig {
    /// The partitions a replica stands by for with `jetstream.pinned_client`: `standby` (numbers
    /// or ranges, `jetstream.standby`), or every partition when it is empty; never those it owns.
    pub fn standby_partitions(&self, standby: &[String]) -> Result<Vec<u32>, ConfigError> {
        let owned = self.owned_partitions()?;
        let candidates = if standby.is_empty() {
            (0..self.count).collect()
        } else {
            parse_partition_ranges("jetstream.standby", standby, self.count)?
        };
        Ok(candidates.into_iter().filter(|p| owned.binary_search(p).is_err()).collect())
    }

    /// The partitions this replica owns, sorted; validated ranges.
    pub fn owned_partitions(&self) -> Result<Vec<u32>, ConfigError> {
        if self.count == 0 {
            return Err(ConfigError::invalid("partitions.count", "must be greater than 0"));
        }
        if !self.owned.is_empty() {
            return parse_partition_ranges("partitions.owned", &self.owned, self.count);
        }
        if self.replica_count > 0 {
            if self.replica_index >= self.replica_count {
                return Err(ConfigError::invalid(
                    "partitions.replica_index",
                    format!("{} is not below replica_count {}", self.replica_index, self.replica_count),
                ));
            }
            return Ok((0..self.count).filter(|p| p % self.replica_count == self.replica_index).collect());
        }
        Ok((0..self.count).collect())
    }
}

/// The error for an input that would read the service's own `output` back.
fn feedback_loop(key: &'static str, input: &str, output: &str) -> ConfigError {
    ConfigError::invalid(key, format!("{input:?} would receive the service's own output {output} (a feedback loop)"))
}

/// Partitions given as numbers or inclusive ranges (`["0-15", "32"]`) below `count`, sorted and
/// without repeats; `key` names the setting in errors.
fn parse_partition_ranges(key: &'static str, items: &[String], count: u32) -> Result<Vec<u32>, ConfigError> {
    let mut partitions = Vec::new();
    for item in items {
        let bad = || ConfigError::invalid(key, format!("{item:?} is not N or N-M below {count}"));
        let (lo, hi) = match item.split_once('-') {
            Some((lo, hi)) => {
                (lo.trim().parse::<u32>().map_err(|_| bad())?, hi.trim().parse::<u32>().map_err(|_| bad())?)
            }
            None => {
                let n = item.trim().parse::<u32>().map_err(|_| bad())?;
                (n, n)
            }
        };
        if lo > hi || hi >= count {
            return Err(bad());
        }
        partitions.extend(lo..=hi);
    }
    partitions.sort_unstable();
    partitions.dedup();
    Ok(partitions)
}

/// Durable input through JetStream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JetStreamConfig {
    /// Consume input from a JetStream stream with one durable pull consumer per owned partition
    /// and explicit acks, instead of plain subscriptions.
    pub enabled: bool,
    /// The stream over the input subjects.
    pub stream: String,
    /// Create the stream when it is missing; otherwise it must exist.
    pub create_stream: bool,
    /// Replicas of a created stream (3 on a three-node cluster).
    pub stream_replicas: usize,
    /// Durable consumer names are `<consumer_prefix>-p<partition>` in subject mode (shared by the
    /// replicas), else `<consumer_prefix>-r<replica_index>-s<i>`, one per input subject `i`.
    pub consumer_prefix: String,
    /// How long the server waits for an ack before redelivering. A stream's first event is
    /// acknowledged when the stream ends, so this should exceed the longest stream plus
    /// `shards.idle_timeout_ms` (a first event redelivered earlier is skipped as a duplicate).
    pub ack_wait_ms: u64,
    /// Unacknowledged messages per consumer; delivery stalls at it. The service holds one per open
    /// stream (its first event), so this must exceed the streams open at once in one partition
    /// plus `pull_batch`.
    pub max_ack_pending: i64,
    /// Messages asked for in one pull request (a new request goes out when half have arrived).
    /// Larger batches cost the server less per message: 1000 instead of async-nats' 200 drained
    /// a stored backlog about a fifth faster (BENCHMARKS.md). The client holds at most this many
    /// messages received and not yet handled, per consumer.
    pub pull_batch: usize,
    /// Bytes asked for in one pull request at most (0: no limit but `pull_batch`), which bounds
    /// the client's buffer when events are large. When set, it must exceed the server's
    /// `max_payload` by 4 KiB (checked at start-up): a message larger than a pull could never be
    /// delivered, and its partition would stop.
    pub pull_max_bytes: usize,
    /// Subject mode, server 2.11 or later: the partition consumers use a pinned-client priority
    /// group shared by every replica. The server delivers each partition to one pinned replica; the
    /// others wait on standby and one of them takes the partition over when the pinned replica has
    /// not pulled for `pinned_ttl_ms`. Start-up stops with an error on an older server (servers
    /// before 2.11 would accept the consumer setting and silently ignore it).
    pub pinned_client: bool,
    /// With `pinned_client`: how long a pinned replica may go without pulling before the server
    /// moves its partition's pin to a standby replica (the takeover delay after a crash).
    pub pinned_ttl_ms: u64,
    /// With `pinned_client`: the partitions this replica stands by for, besides those it owns, as
    /// numbers or inclusive ranges (`["0-15", "32"]`). Empty: every partition it does not own.
    pub standby: Vec<String>,
}

impl Default for JetStreamConfig {
    fn default() -> Self {
        JetStreamConfig {
            enabled: false,
            stream: "CHAT_RAW".into(),
            create_stream: true,
            stream_replicas: 1,
            consumer_prefix: "structured-sink".into(),
            // A stream's first event is acknowledged when it ends: longer than the longest stream
            // plus the idle timeout. Takeovers do not wait for it (consumers restart at their ack floor).
            ack_wait_ms: 600_000,
            max_ack_pending: 100_000,
            pull_batch: 1000,
            pull_max_bytes: 0,
            pinned_client: false,
            pinned_ttl_ms: 30_000,
            standby: Vec::new(),
        }
    }
}

/// Per-stream state and the workers that own it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShardConfig {
    /// Worker tasks, each owning the streams whose message id hashes to it. 0 means one per CPU
    /// less one (at least one): the input's decoding and the NATS connection need a CPU too.
    pub count: usize,
    /// Events queued per worker. When full, the subscription waits (backpressure reaches the
    /// NATS client's buffer, whose overflow is logged and counted as a slow consumer).
    pub inbox_capacity: usize,
    /// A stream with no event for this long is closed with reason `expired`.
    pub idle_timeout_ms: u64,
    /// Open streams per replica, shared evenly by its shards (at least one each). Above its share
    /// a shard closes its longest-idle stream with reason `evicted`.
    pub max_streams: usize,
    /// How often workers look for idle streams.
    pub expiry_tick_ms: u64,
    /// Ids of recently finished streams remembered per replica (split evenly over its shards,
    /// rounded up; the oldest is forgotten first), so that late events for them are dead-lettered
    /// instead of starting a new stream with duplicate sequence numbers. 0 remembers none.
    pub finished_memory: usize,
}

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            count: 0,
            inbox_capacity: 1024,
            idle_timeout_ms: 5 * 60 * 1000,
            max_streams: 100_000,
            expiry_tick_ms: 1000,
            finished_memory: 10_000,
        }
    }
}

/// Metrics and health endpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Serve `/metrics`, `/healthz` and `/readyz`.
    pub enabled: bool,
    /// Address to listen on.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig { enabled: true, listen: "0.0.0.0:9464".into() }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Logs and traces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// `text` or `json`.
    pub log_format: LogFormat,
    /// An env-filter directive such as `info` or `structured_sink=debug`; `RUST_LOG` wins when set.
    pub log_filter: String,
    /// OTLP/HTTP endpoint for traces, such as `http://collector:4318`. Empty: tracing to OTLP
    /// is off.
    pub otlp_endpoint: String,
    /// `service.name` of exported spans.
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            log_format: LogFormat::Text,
            log_filter: "info".into(),
            otlp_endpoint: String::new(),
            service_name: "structured-sink".into(),
        }
    }
}

/// Process lifecycle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceConfig {
    /// How long a graceful shutdown may take (drain input, close streams, flush) before the
    /// process exits anyway.
    pub shutdown_timeout_ms: u64,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig { shutdown_timeout_ms: 10_000 }
    }
}

impl Config {
    /// Loads defaults, then `file` (when given), then the environment, then `overrides`
    /// (`section.key=value`, the value in TOML syntax, or a bare string), and validates.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<Config, ConfigError> {
        Self::figment(file, overrides)?.extract::<Config>().map_err(ConfigError::from)?.validated()
    }

    /// The layered figment, before extraction.
    pub fn figment(file: Option<&Path>, overrides: &[String]) -> Result<Figment, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            if !file.exists() {
                return Err(ConfigError::invalid("--config", format!("file {} does not exist", file.display())));
            }
            figment = figment.merge(Toml::file_exact(file));
        }
        let env = Env::prefixed(ENV_PREFIX).split("__");
        figment = figment.merge(env.clone().ignore(&VERBATIM_KEYS));
        for (key, value) in env.only(&VERBATIM_KEYS).iter() {
            figment = figment.merge(Serialized::global(key.as_str(), value));
        }
        for (index, item) in overrides.iter().enumerate() {
            // Not echoed: it may be a secret typed with the wrong separator.
            let (key, value) = item.split_once('=').ok_or_else(|| {
                ConfigError::invalid("--set", format!("argument {} is not section.key=value", index + 1))
            })?;
            let key = key.trim();
            // The value is TOML (`42`, `true`, `"x"`, `["a", "b"]`), or else a bare string; a
            // secret is a TOML string or else exactly as written.
            let value =
                match toml::from_str::<toml::Table>(&format!("v = {value}")).ok().and_then(|mut t| t.remove("v")) {
                    Some(v @ toml::Value::String(_)) => v,
                    Some(v) if !VERBATIM_KEYS.contains(&key) => v,
                    _ => toml::Value::String(value.to_owned()),
                };
            figment = figment.merge(Serialized::global(key, value));
        }
        Ok(figment)
    }

    /// Checks ranges and cross-field rules that serde cannot express.
    pub fn validated(self) -> Result<Config, ConfigError> {
        self.nats.validate().map_err(|e| ConfigError::invalid("nats", e.to_string()))?;
        if self.input.subjects.is_empty() {
            return Err(ConfigError::invalid("input.subjects", "at least one subject is required"));
        }
        if self.input.max_event_bytes == 0 {
            return Err(ConfigError::invalid("input.max_event_bytes", "must be greater than 0"));
        }
        let outputs = self.output_patterns();
        for (key, subject) in [
            ("output.subjects.filtered", &self.output.subjects.filtered),
            ("output.subjects.thinking", &self.output.subjects.thinking),
            ("output.subjects.tools", &self.output.subjects.tools),
            ("output.subjects.structured_prefix", &self.output.subjects.structured_prefix),
            ("input.dead_letter_subject", &self.input.dead_letter_subject),
        ] {
            if !is_valid_publish_subject(subject) {
                return Err(ConfigError::invalid(key, format!("{subject:?} is not a valid subject to publish to")));
            }
        }
        if !self.input.pass_through_subject.is_empty() && !is_valid_publish_subject(&self.input.pass_through_subject) {
            return Err(ConfigError::invalid("input.pass_through_subject", "not a valid subject to publish to"));
        }
        for input in self.input_patterns() {
            if let Some(out) = outputs.iter().find(|o| patterns_overlap(&input, o)) {
                return Err(feedback_loop(self.input_key(), &input, &format!("{out:?}")));
            }
        }
        let owned = self.partitions.owned_partitions()?;
        if !self.partitions.owned.is_empty() && self.partitions.replica_count > 0 {
            return Err(ConfigError::invalid(
                "partitions.owned",
                "give partitions.owned or partitions.replica_index and replica_count, not both",
            ));
        }
        // Unpartitioned, every replica applies every event: replicas would publish each output
        // once each. (Several unpartitioned instances on different input subjects are fine: they
        // say nothing of each other here.)
        if self.partitions.mode == PartitionMode::None
            && (self.partitions.replica_count > 1 || !self.partitions.owned.is_empty())
        {
            let (key, what) = match self.partitions.owned.is_empty() {
                true => ("partitions.replica_count", format!("{} replicas", self.partitions.replica_count)),
                false => ("partitions.owned", "owned partitions".to_owned()),
            };
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{what} with partitions.mode = \"none\": every replica would apply every event and \
                     publish every output again; set partitions.mode to \"subject\" or \"filter\""
                ),
            ));
        }
        // A replica that owns nothing would report ready and consume nothing (with pinned_client
        // it stands by for the others' partitions: that is work).
        if self.partitions.mode != PartitionMode::None && owned.is_empty() && !self.jetstream.pinned_client {
            return Err(ConfigError::invalid(
                "partitions.replica_index",
                format!(
                    "{} owns none of the {} partitions (replica_count {}): it would consume nothing",
                    self.partitions.replica_index, self.partitions.count, self.partitions.replica_count
                ),
            ));
        }
        if self.partitions.mode == PartitionMode::Subject && !is_valid_publish_subject(&self.partitions.subject_prefix)
        {
            return Err(ConfigError::invalid("partitions.subject_prefix", "not a valid subject prefix"));
        }
        if self.jetstream.enabled && self.jetstream.stream.is_empty() {
            return Err(ConfigError::invalid("jetstream.stream", "must not be empty"));
        }
        // Outside subject mode each input subject gets a consumer of its own, and consumers run
        // side by side: the events of a message spread over two subjects would reach its shard in
        // no common order, and an earlier one applied after a later one looks like a redelivery
        // (skipped and acknowledged, so lost). One pattern is one consumer, in stream order.
        if self.jetstream.enabled && self.partitions.mode != PartitionMode::Subject && self.input.subjects.len() > 1 {
            return Err(ConfigError::invalid(
                "input.subjects",
                "with jetstream.enabled, give one subject: each would have its own consumer, and a message whose \
                 events span two of them would lose some; one wildcard (`agents.*`, `agents.>`) covers several \
                 subjects in stream order",
            ));
        }
        if self.jetstream.pull_batch == 0 {
            return Err(ConfigError::invalid("jetstream.pull_batch", "must be greater than 0"));
        }
        // Not 0 for "unlimited": the server takes 0 as its own default (1,000), at which a
        // partition's held first events stall delivery; -1 is the server's "no limit".
        if self.jetstream.max_ack_pending == 0 || self.jetstream.max_ack_pending < -1 {
            return Err(ConfigError::invalid(
                "jetstream.max_ack_pending",
                "must be greater than 0 (or -1 for no limit): it must exceed the streams open at once in a \
                 partition plus jetstream.pull_batch",
            ));
        }
        if self.jetstream.pinned_client {
            // Only subject mode has consumers shared by the replicas (one per partition); in the
            // other modes each replica reads everything through a consumer of its own.
            if !self.jetstream.enabled || self.partitions.mode != PartitionMode::Subject {
                return Err(ConfigError::invalid(
                    "jetstream.pinned_client",
                    "needs jetstream.enabled = true and partitions.mode = \"subject\"",
                ));
            }
            // Pulls are renewed every third of the TTL: below a second that is too tight.
            if self.jetstream.pinned_ttl_ms < 1_000 {
                return Err(ConfigError::invalid("jetstream.pinned_ttl_ms", "must be at least 1000"));
            }
            self.partitions.standby_partitions(&self.jetstream.standby)?;
        }
        if self.pipeline.max_capture_bytes == 0 {
            return Err(ConfigError::invalid("pipeline.max_capture_bytes", "must be greater than 0"));
        }
        if let Some(tag) = self.tags.iter().find(|t| t.max_capture_bytes == Some(0)) {
            return Err(ConfigError::invalid(
                "tags.max_capture_bytes",
                format!("must be greater than 0 (tag {:?})", tag.name),
            ));
        }
        if self.schemas.max_depth == 0 {
            return Err(ConfigError::invalid("schemas.max_depth", "must be greater than 0"));
        }
        if self.shards.inbox_capacity == 0 {
            return Err(ConfigError::invalid("shards.inbox_capacity", "must be greater than 0"));
        }
        if self.shards.max_streams == 0 {
            return Err(ConfigError::invalid("shards.max_streams", "must be greater than 0"));
        }
        for (key, value) in [
            ("shards.idle_timeout_ms", self.shards.idle_timeout_ms),
            ("shards.expiry_tick_ms", self.shards.expiry_tick_ms),
            ("service.shutdown_timeout_ms", self.service.shutdown_timeout_ms),
        ] {
            if value == 0 {
                return Err(ConfigError::invalid(key, "must be greater than 0"));
            }
        }
        crate::pipeline::Pipeline::new(self.tag_specs(), self.pipeline_limits())
            .map_err(|e| ConfigError::invalid("tags", e.to_string()))?;
        Ok(self)
    }

    /// Every subject or pattern the service publishes to.
    pub fn output_patterns(&self) -> Vec<String> {
        let mut out = self.output.subjects.patterns();
        out.push(self.input.dead_letter_subject.clone());
        if !self.input.pass_through_subject.is_empty() {
            out.push(self.input.pass_through_subject.clone());
        }
        out
    }

    /// Every subject or pattern the service's input reads: the configured input subjects, or in
    /// subject mode both the subjects producers publish to (`<subject_prefix>.<message_id>`,
    /// which the server maps into the partitions) and the partitioned subjects themselves.
    pub fn input_patterns(&self) -> Vec<String> {
        match self.partitions.mode {
            PartitionMode::Subject => {
                let prefix = &self.partitions.subject_prefix;
                vec![format!("{prefix}.*"), format!("{prefix}.p.*.*")]
            }
            PartitionMode::None | PartitionMode::Filter => self.input.subjects.clone(),
        }
    }

    /// The key that sets [`Config::input_patterns`], for errors.
    fn input_key(&self) -> &'static str {
        match self.partitions.mode {
            PartitionMode::Subject => "partitions.subject_prefix",
            PartitionMode::None | PartitionMode::Filter => "input.subjects",
        }
    }

    /// Refuses a block type whose declared subject the input would read back. Declared subjects
    /// are known only once the schemas are loaded, after [`Config::validated`].
    fn check_block_subjects(&self, registry: &SchemaRegistry) -> Result<(), ConfigError> {
        let inputs = self.input_patterns();
        for block in registry.block_types() {
            let Some(subject) = block.subject() else { continue };
            if let Some(input) = inputs.iter().find(|i| patterns_overlap(i, subject)) {
                let output = format!("{subject:?} (declared for block {})", block.tag());
                return Err(feedback_loop(self.input_key(), input, &output));
            }
        }
        Ok(())
    }

    /// The core's limits. `geppetto-json` output needs the cumulative text on every message (its
    /// `completion` field), so that format forces `cumulative_text = "every"`.
    pub fn pipeline_limits(&self) -> PipelineLimits {
        let mut limits = self.pipeline.limits();
        if self.output.format == OutputFormat::GeppettoJson {
            limits.cumulative_text = CumulativeText::Every;
        }
        limits
    }

    /// How visible text is encoded.
    pub fn text_encoding(&self) -> TextEncoding {
        match self.output.format {
            OutputFormat::Protobuf => TextEncoding::Protobuf,
            OutputFormat::GeppettoJson => TextEncoding::GeppettoJson,
        }
    }

    /// The core's view of the configured tags (without declared block types).
    pub fn tag_specs(&self) -> Vec<TagSpec> {
        self.tags.iter().map(TagConfig::spec).collect()
    }

    /// Loads the block types declared in `schemas.dirs` (and the built-in ones).
    pub fn load_schemas(&self) -> Result<SchemaRegistry, ConfigError> {
        SchemaRegistry::load(&self.schemas.dirs)
            .map(|registry| registry.with_max_depth(self.schemas.max_depth))
            .map_err(|e| ConfigError::invalid("schemas.dirs", e.to_string()))
    }

    /// The configured tags plus every declared block type not configured explicitly.
    pub fn tag_specs_with(&self, registry: &SchemaRegistry) -> Vec<TagSpec> {
        let mut specs = self.tag_specs();
        for tag in registry.tags() {
            if !specs.iter().any(|s| s.name == tag) {
                specs.push(TagSpec::new(tag, TagKind::Block));
            }
        }
        specs
    }

    /// The limits of each shard's stream table: the per-replica bounds shared by the shards (each
    /// stream lives in one shard), `max_streams` at least one per shard, a `finished_memory` of 0
    /// still 0 (nothing remembered).
    pub fn table_limits(&self) -> TableLimits {
        let shards = self.shard_count();
        TableLimits {
            idle_timeout: std::time::Duration::from_millis(self.shards.idle_timeout_ms),
            max_streams: (self.shards.max_streams / shards).max(1),
            finished_memory: self.shards.finished_memory.div_ceil(shards),
        }
    }

    /// The pipeline and encoder this configuration describes: the one place both the service and
    /// `replay` build them, so they cannot drift apart.
    pub fn processing(&self, registry: &SchemaRegistry) -> Result<(Pipeline, OutputEncoder), ConfigError> {
        self.check_block_subjects(registry)?;
        let pipeline = Pipeline::new(self.tag_specs_with(registry), self.pipeline_limits())
            .map_err(|e| ConfigError::invalid("tags", e.to_string()))?;
        let encoder = OutputEncoder::with_text_encoding(&pipeline, &self.output.subjects, self.text_encoding())
            .with_schemas(&pipeline, registry);
        Ok((pipeline, encoder))
    }

    /// The effective number of shard workers.
    pub fn shard_count(&self) -> usize {
        match self.shards.count {
            // The dispatcher decodes every event and the connection task writes every output: a
            // worker per CPU leaves them competing with the workers, and every event then wakes a
            // worker parked on another CPU. On 2 CPUs one worker costs 10 to 22% less CPU per
            // event than two, for the same instructions (BENCHMARKS.md, fourth session).
            0 => std::thread::available_parallelism().map_or(1, |n| usize::from(n).saturating_sub(1).max(1)),
            n => n,
        }
    }

    /// What this configuration amounts to on this machine, as TOML comments for `structured-sink
    /// config` to print after [`Config::to_masked_toml`]: the shard count `0` leaves to the
    /// service, the per-shard bounds, the partitions owned, and every registered tag, block types
    /// declared in `schemas.dirs` included. Checks what start-up checks beyond loading (schemas
    /// that load, block subjects), so a configuration `serve` would refuse fails here too.
    pub fn effective(&self) -> Result<String, ConfigError> {
        let registry = self.load_schemas()?;
        let (pipeline, _) = self.processing(&registry)?;
        let limits = self.table_limits();
        let mut out = String::from("\n# Effective on this machine (derived from the settings above):\n");
        let chosen = if self.shards.count == 0 { " (0: one per CPU less one, at least one)" } else { "" };
        out.push_str(&format!("# shards.count = {}{chosen}\n", self.shard_count()));
        out.push_str(&format!(
            "# per shard: max_streams = {}, finished_memory = {}\n",
            limits.max_streams, limits.finished_memory
        ));
        match self.partitions.mode {
            PartitionMode::None => out.push_str("# partitions: none (mode \"none\": this replica takes every event)\n"),
            _ => {
                let owned = self.partitions.owned_partitions()?;
                let list = owned.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
                out.push_str(&format!("# partitions owned ({} of {}): {list}\n", owned.len(), self.partitions.count));
            }
        }
        // Kinds as the configuration spells them (`TagKind`'s serde names).
        let kind = |kind: TagKind| serde_json::to_value(kind).ok().and_then(|v| v.as_str().map(str::to_owned));
        let tags: Vec<String> = pipeline
            .tags()
            .iter()
            .map(|t| format!("{} ({})", t.spec.name, kind(t.spec.kind).unwrap_or_default()))
            .collect();
        out.push_str(&format!("# tags: {}\n", tags.join(", ")));
        Ok(out)
    }

    /// This configuration as TOML, with secrets masked, for `structured-sink config`.
    pub fn to_masked_toml(&self) -> String {
        let mut masked = self.clone();
        masked.nats = self.nats.masked();
        toml::to_string_pretty(&masked).unwrap_or_else(|e| format!("# cannot print the configuration: {e}\n"))
    }
}

#[cfg(test)]
// figment's `Jail` closures return its own (large) error type.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use figment::Jail;

    #[test]
    fn defaults_are_valid() {
        Jail::expect_with(|_| {
            let c = Config::load(None, &[]).unwrap();
            assert_eq!(c.input.subjects, vec!["chat".to_owned()]);
            assert_eq!(c.pipeline.max_capture_bytes, 1 << 20);
            assert_eq!(c.tags.len(), 3);
            let cpus = std::thread::available_parallelism().map_or(1, usize::from);
            assert_eq!(c.shard_count(), (cpus - 1).max(1), "one worker per CPU less one, at least one");
            Ok(())
        });
    }

    #[test]
    fn file_then_env_then_flags() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "c.toml",
                r#"
                [pipeline]
                malformed = "restore"
                max_capture_bytes = 100
                unescape_text = true

                [[tags]]
                name = "core:x:v1"
                kind = "block"
                [[tags]]
                name = "thinking"
                kind = "channel"
                "#,
            )?;
            jail.set_env("STRUCTURED_SINK__PIPELINE__MAX_CAPTURE_BYTES", "200");
            jail.set_env("STRUCTURED_SINK__SHARDS__COUNT", "3");
            let c = Config::load(Some(Path::new("c.toml")), &["shards.count=5".into()]).unwrap();
            assert_eq!(c.pipeline.malformed, MalformedPolicy::Restore);
            assert!(c.pipeline.unescape_text);
            assert_eq!(c.pipeline.max_capture_bytes, 200, "env beats file");
            assert_eq!(c.shards.count, 5, "flags beat env");
            assert_eq!(c.tags.len(), 2, "a tag list replaces the defaults");
            Ok(())
        });
    }

    #[test]
    fn unknown_keys_are_named() {
        Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[pipeline]\nmax_capture_byte = 5\n")?;
            let err = Config::load(Some(Path::new("c.toml")), &[]).unwrap_err().to_string();
            assert!(err.contains("max_capture_byte"), "{err}");
            jail.create_file("d.toml", "[pipelin]\nx = 1\n")?;
            let err = Config::load(Some(Path::new("d.toml")), &[]).unwrap_err().to_string();
            assert!(err.contains("pipelin"), "{err}");
            jail.set_env("STRUCTURED_SINK__SHARDS__BOGUS", "1");
            let err = Config::load(None, &[]).unwrap_err().to_string();
            assert!(err.contains("bogus"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn invalid_values_are_named() {
        Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[pipeline]\nmalformed = \"keep\"\n")?;
            let err = Config::load(Some(Path::new("c.toml")), &[]).unwrap_err().to_string();
            assert!(err.contains("malformed"), "{err}");
            jail.create_file("d.toml", "[[tags]]\nname = \"a:b\"\nkind = \"block\"\n")?;
            let err = Config::load(Some(Path::new("d.toml")), &[]).unwrap_err().to_string();
            assert!(err.contains("tags") && err.contains("a:b"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn values_that_would_misbehave_later_are_refused_by_key() {
        // In a jail: other tests set environment variables the load would read.
        Jail::expect_with(|_| {
            let refused = |flags: &[&str]| {
                let flags: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
                Config::load(None, &flags).unwrap_err().to_string()
            };
            for (flags, key) in [
                (&["jetstream.max_ack_pending=0"][..], "jetstream.max_ack_pending"),
                (&["jetstream.max_ack_pending=-2"], "jetstream.max_ack_pending"),
                (&["service.shutdown_timeout_ms=0"], "service.shutdown_timeout_ms"),
                (&["shards.expiry_tick_ms=0"], "shards.expiry_tick_ms"),
                (&["shards.idle_timeout_ms=0"], "shards.idle_timeout_ms"),
                (
                    &[
                        "partitions.mode=\"filter\"",
                        "partitions.count=4",
                        "partitions.replica_count=5",
                        "partitions.replica_index=4",
                    ],
                    "partitions.replica_index",
                ),
                (&["partitions.owned=[\"1\"]", "partitions.replica_count=2"], "partitions.owned"),
                (&["partitions.replica_count=2"], "partitions.replica_count"),
                (&["partitions.owned=[\"1\"]"], "partitions.owned"),
            ] {
                let err = refused(flags);
                assert!(err.contains(&format!("`{key}`")), "{flags:?}: {err}");
            }
            assert!(Config::load(None, &["jetstream.max_ack_pending=-1".into()]).is_ok(), "-1: no limit");
            // A replica owning nothing may stand by for the others' partitions.
            let standby = [
                "partitions.mode=\"subject\"",
                "partitions.count=1",
                "partitions.replica_count=2",
                "partitions.replica_index=1",
                "jetstream.enabled=true",
                "jetstream.pinned_client=true",
            ];
            let standby: Vec<String> = standby.iter().map(|f| (*f).to_owned()).collect();
            Config::load(None, &standby).unwrap();
            Ok(())
        });
    }

    #[test]
    fn partitions_are_owned_by_ranges_or_by_replica_index() {
        let p = |owned: &[&str], index, count| PartitionConfig {
            count: 8,
            owned: owned.iter().map(|s| (*s).to_owned()).collect(),
            replica_index: index,
            replica_count: count,
            ..PartitionConfig::default()
        };
        assert_eq!(p(&["0-2", "5", "2"], 0, 0).owned_partitions().unwrap(), vec![0, 1, 2, 5]);
        assert_eq!(p(&[], 1, 3).owned_partitions().unwrap(), vec![1, 4, 7]);
        assert_eq!(p(&[], 0, 0).owned_partitions().unwrap(), (0..8).collect::<Vec<_>>());
        for bad in [p(&["8"], 0, 0), p(&["3-1"], 0, 0), p(&["x"], 0, 0), p(&[], 3, 3)] {
            let err = bad.owned_partitions().unwrap_err().to_string();
            assert!(err.contains("partitions."), "{err}");
        }
    }

    #[test]
    fn standby_partitions_exclude_the_owned_ones() {
        let p = PartitionConfig { count: 8, replica_index: 1, replica_count: 2, ..PartitionConfig::default() };
        assert_eq!(p.standby_partitions(&[]).unwrap(), vec![0, 2, 4, 6]);
        assert_eq!(p.standby_partitions(&["0-3".into()]).unwrap(), vec![0, 2]);
        let err = p.standby_partitions(&["9".into()]).unwrap_err().to_string();
        assert!(err.contains("jetstream.standby"), "{err}");
    }

    #[test]
    fn pinned_client_needs_jetstream_subject_mode_and_a_sane_ttl() {
        let config = |mode: PartitionMode, enabled: bool, ttl: u64| {
            let mut c = Config::default();
            c.partitions.mode = mode;
            c.jetstream.enabled = enabled;
            c.jetstream.pinned_client = true;
            c.jetstream.pinned_ttl_ms = ttl;
            c.validated()
        };
        assert!(config(PartitionMode::Subject, true, 30_000).is_ok());
        for (mode, enabled, ttl, key) in [
            (PartitionMode::Filter, true, 30_000, "jetstream.pinned_client"),
            (PartitionMode::None, true, 30_000, "jetstream.pinned_client"),
            (PartitionMode::Subject, false, 30_000, "jetstream.pinned_client"),
            (PartitionMode::Subject, true, 999, "jetstream.pinned_ttl_ms"),
        ] {
            let err = config(mode, enabled, ttl).unwrap_err().to_string();
            assert!(err.contains(key), "{mode:?} {enabled} {ttl}: {err}");
        }
    }

    #[test]
    fn per_replica_bounds_are_shared_by_the_shards() {
        let mut config = Config::default();
        config.shards.count = 3;
        config.shards.max_streams = 100;
        config.shards.finished_memory = 10;
        let limits = config.table_limits();
        assert_eq!((limits.max_streams, limits.finished_memory), (33, 4));
        config.shards.max_streams = 2;
        config.shards.finished_memory = 0;
        let limits = config.table_limits();
        assert_eq!((limits.max_streams, limits.finished_memory), (1, 0), "one stream per shard at least");
    }

    #[test]
    fn jetstream_input_reads_one_subject_outside_subject_mode() {
        Jail::expect_with(|_| {
            let two = "input.subjects=[\"agents.a\", \"agents.b\"]".to_owned();
            assert!(Config::load(None, std::slice::from_ref(&two)).is_ok(), "core NATS may subscribe to several");
            let err = Config::load(None, &[two.clone(), "jetstream.enabled=true".into()]).unwrap_err().to_string();
            assert!(err.contains("input.subjects") && err.contains("one wildcard"), "{err}");
            let one = "input.subjects=[\"agents.*\"]".to_owned();
            assert!(Config::load(None, &[one, "jetstream.enabled=true".into()]).is_ok());
            Ok(())
        });
    }

    #[test]
    fn feedback_loops_are_refused() {
        Jail::expect_with(|_| {
            for input in ["chat.>", ">", "chat.filtered", "*.tools", "chat.structured.*.*.*"] {
                let err = Config::load(None, &[format!("input.subjects=[\"{input}\"]")]).unwrap_err().to_string();
                assert!(err.contains("input.subjects") && err.contains("feedback"), "{input}: {err}");
            }
            assert!(Config::load(None, &["input.subjects=[\"chat.raw.*\"]".into()]).is_ok());
            Ok(())
        });
    }

    #[test]
    fn a_tag_capture_limit_of_zero_is_refused() {
        Jail::expect_with(|jail| {
            jail.create_file("t.toml", "[[tags]]\nname = \"a:b:v1\"\nkind = \"block\"\nmax_capture_bytes = 0\n")?;
            let err = Config::load(Some(Path::new("t.toml")), &[]).unwrap_err().to_string();
            assert!(err.contains("tags.max_capture_bytes") && err.contains("a:b:v1"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn a_set_without_equals_is_refused_without_echoing_it() {
        Jail::expect_with(|_| {
            let err = Config::load(None, &["pipeline.malformed=\"drop\"".into(), "nats.password:hunter2".into()])
                .unwrap_err()
                .to_string();
            assert!(err.contains("--set") && err.contains("argument 2"), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn subject_mode_refuses_outputs_its_producers_subjects_would_carry_back() {
        Jail::expect_with(|_| {
            let subject_mode = |prefix: &str, filtered: &str| {
                Config::load(
                    None,
                    &[
                        "partitions.mode=\"subject\"".into(),
                        format!("partitions.subject_prefix=\"{prefix}\""),
                        format!("output.subjects.filtered=\"{filtered}\""),
                    ],
                )
            };
            // `chat.raw.filtered` is a producer subject the server maps into a partition; the
            // second is a partition subject itself.
            for (prefix, filtered) in [("chat.raw", "chat.raw.filtered"), ("chat.raw", "chat.raw.p.0.x")] {
                let err = subject_mode(prefix, filtered).unwrap_err().to_string();
                assert!(err.contains("partitions.subject_prefix") && err.contains("feedback"), "{filtered}: {err}");
            }
            // The unused `input.subjects` no longer decides: `chat` is its default, and a filtered
            // subject under it is fine when the input is `chat.raw.*`.
            assert!(subject_mode("chat.raw", "chat.filtered.out").is_ok());
            assert!(
                Config::load(None, &["output.subjects.filtered=\"chat\"".into()]).is_err(),
                "none mode reads `chat`"
            );
            Ok(())
        });
    }

    #[test]
    fn a_block_subject_declared_in_a_proto_file_is_refused_when_the_input_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mode.proto");
        std::fs::write(
            &file,
            "syntax = \"proto3\";\npackage myapp.v1;\nimport \"structuredsink/v1/options.proto\";\n\
             message ModeSwitch {\n  option (structuredsink.v1.block) = { tag: \"myapp:ModeSwitch:v1\", subject: \"agents.modes\" };\n  string new_mode = 1;\n}\n",
        )
        .unwrap();
        let dirs = format!("schemas.dirs=[{:?}]", dir.path().display().to_string());
        let processing = |inputs: &str| {
            let config = Config::load(None, &[dirs.clone(), format!("input.subjects={inputs}")]).unwrap();
            config.processing(&config.load_schemas().unwrap()).map(|_| ())
        };
        // In a jail: other tests set environment variables that `Config::load` reads.
        Jail::expect_with(|_| {
            let err = processing("[\"chat\", \"agents.*\"]").unwrap_err().to_string();
            assert!(err.contains("input.subjects") && err.contains("feedback"), "{err}");
            assert!(
                err.contains("agents.modes") && err.contains("myapp:ModeSwitch:v1"),
                "names the subject and block: {err}"
            );
            assert!(processing("[\"chat\", \"agents.raw\"]").is_ok());
            Ok(())
        });
    }

    #[test]
    fn numeric_and_boolean_secrets_from_the_environment_are_strings() {
        Jail::expect_with(|jail| {
            jail.set_env("STRUCTURED_SINK__NATS__TOKEN", "12345");
            jail.set_env("STRUCTURED_SINK__NATS__USER", "true");
            let err = Config::load(None, &[]).unwrap_err().to_string();
            // Both kinds at once are refused, which proves both were read as strings.
            assert!(err.contains("nats"), "{err}");
            jail.clear_env();
            jail.set_env("STRUCTURED_SINK__NATS__TOKEN", "12345");
            assert_eq!(Config::load(None, &[]).unwrap().nats.token.as_deref(), Some("12345"));
            Ok(())
        });
    }

    #[test]
    fn secrets_from_the_environment_and_flags_are_taken_as_written() {
        Jail::expect_with(|jail| {
            // Each would be retyped by the environment's TOML-like parsing: a number losing its
            // leading zeros or trailing zero, a quoted string its quotes, a list failing to load.
            for (key, text) in [
                ("TOKEN", "0042"),
                ("PASSWORD", "1.50"),
                ("TOKEN", "\"quoted\""),
                ("TOKEN", "[abc]"),
                ("TOKEN", "{a=1}"),
                ("PASSWORD", "-7"),
            ] {
                jail.clear_env();
                jail.set_env(format!("STRUCTURED_SINK__NATS__{key}"), text);
                if key == "PASSWORD" {
                    jail.set_env("STRUCTURED_SINK__NATS__USER", "007");
                }
                let nats = Config::load(None, &[]).map_err(|e| format!("{key}={text}: {e}"))?.nats;
                let read = match key {
                    "TOKEN" => nats.token,
                    _ => {
                        assert_eq!(nats.user.as_deref(), Some("007"));
                        nats.password
                    }
                };
                assert_eq!(read.as_deref(), Some(text), "{key}");
            }
            jail.clear_env();
            // Flags: a TOML string is unquoted, anything else is taken as written.
            for (flag, expected) in
                [("nats.token=0042", "0042"), ("nats.token=1.50", "1.50"), ("nats.token=\"a b\"", "a b")]
            {
                let nats = Config::load(None, &[flag.into()]).map_err(|e| format!("{flag}: {e}"))?.nats;
                assert_eq!(nats.token.as_deref(), Some(expected), "{flag}");
            }
            Ok(())
        });
    }

    #[test]
    fn one_server_url_may_be_a_string_and_load_errors_mask_nats_values() {
        Jail::expect_with(|jail| {
            jail.set_env("STRUCTURED_SINK__NATS__SERVERS", "nats://sink:hunter2@nats:4222");
            let servers = Config::load(None, &[]).map_err(|e| e.to_string())?.nats.servers;
            assert_eq!(servers, ["nats://sink:hunter2@nats:4222"]);
            jail.clear_env();
            // A value of the wrong type is quoted by figment's message, masked in the nats section.
            for (flag, shown) in
                [("nats.tls=nats://sink:hunter2@nats:4222", "\"***\""), ("input.subjects=hunter2", "hunter2")]
            {
                let err = Config::load(None, &[flag.into()]).unwrap_err().to_string();
                assert!(err.contains(shown), "{flag}: {err}");
                assert_eq!(err.contains("hunter2"), !flag.starts_with("nats."), "{flag}: {err}");
            }
            Ok(())
        });
    }

    #[test]
    fn printed_config_masks_secrets_and_reloads() {
        Jail::expect_with(|jail| {
            jail.set_env("STRUCTURED_SINK__NATS__TOKEN", "s3cr3t-token");
            let c = Config::load(None, &[]).unwrap();
            let printed = c.to_masked_toml();
            assert!(!printed.contains("s3cr3t-token"), "{printed}");
            assert!(printed.contains("[pipeline]"));
            jail.clear_env();
            jail.create_file("printed.toml", &printed)?;
            let reloaded = Config::load(Some(Path::new("printed.toml")), &[]).unwrap();
            assert_eq!(reloaded.pipeline, c.pipeline);
            assert_eq!(reloaded.tags, c.tags);
            Ok(())
        });
    }
}
