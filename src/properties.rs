//! Invariants that must hold for any input, written once as plain functions that panic with a
//! description when one breaks.
//!
//! They are the single definition shared by the fuzz targets (`fuzz/fuzz_targets/`, run with
//! cargo-fuzz), the proptest campaigns below (long runs with `STRUCTURED_SINK_CAMPAIGN_CASES`), and
//! the named regression tests for inputs a fuzzer once broke. Each property states what it
//! checks in its doc. The module is pure (no tokio, no NATS) and compiled for tests and with the
//! `fuzzing` feature only; nothing in the service uses it.

use std::sync::OnceLock;

use serde_json::Value;

use crate::codec::inbound::{decode, EventAction, MAX_ID_BYTES};
use crate::payload::{self, PartialJson, PayloadFormat, Snapshotter};
use crate::pipeline::{
    Emit, MalformedPolicy, Output, OutputKind, Pipeline, PipelineLimits, StreamState, TagKind, TagSpec,
};
use crate::typed::SchemaRegistry;

/// An owned copy of one pipeline output, comparable across runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Rec {
    /// Visible text.
    Text(String),
    /// The final text output: delta, whole text, reason.
    Final(String, Option<String>, String),
    /// A block opened (item number).
    Started(u32),
    /// Raw block text.
    Delta(u32, String),
    /// A block completed: raw payload and error.
    Completed(u32, String, Option<String>),
    /// Thinking began.
    ThinkStart(u32),
    /// Thinking text.
    Think(u32, String),
    /// Thinking ended (closed by its tag or not).
    ThinkEnd(u32, bool),
    /// A tool call: tool name, server name and arguments, or the error.
    Tool(u32, Result<(String, String, Value), String>),
    /// A live snapshot of a block's value.
    Snapshot(u32, Value),
}

/// Collects outputs as [`Rec`]s with their sequence numbers, checking the per-output rules on
/// the way (no empty text or block delta is ever emitted).
#[derive(Debug, Default)]
pub struct Recorder {
    /// The outputs, in order.
    pub outs: Vec<Rec>,
    /// Their sequence numbers.
    pub seqs: Vec<u64>,
}

impl Emit for Recorder {
    fn emit(&mut self, o: Output<'_>) {
        self.seqs.push(o.seq);
        let rec = match o.kind {
            OutputKind::Text { delta, finish: None, .. } => {
                assert!(!delta.is_empty(), "empty text emitted");
                Rec::Text(delta.to_owned())
            }
            OutputKind::Text { delta, text, finish: Some(f), .. } => {
                Rec::Final(delta.to_owned(), text.map(str::to_owned), f.reason.to_owned())
            }
            OutputKind::BlockStarted { item } => Rec::Started(item.number),
            OutputKind::BlockDelta { item, raw } => {
                assert!(!raw.is_empty(), "empty block delta emitted");
                Rec::Delta(item.number, raw.to_owned())
            }
            OutputKind::BlockSnapshot { item, value } => Rec::Snapshot(item.number, value.clone()),
            OutputKind::BlockCompleted { item, raw, error, .. } => {
                Rec::Completed(item.number, raw.to_owned(), error.map(str::to_owned))
            }
            OutputKind::ThinkingStarted { item } => Rec::ThinkStart(item.number),
            OutputKind::ThinkingDelta { item, text } => Rec::Think(item.number, text.to_owned()),
            OutputKind::ThinkingEnded { item, closed } => Rec::ThinkEnd(item.number, closed),
            OutputKind::ToolCall { item, call, .. } => Rec::Tool(
                item.number,
                call.map(|c| (c.tool_name.clone(), c.server_name.clone(), c.arguments.clone())).map_err(str::to_owned),
            ),
        };
        self.outs.push(rec);
    }
}

