//! Test support (placeholder, being written).
