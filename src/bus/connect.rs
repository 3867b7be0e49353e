//! Building a NATS client from [`NatsConfig`], and what the connection reports afterwards.
//!
//! This file owns the translation from operator settings to `async_nats::ConnectOptions`
//! (authentication, TLS, reconnect backoff, buffers, pings), the mapping of the client's
//! events to [`ConnectionEvent`] with one log line each, and reading the server's version.
//! It does not count events (the caller's callback does, so the metrics module stays the one
//! place that names metrics) and knows nothing of what is published or subscribed.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerError};

use super::config::{mask_url_secret, UrlCredentials};
use super::{BusError, NatsConfig};

/// What happened to the connection, as reported by the client library.
///
/// Each event is also logged by [`connect`] (`warn` for disconnects, lame duck mode and slow
/// consumers, `error` for authorization and permission violations), so the callback only needs
/// to count it, e.g. by [`ConnectionEvent::kind`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEvent {
    /// The connection to a server is established (at start-up and after every reconnect).
    Connected,
    /// The connection was lost; the client is reconnecting with backoff. Publishes are
    /// buffered in the meantime and subscriptions are restored on reconnect.
    Disconnected,
    /// The server announced it is shutting down (lame duck mode); the client will move to
    /// another server.
    LameDuckMode,
    /// A subscription's buffer (`subscription_capacity`) was full and messages for it were
    /// dropped.
    SlowConsumer {
        /// The client-side id of the subscription that fell behind.
        subscription_id: u64,
    },
    /// The server refused the credentials.
    AuthorizationViolation,
    /// The server refused a publish or subscribe on a subject this user may not use.
    PermissionViolation {
        /// The server's message, naming the operation and the subject.
        message: String,
    },
    /// Any other error the server reported.
    ServerError {
        /// The server's message.
        message: String,
    },
    /// An error inside the client, such as running out of reconnect attempts.
    ClientError {
        /// The client's message.
        message: String,
    },
    /// The connection is draining (flushing and unsubscribing before close).
    Draining,
    /// The connection is closed for good (after a drain, or after `max_reconnects`).
    Closed,
}

impl ConnectionEvent {
    /// A short, stable name for logs and metric labels, e.g. `"disconnected"`.
    pub fn kind(&self) -> &'static str {
        match self {
            ConnectionEvent::Connected => "connected",
            ConnectionEvent::Disconnected => "disconnected",
            ConnectionEvent::LameDuckMode => "lame_duck_mode",
            ConnectionEvent::SlowConsumer { .. } => "slow_consumer",
            ConnectionEvent::AuthorizationViolation => "authorization_violation",
            ConnectionEvent::PermissionViolation { .. } => "permission_violation",
            ConnectionEvent::ServerError { .. } => "server_error",
            ConnectionEvent::ClientError { .. } => "client_error",
            ConnectionEvent::Draining => "draining",
            ConnectionEvent::Closed => "closed",
        }
    }

    fn log(&self) {
        let kind = self.kind();
        match self {
            ConnectionEvent::Connected => tracing::info!(event = kind, "NATS connected"),
            ConnectionEvent::Disconnected => {
                tracing::warn!(event = kind, "NATS connection lost; reconnecting")
            }
            ConnectionEvent::LameDuckMode => {
                tracing::warn!(event = kind, "NATS server is shutting down (lame duck mode)")
            }
            ConnectionEvent::SlowConsumer { subscription_id } => tracing::warn!(
                event = kind,
                subscription_id,
                "NATS subscription fell behind and the client dropped messages \
                 (raise subscription_capacity or add replicas)"
            ),
            ConnectionEvent::AuthorizationViolation => {
                tracing::error!(event = kind, "NATS server rejected the credentials")
            }
            ConnectionEvent::PermissionViolation { message } => {
                tracing::error!(event = kind, message = %message, "NATS permissions violation")
            }
            ConnectionEvent::ServerError { message } => {
                tracing::warn!(event = kind, message = %message, "NATS server error")
            }
            ConnectionEvent::ClientError { message } => {
                tracing::warn!(event = kind, message = %message, "NATS client error")
            }
            ConnectionEvent::Draining => tracing::info!(event = kind, "NATS connection draining"),
            ConnectionEvent::Closed => tracing::warn!(event = kind, "NATS connection closed for good"),
        }
    }
}