/// The chunking-independent content of a run: adjacent text, block and thinking deltas merged,
/// the final's delta joined to the text before it, snapshots left out (their timing depends on
/// the chunking by design; their values are checked by [`snapshots_are_bounded`]).
pub fn merge(outs: Vec<Rec>) -> Vec<Rec> {
    let mut merged: Vec<Rec> = Vec::new();
    for o in outs.into_iter().filter(|o| !matches!(o, Rec::Snapshot(..))) {
        match (merged.last_mut(), o) {
            (Some(Rec::Text(a)), Rec::Text(b)) => a.push_str(&b),
            (Some(Rec::Delta(i, a)), Rec::Delta(j, b)) if *i == j => a.push_str(&b),
            (Some(Rec::Think(i, a)), Rec::Think(j, b)) if *i == j => a.push_str(&b),
            // The final's delta is text like any other.
            (Some(Rec::Text(a)), Rec::Final(d, text, r)) => {
                a.push_str(&d);
                let a = std::mem::take(a);
                merged.pop();
                merged.push(Rec::Final(a, text, r));
            }
            (_, o) => merged.push(o),
        }
    }
    merged
}

/// The tags the properties run with: a block, a block with an 8-byte capture limit, thinking
/// and tool calls, so that every capture path is reachable from short inputs.
pub fn tags() -> Vec<TagSpec> {
    vec![
        TagSpec::new("core:x:v1", TagKind::Block),
        TagSpec { max_capture_bytes: Some(8), ..TagSpec::new("small:y:v1", TagKind::Block) },
        TagSpec { payload: PayloadFormat::Json, ..TagSpec::new("core:j:v1", TagKind::Block) },
        TagSpec::new("thinking", TagKind::Channel),
        TagSpec::new("tool", TagKind::ToolCall),
    ]
}

/// Pipeline settings a fuzzer can vary with two bits.
pub fn limits(restore: bool, unescape: bool) -> PipelineLimits {
    PipelineLimits {
        malformed: if restore { MalformedPolicy::Restore } else { MalformedPolicy::Drop },
        unescape_text: unescape,
        ..PipelineLimits::default()
    }
}

/// Runs one stream fed `input` cut at `cuts` (indexes into `input`, any order, out-of-range
/// ones clamped) as raw bytes, then a final without text. After every delta the bytes held back
/// stay within [`Pipeline::max_held_len`]; sequence numbers count from 1 without gaps.
pub fn run_chunked(limits: &PipelineLimits, input: &[u8], cuts: &[usize]) -> Recorder {
    let mut points: Vec<usize> = cuts.iter().map(|&c| c.min(input.len())).collect();
    points.push(input.len());
    points.sort_unstable();
    let mut pipeline = Pipeline::new(tags(), limits.clone()).expect("valid tags");
    let bound = pipeline.max_held_len();
    let mut stream = StreamState::new();
    let mut sink = Recorder::default();
    let mut last = 0;
    for cut in points {
        pipeline.feed_bytes(&mut stream, &input[last..cut], &mut sink);
        let held = stream.held_len();
        assert!(held <= bound, "{held} bytes held back, bound {bound}");
        last = cut;
    }
    pipeline.finish(&mut stream, None, "stop", &mut sink);
    assert_eq!(sink.seqs, (1..=sink.seqs.len() as u64).collect::<Vec<_>>(), "sequence numbers have gaps");
    sink
}

/// **Chunking invariance.** Any cutting of any bytes gives the same visible text, thinking, block
/// payloads, tool calls and outcomes as feeding them in one piece; nothing panics; held-back
/// bytes stay bounded (see [`run_chunked`]). When the input is UTF-8, feeding it as `&str` at
/// character boundaries agrees too.
pub fn chunking_invariance(input: &[u8], cuts: &[usize], restore: bool, unescape: bool) {
    let limits = limits(restore, unescape);
    let whole = merge(run_chunked(&limits, input, &[]).outs);
    let chunked = merge(run_chunked(&limits, input, cuts).outs);
    assert_eq!(chunked, whole, "chunked run differs from the single-chunk run");
    if let Ok(text) = std::str::from_utf8(input) {
        let mut pipeline = Pipeline::new(tags(), limits).expect("valid tags");
        let mut stream = StreamState::new();
        let mut sink = Recorder::default();
        let mut last = 0;
        for cut in char_cuts(text, cuts) {
            pipeline.feed(&mut stream, &text[last..cut], &mut sink);
            last = cut;
        }
        pipeline.finish(&mut stream, None, "stop", &mut sink);
        assert_eq!(merge(sink.outs), whole, "`feed` and `feed_bytes` disagree");
    }
}

