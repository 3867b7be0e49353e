//! Logs and traces: the process-wide `tracing` subscriber, the optional OTLP span exporter, and
//! W3C trace context propagation through message headers.
//!
//! [`init`] installs, once per process, a subscriber that filters with an env-filter
//! (`RUST_LOG` wins over `telemetry.log_filter`), writes logs to stderr as text or JSON, and, when
//! `telemetry.otlp_endpoint` is set, exports spans over OTLP/HTTP (protobuf) through a batch
//! processor, bridged from `tracing` by `tracing-opentelemetry`. Exporters are switched by
//! configuration, not by cargo features. [`TelemetryGuard::shutdown`] flushes the exporter and
//! is the last step of a graceful shutdown.
//!
//! [`inject_context`], [`extract_context`] and [`set_remote_parent`] carry the `traceparent` and
//! `tracestate` headers through closures, so this module knows nothing of NATS or async-nats
//! types. It does not decide what is logged or which spans exist (no payload text may be put in
//! either; that is the callers' rule), and it knows nothing of metrics.

use std::collections::HashMap;
use std::io::IsTerminal as _;
use std::time::Duration;

use opentelemetry::propagation::{Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::{Layered, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::{LogFormat, TelemetryConfig};

/// The headers of W3C trace context, in the order they are written.
pub const TRACE_CONTEXT_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// The path OTLP/HTTP collectors accept spans on, appended to `telemetry.otlp_endpoint`.
const OTLP_TRACES_PATH: &str = "/v1/traces";

/// How long [`TelemetryGuard::shutdown`] waits for the exporter to flush.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Targets whose spans and events never reach the OpenTelemetry layer: the exporter's own
/// machinery, which would otherwise trace its own exports.
const EXPORTER_TARGETS: [&str; 5] = ["opentelemetry", "hyper", "reqwest", "h2", "tower"];

/// Why telemetry could not be set up or shut down.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A log filter does not parse.
    #[error("invalid log filter in {origin}: {reason}")]
    InvalidFilter {
        /// `RUST_LOG` or `telemetry.log_filter`.
        origin: &'static str,
        /// The parser's message.
        reason: String,
    },
    /// `telemetry.otlp_endpoint` is not an `http://` or `https://` URL. The value is not repeated
    /// because URLs may carry credentials.
    #[error("configuration key `telemetry.otlp_endpoint`: {reason}")]
    InvalidEndpoint {
        /// What is wrong with it.
        reason: String,
    },
    /// The OTLP span exporter could not be built.
    #[error("building the OTLP span exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// A global `tracing` subscriber (or `log` logger) is already installed: [`init`] was called
    /// twice, or something else installed one first.
    #[error("a global tracing subscriber is already installed")]
    AlreadyInitialized,
    /// The tracer provider reported an error while flushing or shutting down (spans may be lost).
    #[error("shutting down the tracer provider: {0}")]
    Shutdown(opentelemetry_sdk::error::OTelSdkError),
}

/// Keeps the tracer provider of [`init`]; call [`TelemetryGuard::shutdown`] last during shutdown
/// so buffered spans are exported. Dropping the guard without calling it shuts down the same way
/// (ignoring errors).
#[derive(Debug)]
#[must_use = "dropping the guard shuts the span exporter down"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether spans are exported over OTLP (`telemetry.otlp_endpoint` was set).
    pub fn exports_traces(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes buffered spans and shuts the exporter down, waiting at most
    /// [`DEFAULT_SHUTDOWN_TIMEOUT`]. See [`TelemetryGuard::shutdown_with_timeout`].
    pub fn shutdown(self) -> Result<(), TelemetryError> {
        self.shutdown_with_timeout(DEFAULT_SHUTDOWN_TIMEOUT)
    }

    /// Flushes buffered spans and shuts the exporter down, waiting at most `timeout`. This blocks
    /// the calling thread (the export runs on the batch processor's own thread); from async code
    /// call it last, or inside `spawn_blocking`. Spans ended afterwards are dropped. Without an
    /// OTLP endpoint it returns at once.
    pub fn shutdown_with_timeout(mut self, timeout: Duration) -> Result<(), TelemetryError> {
        match self.provider.take() {
            Some(provider) => provider.shutdown_with_timeout(timeout).map_err(TelemetryError::Shutdown),
            None => Ok(()),
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Best effort: the guard is dropped on an early return, where nobody can act on it.
            let _ = provider.shutdown_with_timeout(DEFAULT_SHUTDOWN_TIMEOUT);
        }
    }
}

/// The subscriber type the layers are stacked on.
type Base = Layered<EnvFilter, Registry>;
type BoxedLayer = Box<dyn Layer<Base> + Send + Sync + 'static>;

/// Installs the process-wide subscriber described by `cfg` (see the module documentation).
///
/// Call it once, early in `main`, inside or outside a tokio runtime. A second call, or a call
/// after something else installed a global subscriber, returns
/// [`TelemetryError::AlreadyInitialized`] and changes nothing. Tests should not call it; they use
/// `tracing::subscriber::with_default` with a local subscriber instead.
pub fn init(cfg: &TelemetryConfig) -> Result<TelemetryGuard, TelemetryError> {
    let filter = env_filter(&cfg.log_filter, std::env::var("RUST_LOG").ok().as_deref())?;
    let provider = tracer_provider(cfg)?;

    let fmt_layer: BoxedLayer = match cfg.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            // Colours only for a person at a terminal, not in collected container logs.
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(payload_guard())
            .boxed(),
        LogFormat::Json => {
            tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).with_filter(payload_guard()).boxed()
        }
    };
    let mut layers = vec![fmt_layer];
    if let Some(provider) = &provider {
        let tracer = provider.tracer(env!("CARGO_PKG_NAME"));
        let exporter_targets =
            EXPORTER_TARGETS.iter().fold(Targets::new().with_default(LevelFilter::TRACE), |targets, target| {
                targets.with_target(*target, LevelFilter::OFF)
            });
        layers.push(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(exporter_targets).boxed());
    }

    let installed = tracing_subscriber::registry().with(filter).with(layers).try_init();
    if installed.is_err() {
        if let Some(provider) = provider {
            let _ = provider.shutdown_with_timeout(DEFAULT_SHUTDOWN_TIMEOUT);
        }
        return Err(TelemetryError::AlreadyInitialized);
    }
    Ok(TelemetryGuard { provider })
}

