//! NATS connectivity (placeholder, being written).
