//! The service: the one module that sees everything and wires it together.
//!
//! Start-up: validate configuration, connect to NATS, subscribe to the input subjects (one
//! dispatcher task per subject or partition consumer), start the shards, register with the NATS
//! service API, serve metrics and health. Each dispatcher decodes events (bad ones go to the
//! dead-letter subject from here) and routes the rest by message id to a shard worker, which runs
//! the pipeline and publishes through a [`NatsSink`]; with one input and one shard the dispatcher
//! owns the shard and applies events itself. The input side (sources, partition consumers, pins,
//! dispatchers) lives in `input`, the output side (publishing, acknowledgements, storage
//! confirmations) in `output`; this module starts them and stops them in order.
//!
//! Shutdown, in this order, within `service.shutdown_timeout_ms`: stop input (drain every
//! subscription, dispatching what was already delivered), let shards apply what is queued and
//! close open streams with reason `shutdown`, release held pins (`jetstream.pinned_client`),
//! flush the publisher, stop the service API and the HTTP server. Telemetry is shut down last by
//! the caller. A shutdown that runs out of time stops the dispatchers and workers still running
//! where they are (as a crash would: JetStream delivers what they held again to the next owner),
//! then releases the pins they held, so that a standby need not wait out `pinned_ttl_ms`.

mod input;
mod output;

pub use output::NatsSink;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::header::HeaderValue;
use async_nats::{HeaderMap, HeaderName, Subject};
use bytes::Bytes;
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::bus::{self, round_trip, BusError, ConnectionEvent};
use crate::codec::outbound::payload_bound;
use crate::config::Config;
use crate::http::{self, Readiness};
use crate::metrics::{ConnectionEventKind, Metrics};
use crate::shard::table::StreamTable;
use crate::shard::worker::{Shard, ShardSet, ShardSettings};
use crate::typed::SchemaRegistry;

/// Header naming the protobuf message type of an output.
pub const TYPE_HEADER: &str = "Structured-Sink-Type";
/// Header giving the reason code of a dead-lettered event.
pub const ERROR_HEADER: &str = "Structured-Sink-Error";
/// Header giving a human-readable reason (never payload text) of a dead-lettered event.
pub const ERROR_DETAIL_HEADER: &str = "Structured-Sink-Error-Detail";
/// Header giving the subject a dead-lettered or passed-through event arrived on.
pub const SOURCE_SUBJECT_HEADER: &str = "Structured-Sink-Source-Subject";
/// Header of a dead letter or pass-through event published without its payload, which with the
/// headers would have exceeded the server's `max_payload`: the payload's size in bytes.
pub const PAYLOAD_OMITTED_HEADER: &str = "Structured-Sink-Payload-Omitted";
/// W3C trace context headers carried from input to output.
const TRACE_HEADERS: [HeaderName; 2] = [HeaderName::from_static("traceparent"), HeaderName::from_static("tracestate")];

/// Why the service could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// NATS refused a connection, subscription or registration.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The HTTP listener could not be bound.
    #[error("cannot listen on {address}: {error}")]
    Listen {
        /// The configured address.
        address: String,
        /// The cause.
        error: std::io::Error,
    },
    /// The NATS service API registration failed.
    #[error("cannot register with the NATS service API: {0}")]
    Register(String),
    /// The partition mapping of the server is missing or different.
    #[error("partition mapping: {0}")]
    Mapping(String),
    /// JetStream refused the stream or a consumer.
    #[error("JetStream: {0}")]
    JetStream(String),
    /// `nats.retry_on_initial_connect` waited for a first connection until the client gave up
    /// (`nats.max_reconnects`).
    #[error("no NATS server accepted the connection before nats.max_reconnects ran out")]
    Unreachable,
    /// Shutdown did not finish within the timeout.
    #[error("shutdown did not finish within {0:?}")]
    ShutdownTimeout(Duration),
}

