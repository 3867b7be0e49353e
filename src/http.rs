//! The operator's HTTP endpoint: `GET /metrics`, `GET /healthz` and `GET /readyz`.
//!
//! A minimal HTTP/1.1 server on hyper. `/metrics` renders [`Metrics`] in the Prometheus text
//! format; `/healthz` answers 200 while the process can serve at all (503 once its NATS
//! connection is closed for good, after `nats.max_reconnects`, a shard worker stopped, or a
//! JetStream consumer the replica reads no longer exists);
//! `/readyz` answers 200 only
//! while the shared [`Readiness`] says the service is connected to NATS and subscribed to its
//! input, else 503 with a one-line reason. Other paths get 404 and other methods 405.
//!
//! Bounds: at most [`MAX_CONNECTIONS`] connections are served at once (further ones wait in the
//! listen backlog until one closes), and a client has [`HEADER_READ_TIMEOUT`] to send its request
//! head. When the shutdown future resolves the server stops accepting, lets in-flight requests
//! finish, closes idle keep-alive connections and returns.
//!
//! This module knows HTTP and the two shared state objects; it knows nothing of NATS, shards or
//! configuration (the caller binds the listener, e.g. from `http.listen`).

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::Metrics;

/// Connections served at once; more wait in the kernel's listen backlog until one closes.
pub const MAX_CONNECTIONS: usize = 64;

/// Time a client has to send a complete request head before its connection is closed.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause after an accept error that is not about one connection (e.g. out of file descriptors),
/// so the loop does not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// The content type of the Prometheus text exposition format 0.0.4.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the service can do its job: connected to NATS and subscribed to its input. Shared
/// (`Arc`) between the service, which sets it, and `/readyz`, which reads it. Both start false.
#[derive(Default)]
pub struct Readiness {
    /// Asks the connection whether it is up, on every `/readyz`. Not a flag kept from the
    /// client's connected/disconnected events: the client drops events when its event queue
    /// is full (a burst of slow-consumer reports fills it), and a flag that missed the
    /// reconnect would keep the service out of rotation for good. `None` (no client yet) is
    /// not connected.
    connection: OnceLock<ConnectionProbe>,
    subscribed: AtomicBool,
    /// The NATS connection is closed for good (`nats.max_reconnects` ran out): nothing will
    /// bring it back, so the process is no longer alive in the orchestrator's sense.
    connection_lost: AtomicBool,
    /// A shard worker stopped (a failure outside any one stream's processing): the events routed
    /// to it can no longer be applied, so the process is no longer alive either.
    shard_lost: AtomicBool,
    /// A JetStream consumer this replica reads no longer exists: nothing more comes from it.
    consumer_lost: AtomicBool,
}

impl Readiness {
    /// Not connected, not subscribed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Follows the NATS connection through `is_connected`, asked on every readiness check (it
    /// should be cheap: a state read, no IO). Set once, when the client exists; later calls are
    /// ignored.
    pub fn follow_connection(&self, is_connected: impl Fn() -> bool + Send + Sync + 'static) {
        let _ = self.connection.set(Box::new(is_connected));
    }

    fn is_connected(&self) -> bool {
        self.connection.get().is_some_and(|is_connected| is_connected())
    }

    /// Records whether the input subscriptions are active (set false when draining at shutdown).
    pub fn set_subscribed(&self, subscribed: bool) {
        self.subscribed.store(subscribed, Ordering::Relaxed);
    }

    /// Records that the NATS connection is closed for good: `/healthz` fails from now on, so an
    /// orchestrator restarts the process.
    pub fn set_connection_lost(&self) {
        self.connection_lost.store(true, Ordering::Relaxed);
    }

    /// Records that a shard worker stopped: `/healthz` fails from now on, so an orchestrator
    /// restarts the process.
    pub fn set_shard_lost(&self) {
        self.shard_lost.store(true, Ordering::Relaxed);
    }

    /// Records that a JetStream consumer this replica reads is gone: `/healthz` fails from now
    /// on, so an orchestrator restarts the process (which creates the consumer again).
    pub fn set_consumer_lost(&self) {
        self.consumer_lost.store(true, Ordering::Relaxed);
    }

    /// Whether the process can still do its job at all (`/healthz`).
    pub fn is_alive(&self) -> bool {
        self.not_alive_reason().is_none()
    }

    /// Why the process can no longer do its job, in one line, or `None` while it can.
    pub fn not_alive_reason(&self) -> Option<&'static str> {
        if self.connection_lost.load(Ordering::Relaxed) {
            Some("the NATS connection is closed for good")
        } else if self.shard_lost.load(Ordering::Relaxed) {
            Some("a shard worker stopped")
        } else if self.consumer_lost.load(Ordering::Relaxed) {
            Some("a JetStream consumer of this replica no longer exists")
        } else {
            None
        }
    }

    /// Connected and subscribed.
    pub fn is_ready(&self) -> bool {
        self.not_ready_reason().is_none()
    }

    /// Why the service is not ready, in one line, or `None` when it is.
    pub fn not_ready_reason(&self) -> Option<&'static str> {
        match (self.is_connected(), self.subscribed.load(Ordering::Relaxed)) {
            (true, true) => None,
            (false, _) => Some("not connected to NATS"),
            (true, false) => Some("not subscribed to the input subjects"),
        }
    }
}