impl From<Event> for ConnectionEvent {
    fn from(event: Event) -> Self {
        match event {
            Event::Connected => ConnectionEvent::Connected,
            Event::Disconnected => ConnectionEvent::Disconnected,
            Event::LameDuckMode => ConnectionEvent::LameDuckMode,
            Event::Draining => ConnectionEvent::Draining,
            Event::Closed => ConnectionEvent::Closed,
            Event::SlowConsumer(subscription_id) | Event::ServerError(ServerError::SlowConsumer(subscription_id)) => {
                ConnectionEvent::SlowConsumer { subscription_id }
            }
            Event::ServerError(ServerError::AuthorizationViolation) => ConnectionEvent::AuthorizationViolation,
            Event::ServerError(ServerError::Other(message)) => {
                // The server words it `Permissions Violation for Publish to "x"`; the client
                // keeps the text but gives it no variant of its own.
                if message.to_ascii_lowercase().contains("permissions violation") {
                    ConnectionEvent::PermissionViolation { message }
                } else {
                    ConnectionEvent::ServerError { message }
                }
            }
            // The client stops reconnecting: the connection is closed for good.
            Event::ClientError(async_nats::ClientError::MaxReconnects) => ConnectionEvent::Closed,
            Event::ClientError(error) => ConnectionEvent::ClientError { message: error.to_string() },
        }
    }
}

/// Connects to NATS as `cfg` says and returns the client.
///
/// The configuration is [validated](NatsConfig::validate) first and the files it names are
/// checked, so a mistake fails here with the key's name. Unless `retry_on_initial_connect` is
/// set, the first connection must succeed: the error names the servers tried (credentials in
/// URLs masked) and tells an authorization failure apart from an unreachable server.
///
/// Every connection event is logged and then passed to `events`, which is called on the
/// client's event task: keep it short and non-blocking (count, set a flag, `try_send`).
pub async fn connect(
    cfg: &NatsConfig,
    events: impl Fn(ConnectionEvent) + Send + Sync + 'static,
) -> Result<async_nats::Client, BusError> {
    cfg.validate()?;
    let options = connect_options(cfg, events).await?;
    let servers = cfg.servers.iter().map(|url| mask_url_secret(url)).collect::<Vec<_>>().join(", ");
    tracing::debug!(servers = %servers, client_name = %cfg.client_name, "connecting to NATS");
    options.connect(cfg.servers.as_slice()).await.map_err(|error| match error.kind() {
        ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
            BusError::AuthorizationViolation { servers, error }
        }
        _ => BusError::Connect { servers, error },
    })
}

async fn connect_options(
    cfg: &NatsConfig,
    events: impl Fn(ConnectionEvent) + Send + Sync + 'static,
) -> Result<ConnectOptions, BusError> {
    let mut options = ConnectOptions::new()
        .name(&cfg.client_name)
        .connection_timeout(Duration::from_millis(cfg.connect_timeout_ms))
        .ping_interval(Duration::from_millis(cfg.ping_interval_ms))
        .subscription_capacity(cfg.subscription_capacity)
        .max_reconnects(cfg.max_reconnects);

    let delay_cap = Duration::from_millis(cfg.reconnect_delay_max_ms);
    let jitter_seed = RandomState::new();
    options = options.reconnect_delay_callback(move |attempt| {
        let delay = reconnect_delay(attempt, delay_cap);
        // Up to 20 % shorter, differently in each process, so that replicas cut off together
        // do not return in lockstep; subtracting keeps the cap a real upper bound.
        let jitter_range = delay.as_millis() as u64 / 5;
        let jitter = match jitter_range {
            0 => 0,
            range => jitter_seed.hash_one(attempt) % (range + 1),
        };
        delay - Duration::from_millis(jitter)
    });

    if cfg.retry_on_initial_connect {
        options = options.retry_on_initial_connect();
    }

    if let Some(path) = &cfg.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|error| BusError::unreadable_file("credentials_file", path, &error))?;
    }
    if let Some(seed) = &cfg.nkey_seed {
        options = options.nkey(seed.clone());
    }
    if let (Some(user), Some(password)) = (&cfg.user, &cfg.password) {
        options = options.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &cfg.token {
        options = options.token(token.clone());
    }
    match cfg.url_credentials()? {
        Some(UrlCredentials::UserPassword { user, password }) => options = options.user_and_password(user, password),
        Some(UrlCredentials::Token(token)) => options = options.token(token),
        None => {}
    }

    let tls = &cfg.tls;
    if tls.required {
        options = options.require_tls(true);
    }
    if let Some(ca_file) = &tls.ca_file {
        check_readable("tls.ca_file", ca_file)?;
        options = options.add_root_certificates(ca_file.clone());
    }
    if let (Some(cert_file), Some(key_file)) = (&tls.cert_file, &tls.key_file) {
        check_readable("tls.cert_file", cert_file)?;
        check_readable("tls.key_file", key_file)?;
        options = options.add_client_certificate(cert_file.clone(), key_file.clone());
    }

    options = options.event_callback(move |event| {
        let event = ConnectionEvent::from(event);
        event.log();
        events(event);
        std::future::ready(())
    });
    Ok(options)
}

