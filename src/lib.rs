//! structured-sink: filters structured blocks out of streamed LLM text on NATS.
//!
//! Data flows one way:
//!
//! ```text
//! NATS subscription ─► codec (decode) ─► shard (route by message_id) ─► pipeline per stream ─► codec (encode) ─► publish
//! ```
//!
//! * [`scanner`] and [`pipeline`] are the pure core: no tokio, NATS or protobuf; time is an argument and
//!   output goes into a sink the caller provides.
//! * [`payload`] turns a block's raw text into values (fences, YAML, JSON chain, partial JSON).
//! * [`codec`] is the only place that knows wire formats (geppetto JSON in, protobuf out, subjects).
//! * [`bus`] knows NATS, not the domain.

pub mod bus;
pub mod codec;
pub mod config;
pub mod demo;
pub mod http;
pub mod metrics;
pub mod payload;
pub mod pipeline;
#[cfg(any(test, feature = "fuzzing"))]
pub mod properties;
pub mod replay;
pub mod scanner;
pub mod service;
pub mod shard;
pub mod telemetry;
pub mod typed;
