//! `structured-sink replay`: the service's processing, offline, from JSON Lines to JSON Lines.
//!
//! Reads geppetto events (one JSON object per line), runs them through the same decoding, stream
//! table, pipeline and encoding the service runs, in a single shard, and writes one JSON object
//! per published message, in publish order:
//! `{"subject": ..., "type": "<full protobuf name>", "message": <proto3 JSON, proto field names>}`.
//! Events that are not text are written as they would be forwarded (type `geppetto.Event`) when
//! a pass-through subject is configured. A line that is not a valid event is reported on the
//! error stream with its line number and cause, and processing continues. Streams still open at
//! the end of the input are closed with reason `shutdown`, as the service does when it stops.
//!
//! It knows nothing of NATS or tokio; output is deterministic for a given input and
//! configuration (the clock is only used for idle expiry, which cannot trigger here because the
//! table's idle timeout is not consulted).

use std::io::{self, BufRead, Write};
use std::time::{Duration, Instant};

use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};

use crate::codec::inbound::decode;
use crate::codec::outbound::{Publication, GEPPETTO_EVENT_TYPE};
use crate::config::Config;
use crate::shard::table::{Disposition, StreamTable, TableLimits};
#[cfg(doc)]
use crate::typed::SchemaRegistry;

/// What a replay saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplaySummary {
    /// Input lines read (blank lines included).
    pub lines: usize,
    /// Lines refused (reported on the error stream).
    pub rejected: usize,
    /// Messages written.
    pub published: usize,
}

/// Replays `input` under `config`, writing messages to `out` and problems to `err`.
pub fn replay(
    config: &Config,
    input: impl BufRead,
    mut out: impl Write,
    mut err: impl Write,
) -> io::Result<ReplaySummary> {
    let registry = config.load_schemas().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let (pipeline, encoder) =
        config.processing(&registry).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let limits = TableLimits {
        // Offline there is no idle time; the stream bound still applies, as in one shard.
        idle_timeout: Duration::MAX,
        max_streams: config.shards.max_streams,
        finished_memory: config.shards.finished_memory,
    };
    let mut table = StreamTable::new(pipeline, encoder, limits);
    let mut summary = ReplaySummary::default();
    let now = Instant::now();
    let mut published = Vec::new();
    for (index, line) in input.lines().enumerate() {
        let line = line?;
        let number = index + 1;
        summary.lines += 1;
        if line.trim().is_empty() {
            continue;
        }
        let event = match decode(line.as_bytes(), config.input.max_event_bytes) {
            Ok(event) => event,
            Err(e) => {
                summary.rejected += 1;
                writeln!(err, "line {number}: {e}")?;
                continue;
            }
        };
        match table.apply(&event, None, now, &mut |p| published.push(p), &mut |_| {}) {
            Disposition::Applied | Disposition::Duplicate => {}
            Disposition::PassThrough if !config.input.pass_through_subject.is_empty() => {
                let message: serde_json::Value = serde_json::from_str(&line)?;
                let record = serde_json::json!({
                    "subject": config.input.pass_through_subject,
                    "type": "geppetto.Event",
                    "message": message,
                });
                summary.published += 1;
                writeln!(out, "{record}")?;
            }
            Disposition::PassThrough => {}
            Disposition::Late => {
                summary.rejected += 1;
                writeln!(err, "line {number}: event for stream {} after its end", event.stream.stream_id)?;
            }
        }
        for p in published.drain(..) {
            summary.published += 1;
            write_publication(&mut out, &p, registry.descriptor_pool())?;
        }
    }
    table.close_all("shutdown", &mut |p| published.push(p));
    for p in published {
        summary.published += 1;
        write_publication(&mut out, &p, registry.descriptor_pool())?;
    }
    out.flush()?;
    Ok(summary)
}

/// Writes one publication as a JSON line.
pub fn write_publication(out: &mut impl Write, p: &Publication, pool: &DescriptorPool) -> io::Result<()> {
    let message = publication_json(p, pool)?;
    // Written field by field so that the keys keep this order.
    writeln!(
        out,
        r#"{{"subject":{},"type":{},"message":{message}}}"#,
        serde_json::Value::from(p.subject.as_ref()),
        serde_json::Value::from(p.type_name)
    )
}

/// The proto3 JSON form (proto field names) of a publication's message. `pool` must know the
/// message type and any type inside its `Any` fields ([`SchemaRegistry::descriptor_pool`]).
pub fn publication_json(p: &Publication, pool: &DescriptorPool) -> io::Result<serde_json::Value> {
    let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
    if p.type_name == GEPPETTO_EVENT_TYPE {
        return serde_json::from_slice(&p.payload).map_err(|e| invalid(e.to_string()));
    }
    let descriptor = pool
        .get_message_by_name(p.type_name)
        .ok_or_else(|| invalid(format!("unknown message type {}", p.type_name)))?;
    let message = DynamicMessage::decode(descriptor, p.payload.clone()).map_err(|e| invalid(e.to_string()))?;
    let options = SerializeOptions::new().use_proto_field_name(true);
    message.serialize_with_options(serde_json::value::Serializer, &options).map_err(|e| invalid(e.to_string()))
}