type ConnectionProbe = Box<dyn Fn() -> bool + Send + Sync>;

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("connected", &self.is_connected())
            .field("subscribed", &self.subscribed.load(Ordering::Relaxed))
            .field("connection_lost", &self.connection_lost.load(Ordering::Relaxed))
            .field("shard_lost", &self.shard_lost.load(Ordering::Relaxed))
            .field("consumer_lost", &self.consumer_lost.load(Ordering::Relaxed))
            .finish()
    }
}

/// Serves the endpoints on `listener` until `shutdown` resolves, then stops accepting, waits for
/// in-flight requests and returns. Bind the listener yourself (port 0 is fine; read the port
/// from `listener.local_addr()` first).
///
/// Accept errors never end the server: errors about a single connection are ignored, others
/// (such as running out of file descriptors) are logged and retried after a short pause.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let stop = CancellationToken::new();
    let connections = TaskTracker::new();
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    tokio::pin!(shutdown);

    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) if is_connection_error(&error) => continue,
                Err(error) => {
                    tracing::warn!(%error, "metrics endpoint failed to accept a connection");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            },
        };
        let (metrics, readiness, stop) = (metrics.clone(), readiness.clone(), stop.clone());
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            let response = respond(&request, &metrics, &readiness);
            async move { Ok::<_, Infallible>(response) }
        });
        let connection = http.serve_connection(TokioIo::new(stream), service);
        connections.spawn(async move {
            let _permit = permit;
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = result {
                tracing::debug!(%error, "metrics endpoint connection ended with an error");
            }
        });
    }

    drop(listener);
    stop.cancel();
    connections.close();
    connections.wait().await;
}

/// Accept errors that concern one connection only, after which accepting again is right.
fn is_connection_error(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::Interrupted
            | std::io::ErrorKind::WouldBlock
    )
}

/// Routes one request.
fn respond(request: &Request<Incoming>, metrics: &Metrics, readiness: &Readiness) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    if !matches!(path, "/metrics" | "/healthz" | "/readyz") {
        return text(StatusCode::NOT_FOUND, "not found\n");
    }
    if request.method() != Method::GET {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET"));
        return response;
    }
    match path {
        "/metrics" => {
            let mut response = Response::new(Full::new(Bytes::from(metrics.render())));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(METRICS_CONTENT_TYPE));
            response
        }
        "/healthz" => match readiness.not_alive_reason() {
            None => text(StatusCode::OK, "ok\n"),
            Some(reason) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("{reason}\n")),
        },
        _ => match readiness.not_ready_reason() {
            None => text(StatusCode::OK, "ready\n"),
            Some(reason) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("{reason}\n")),
        },
    }
}

