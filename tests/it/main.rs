//! Integration tests: one binary, one module per area, each against a real nats-server.

mod support;