/// **Event decoding.** Decoding arbitrary bytes never panics; the single-pass reader either
/// leaves a payload to serde_json or reads exactly the fields serde_json reads; an accepted event
/// is within the size limit, has a usable message id and stream id (non-empty, at most [`MAX_ID_BYTES`], no
/// control characters), and decodes to the same event again; an error has a stable reason code.
pub fn event_decoding(payload: &[u8]) {
    const LIMIT: usize = 64 * 1024;
    if let Err(difference) = crate::codec::inbound::reader_agrees_with_serde(payload) {
        panic!("the single-pass reader disagrees with serde_json: {difference}");
    }
    match decode(payload, LIMIT) {
        Ok(event) => {
            assert!(payload.len() <= LIMIT);
            for id in [&event.stream.message_id, &event.stream.stream_id] {
                assert!(!id.is_empty() && id.len() <= MAX_ID_BYTES, "unusable id of {} bytes", id.len());
                assert!(!id.chars().any(char::is_control), "an id with control characters was accepted");
            }
            let separators = event.stream.message_id.contains(['%', '/']);
            assert_eq!(event.stream.message_id_escapes, separators, "the id scan missed or invented a separator");
            let key = event.stream.key(&mut String::new()).to_owned();
            assert!(!key.is_empty() && !key.chars().any(char::is_control), "an unusable stream key");
            if let EventAction::Finish { reason, .. } = &event.action {
                assert!(!reason.is_empty(), "a finish without a reason");
            }
            let owned = event.clone().into_owned();
            assert_eq!(owned, event, "into_owned changed the event");
            let detached = event.clone().detach(payload);
            assert_eq!(detached.attach(payload), event, "detaching and attaching changed the event");
            assert_eq!(detached.message_id(payload), event.stream.message_id);
            assert_eq!(decode(payload, LIMIT).ok(), Some(event), "decoding is not deterministic");
        }
        Err(e) => {
            assert!(!e.code().is_empty());
            // Errors are logged: they carry positions, never payload text.
            let message = e.to_string();
            assert!(message.len() < 128, "an error message of {} bytes: {message}", message.len());
        }
    }
}

/// **Payload parsing.** YAML, the JSON chain and raw decoding never panic on any text; the
/// partial JSON parser fed the text in pieces ends in the same state as fed at once, and when
/// the text is one complete JSON object or array its snapshot is that value.
pub fn payload_parsing(text: &str, cuts: &[usize]) {
    for format in [PayloadFormat::Yaml, PayloadFormat::Json, PayloadFormat::Raw] {
        let _ = payload::decode(format, text);
    }
    let _ = payload::extract_json(text);
    let _ = payload::fence::find_fence(text);

    let whole = {
        let mut parser = PartialJson::new();
        parser.feed(text);
        (parser.snapshot(), parser.is_complete(), parser.error().cloned())
    };
    let mut parser = PartialJson::new();
    let mut last = 0;
    for cut in char_cuts(text, cuts) {
        parser.feed(&text[last..cut]);
        last = cut;
    }
    let chunked = (parser.snapshot(), parser.is_complete(), parser.error().cloned());
    assert_eq!(chunked, whole, "partial JSON depends on the chunking");
    // Only objects and arrays: the parser skips everything before the first `{` or `[` as prose
    // (a fence line, "Here it is:"), so a top-level string is skipped up to a bracket inside it.
    if let Ok(value @ (Value::Object(_) | Value::Array(_))) = serde_json::from_str::<Value>(text) {
        if whole.1 && whole.2.is_none() {
            assert_eq!(whole.0.as_ref(), Some(&value), "a complete document snapshots as itself");
        }
    }
}