/// Libraries whose low-level events print secrets or payloads: async-nats logs every protocol
/// operation with its bytes at TRACE, and each server address it tries at DEBUG with the
/// address's `Debug` form, which spells out a password written in the URL. They are capped at
/// INFO whatever `RUST_LOG` or `telemetry.log_filter` say, so that neither reaches a log line.
const PAYLOAD_TARGETS: &[&str] = &["async_nats"];

/// The log layer's filter that applies [`PAYLOAD_TARGETS`].
fn payload_guard() -> Targets {
    PAYLOAD_TARGETS.iter().fold(Targets::new().with_default(LevelFilter::TRACE), |targets, target| {
        targets.with_target(*target, LevelFilter::INFO)
    })
}

/// The env-filter: `rust_log` (the value of `RUST_LOG`) when set and not blank, else
/// `log_filter`.
fn env_filter(log_filter: &str, rust_log: Option<&str>) -> Result<EnvFilter, TelemetryError> {
    let (origin, directives) = match rust_log.filter(|value| !value.trim().is_empty()) {
        Some(value) => ("RUST_LOG", value),
        None => ("telemetry.log_filter", log_filter),
    };
    EnvFilter::try_new(directives).map_err(|error| TelemetryError::InvalidFilter { origin, reason: error.to_string() })
}

