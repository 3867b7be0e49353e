//! Per-stream state, owned by shard workers.
//!
//! [`table::StreamTable`] is one shard's state: the open streams of the messages routed to it,
//! their expiry and eviction, and the memory of recently finished streams. It is plain data
//! driven by the caller (time is an argument), so `replay` uses it directly and the service runs
//! one per worker task ([`worker`]), routing every event of a message id to the same worker.
//! `segments` indexes a table's open segments by message and provider call.

mod segments;
pub mod table;
pub mod worker;