/// A plain-text response that no cache keeps.
fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::copy_from_slice(body.as_bytes())));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::oneshot;
    use tokio::task::JoinHandle;

    use super::*;
    use crate::metrics::OutputKind;

    struct TestServer {
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        readiness: Arc<Readiness>,
        stop: Option<oneshot::Sender<()>>,
        task: JoinHandle<()>,
    }

    impl TestServer {
        async fn start() -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let metrics = Arc::new(Metrics::new(1));
            let readiness = Arc::new(Readiness::new());
            let (stop, stopped) = oneshot::channel::<()>();
            let task = tokio::spawn(serve(listener, metrics.clone(), readiness.clone(), async move {
                let _ = stopped.await;
            }));
            TestServer { addr, metrics, readiness, stop: Some(stop), task }
        }

        /// Sends one raw request on a new connection and returns (status, head, body).
        async fn request(&self, method: &str, path: &str) -> (u16, String, String) {
            let mut stream = TcpStream::connect(self.addr).await.unwrap();
            let request = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut raw = Vec::new();
            tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut raw)).await.unwrap().unwrap();
            parse_response(&raw)
        }

        async fn shut_down(mut self) {
            self.stop.take().unwrap().send(()).unwrap();
            tokio::time::timeout(Duration::from_secs(5), self.task).await.expect("serve returns").unwrap();
        }
    }

    fn parse_response(raw: &[u8]) -> (u16, String, String) {
        let raw = String::from_utf8(raw.to_vec()).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").expect("a complete response");
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_ascii_lowercase(), body.to_owned())
    }

    #[tokio::test]
    async fn healthz_answers_ok() {
        let server = TestServer::start().await;
        let (status, head, body) = server.request("GET", "/healthz").await;
        assert_eq!(status, 200);
        assert_eq!(body, "ok\n");
        assert!(head.contains("content-type: text/plain"), "{head}");
        server.shut_down().await;
    }

    #[tokio::test]
    async fn readyz_flips_with_readiness() {
        let server = TestServer::start().await;
        let (status, _, body) = server.request("GET", "/readyz").await;
        assert_eq!((status, body.as_str()), (503, "not connected to NATS\n"));

        let connected = Arc::new(AtomicBool::new(true));
        server.readiness.follow_connection({
            let connected = connected.clone();
            move || connected.load(Ordering::Relaxed)
        });
        let (status, _, body) = server.request("GET", "/readyz").await;
        assert_eq!((status, body.as_str()), (503, "not subscribed to the input subjects\n"));

        server.readiness.set_subscribed(true);
        assert!(server.readiness.is_ready());
        let (status, _, body) = server.request("GET", "/readyz").await;
        assert_eq!((status, body.as_str()), (200, "ready\n"));

        // The connection is asked on every check: nothing has to report the change.
        connected.store(false, Ordering::Relaxed);
        let (status, _, body) = server.request("GET", "/readyz").await;
        assert_eq!((status, body.as_str()), (503, "not connected to NATS\n"));
        connected.store(true, Ordering::Relaxed);
        assert_eq!(server.request("GET", "/readyz").await.0, 200);
        connected.store(false, Ordering::Relaxed);
        // Liveness does not depend on readiness, only on the connection being recoverable.
        assert_eq!(server.request("GET", "/healthz").await.0, 200);
        server.readiness.set_connection_lost();
        let (status, _, body) = server.request("GET", "/healthz").await;
        assert_eq!((status, body.as_str()), (503, "the NATS connection is closed for good\n"));
        server.shut_down().await;
    }

    #[tokio::test]
    async fn healthz_fails_once_a_shard_worker_stopped() {
        let server = TestServer::start().await;
        assert_eq!(server.request("GET", "/healthz").await.0, 200);
        server.readiness.set_shard_lost();
        let (status, _, body) = server.request("GET", "/healthz").await;
        assert_eq!((status, body.as_str()), (503, "a shard worker stopped\n"));
        let readiness = Readiness::new();
        readiness.set_consumer_lost();
        assert_eq!(readiness.not_alive_reason(), Some("a JetStream consumer of this replica no longer exists"));
        server.shut_down().await;
    }

    #[tokio::test]
    async fn metrics_are_rendered_in_the_text_format() {
        let server = TestServer::start().await;
        server.metrics.count_received();
        server.metrics.count_published(OutputKind::Thinking);
        let (status, head, body) = server.request("GET", "/metrics?ignored=1").await;
        assert_eq!(status, 200);
        assert!(head.contains("content-type: text/plain; version=0.0.4"), "{head}");
        assert!(body.contains("# TYPE structured_sink_events_received_total counter\n"), "{body}");
        assert!(body.contains("\nstructured_sink_events_received_total 1\n"), "{body}");
        assert!(body.contains("\nstructured_sink_messages_published_total{kind=\"thinking\"} 1\n"), "{body}");
        assert_eq!(body, server.metrics.render());
        server.shut_down().await;
    }

    #[tokio::test]
    async fn unknown_paths_are_404_and_other_methods_405() {
        let server = TestServer::start().await;
        assert_eq!(server.request("GET", "/").await.0, 404);
        assert_eq!(server.request("GET", "/metrics/x").await.0, 404);
        assert_eq!(server.request("POST", "/nope").await.0, 404);
        for (method, path) in [("POST", "/metrics"), ("DELETE", "/readyz"), ("PUT", "/healthz"), ("HEAD", "/healthz")] {
            let (status, head, _) = server.request(method, path).await;
            assert_eq!(status, 405, "{method} {path}");
            assert!(head.contains("allow: get"), "{head}");
        }
        server.shut_down().await;
    }

    #[tokio::test]
    async fn keep_alive_connections_serve_several_requests() {
        let server = TestServer::start().await;
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\nGET /readyz HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&raw).contains("not connected to NATS\n") {
            let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await.unwrap().unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&raw));
            raw.extend_from_slice(&buf[..n]);
        }
        let raw = String::from_utf8(raw).unwrap();
        assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
        assert!(raw.contains("HTTP/1.1 503"), "{raw}");
        // The idle keep-alive connection does not hold up shutdown, and is closed by it.
        server.shut_down().await;
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0);
    }

    #[tokio::test]
    async fn shutdown_stops_accepting() {
        let server = TestServer::start().await;
        let addr = server.addr;
        assert_eq!(server.request("GET", "/healthz").await.0, 200);
        server.shut_down().await;
        assert!(TcpStream::connect(addr).await.is_err(), "the listener is closed");
    }

    #[test]
    fn readiness_starts_not_ready() {
        let readiness = Readiness::default();
        assert!(!readiness.is_ready());
        readiness.set_subscribed(true);
        assert_eq!(readiness.not_ready_reason(), Some("not connected to NATS"));
    }
}