/// The tracer provider exporting to `cfg.otlp_endpoint`, or `None` (and no exporter at all) when
/// the endpoint is empty.
fn tracer_provider(cfg: &TelemetryConfig) -> Result<Option<SdkTracerProvider>, TelemetryError> {
    let Some(endpoint) = traces_endpoint(&cfg.otlp_endpoint)? else {
        return Ok(None);
    };
    install_tls_provider();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .build()?;
    let resource = Resource::builder()
        .with_service_name(cfg.service_name.clone())
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let provider = SdkTracerProvider::builder().with_resource(resource).with_batch_exporter(exporter).build();
    Ok(Some(provider))
}

/// Makes ring rustls' process-wide crypto provider. The exporter's HTTP client (reqwest with
/// rustls and no provider of its own) takes its TLS crypto from there, and cannot even be built
/// without one, whatever the endpoint's scheme; ring is the provider this build already carries
/// for the bus's TLS. Installing fails only when a provider is already installed, and that one
/// serves as well.
fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The full traces URL for a configured collector address: `http://collector:4318` becomes
/// `http://collector:4318/v1/traces` (as `OTEL_EXPORTER_OTLP_ENDPOINT` is read); a URL that
/// already ends in `/v1/traces` is kept. `None` when the setting is empty.
fn traces_endpoint(configured: &str) -> Result<Option<String>, TelemetryError> {
    let configured = configured.trim();
    if configured.is_empty() {
        return Ok(None);
    }
    let Some((scheme, rest)) = configured.split_once("://") else {
        return Err(TelemetryError::InvalidEndpoint { reason: "expected a URL such as http://collector:4318".into() });
    };
    if !matches!(scheme, "http" | "https") {
        return Err(TelemetryError::InvalidEndpoint { reason: "the scheme must be http or https (OTLP/HTTP)".into() });
    }
    if rest.is_empty() || rest.starts_with('/') {
        return Err(TelemetryError::InvalidEndpoint { reason: "the URL has no host".into() });
    }
    if configured.ends_with(OTLP_TRACES_PATH) {
        return Ok(Some(configured.to_owned()));
    }
    Ok(Some(format!("{}{OTLP_TRACES_PATH}", configured.trim_end_matches('/'))))
}

/// Adapts a closure to OpenTelemetry's [`Injector`].
struct FnInjector<F>(F);

impl<F: FnMut(&str, String)> Injector for FnInjector<F> {
    fn set(&mut self, key: &str, value: String) {
        (self.0)(key, value);
    }
}

/// Writes `span`'s W3C trace context through `set` (`traceparent`, and `tracestate` when the
/// trace has one), for the headers of an outgoing message.
///
/// Returns `false` and writes nothing when the span has no OpenTelemetry context: OTLP export is
/// off (no OpenTelemetry layer is installed) or the span is disabled. A caller that must carry an
/// incoming context over anyway then copies the input's [`TRACE_CONTEXT_HEADERS`] unchanged.
pub fn inject_context(span: &tracing::Span, set: impl FnMut(&str, String)) -> bool {
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return false;
    }
    TraceContextPropagator::new().inject_context(&context, &mut FnInjector(set));
    true
}

/// Reads a W3C trace context from an incoming message's headers. `get` is called with the
/// lowercase names in [`TRACE_CONTEXT_HEADERS`] and returns the header's value when present.
///
/// Missing or malformed headers give a context without a valid span (check with
/// `opentelemetry::trace::TraceContextExt::has_active_span`); [`set_remote_parent`] ignores it.
pub fn extract_context(get: impl Fn(&str) -> Option<String>) -> opentelemetry::Context {
    let propagator = TraceContextPropagator::new();
    let carrier: HashMap<String, String> =
        propagator.fields().filter_map(|field| get(field).map(|value| (field.to_owned(), value))).collect();
    propagator.extract(&carrier)
}

