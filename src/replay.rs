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
use crate::shard::table::{Disposition, InputPosition, StreamTable, TableLimits};
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
    // Lines as bytes: a line that is not UTF-8 is a bad event like any other (the service decodes
    // bytes too), not the end of the replay.
    for (index, line) in input.split(b'\n').enumerate() {
        let mut line = line?;
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        let number = index + 1;
        summary.lines += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let event = match decode(&line, config.input.max_event_bytes) {
            Ok(event) => event,
            Err(e) => {
                summary.rejected += 1;
                writeln!(err, "line {number}: {e}")?;
                continue;
            }
        };
        let disposition = table.apply(&event, InputPosition::default(), now, &mut |p| published.push(p), &mut |_| {});
        // An event's outputs come before its forwarded copy, as the service publishes them.
        for p in published.drain(..) {
            summary.published += write_or_report(&mut out, &mut err, &p, registry.descriptor_pool(), number)?;
        }
        match disposition {
            Disposition::Applied | Disposition::Duplicate => {}
            Disposition::PassThrough if !config.input.pass_through_subject.is_empty() => {
                // The service forwards the bytes unchanged; serde_json refuses a few that the event
                // decoder skips in fields it does not read (a number beyond f64, a lone surrogate).
                match serde_json::from_slice::<serde_json::Value>(&line) {
                    Ok(message) => {
                        let record = serde_json::json!({
                            "subject": config.input.pass_through_subject,
                            "type": "geppetto.Event",
                            "message": message,
                        });
                        summary.published += 1;
                        writeln!(out, "{record}")?;
                    }
                    Err(e) => writeln!(err, "line {number}: forwarded unchanged, but cannot be shown as JSON: {e}")?,
                }
            }
            Disposition::PassThrough => {}
            Disposition::Late => {
                summary.rejected += 1;
                writeln!(err, "line {number}: event for stream {} after its end", event.stream.stream_id)?;
            }
        }
    }
    table.close_all("shutdown", &mut |p| published.push(p));
    for p in published {
        summary.published += write_or_report(&mut out, &mut err, &p, registry.descriptor_pool(), summary.lines)?;
    }
    out.flush()?;
    Ok(summary)
}

/// Writes `p` (caused by line `number`) and returns 1, or reports on `err` why it cannot be shown
/// and returns 0: one message that cannot be rendered does not end the replay.
fn write_or_report(
    out: &mut impl Write,
    err: &mut impl Write,
    p: &Publication,
    pool: &DescriptorPool,
    number: usize,
) -> io::Result<usize> {
    match write_publication(out, p, pool) {
        Ok(()) => Ok(1),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            writeln!(err, "line {number}: message {} on {} cannot be shown: {e}", p.msg_id, p.subject)?;
            Ok(0)
        }
        Err(e) => Err(e),
    }
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
    message_json(pool, p.type_name, &p.payload)
}

/// The proto3 JSON form (proto field names) of a message of type `type_name` (an output's
/// `Structured-Sink-Type` header) encoded in `payload`; a forwarded geppetto event is JSON already.
/// How a downstream handler sees what replay shows.
pub fn message_json(pool: &DescriptorPool, type_name: &str, payload: &[u8]) -> io::Result<serde_json::Value> {
    let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
    if type_name == GEPPETTO_EVENT_TYPE {
        return serde_json::from_slice(payload).map_err(|e| invalid(e.to_string()));
    }
    let descriptor =
        pool.get_message_by_name(type_name).ok_or_else(|| invalid(format!("unknown message type {type_name}")))?;
    let message = DynamicMessage::decode(descriptor, payload).map_err(|e| invalid(e.to_string()))?;
    let options = SerializeOptions::new().use_proto_field_name(true);
    message.serialize_with_options(serde_json::value::Serializer, &options).map_err(|e| invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_the_service_would_take_or_refuse_never_ends_the_replay() {
        let mut config = Config::default();
        config.input.pass_through_subject = "chat.passthrough".into();
        let mut input = Vec::new();
        input.extend_from_slice(b"{\"type\":\"partial\",\"meta\":{\"message_id\":\"m\"},\"delta\":\"a \"}\n");
        // Not UTF-8: refused, like a bad event.
        input.extend_from_slice(b"{\"type\":\"partial\",\"meta\":{\"message_id\":\"m\"},\"delta\":\"\xff\"}\n");
        // Not text, so forwarded unchanged; serde_json cannot show either as a value.
        input.extend_from_slice(b"{\"type\":\"usage\",\"meta\":{\"message_id\":\"u\"},\"n\":1e400}\r\n");
        input.extend_from_slice(b"{\"type\":\"usage\",\"meta\":{\"message_id\":\"u\"},\"s\":\"\\ud800\"}\n");
        input.extend_from_slice(b"{\"type\":\"final\",\"meta\":{\"message_id\":\"m\"},\"text\":\"a b\"}\n");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let summary = replay(&config, input.as_slice(), &mut out, &mut err).unwrap();
        let (out, err) = (String::from_utf8(out).unwrap(), String::from_utf8(err).unwrap());
        assert_eq!((summary.lines, summary.rejected), (5, 1), "{err}");
        assert!(err.contains("line 2: invalid JSON"), "{err}");
        assert!(err.contains("line 3: forwarded unchanged") && err.contains("line 4: forwarded unchanged"), "{err}");
        // The final after them was applied: the stream's last message carries the whole text.
        let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        assert_eq!((last["message"]["final"].as_bool(), last["message"]["text"].as_str()), (Some(true), Some("a b")));
    }
}
