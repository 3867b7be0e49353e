//! The errors of the NATS boundary.
//!
//! Each variant says what was being done and with which server, subject or key, so that a log
//! line or a start-up failure is enough to act on. Secrets never appear in these messages.
//! This file does not know how errors are counted or reported; callers decide that.

use std::path::Path;

/// An error at the NATS boundary: bad settings, a failed connection, or a failed operation on a
/// subject.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// A NATS setting is invalid or a file it names cannot be read. `key` is relative to the
    /// NATS section of the configuration (e.g. `tls.key_file`).
    #[error("invalid NATS setting `{key}`: {reason}")]
    Config {
        /// The offending key, relative to the NATS section.
        key: String,
        /// What is wrong with it and what would be accepted.
        reason: String,
    },

    /// The server rejected the credentials while connecting.
    #[error(
        "NATS server(s) {servers} rejected the connection: {error} \
         (check user/password, token, nkey seed or credentials file)"
    )]
    AuthorizationViolation {
        /// The configured server list (secrets masked).
        servers: String,
        /// What the client library reported.
        error: async_nats::ConnectError,
    },

    /// No configured server could be reached, or the handshake (TLS included) failed.
    #[error("could not connect to NATS server(s) {servers}: {error}")]
    Connect {
        /// The configured server list (secrets masked).
        servers: String,
        /// What the client library reported.
        error: async_nats::ConnectError,
    },

    /// The server reported that this connection may not publish to or subscribe to a subject.
    #[error("NATS permissions violation: {message}")]
    PermissionViolation {
        /// The server's message, which names the operation and the subject.
        message: String,
    },

    /// Publishing a message failed.
    #[error("could not publish to NATS subject `{subject}`: {error}")]
    Publish {
        /// The subject that was published to.
        subject: String,
        /// What the client library reported.
        error: async_nats::PublishError,
    },

    /// Subscribing failed.
    #[error("could not subscribe to NATS subject `{subject}`: {error}")]
    Subscribe {
        /// The subject (or wildcard) that was subscribed to.
        subject: String,
        /// What the client library reported.
        error: async_nats::SubscribeError,
    },

    /// Flushing buffered messages to the server failed.
    #[error("could not flush the NATS connection: {error}")]
    Flush {
        /// What the client library reported.
        error: async_nats::client::FlushError,
    },
}

impl BusError {
    /// A [`BusError::Config`] for `key`.
    pub fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        BusError::Config { key: key.into(), reason: reason.into() }
    }

    /// A [`BusError::Config`] for a file named by `key` that cannot be read.
    pub(crate) fn unreadable_file(key: &str, path: &Path, error: &std::io::Error) -> Self {
        BusError::config(key, format!("cannot read {}: {error}", path.display()))
    }
}
