//! Wire formats: geppetto event JSON in, protobuf (schema v1) out, and subject names.
//!
//! The only module that knows what bytes look like on the bus. It turns a NATS payload into an
//! [`inbound::InboundEvent`] for the pipeline, and a pipeline [`crate::pipeline::Output`] into a
//! [`outbound::Publication`] (subject, headers' values, bytes). It knows nothing of connections,
//! shards or time. Generated protobuf code lives in [`proto`] and is never edited.

pub mod inbound;
pub mod outbound;
pub mod proto;
pub mod subject;