fn check_readable(key: &str, path: &std::path::Path) -> Result<(), BusError> {
    std::fs::File::open(path).map(drop).map_err(|error| BusError::unreadable_file(key, path, &error))
}

/// Backoff before reconnect attempt `attempt` (1 for the first): immediate, then 100 ms
/// doubling, never above `cap`.
fn reconnect_delay(attempt: usize, cap: Duration) -> Duration {
    const BASE: Duration = Duration::from_millis(100);
    if attempt <= 1 {
        return Duration::ZERO;
    }
    let doublings = u32::try_from(attempt - 2).unwrap_or(u32::MAX).min(20);
    BASE.saturating_mul(1 << doublings).min(cap)
}

/// The version the connected server announced, as `(major, minor, patch)`, or `None` when not
/// connected yet or the version does not parse.
///
/// Use it before relying on newer server features: servers before 2.10 accept unknown stream
/// settings without error and ignore them.
pub fn server_version(client: &async_nats::Client) -> Option<(u32, u32, u32)> {
    parse_server_version(&client.server_info().version)
}

/// Parses a NATS server version such as `2.9.10`, `v2.10.3` or `2.11.0-RC.1` into
/// `(major, minor, patch)`; pre-release and build suffixes are ignored.
pub fn parse_server_version(version: &str) -> Option<(u32, u32, u32)> {
    let version = version.trim();
    let version = version.strip_prefix('v').unwrap_or(version);
    let core = version.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(str::parse::<u32>);
    let version = (parts.next()?.ok()?, parts.next()?.ok()?, parts.next()?.ok()?);
    parts.next().is_none().then_some(version)
}

