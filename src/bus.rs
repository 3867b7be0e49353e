//! The NATS boundary: how the service connects to the bus and what the connection reports.
//!
//! This module owns everything that knows about NATS itself: the operator's connection
//! settings ([`NatsConfig`], with secrets masked for printing), building an `async_nats`
//! client from them ([`connect()`]: authentication of each kind, TLS, reconnect backoff, buffer
//! sizes), turning the client's connection events into our own [`ConnectionEvent`] (logged
//! here, counted by whoever passes the callback), header values built without async-nats'
//! per-character scan ([`header_value`]), and the errors of this boundary ([`BusError`]).
//!
//! It does not know about the domain: no geppetto events, streams, subjects of the product or
//! protobuf. Callers (the service) decide what to subscribe to and what to publish; this module
//! only gives them a well-configured connection and clear errors.

mod config;
mod connect;
mod error;
mod header;

pub(crate) use config::mask_url_secret;
pub use config::{NatsConfig, TlsConfig, MASK};
pub use connect::{connect, parse_server_version, round_trip, server_version, ConnectionEvent};
pub use error::BusError;
pub use header::header_value;
