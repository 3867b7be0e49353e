//! Payload decoding (placeholder, being written).