/// Waits until the server has answered a request sent now: it has then processed everything this
/// client sent before (subscriptions, publishes), and every message it queued for this connection
/// before has been read (each direction is in order). `Client::flush` only empties the local write
/// buffer, so it cannot serve here. The subject has no subscribers; the server's immediate "no
/// responders" reply is the answer. Gives up with a warning after 2 s.
pub async fn round_trip(client: &async_nats::Client) {
    let fence = format!("_STRUCTURED_SINK.fence.{}", client.new_inbox().rsplit('.').next().unwrap_or("x"));
    match tokio::time::timeout(Duration::from_secs(2), client.request(fence, bytes::Bytes::new())).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "round trip through the server failed"),
        Err(_) => tracing::warn!("round trip through the server timed out"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::ClientError;

    #[test]
    fn backoff_starts_immediately_doubles_and_is_capped() {
        let cap = Duration::from_millis(4_000);
        let delays: Vec<u128> = (1..=9).map(|a| reconnect_delay(a, cap).as_millis()).collect();
        assert_eq!(delays, [0, 100, 200, 400, 800, 1600, 3200, 4000, 4000]);
        assert_eq!(reconnect_delay(0, cap), Duration::ZERO);
        assert_eq!(reconnect_delay(usize::MAX, cap), cap);
        assert_eq!(reconnect_delay(5, Duration::from_millis(50)), Duration::from_millis(50));
    }

    #[test]
    fn server_versions_parse() {
        assert_eq!(parse_server_version("2.9.10"), Some((2, 9, 10)));
        assert_eq!(parse_server_version("v2.10.3"), Some((2, 10, 3)));
        assert_eq!(parse_server_version("2.11.0-RC.1"), Some((2, 11, 0)));
        assert_eq!(parse_server_version("2.12.1+build"), Some((2, 12, 1)));
        assert_eq!(parse_server_version(""), None);
        assert_eq!(parse_server_version("2.10"), None);
        assert_eq!(parse_server_version("2.10.x"), None);
        assert_eq!(parse_server_version("2.10.1.4"), None);
        assert!(parse_server_version("2.9.10") < Some((2, 10, 0)));
    }

    #[test]
    fn client_events_map_to_ours() {
        let cases = [
            (Event::Connected, ConnectionEvent::Connected),
            (Event::Disconnected, ConnectionEvent::Disconnected),
            (Event::LameDuckMode, ConnectionEvent::LameDuckMode),
            (Event::Draining, ConnectionEvent::Draining),
            (Event::Closed, ConnectionEvent::Closed),
            (Event::SlowConsumer(7), ConnectionEvent::SlowConsumer { subscription_id: 7 }),
            (Event::ServerError(ServerError::SlowConsumer(8)), ConnectionEvent::SlowConsumer { subscription_id: 8 }),
            (Event::ServerError(ServerError::AuthorizationViolation), ConnectionEvent::AuthorizationViolation),
            (
                Event::ServerError(ServerError::Other("Permissions Violation for Publish to \"chat.filtered\"".into())),
                ConnectionEvent::PermissionViolation {
                    message: "Permissions Violation for Publish to \"chat.filtered\"".into(),
                },
            ),
            (
                Event::ServerError(ServerError::Other("Maximum Payload Violation".into())),
                ConnectionEvent::ServerError { message: "Maximum Payload Violation".into() },
            ),
        ];
        for (event, expected) in cases {
            assert_eq!(ConnectionEvent::from(event), expected);
        }
        let event = ConnectionEvent::from(Event::ClientError(ClientError::MaxReconnects));
        assert_eq!(event.kind(), "closed", "running out of reconnects closes the connection for good");
    }

    /// A loopback URL where nothing listens: a port the OS just handed out and took back.
    fn closed_url(userinfo: &str) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        format!("nats://{userinfo}127.0.0.1:{port}")
    }

    #[tokio::test]
    async fn unreadable_files_are_named_before_connecting() {
        let cfg = NatsConfig {
            // Nothing listens here; the file check must fail before any connection attempt.
            servers: vec![closed_url("")],
            tls: super::super::TlsConfig { ca_file: Some("/nonexistent/ca.pem".into()), ..Default::default() },
            ..NatsConfig::default()
        };
        match connect(&cfg, |_| {}).await {
            Err(BusError::Config { key, reason }) => {
                assert_eq!(key, "tls.ca_file");
                assert!(reason.contains("/nonexistent/ca.pem"), "{reason}");
            }
            other => panic!("expected a config error, got {:?}", other.map(|_| ())),
        }
        let cfg = NatsConfig {
            servers: vec![closed_url("")],
            credentials_file: Some("/nonexistent/user.creds".into()),
            ..NatsConfig::default()
        };
        let error = connect(&cfg, |_| {}).await.map(|_| ()).unwrap_err();
        assert!(matches!(&error, BusError::Config { key, .. } if key == "credentials_file"), "{error}");
    }

    #[tokio::test]
    async fn unreachable_server_fails_with_the_server_list() {
        let (plain, with_password) = (closed_url(""), closed_url("u:secret@"));
        let cfg = NatsConfig {
            servers: vec![plain.clone(), with_password.clone()],
            connect_timeout_ms: 1_000,
            ..NatsConfig::default()
        };
        let error = connect(&cfg, |_| {}).await.map(|_| ()).unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, BusError::Connect { .. }), "{message}");
        let masked = with_password.replace("secret", "***");
        assert!(message.contains(&format!("{plain}, {masked}")), "{message}");
        assert!(!message.contains("secret"), "{message}");
    }
}