/// Makes the remote span in `parent` (from [`extract_context`]) the parent of `span`, so the
/// stream's span joins the upstream trace. Call it right after creating the span, before it is
/// first entered.
///
/// Returns whether the parent was set: `false` when `parent` holds no valid remote span (the
/// span keeps its local parent), when no OpenTelemetry layer is installed, when the span is
/// disabled, or when it was already entered.
pub fn set_remote_parent(span: &tracing::Span, parent: opentelemetry::Context) -> bool {
    if !parent.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(parent).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceId;

    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const UPSTREAM: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// Runs `f` with a local subscriber bridged to an SDK tracer provider that has no exporter.
    fn with_otel_layer(f: impl FnOnce()) {
        let provider = SdkTracerProvider::builder().build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f);
        let _ = provider.shutdown();
    }

    fn headers(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn inject(span: &tracing::Span) -> (bool, HashMap<String, String>) {
        let mut out = HashMap::new();
        let written = inject_context(span, |key, value| {
            out.insert(key.to_owned(), value);
        });
        (written, out)
    }

    fn trace_id(context: &opentelemetry::Context) -> TraceId {
        context.span().span_context().trace_id()
    }

    #[test]
    fn injection_then_extraction_round_trips_a_root_span() {
        with_otel_layer(|| {
            let span = tracing::info_span!("stream");
            let (written, out) = inject(&span);
            assert!(written);
            assert!(out.contains_key("traceparent"), "{out:?}");
            let extracted = extract_context(|key| out.get(key).cloned());
            assert!(extracted.span().span_context().is_remote());
            assert_eq!(trace_id(&extracted), trace_id(&span.context()));
            assert_ne!(trace_id(&extracted), TraceId::INVALID);
        });
    }

    #[test]
    fn a_remote_parent_carries_the_upstream_trace_to_outputs() {
        with_otel_layer(|| {
            let incoming = headers(&[("traceparent", UPSTREAM), ("tracestate", "vendor=abc")]);
            let parent = extract_context(|key| incoming.get(key).cloned());
            assert_eq!(trace_id(&parent), TraceId::from_hex(TRACE_ID).unwrap());

            let span = tracing::info_span!("stream");
            assert!(set_remote_parent(&span, parent));
            let (written, out) = inject(&span);
            assert!(written);
            let traceparent = &out["traceparent"];
            assert!(traceparent.starts_with(&format!("00-{TRACE_ID}-")), "{traceparent}");
            // Our own span id, not the upstream's.
            assert!(!traceparent.contains("00f067aa0ba902b7"), "{traceparent}");
            assert_eq!(out["tracestate"], "vendor=abc");

            // Too late once the span has been entered.
            let entered = tracing::info_span!("entered");
            entered.in_scope(|| {});
            let again = extract_context(|key| incoming.get(key).cloned());
            assert!(!set_remote_parent(&entered, again));
        });
    }

    #[test]
    fn missing_or_malformed_headers_give_no_parent() {
        with_otel_layer(|| {
            let none = extract_context(|_| None);
            assert!(!none.span().span_context().is_valid());
            let garbage = headers(&[("traceparent", "00-zz-yy-01")]);
            let bad = extract_context(|key| garbage.get(key).cloned());
            assert!(!bad.span().span_context().is_valid());
            let span = tracing::info_span!("stream");
            assert!(!set_remote_parent(&span, bad));
        });
    }

    #[test]
    fn without_an_otel_layer_nothing_is_injected() {
        let subscriber = tracing_subscriber::registry();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("stream");
            let (written, out) = inject(&span);
            assert!(!written);
            assert!(out.is_empty());
            let incoming = headers(&[("traceparent", UPSTREAM)]);
            assert!(!set_remote_parent(&span, extract_context(|key| incoming.get(key).cloned())));
        });
    }

    #[test]
    fn no_endpoint_builds_no_exporter() {
        let cfg = TelemetryConfig::default();
        assert!(cfg.otlp_endpoint.is_empty());
        assert!(tracer_provider(&cfg).unwrap().is_none());
        let blank = TelemetryConfig { otlp_endpoint: "  ".into(), ..TelemetryConfig::default() };
        assert!(tracer_provider(&blank).unwrap().is_none());
    }

    #[test]
    fn an_endpoint_builds_an_exporter_without_connecting() {
        let cfg = TelemetryConfig { otlp_endpoint: "http://127.0.0.1:9".into(), ..TelemetryConfig::default() };
        let provider = tracer_provider(&cfg).unwrap().expect("a provider");
        provider.shutdown_with_timeout(Duration::from_secs(2)).unwrap();
    }

    #[test]
    fn endpoints_get_the_traces_path() {
        assert_eq!(traces_endpoint("").unwrap(), None);
        assert_eq!(traces_endpoint("http://c:4318").unwrap().unwrap(), "http://c:4318/v1/traces");
        assert_eq!(traces_endpoint("https://c:4318/").unwrap().unwrap(), "https://c:4318/v1/traces");
        assert_eq!(traces_endpoint("http://c/otlp").unwrap().unwrap(), "http://c/otlp/v1/traces");
        assert_eq!(traces_endpoint("http://c:4318/v1/traces").unwrap().unwrap(), "http://c:4318/v1/traces");
        for bad in ["collector:4318", "grpc://c:4317", "http://", "http:///x"] {
            let error = traces_endpoint(bad).unwrap_err();
            assert!(matches!(error, TelemetryError::InvalidEndpoint { .. }), "{bad}");
            assert!(error.to_string().contains("telemetry.otlp_endpoint"));
        }
        // The value itself is never echoed (it may hold credentials).
        let error = traces_endpoint("ftp://user:secret@c").unwrap_err();
        assert!(!error.to_string().contains("secret"));
    }

    #[test]
    fn rust_log_wins_over_the_configured_filter() {
        let from_env = env_filter("info", Some("structured_sink=trace")).unwrap();
        assert_eq!(from_env.to_string(), "structured_sink=trace");
        let from_config = env_filter("warn", None).unwrap();
        assert_eq!(from_config.to_string(), "warn");
        assert_eq!(env_filter("warn", Some(" ")).unwrap().to_string(), "warn");

        let error = env_filter("info,=[", None).unwrap_err();
        assert!(error.to_string().contains("telemetry.log_filter"), "{error}");
        let error = env_filter("info", Some("x=notalevel")).unwrap_err();
        assert!(error.to_string().contains("RUST_LOG"), "{error}");
    }

    /// Set in the child process that [`init_installs_once_per_process`] starts.
    const CHILD_ENV: &str = "STRUCTURED_SINK_TELEMETRY_INIT_CHILD";

    /// The real test of [`init`]; it only acts in a child process, because installing a global
    /// subscriber would affect every other test of this binary.
    #[test]
    fn init_child() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        let cfg = TelemetryConfig {
            log_format: LogFormat::Json,
            otlp_endpoint: "http://127.0.0.1:9".into(),
            ..TelemetryConfig::default()
        };
        let guard = init(&cfg).expect("first init");
        assert!(guard.exports_traces());
        tracing::info_span!("stream").in_scope(|| tracing::info!("inside"));
        assert!(matches!(init(&TelemetryConfig::default()), Err(TelemetryError::AlreadyInitialized)));
        // The collector is unreachable: shutdown must still return within its timeout.
        let started = std::time::Instant::now();
        let _ = guard.shutdown_with_timeout(Duration::from_secs(3));
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn init_installs_once_per_process() {
        let module = module_path!().split_once("::").map_or(module_path!(), |(_, rest)| rest);
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &format!("{module}::init_child"), "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "child failed:\n{stdout}\n{stderr}");
        assert!(stdout.contains("1 passed"), "the child ran no test:\n{stdout}");
        // JSON logs go to stderr.
        assert!(stderr.lines().any(|line| line.starts_with('{') && line.contains("\"inside\"")), "{stderr}");
    }
}