/// **Snapshot cost.** For any payload and chunking, live snapshots of every format stay within
/// the work budget (`(budget + 1)` × bytes received), and the final value equals decoding the
/// whole text from scratch.
pub fn snapshots_are_bounded(text: &str, cuts: &[usize], budget: usize) {
    for format in [PayloadFormat::Yaml, PayloadFormat::Json] {
        let mut snapshotter = Snapshotter::new(format).with_min_growth(1).with_budget(budget);
        let mut last = 0;
        for cut in char_cuts(text, cuts) {
            let _ = snapshotter.push(&text[last..cut]);
            last = cut;
        }
        let limit = (budget + 1) * text.len();
        assert!(snapshotter.parsed_bytes() <= limit, "{format:?}: {} > {limit}", snapshotter.parsed_bytes());
        assert_eq!(snapshotter.complete(text), payload::decode(format, text));
    }
}

/// A schema with a recursive type, every scalar kind, enums, maps, oneofs and well-known types,
/// for [`typed_conversion`].
const FUZZ_PROTO: &str = r#"syntax = "proto3";
package fuzz.v1;
import "structuredsink/v1/options.proto";
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";
import "google/protobuf/struct.proto";

message Node {
  option (structuredsink.v1.block) = { tag: "fuzz:node:v1" };
  string name = 1;
  Node child = 2;
  repeated Node children = 3;
  map<string, Node> named = 4;
  int32 i32 = 5;
  uint64 u64 = 6;
  sint32 s32 = 7;
  double f64 = 8;
  float f32 = 9;
  bool flag = 10;
  bytes blob = 11;
  Kind kind = 12;
  oneof choice {
    string text = 13;
    int64 number = 14;
  }
  google.protobuf.Timestamp at = 15;
  google.protobuf.Int32Value wrapped = 16;
  google.protobuf.Struct extra = 17;
  map<int32, string> by_number = 18;
  repeated Kind kinds = 19;
}

enum Kind {
  KIND_UNSPECIFIED = 0;
  KIND_A = 1;
}
"#;

/// The registry of [`FUZZ_PROTO`] plus the built-in block types, compiled once.
fn fuzz_registry() -> &'static SchemaRegistry {
    static REGISTRY: OnceLock<SchemaRegistry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::write(dir.path().join("fuzz.proto"), FUZZ_PROTO).expect("write the fuzz schema");
        SchemaRegistry::load(&[dir.path().to_path_buf()]).expect("the fuzz schema compiles").with_max_depth(16)
    })
}

/// **Typed conversion.** Converting any JSON value into any registered block type never panics
/// or recurses without bound; a strict success implies the partial conversion gives the same
/// message; a converted message survives the `Any` encoding.
pub fn typed_conversion(json: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(json) else { return };
    for block in fuzz_registry().block_types() {
        let partial = block.convert_partial(&value);
        match block.convert(&value) {
            Ok(message) => {
                // (`DynamicMessage`'s `Debug` prints its descriptor, endlessly for a recursive
                // type: messages are shown as JSON.)
                assert!(
                    partial.as_ref().is_some_and(|partial| same_message(partial, &message)),
                    "{}: partial {} differs from strict {}",
                    block.tag(),
                    partial.as_ref().map_or("none".into(), show),
                    show(&message)
                );
                let any = block.to_any(&message);
                let decoded = prost_reflect::DynamicMessage::decode(block.descriptor().clone(), any.value.as_slice())
                    .expect("an encoded message decodes");
                assert!(
                    same_message(&decoded, &message),
                    "{}: {} does not round-trip through Any",
                    block.tag(),
                    show(&message)
                );
            }
            Err(e) => assert!(e.to_string().len() < 4096, "{}: an error of {} bytes", block.tag(), e.to_string().len()),
        }
    }
}