/// A running service.
pub struct RunningService {
    client: async_nats::Client,
    cancel: CancellationToken,
    /// Dispatchers still running: shutdown takes each off once it has ended, so that one that
    /// times out finds here what is left to stop.
    dispatchers: Vec<JoinHandle<()>>,
    /// Pins the partition consumers hold, released at the end of shutdown.
    held_pins: input::HeldPins,
    shards: Option<Arc<ShardSet<Envelope>>>,
    /// The shards once every dispatcher has ended, while they drain at shutdown.
    draining: Option<ShardSet<Envelope>>,
    api: Option<async_nats::service::Service>,
    status: Option<JoinHandle<()>>,
    http: Option<(std::net::SocketAddr, JoinHandle<()>)>,
    http_stop: CancellationToken,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    shutdown_timeout: Duration,
}

/// What a dispatcher hands a worker besides the decoded event: the original message.
pub struct Envelope {
    subject: Subject,
    payload: Bytes,
    headers: Option<HeaderMap>,
    /// The W3C trace context headers of `headers`, found once per event (every output of the
    /// event carries them).
    trace: Vec<(HeaderName, HeaderValue)>,
    received: Instant,
    /// JetStream: where the ack goes.
    ack: Option<Subject>,
    /// JetStream: the stream sequence of the message.
    sequence: Option<u64>,
    /// JetStream: the partition whose consumer delivered it, or whose stream read a recovery
    /// took it from (0 when consumers are not per partition). Open streams keep it, so that a
    /// partition given up gives up exactly the streams its consumer fed.
    partition: u32,
    /// JetStream: delivered before (a redelivery).
    redelivered: bool,
    /// JetStream: a delivery of a message that a recovery has read from the stream and processed
    /// already (see `input::Recovery`). Whatever of it goes out as the input itself (a dead letter,
    /// a pass-through) went out then: the delivery is only acknowledged, or the consumer's
    /// redelivery (after `ack_wait_ms`, beyond a downstream duplicate window) would be published
    /// twice.
    rebuilt: bool,
}

