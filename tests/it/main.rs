//! Integration tests: one binary, one module per area. Tests that need NATS start their own
//! `nats-server` on a random port (see `support`).

mod cli;
mod compose;
mod deploy;
mod harness;
mod hostile;
mod reconnect;
mod replay;
mod scale;
mod service;
mod support;
mod typed;