/// Whether two messages are the same message: equal, or else equal in proto3 JSON. `==` is false
/// for a message and its copy when a float field holds NaN (`"NaN"` is valid proto3 JSON for one;
/// there it is a string), and for a message and its decoded encoding when a field was set to its
/// default (`"i32": 0` is not encoded and decodes as unset, the same message on the wire).
fn same_message(a: &prost_reflect::DynamicMessage, b: &prost_reflect::DynamicMessage) -> bool {
    a == b || matches!((serde_json::to_value(a), serde_json::to_value(b)), (Ok(a), Ok(b)) if a == b)
}

/// A message as JSON, for assertion messages.
fn show(message: &prost_reflect::DynamicMessage) -> String {
    serde_json::to_string(message).unwrap_or_else(|e| format!("<{e}>"))
}

/// `cuts` clamped to `text` and moved back to character boundaries, sorted, ending at the end.
fn char_cuts(text: &str, cuts: &[usize]) -> Vec<usize> {
    let mut points: Vec<usize> = cuts.iter().map(|&c| c.min(text.len())).collect();
    for p in &mut points {
        while !text.is_char_boundary(*p) {
            *p -= 1;
        }
    }
    points.push(text.len());
    points.sort_unstable();
    points
}

/// Long runs of every property over inputs biased towards the tag syntax: 256 cases each by
/// default, `STRUCTURED_SINK_CAMPAIGN_CASES=<n>` for a campaign (the same properties the fuzz
/// targets check, for machines where cargo-fuzz cannot run).
#[cfg(test)]
mod campaigns {
    use proptest::prelude::*;

    use super::*;

    fn cases() -> u32 {
        std::env::var("STRUCTURED_SINK_CAMPAIGN_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    }

    /// Bytes that are mostly tag syntax, escapes, JSON and multi-byte characters, with some noise.
    fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            "[a-z :\\n-]{0,6}".prop_map(String::into_bytes),
            Just(b"<".to_vec()),
            Just(b"</".to_vec()),
            Just(b">".to_vec()),
            Just(b"<core:x:v1>".to_vec()),
            Just(b"</core:x:v1>".to_vec()),
            Just(b"<core:j:v1>".to_vec()),
            Just(b"</core:j:v1>".to_vec()),
            Just(b"<small:y:v1>".to_vec()),
            Just(b"</small:y:v1>".to_vec()),
            Just(b"<thinking>".to_vec()),
            Just(b"</thinking>".to_vec()),
            Just(b"<tool>".to_vec()),
            Just(b"</tool>".to_vec()),
            Just(br#"{"tool_name":"t","arguments":{"a":"</tool>\"x"}}"#.to_vec()),
            Just(b"```yaml\nk: [1, {a: b}]\n```".to_vec()),
            Just(br#"{"a": [1, "\u00e9", {"b": null}]}"#.to_vec()),
            Just(b"\\u003c\\n\\\"\\ud83d\\ude00\\".to_vec()),
            Just("é€😀".as_bytes().to_vec()),
            Just(vec![0xff, 0xc3]),
            Just(vec![0xf0, 0x9f]),
            prop::collection::vec(any::<u8>(), 0..4),
        ];
        prop::collection::vec(piece, 0..32).prop_map(|pieces| pieces.concat())
    }

    fn cuts() -> impl Strategy<Value = Vec<usize>> {
        prop::collection::vec(0usize..2048, 0..24)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn campaign_chunking_invariance(input in hostile_bytes(), cuts in cuts(), restore: bool, unescape: bool) {
            chunking_invariance(&input, &cuts, restore, unescape);
        }

        #[test]
        fn campaign_event_decoding(event in event_json()) {
            event_decoding(&event);
        }

        #[test]
        fn campaign_event_decoding_of_geppetto_shapes(event in geppetto_json()) {
            event_decoding(&event);
        }

        #[test]
        fn campaign_payload_parsing(input in hostile_bytes(), cuts in cuts()) {
            let text = String::from_utf8_lossy(&input);
            payload_parsing(&text, &cuts);
        }

        #[test]
        fn campaign_snapshots_are_bounded(input in hostile_bytes(), cuts in cuts(), budget in 0usize..10) {
            let text = String::from_utf8_lossy(&input);
            snapshots_are_bounded(&text, &cuts, budget);
        }

        #[test]
        fn campaign_typed_conversion(value in json_value()) {
            typed_conversion(value.to_string().as_bytes());
        }
    }

    /// Events shaped like geppetto's, with fields of every type in every place, mutated.
    fn event_json() -> impl Strategy<Value = Vec<u8>> {
        let scalar = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z.*> \\x00-\\x1f\u{80}-\u{10ffff}]{0,12}".prop_map(Value::from),
        ];
        let kind = prop_oneof![
            Just("partial"),
            Just("final"),
            Just("text-delta"),
            Just("text-segment-finished"),
            Just("interrupt"),
            Just("error"),
            Just("tool-call"),
            Just(""),
        ];
        (kind, scalar.clone(), scalar.clone(), scalar, any::<bool>(), prop::collection::vec(any::<u8>(), 0..3))
            .prop_map(|(kind, id, delta, text, segment, noise)| {
                let mut event =
                    serde_json::json!({"type": kind, "meta": {"message_id": id}, "delta": delta, "text": text});
                if segment {
                    event["correlation"] = serde_json::json!({"segment_id": "s-1"});
                }
                let mut bytes = serde_json::to_vec(&event).expect("serializable");
                // Some noise at a position given by the noise itself, to reach the error paths.
                if let Some(&at) = noise.first() {
                    let at = usize::from(at) % (bytes.len() + 1);
                    bytes.splice(at..at, noise[1..].iter().copied());
                }
                bytes
            })
    }