impl RunningService {
    /// Starts the service under `config`.
    pub async fn start(config: Config) -> Result<RunningService, ServiceError> {
        let config = config.validated()?;
        let metrics = Arc::new(Metrics::new(config.shard_count()));
        let readiness = Arc::new(Readiness::new());

        let events = {
            let (metrics, readiness) = (metrics.clone(), readiness.clone());
            move |event: ConnectionEvent| {
                if let Some(kind) = ConnectionEventKind::from_label(event.kind()) {
                    metrics.count_connection_event(kind);
                }
                // Readiness asks the client for its state instead (`follow_connection`): the
                // client drops events when its queue is full.
                if event == ConnectionEvent::Closed {
                    readiness.set_connection_lost();
                }
            }
        };
        // HTTP first: while start-up waits for NATS (`nats.retry_on_initial_connect`), `/healthz`
        // answers and `/readyz` says not ready. A start that fails stops it again (the guard).
        let http_stop = CancellationToken::new();
        let http_guard = http_stop.clone().drop_guard();
        let http = match config.http.enabled {
            true => {
                let (listener, address) = bind(&config.http.listen).await?;
                let stop = http_stop.clone();
                let server = http::serve(listener, metrics.clone(), readiness.clone(), async move {
                    stop.cancelled().await;
                });
                tracing::info!(%address, "serving /metrics, /healthz and /readyz");
                Some((address, tokio::spawn(server)))
            }
            false => None,
        };
        let client = bus::connect(&config.nats, events).await?;
        readiness.follow_connection({
            let client = client.clone();
            move || client.connection_state() == async_nats::connection::State::Connected
        });
        // With `retry_on_initial_connect` the client comes back before any connection exists, and
        // everything below needs one (the server's version and limits, the mapping probe, the
        // consumers): wait for it, as long as the client keeps trying (`nats.max_reconnects`).
        // The server's INFO may land a moment after the state turns connected: until then its
        // version and limits read as defaults (an empty version, a `max_payload` of 0).
        let connected = |client: &async_nats::Client| {
            client.connection_state() == async_nats::connection::State::Connected && client.try_server_info().is_some()
        };
        if !connected(&client) {
            tracing::warn!("waiting for a NATS server to accept the connection");
            while !connected(&client) {
                if !readiness.is_alive() {
                    return Err(ServiceError::Unreachable);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let max_payload = client.server_info().max_payload;
        tracing::info!(
            // Masked: a URL may carry credentials.
            servers = ?config.nats.masked().servers,
            server_version = %client.server_info().version,
            max_payload,
            "connected to NATS"
        );

        let registry = config.load_schemas()?;
        let (pipeline, encoder) = config.processing(&registry)?;
        // An output over the server's limit could never be published, while its input is
        // acknowledged: it goes with its bulk left out instead.
        let mut encoder = encoder.with_max_payload(payload_bound(max_payload));
        if config.jetstream.enabled {
            encoder = output::bound_by_downstream_streams(&client, encoder).await;
        }
        let limits = config.table_limits();
        let cancel = CancellationToken::new();
        let sink_template = NatsSink::new(&client, &metrics, &config, cancel.clone());

        let ownership = Arc::new(input::Ownership::new(&config)?);
        if config.partitions.mode == crate::config::PartitionMode::Subject && config.partitions.verify_mapping {
            input::verify_mapping(&client, &ownership).await?;
        }
        let held_pins = input::HeldPins::default();
        let sources = input::open_sources(&client, &config, &ownership, &held_pins).await?;
        // Everything that can refuse to start does so before any input is consumed: a start that
        // fails must not leave tasks behind that consume (and acknowledge) input, nor a service
        // API that answers for a service that is not there. (Sources consume nothing until their
        // dispatchers run.)
        let (api, status) = register(&client, &metrics, registry).await?;
        let subjects: Vec<String> = sources.iter().map(|(subject, _)| subject.clone()).collect();
        let expiry_tick = Duration::from_millis(config.shards.expiry_tick_ms);
        let close_on_shutdown = !config.jetstream.enabled;
        let table = || StreamTable::new(pipeline.clone(), encoder.clone(), limits);
        // One source and one shard: the dispatcher applies events itself (no hand-off). Otherwise
        // worker tasks, fed by message id from every source.
        let shards = (config.shard_count() > 1 || sources.len() > 1).then(|| {
            let settings = ShardSettings {
                count: config.shard_count(),
                inbox_capacity: config.shards.inbox_capacity,
                expiry_tick,
                close_on_shutdown,
            };
            Arc::new(ShardSet::start(settings, |_| (table(), sink_template.clone())))
        });
        let mut dispatchers = Vec::new();
        for (_, source) in sources {
            let route = match &shards {
                Some(shards) => input::Route::Shards(shards.clone()),
                None => input::Route::Own(Box::new(Shard::new(
                    0,
                    table(),
                    sink_template.clone(),
                    expiry_tick,
                    close_on_shutdown,
                ))),
            };
            let dispatcher = input::Dispatcher {
                source,
                route,
                sink: sink_template.clone(),
                max_event_bytes: config.input.max_event_bytes,
                cancel: cancel.clone(),
                ownership: ownership.clone(),
                readiness: readiness.clone(),
            };
            dispatchers.push(tokio::spawn(dispatcher.run()));
        }
        // Make sure the server has the subscriptions before reporting ready: a round trip, since
        // `flush` only empties the local write buffer.
        round_trip(&client).await;
        readiness.set_subscribed(true);
        tracing::info!(
            subjects = subjects.len(),
            partitions = ownership.partitions().len(),
            jetstream = config.jetstream.enabled,
            shards = config.shard_count(),
            "subscribed"
        );

        http_guard.disarm();

        Ok(RunningService {
            client,
            cancel,
            dispatchers,
            held_pins,
            shards,
            draining: None,
            api: Some(api),
            status: Some(status),
            http,
            http_stop,
            metrics,
            readiness,
            shutdown_timeout: Duration::from_millis(config.service.shutdown_timeout_ms),
        })
    }

    /// The service's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Whether the service is connected and subscribed.
    pub fn is_ready(&self) -> bool {
        self.readiness.is_ready()
    }

    /// Why the service can no longer do its job (what `/healthz` answers), or `None` while it can.
    pub fn not_alive_reason(&self) -> Option<&'static str> {
        self.readiness.not_alive_reason()
    }

    /// The bound address of the HTTP server, when enabled.
    pub fn http_address(&self) -> Option<std::net::SocketAddr> {
        self.http.as_ref().map(|(address, _)| *address)
    }

    /// Stops in order (input, workers, publisher, API, HTTP) within the shutdown timeout.
    pub async fn shutdown(mut self) -> Result<(), ServiceError> {
        let timeout = self.shutdown_timeout;
        let started = Instant::now();
        let result = tokio::time::timeout(timeout, self.stop_in_order()).await;
        self.http_stop.cancel();
        if let Some((_, mut task)) = self.http.take() {
            // Open connections end gracefully; one whose client does not read its response must
            // not hold the shutdown past this.
            if tokio::time::timeout(HTTP_STOP_GRACE, &mut task).await.is_err() {
                task.abort();
            }
        }
        match result {
            Ok(()) => {
                tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, "stopped");
                Ok(())
            }
            Err(_) => {
                tracing::error!(?timeout, "shutdown timed out; open streams may not have been closed");
                self.stop_at_once().await;
                Err(ServiceError::ShutdownTimeout(timeout))
            }
        }
    }

    /// After a shutdown that timed out: stops the dispatchers and shard workers still running
    /// where they are, as a crash would (what they held is neither published nor acknowledged;
    /// JetStream delivers it again to the partition's next owner), then releases the pins held.
    /// Released while a worker could still acknowledge, a standby could read the same events from
    /// the ack floor and publish their outputs a second time; left held, a pin lapses only after
    /// `pinned_ttl_ms`. (A stopped input task's pull stream ends with it: async-nats sends its
    /// unsubscription at once, ahead of the release on the same connection unless the client's
    /// command queue is full, as on the graceful path.) Each step is bounded by
    /// [`STOP_AT_ONCE_GRACE`].
    async fn stop_at_once(&mut self) {
        for dispatcher in &self.dispatchers {
            dispatcher.abort();
        }
        if let Some(status) = self.status.take() {
            status.abort();
        }
        let stopped = async {
            for dispatcher in self.dispatchers.drain(..) {
                // Cancelled, or ended before the abort reached it.
                let _ = dispatcher.await;
            }
            // Every dispatcher has ended: the shard set is no longer shared, if it was not taken.
            if let Some(shards) = self.shards.take().and_then(|shards| Arc::try_unwrap(shards).ok()) {
                self.draining = Some(shards);
            }
            if let Some(shards) = &mut self.draining {
                shards.abort().await;
            }
        };
        if tokio::time::timeout(STOP_AT_ONCE_GRACE, stopped).await.is_err() {
            tracing::error!("tasks did not stop when told to; held pins lapse after pinned_ttl_ms");
            return;
        }
        let release =
            futures::future::join_all(input::take_held(&self.held_pins).into_iter().map(input::PinRelease::release));
        if tokio::time::timeout(STOP_AT_ONCE_GRACE, release).await.is_err() {
            tracing::warn!("releasing the pins timed out; they lapse after pinned_ttl_ms");
        }
    }

    async fn stop_in_order(&mut self) {
        self.readiness.set_subscribed(false);
        self.cancel.cancel();
        while let Some(dispatcher) = self.dispatchers.first_mut() {
            if let Err(e) = dispatcher.await {
                tracing::error!(error = %e, "dispatcher failed");
            }
            self.dispatchers.remove(0);
        }
        // Every dispatcher has ended, so this is the last reference to the shard set.
        if let Some(shards) = self.shards.take() {
            match Arc::try_unwrap(shards) {
                Ok(shards) => self.draining = Some(shards),
                Err(_) => tracing::error!("shard set still referenced at shutdown"),
            }
        }
        if let Some(shards) = &mut self.draining {
            shards.drain().await;
        }
        self.draining = None;
        // Only now, with every queued event processed and its acks sent on this connection (which
        // the server reads in order), may a standby take the pins over.
        futures::future::join_all(input::take_held(&self.held_pins).into_iter().map(input::PinRelease::release)).await;
        // Not a flush: it only hands the outputs to the socket, and closing a socket that holds
        // unread input (events still arriving, anything the server sent) makes the kernel reset
        // the connection and discard what it has not sent yet. The server's answer to a request
        // sent now comes only once it has read every output before it.
        round_trip(&self.client).await;
        if let Some(api) = self.api.take() {
            if let Err(e) = api.stop().await {
                tracing::warn!(error = %e, "service API did not stop cleanly");
            }
        }
        if let Some(status) = self.status.take() {
            status.abort();
        }
    }
}

/// How long the HTTP endpoint's open connections may take to end at shutdown.
const HTTP_STOP_GRACE: Duration = Duration::from_secs(1);

/// After a shutdown timed out, how long the tasks told to stop may take to end, and then the pins'
/// release.
const STOP_AT_ONCE_GRACE: Duration = Duration::from_secs(1);

/// Binds the HTTP endpoint's listener on `listen` (`HOST:PORT`), with the address it got.
async fn bind(listen: &str) -> Result<(tokio::net::TcpListener, std::net::SocketAddr), ServiceError> {
    let error = |error| ServiceError::Listen { address: listen.to_owned(), error };
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(error)?;
    let address = listener.local_addr().map_err(error)?;
    Ok((listener, address))
}

/// The trace context headers of an input event (compared by name: an event carries few headers,
/// so this is cheaper than hashing each name).
fn trace_context(headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    let mut trace = Vec::new();
    for (name, values) in headers.iter() {
        if let (true, Some(value)) = (TRACE_HEADERS.contains(name), values.last()) {
            trace.push((name.clone(), value.clone()));
        }
    }
    trace
}

/// The tags asked for in a `structured-sink.prompt` request: a JSON array of strings, or tags
/// separated by white space; none means all.
fn requested_tags(payload: &[u8]) -> Vec<String> {
    serde_json::from_slice::<Vec<String>>(payload)
        .unwrap_or_else(|_| String::from_utf8_lossy(payload).split_whitespace().map(str::to_owned).collect())
}

/// Registers this replica with the NATS service API (`$SRV.PING`, `$SRV.INFO`, `$SRV.STATS`),
/// answers `structured-sink.status` with the counters and `structured-sink.prompt` with the
/// prompt instructions of the requested block types.
async fn register(
    client: &async_nats::Client,
    metrics: &Arc<Metrics>,
    registry: SchemaRegistry,
) -> Result<(async_nats::service::Service, JoinHandle<()>), ServiceError> {
    use async_nats::service::ServiceExt;
    let stats_metrics = metrics.clone();
    let service = client
        .service_builder()
        .description("Filters structured blocks out of streamed LLM text")
        .stats_handler(move |_endpoint, _stats| serde_json::to_value(stats_metrics.snapshot()).unwrap_or_default())
        .start("structured-sink", env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| ServiceError::Register(e.to_string()))?;
    let group = service.group("structured-sink");
    let status = group.endpoint("status").await.map_err(|e| ServiceError::Register(e.to_string()))?;
    let prompt = group.endpoint("prompt").await.map_err(|e| ServiceError::Register(e.to_string()))?;
    let metrics = metrics.clone();
    let task = tokio::spawn(async move {
        let mut requests = futures::stream::select(status.map(|r| (true, r)), prompt.map(|r| (false, r)));
        while let Some((is_status, request)) = requests.next().await {
            let reply = if is_status {
                Ok(serde_json::to_vec(&metrics.snapshot()).unwrap_or_default().into())
            } else {
                crate::typed::render_prompt(&registry, &requested_tags(&request.message.payload))
                    .map(Into::into)
                    .map_err(|e| async_nats::service::error::Error { status: e.to_string(), code: 404 })
            };
            if let Err(e) = request.respond(reply).await {
                tracing::warn!(error = %e, "service API reply failed");
            }
        }
    });
    Ok((service, task))
}