    /// Geppetto events written the way producers write them (Go's escapes, white space, numbers,
    /// nested values the decoder skips, `null`s, repeated and escaped keys), then mutated byte by
    /// byte: the shapes the single-pass reader handles and the near misses it must leave to serde.
    fn geppetto_json() -> impl Strategy<Value = Vec<u8>> {
        let string = prop_oneof![
            Just(r#""plain""#.to_owned()),
            Just(r#""""#.to_owned()),
            Just(r#""3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071""#.to_owned()),
            Just(r#""a \u003ctag\u003e \u0026 \n\t\"q\" \\ \/ \b\f\r""#.to_owned()),
            Just(r#""caf\u00e9 é — \u2028""#.to_owned()),
            Just(r#""\ud83d\ude00 pair""#.to_owned()),
            Just(r#""\ud800 lone""#.to_owned()),
            Just(r#""\uDFFF""#.to_owned()),
            Just(r#""bad \x escape""#.to_owned()),
            Just(r#""short \u12""#.to_owned()),
            Just("\"raw\u{1}control\"".to_owned()),
            Just("\"\u{7f}del and 😀\"".to_owned()),
            "[a-z0-9 <>&\\\\\"\u{e9}\n]{0,40}".prop_map(|t| serde_json::to_string(&t).expect("a string serializes")),
        ];
        let scalar = prop_oneof![
            string.clone(),
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("false".to_owned()),
            Just("0".to_owned()),
            Just("-12.5e+3".to_owned()),
            Just("1E9".to_owned()),
            Just("01".to_owned()),
            Just("1.".to_owned()),
            Just("-".to_owned()),
            Just("2e".to_owned()),
            Just("nul".to_owned()),
        ];
        let value = scalar.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(|items| format!("[{}]", items.join(","))),
                prop::collection::vec(("[a-z_]{1,6}", inner), 0..4).prop_map(|members| {
                    let members: Vec<String> = members.into_iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
                    format!("{{ {} }}", members.join(" , "))
                }),
            ]
        });
        let key = prop_oneof![
            Just("type"),
            Just("delta"),
            Just("completion"),
            Just("text"),
            Just("finish_reason"),
            Just("sequence"),
            Just("error"),
            Just("error_string"),
            Just("meta"),
            Just("correlation"),
            Just("t\\u0079pe"),
            Just("kl\u{e9}"),
        ];
        let meta_key = prop_oneof![
            Just("message_id"),
            Just("session_id"),
            Just("run_id"),
            Just("inference_id"),
            Just("turn_id"),
            Just("stop_reason"),
            Just("segment_id"),
            Just("provider_call_id"),
            Just("model"),
            Just("usage"),
        ];
        let nested = prop::collection::vec((meta_key, prop_oneof![3 => string.clone(), 1 => value.clone()]), 0..6)
            .prop_map(|members| {
                let members: Vec<String> = members.into_iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                format!("{{{}}}", members.join(","))
            });
        let member_value = prop_oneof![4 => string, 2 => nested, 1 => value];
        let kind = prop_oneof![
            Just(r#""partial""#),
            Just(r#""final""#),
            Just(r#""text-delta""#),
            Just(r#""text-segment-finished""#),
            Just(r#""interrupt""#),
            Just(r#""error""#),
            Just(r#""tool-call""#),
        ];
        let members = prop::collection::vec((key, member_value), 0..7);
        let mutation = prop::collection::vec((any::<u16>(), 0u8..4, any::<u8>()), 0..3);
        (kind, members, prop_oneof![Just(""), Just(" "), Just("\n\t ")], mutation).prop_map(
            |(kind, members, space, mutations)| {
                let mut text = format!(r#"{space}{{"type":{kind},"meta":{{"message_id":"m-1"}}"#);
                for (key, value) in members {
                    text.push_str(&format!(",{space}\"{key}\"{space}:{space}{value}"));
                }
                text.push('}');
                text.push_str(space);
                let mut bytes = text.into_bytes();
                for (at, how, byte) in mutations {
                    let at = usize::from(at) % (bytes.len() + 1);
                    match how {
                        0 if at < bytes.len() => {
                            bytes.remove(at);
                        }
                        1 => bytes.insert(at, byte),
                        2 if at < bytes.len() => bytes[at] = byte,
                        _ => bytes.truncate(at),
                    }
                }
                bytes
            },
        )
    }

    /// JSON values shaped like the fuzz schema's messages, with wrong types and deep nesting.
    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            prop_oneof![
                Just("KIND_A"),
                Just("1970-01-01T00:00:00Z"),
                Just("aGVsbG8="),
                Just("x"),
                Just("4294967296"),
                Just("NaN"),
                Just("-Infinity"),
            ]
            .prop_map(Value::from),
        ];
        leaf.prop_recursive(6, 128, 6, |inner| {
            let key = prop_oneof![
                Just("name"),
                Just("child"),
                Just("children"),
                Just("named"),
                Just("i32"),
                Just("u64"),
                Just("s32"),
                Just("f64"),
                Just("f32"),
                Just("flag"),
                Just("blob"),
                Just("kind"),
                Just("text"),
                Just("number"),
                Just("at"),
                Just("wrapped"),
                Just("extra"),
                Just("by_number"),
                Just("kinds"),
                Just("byNumber"),
                Just("1"),
                Just("zzz"),
            ];
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((key, inner), 0..6).prop_map(|entries| {
                    Value::Object(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
                }),
            ]
        })
    }
}

/// Hostile inputs worth naming, and inputs a fuzzer or campaign once broke (each test says what
/// it guards against).
#[cfg(test)]
mod regressions {
    use super::*;

    /// Payload values come from parsers that stop at 128 levels of nesting (serde_json's and
    /// serde_norway's limits); conversion of the deepest such value along every recursive path
    /// of the fuzz schema (messages, lists, maps, `google.protobuf.Struct`) fits in 1 MiB of stack
    /// even in a debug build, half of what a tokio worker thread has.
    #[test]
    fn the_deepest_parsable_payload_converts_within_a_small_stack() {
        for key in ["child", "children", "named", "extra"] {
            // 127 levels of JSON in all: one per wrap for `child`, two for the others.
            let wraps = if key == "child" { 126 } else { 63 };
            let mut value = serde_json::json!({"name": "x"});
            for _ in 0..wraps {
                value = match key {
                    "children" => serde_json::json!({ "children": [value] }),
                    "named" => serde_json::json!({ "named": {"k": value} }),
                    "extra" => serde_json::json!({ "extra": {"k": value} }),
                    _ => serde_json::json!({ "child": value }),
                };
            }
            let text = value.to_string();
            assert!(serde_json::from_str::<Value>(&text).is_ok(), "{key}: within the parser's limit");
            let thread = std::thread::Builder::new().stack_size(1 << 20);
            let run = thread.spawn(move || typed_conversion(text.as_bytes())).expect("spawn");
            assert!(run.join().is_ok(), "{key}: conversion failed on a 1 MiB stack");
        }
    }

    /// The JSON repair trimmed a trailing token by stepping back one byte from the character
    /// before it, which split a multi-byte character and panicked (found by the chunking
    /// campaign through a tool call's payload).
    #[test]
    fn json_repair_steps_over_a_multibyte_character_before_a_token() {
        for text in ["{\"a\": 1😀tru", "[😀1", "{\"tool_name\":\"t\"}<\n\"😀\\é€😀", "é-"] {
            let _ = payload::json::repair(text);
            let _ = payload::extract_json(text);
        }
        payload_parsing("{\"tool_name\":\"t\",\"arguments\":{\"a\":\"</tool>\"x\"}}<\n\"😀\\é€😀", &[]);
    }

    /// Payload parsers refuse nesting beyond their recursion limit instead of overflowing the
    /// stack (what SECURITY.md promises): YAML flow and block nesting, and JSON.
    #[test]
    fn payload_parsers_refuse_deep_nesting() {
        let deep_flow = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let deep_block: String = (0..300).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        for text in [&deep_flow, &deep_block] {
            assert!(payload::decode(PayloadFormat::Yaml, text).is_err());
            assert!(payload::decode(PayloadFormat::Json, text).is_err());
        }
        payload_parsing(&deep_flow, &[3, 5000]);
    }

    /// `"NaN"` is valid proto3 JSON for a float field, and a message holding NaN is not `==` to
    /// itself, so the property reported equal strict and partial conversions as different (found
    /// by the `typed` fuzz target).
    #[test]
    fn a_float_holding_nan_converts_the_same_strictly_and_partially() {
        typed_conversion(br#"{"f64":"NaN","f32":"NaN"}"#);
        typed_conversion(br#"{"f64":"NaN","f32":"Infinity","i32":"12","u64":12,"s32":"-0"}"#);
    }

    /// The property expected every complete JSON document to snapshot as itself, but the live
    /// parser reads only objects and arrays and skips what comes before the first bracket as
    /// prose, as its documentation says: the top-level string `"[2,]&&"` is read from its `[`
    /// and completes as `[2]` (found by the `payload` fuzz target). The final value comes from
    /// the extraction chain, which gives the string.
    #[test]
    fn a_top_level_string_holding_a_bracket_is_read_from_the_bracket_live_and_whole_at_the_end() {
        let text = "\"[2,]&&\"";
        payload_parsing(text, &[56354]);
        let mut parser = PartialJson::new();
        parser.feed(text);
        assert_eq!(parser.snapshot(), Some(serde_json::json!([2])));
        assert_eq!(payload::decode(PayloadFormat::Json, text).ok(), Some(Value::from("[2,]&&")));
        let mut snapshotter = Snapshotter::new(PayloadFormat::Json);
        let _ = snapshotter.push(text);
        assert_eq!(snapshotter.complete(text).ok(), Some(Value::from("[2,]&&")));
    }

    /// With a budget of 0, YAML's hold-back scan ran outside the budget, so snapshot work
    /// exceeded `(budget + 1)` × the payload (found by the `payload` fuzz target).
    #[test]
    fn the_yaml_hold_back_scan_is_within_the_budget() {
        snapshots_are_bounded("0x6\n\n", &[], 0);
        snapshots_are_bounded("k:\nl:\nm:\n", &[2, 4, 6, 8], 0);
    }
}
