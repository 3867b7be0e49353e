//! Encoding of pipeline outputs as protobuf messages of schema v1, with their subjects.
//!
//! An [`OutputEncoder`] is built once from the registered tags and the configured subjects; it
//! precomputes every subject so that encoding an output allocates only the message itself. A
//! [`StreamHeader`] is built once per stream: it holds the stream's `StreamRef` already encoded,
//! which is spliced into every message of the stream (protobuf merges fields, so a field appended
//! to an encoded message is the same as one encoded with it).

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use serde::{Deserialize, Serialize};

use super::inbound::StreamIdentity;
use super::proto;
use super::subject::escape_token;
use crate::pipeline::{Finish, Item, Output, OutputKind, Pipeline, TagKind};
use crate::typed::{BlockType, ConversionErrorKind, SchemaRegistry};

/// The subjects the service publishes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputSubjects {
    /// Visible text (`FilteredText`).
    pub filtered: String,
    /// Prefix of the per-type block subjects: `<prefix>.<package>.<type>.<version>`, each part
    /// escaped into one token (`.` becomes `%2E`).
    pub structured_prefix: String,
    /// Thinking text (`ThinkingText`).
    pub thinking: String,
    /// Tool calls (`ToolCall`).
    pub tools: String,
}

impl Default for OutputSubjects {
    fn default() -> Self {
        OutputSubjects {
            filtered: "chat.filtered".into(),
            structured_prefix: "chat.structured".into(),
            thinking: "chat.thinking".into(),
            tools: "chat.tools".into(),
        }
    }
}

impl OutputSubjects {
    /// Every subject (or subject pattern, for blocks) this configuration publishes to.
    pub fn patterns(&self) -> Vec<String> {
        vec![self.filtered.clone(), format!("{}.>", self.structured_prefix), self.thinking.clone(), self.tools.clone()]
    }
}

/// The `Content-Type` of protobuf outputs.
pub const PROTOBUF_CONTENT_TYPE: &str = "application/x-protobuf";

/// The `Content-Type` of geppetto JSON outputs.
pub const JSON_CONTENT_TYPE: &str = "application/json";
/// The type name announced for geppetto JSON outputs.
pub const GEPPETTO_EVENT_TYPE: &str = "geppetto.Event";

/// How visible text is encoded; block, thinking and tool events are always protobuf.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TextEncoding {
    /// `structuredsink.v1.FilteredText`.
    #[default]
    Protobuf,
    /// geppetto event JSON in the vocabulary the stream arrived in: `partial`/`final` (legacy) or
    /// `text-delta`/`text-segment-finished` (canonical), with the filtered `delta` and the
    /// cumulative filtered `completion`/`text`.
    GeppettoJson,
}

/// The geppetto vocabulary a stream arrived in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vocabulary {
    /// `partial`, `final`, `interrupt`, `error` (geppetto up to v0.11.22).
    Legacy,
    /// `text-delta`, `text-segment-finished` (v0.11.23 and later).
    Canonical,
}

impl Vocabulary {
    /// The vocabulary of an event type.
    pub fn of(event_type: &str) -> Vocabulary {
        match event_type {
            "text-delta" | "text-segment-finished" => Vocabulary::Canonical,
            _ => Vocabulary::Legacy,
        }
    }
}

/// One message ready to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Publication {
    /// Where it goes.
    pub subject: Arc<str>,
    /// The full protobuf name of the message type.
    pub type_name: &'static str,
    /// The `Content-Type` of `payload`.
    pub content_type: &'static str,
    /// The encoded message.
    pub payload: Bytes,
    /// `<stream key>:<seq>`: deterministic, so JetStream can drop replayed duplicates.
    pub msg_id: String,
}

impl Publication {
    /// The key of the stream it belongs to (`msg_id` without its sequence number).
    pub fn stream_key(&self) -> &str {
        stream_key(&self.msg_id)
    }
}

/// The key of the stream an output message id (`<stream key>:<seq>`) belongs to.
pub fn stream_key(msg_id: &str) -> &str {
    msg_id.rsplit_once(':').map_or("", |(id, _)| id)
}

/// A stream's identity in the form every one of its messages needs.
#[derive(Debug, Clone)]
pub struct StreamHeader {
    /// The stream's key ([`StreamIdentity::key`]), which output and item ids begin with (shared
    /// with the stream table, which keeps the stream under it).
    key: Arc<str>,
    /// Field 1 (`stream`) of every output message, key and length included.
    stream_field: Bytes,
    /// The vocabulary the stream arrived in (for geppetto JSON output).
    vocabulary: Vocabulary,
}

impl StreamHeader {
    /// Prepares the header of the stream `identity` (whose [key](StreamIdentity::key) is `key`),
    /// which arrived in `vocabulary`.
    pub fn new(identity: &StreamIdentity<'_>, key: Arc<str>, vocabulary: Vocabulary) -> Self {
        let reference = proto::StreamRef {
            message_id: identity.message_id.to_string(),
            stream_id: identity.stream_id.to_string(),
            session_id: identity.session_id.to_string(),
            inference_id: identity.inference_id.to_string(),
            turn_id: identity.turn_id.to_string(),
        };
        let mut field = BytesMut::with_capacity(reference.encoded_len() + 4);
        prost::encoding::message::encode(1, &reference, &mut field);
        StreamHeader { key, stream_field: field.freeze(), vocabulary }
    }

    fn item_id(&self, item: Item) -> String {
        numbered(&self.key, u64::from(item.number))
    }
}

/// Per-tag facts the encoder needs.
#[derive(Debug, Clone)]
struct TagOut {
    subject: Arc<str>,
    /// Field 4 (`tag`) of the tag's `BlockEvent`s or `ThinkingText`s, key and length included
    /// (empty when the field is at its default).
    tag_field: Bytes,
    /// The message type declared for the block in a `.proto` file, when one is.
    typed: Option<BlockType>,
}

/// Counters of typed conversions that failed while encoding completed blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderStats {
    /// Completed blocks whose payload did not fit their declared message type.
    pub schema_mismatches: u64,
    /// Completed blocks whose payload nested messages deeper than `schemas.max_depth`.
    pub too_deep: u64,
    /// Outputs that would have exceeded the payload bound ([`OutputEncoder::with_max_payload`])
    /// and went with parts left out.
    pub outputs_trimmed: u64,
}

/// Room kept for an output's headers (`Nats-Msg-Id`, `Content-Type`, `Structured-Sink-Type`, the
/// trace context) under the server's `max_payload`, which bounds headers and payload together.
pub const OUTPUT_HEADER_ALLOWANCE: usize = 4096;

/// Encodes outputs of any stream of one pipeline.
#[derive(Debug, Clone)]
pub struct OutputEncoder {
    text_encoding: TextEncoding,
    filtered: Arc<str>,
    thinking: Arc<str>,
    tools: Arc<str>,
    tags: Vec<TagOut>,
    stats: EncoderStats,
    /// The largest payload an output may have; see [`OutputEncoder::with_max_payload`].
    max_payload: usize,
    /// Lower bounds of particular subjects (their downstream stream's message size limit), by the
    /// encoder's own subject strings; usually empty.
    subject_limits: Vec<(Arc<str>, usize)>,
}

/// The payload bound left under a message size `limit` that counts headers too: less
/// [`OUTPUT_HEADER_ALLOWANCE`], or a quarter of a limit under four allowances.
pub fn payload_bound(limit: usize) -> usize {
    limit - OUTPUT_HEADER_ALLOWANCE.min(limit / 4)
}

impl OutputEncoder {
    /// Precomputes subjects and tag references for `pipeline`'s tags.
    pub fn new(pipeline: &Pipeline, subjects: &OutputSubjects) -> Self {
        Self::with_text_encoding(pipeline, subjects, TextEncoding::Protobuf)
    }

    /// Like [`OutputEncoder::new`], encoding visible text as `text_encoding`.
    pub fn with_text_encoding(pipeline: &Pipeline, subjects: &OutputSubjects, text_encoding: TextEncoding) -> Self {
        let tags = pipeline
            .tags()
            .iter()
            .map(|t| {
                let subject: Arc<str> = match (&t.spec.kind, &t.triple) {
                    (TagKind::Block, Some(tr)) => format!(
                        "{}.{}.{}.{}",
                        subjects.structured_prefix,
                        escape_token(&tr.package),
                        escape_token(&tr.kind),
                        escape_token(&tr.version)
                    )
                    .into(),
                    (TagKind::ToolCall, _) => subjects.tools.as_str().into(),
                    _ => subjects.thinking.as_str().into(),
                };
                let mut tag_field = BytesMut::new();
                match (&t.spec.kind, &t.triple) {
                    (TagKind::Block, Some(tr)) => {
                        let tag_ref = proto::TagRef {
                            package: tr.package.clone(),
                            r#type: tr.kind.clone(),
                            version: tr.version.clone(),
                        };
                        prost::encoding::message::encode(4, &tag_ref, &mut tag_field);
                    }
                    (TagKind::Block, None) => {}
                    _ => prost::encoding::string::encode(4, &t.spec.name, &mut tag_field),
                }
                TagOut { subject, tag_field: tag_field.freeze(), typed: None }
            })
            .collect();
        OutputEncoder {
            text_encoding,
            filtered: subjects.filtered.as_str().into(),
            thinking: subjects.thinking.as_str().into(),
            tools: subjects.tools.as_str().into(),
            tags,
            stats: EncoderStats::default(),
            max_payload: usize::MAX,
            subject_limits: Vec::new(),
        }
    }

    /// Bounds every output's payload by `bytes` (the server's `max_payload` less
    /// [`OUTPUT_HEADER_ALLOWANCE`]): an output that would exceed it goes with its bulk left out
    /// rather than not at all, since a publish over the server's limit fails for good while the
    /// input is acknowledged. Visible text keeps its `delta` and leaves out the cumulative `text`
    /// (`text_omitted`); a completed block leaves out `typed` and `value`, then `raw`, and a tool
    /// call `arguments`, then `raw` (`payload_omitted`, `success` false); a snapshot goes out
    /// empty. Deltas are parts of one input event, which the server took, so they fit already.
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Bounds the payloads of outputs to `subject` (one of [`OutputEncoder::subjects`]) by `bytes`
    /// too, as [`OutputEncoder::with_max_payload`] bounds all: for a subject whose downstream
    /// stream takes smaller messages than the server.
    pub fn with_subject_limit(mut self, subject: &str, bytes: usize) -> Self {
        // Every string of that text: kinds may share a subject, each with its own string.
        let own: Vec<Arc<str>> = self.subject_strings().filter(|s| &***s == subject).cloned().collect();
        self.subject_limits.retain(|(s, _)| &**s != subject);
        self.subject_limits.extend(own.into_iter().map(|s| (s, bytes)));
        self
    }

    /// Every subject outputs go to, once each.
    pub fn subjects(&self) -> Vec<Arc<str>> {
        let mut subjects: Vec<Arc<str>> = Vec::new();
        for subject in self.subject_strings() {
            if !subjects.contains(subject) {
                subjects.push(subject.clone());
            }
        }
        subjects
    }

    /// The subject strings publications carry, one per kind and tag (equal texts included).
    fn subject_strings(&self) -> impl Iterator<Item = &Arc<str>> {
        [&self.filtered, &self.thinking, &self.tools].into_iter().chain(self.tags.iter().map(|t| &t.subject))
    }

    /// The payload bound of outputs to `subject`.
    fn limit_of(&self, subject: &Arc<str>) -> usize {
        // By pointer: publications carry the encoder's own subject strings.
        match self.subject_limits.iter().find(|(s, _)| Arc::ptr_eq(s, subject)) {
            Some(&(_, limit)) => limit.min(self.max_payload),
            None => self.max_payload,
        }
    }

    /// Types the blocks declared in `registry` (their completed and snapshot events carry the
    /// typed message as `Any`) and applies the subjects their declarations set.
    pub fn with_schemas(mut self, pipeline: &Pipeline, registry: &SchemaRegistry) -> Self {
        for (out, tag) in self.tags.iter_mut().zip(pipeline.tags()) {
            if tag.spec.kind != TagKind::Block {
                continue;
            }
            if let Some(block) = registry.block_type(&tag.spec.name) {
                if let Some(subject) = block.subject() {
                    out.subject = subject.into();
                }
                out.typed = Some(block.clone());
            }
        }
        self
    }

    /// Typed conversions that failed so far.
    pub fn stats(&self) -> EncoderStats {
        self.stats
    }

    /// The subject of block events of `tag` (by index), for documentation and tests.
    pub fn block_subject(&self, tag: usize) -> Option<&str> {
        self.tags.get(tag).map(|t| t.subject.as_ref())
    }

    /// Encodes one output of the stream `header`, within the payload bound.
    pub fn encode(&mut self, header: &StreamHeader, output: &Output<'_>) -> Publication {
        let publication = self.encode_whole(header, output);
        let limit = self.limit_of(&publication.subject);
        match publication.payload.len() <= limit {
            true => publication,
            false => self.fit(header, output, publication, limit),
        }
    }

    /// `publication`, too large, with its bulk left out (see [`OutputEncoder::with_max_payload`]).
    #[cold]
    fn fit(
        &mut self,
        header: &StreamHeader,
        output: &Output<'_>,
        mut publication: Publication,
        limit: usize,
    ) -> Publication {
        self.stats.outputs_trimmed += 1;
        let too_large = |what: &str| {
            format!("{what} would exceed the message size limit ({limit} bytes with headers aside) and was left out")
        };
        publication.payload = match &output.kind {
            OutputKind::Text { delta, finish, number, .. } => match self.text_encoding {
                TextEncoding::GeppettoJson => geppetto_json(header, *number, delta, None, *finish),
                TextEncoding::Protobuf => filtered_text(header, output.seq, delta, "", true, *finish),
            },
            _ => match publication.type_name {
                proto::names::BLOCK_EVENT => {
                    let mut event = proto::BlockEvent::decode(publication.payload.clone()).unwrap_or_default();
                    match &mut event.event {
                        Some(proto::block_event::Event::Completed(completed)) => {
                            completed.typed = None;
                            completed.value = None;
                            let (success, error) = (&mut completed.success, &mut completed.error);
                            completed.payload_omitted = omitted(success, error, || too_large("the block's payload"));
                            if event.encoded_len() > limit {
                                if let Some(proto::block_event::Event::Completed(completed)) = &mut event.event {
                                    completed.raw.clear();
                                }
                            }
                        }
                        Some(proto::block_event::Event::Snapshot(snapshot)) => {
                            snapshot.value = None;
                            snapshot.typed = None;
                        }
                        _ => {}
                    }
                    Bytes::from(event.encode_to_vec())
                }
                proto::names::TOOL_CALL => {
                    let mut call = proto::ToolCall::decode(publication.payload.clone()).unwrap_or_default();
                    call.arguments = None;
                    let (success, error) = (&mut call.success, &mut call.error);
                    call.payload_omitted = omitted(success, error, || too_large("the tool call's arguments"));
                    if call.encoded_len() > limit {
                        call.raw.clear();
                    }
                    Bytes::from(call.encode_to_vec())
                }
                _ => publication.payload,
            },
        };
        publication
    }

    fn encode_whole(&mut self, header: &StreamHeader, output: &Output<'_>) -> Publication {
        let seq = output.seq;
        if let (TextEncoding::GeppettoJson, OutputKind::Text { delta, text, finish, number }) =
            (self.text_encoding, &output.kind)
        {
            let payload = geppetto_json(header, *number, delta, *text, *finish);
            return Publication {
                subject: self.filtered.clone(),
                type_name: GEPPETTO_EVENT_TYPE,
                content_type: JSON_CONTENT_TYPE,
                payload,
                msg_id: numbered(&header.key, seq),
            };
        }
        let (subject, type_name, payload) = match &output.kind {
            OutputKind::Text { delta, text, finish, .. } => {
                let payload = filtered_text(header, seq, delta, text.unwrap_or_default(), false, *finish);
                (self.filtered.clone(), proto::names::FILTERED_TEXT, payload)
            }
            OutputKind::BlockStarted { item } => {
                self.block(header, seq, *item, proto::block_event::Event::Started(proto::BlockStarted {}))
            }
            OutputKind::BlockDelta { item, raw } => {
                let tag = &self.tags[usize::from(item.tag.0)];
                let payload = item_event(header, seq, *item, &tag.tag_field, EventBody::Text(raw));
                (tag.subject.clone(), proto::names::BLOCK_EVENT, payload)
            }
            OutputKind::BlockSnapshot { item, value } => {
                // Too deep to decode: the snapshot goes out empty (the block's `completed` says why).
                let converted = json_to_value(value);
                let typed = self.tags[usize::from(item.tag.0)].typed.as_ref().filter(|_| converted.is_some());
                let typed = typed.and_then(|t| t.convert_partial(value).map(|m| t.to_any(&m)));
                let snapshot = proto::BlockSnapshot { value: converted, typed };
                self.block(header, seq, *item, proto::block_event::Event::Snapshot(snapshot))
            }
            OutputKind::BlockCompleted { item, raw, value, error } => {
                let typed = self.tags[usize::from(item.tag.0)].typed.as_ref();
                let converted = value.map(json_to_value);
                let too_deep = matches!(converted, Some(None));
                let (typed, error) = match (value, typed, error) {
                    (Some(_), _, None) if too_deep => {
                        self.stats.too_deep += 1;
                        (None, Some(too_deep_error("payload nests")))
                    }
                    (Some(value), Some(t), None) => match t.convert(value) {
                        Ok(message) => (Some(t.to_any(&message)), None),
                        Err(e) => {
                            match e.kind() {
                                ConversionErrorKind::TooDeep => self.stats.too_deep += 1,
                                _ => self.stats.schema_mismatches += 1,
                            }
                            (None, Some(format!("payload does not fit {}: {e}", t.descriptor().full_name())))
                        }
                    },
                    (_, _, error) => (None, error.map(str::to_owned)),
                };
                let completed = proto::BlockCompleted {
                    raw: (*raw).to_owned(),
                    success: error.is_none(),
                    error: error.unwrap_or_default(),
                    typed,
                    value: converted.flatten(),
                    payload_omitted: false,
                };
                self.block(header, seq, *item, proto::block_event::Event::Completed(completed))
            }
            OutputKind::ThinkingStarted { item } => {
                self.thinking(header, seq, *item, proto::thinking_text::Event::Started(proto::ThinkingStarted {}))
            }
            OutputKind::ThinkingDelta { item, text } => {
                let tag = &self.tags[usize::from(item.tag.0)];
                (
                    self.thinking.clone(),
                    proto::names::THINKING_TEXT,
                    item_event(header, seq, *item, &tag.tag_field, EventBody::Text(text)),
                )
            }
            OutputKind::ThinkingEnded { item, closed } => self.thinking(
                header,
                seq,
                *item,
                proto::thinking_text::Event::Ended(proto::ThinkingEnded { closed: *closed }),
            ),
            OutputKind::ToolCall { item, raw, call } => {
                let mut msg = proto::ToolCall {
                    stream: None,
                    seq,
                    item_id: header.item_id(*item),
                    raw: (*raw).to_owned(),
                    success: call.is_ok(),
                    ..Default::default()
                };
                match call {
                    Ok(call) => {
                        msg.tool_name.clone_from(&call.tool_name);
                        msg.server_name.clone_from(&call.server_name);
                        match json_to_value(&call.arguments) {
                            Some(arguments) => msg.arguments = into_struct(arguments),
                            None => {
                                msg.success = false;
                                msg.error = too_deep_error("arguments nest");
                            }
                        }
                    }
                    Err(error) => msg.error = (*error).to_owned(),
                }
                (self.tools.clone(), proto::names::TOOL_CALL, splice(header, &msg))
            }
        };
        Publication {
            subject,
            type_name,
            content_type: PROTOBUF_CONTENT_TYPE,
            payload,
            msg_id: numbered(&header.key, seq),
        }
    }

    fn block(
        &self,
        header: &StreamHeader,
        seq: u64,
        item: Item,
        event: proto::block_event::Event,
    ) -> (Arc<str>, &'static str, Bytes) {
        let tag = &self.tags[usize::from(item.tag.0)];
        let mut encoded = BytesMut::with_capacity(event.encoded_len());
        event.encode(&mut encoded);
        let payload = item_event(header, seq, item, &tag.tag_field, EventBody::Encoded(&encoded));
        (tag.subject.clone(), proto::names::BLOCK_EVENT, payload)
    }

    fn thinking(
        &self,
        header: &StreamHeader,
        seq: u64,
        item: Item,
        event: proto::thinking_text::Event,
    ) -> (Arc<str>, &'static str, Bytes) {
        let tag = &self.tags[usize::from(item.tag.0)];
        let mut encoded = BytesMut::with_capacity(event.encoded_len());
        event.encode(&mut encoded);
        let payload = item_event(header, seq, item, &tag.tag_field, EventBody::Encoded(&encoded));
        (self.thinking.clone(), proto::names::THINKING_TEXT, payload)
    }
}

/// Encodes filtered text as a geppetto event in the stream's vocabulary; `number` is the text
/// event's ordinal in its stream (the canonical `sequence`). The identity fields come from the
/// encoded `StreamRef`, so the header keeps a single copy of them.
///
/// A stream ends as it ended upstream: an `error` event (with its `error_string`) or an
/// `interrupt` event, which both vocabularies share, else the vocabulary's final. Each carries the
/// final `delta` and `text` (a geppetto `error` has neither field; its decoders ignore fields
/// they do not know), so the last filtered text is not lost to a consumer that reads them.
fn geppetto_json(
    header: &StreamHeader,
    number: u64,
    delta: &str,
    text: Option<&str>,
    finish: Option<Finish<'_>>,
) -> Bytes {
    let reference = proto::FilteredText::decode(&header.stream_field[..]).unwrap_or_default();
    let stream = reference.stream.unwrap_or_default();
    let mut meta = serde_json::Map::new();
    for (key, value) in [
        ("message_id", &stream.message_id),
        ("session_id", &stream.session_id),
        ("inference_id", &stream.inference_id),
        ("turn_id", &stream.turn_id),
    ] {
        if !value.is_empty() {
            meta.insert(key.to_owned(), value.as_str().into());
        }
    }
    // `geppetto-json` attaches the cumulative text to every text output, except past
    // `pipeline.max_text_bytes`, where it is no longer kept (so memory stays bounded).
    let omitted = text.is_none() || finish.is_some_and(|f| f.text_omitted);
    let text = text.unwrap_or_default();
    let mut event = match (header.vocabulary, finish) {
        (_, Some(Finish { error: Some(error), .. })) => serde_json::json!({
            "type": "error", "meta": meta, "error": {}, "error_string": error, "delta": delta, "text": text,
        }),
        (_, Some(Finish { reason: "interrupt", .. })) => serde_json::json!({
            "type": "interrupt", "meta": meta, "delta": delta, "text": text,
        }),
        (Vocabulary::Legacy, None) => serde_json::json!({
            "type": "partial", "meta": meta, "delta": delta, "completion": text,
        }),
        (Vocabulary::Legacy, Some(Finish { reason, .. })) => {
            meta.insert("stop_reason".to_owned(), reason.into());
            serde_json::json!({ "type": "final", "meta": meta, "delta": delta, "text": text })
        }
        (Vocabulary::Canonical, None) => serde_json::json!({
            "type": "text-delta", "meta": meta, "correlation": { "segment_id": stream.stream_id },
            "delta": delta, "text": text, "sequence": number,
        }),
        (Vocabulary::Canonical, Some(Finish { reason, .. })) => serde_json::json!({
            "type": "text-segment-finished", "meta": meta, "correlation": { "segment_id": stream.stream_id },
            "delta": delta, "text": text, "finish_reason": reason,
        }),
    };
    // The shared shapes carry the canonical correlation too, as every canonical event does.
    if header.vocabulary == Vocabulary::Canonical && event.get("correlation").is_none() {
        event["correlation"] = serde_json::json!({ "segment_id": stream.stream_id });
    }
    // geppetto has no field for it: said as the protobuf form says it, so that an empty
    // `completion`/`text` does not pass for the whole text (Go's decoder ignores the field).
    if omitted {
        event["text_omitted"] = true.into();
    }
    Bytes::from(serde_json::to_vec(&event).unwrap_or_default())
}

/// Marks a block or call whose bulk was left out as failed, with `why` unless it had failed
/// already (its own error says more); the value of its `payload_omitted`.
fn omitted(success: &mut bool, error: &mut String, why: impl FnOnce() -> String) -> bool {
    if std::mem::replace(success, false) {
        *error = why();
    }
    true
}

/// `<id>:<n>` (message ids and item ids), without the formatting machinery: one per output.
fn numbered(id: &str, n: u64) -> String {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(n);
    let mut out = String::with_capacity(id.len() + 1 + digits.len());
    out.push_str(id);
    out.push(':');
    out.push_str(digits);
    out
}

/// `FilteredText` (the most frequent output) encoded field by field from the borrowed text, as
/// prost encodes the message (fields in number order, defaults omitted) but without copying the
/// text into an owned message first.
/// `omitted` says the cumulative `text` was left out (as a final's `text_omitted` does). Inlined
/// by demand, as it was before a second caller (trimming) made the compiler call it instead.
#[inline(always)]
fn filtered_text(
    header: &StreamHeader,
    seq: u64,
    delta: &str,
    text: &str,
    omitted: bool,
    finish: Option<Finish<'_>>,
) -> Bytes {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
    let string_len =
        |tag: u32, s: &str| if s.is_empty() { 0 } else { key_len(tag) + encoded_len_varint(s.len() as u64) + s.len() };
    let reason = finish.map_or("", |f| f.reason);
    let error = finish.and_then(|f| f.error).unwrap_or_default();
    let len = header.stream_field.len()
        + if seq == 0 { 0 } else { key_len(2) + encoded_len_varint(seq) }
        + string_len(3, delta)
        + string_len(4, text)
        + string_len(6, reason)
        + key_len(5)
        + 1
        + key_len(7)
        + 1
        + string_len(8, error);
    let mut buf = BytesMut::with_capacity(len);
    buf.put_slice(&header.stream_field);
    let string = |tag: u32, s: &str, buf: &mut BytesMut| {
        if !s.is_empty() {
            encode_key(tag, WireType::LengthDelimited, buf);
            encode_varint(s.len() as u64, buf);
            buf.put_slice(s.as_bytes());
        }
    };
    if seq != 0 {
        encode_key(2, WireType::Varint, &mut buf);
        encode_varint(seq, &mut buf);
    }
    string(3, delta, &mut buf);
    string(4, text, &mut buf);
    if finish.is_some() {
        encode_key(5, WireType::Varint, &mut buf);
        encode_varint(1, &mut buf);
    }
    string(6, reason, &mut buf);
    let omitted = omitted || finish.is_some_and(|f| f.text_omitted);
    if omitted {
        encode_key(7, WireType::Varint, &mut buf);
        encode_varint(1, &mut buf);
    }
    string(8, error, &mut buf);
    buf.freeze()
}

/// The event of an item event: a delta's text (field 6, a message whose field 1 is the text: the
/// most frequent item events, written without copying the text first), or another event already
/// encoded with its field key (the rare ones: started, completed, snapshot, ended).
enum EventBody<'a> {
    Text(&'a str),
    Encoded(&'a [u8]),
}

/// A `BlockEvent` or `ThinkingText` (they share their fields: stream 1, seq 2, item_id 3, tag 4,
/// then the event), encoded field by field as prost encodes the message (fields in number order,
/// defaults omitted), from the stream's encoded reference, the tag's encoded field, and the item
/// id and delta text written in place rather than copied into an owned message first.
fn item_event(header: &StreamHeader, seq: u64, item: Item, tag_field: &[u8], event: EventBody<'_>) -> Bytes {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
    let mut number = itoa::Buffer::new();
    let number = number.format(item.number);
    let item_id_len = header.key.len() + 1 + number.len();
    let text_len =
        |text: &str| if text.is_empty() { 0 } else { key_len(1) + encoded_len_varint(text.len() as u64) + text.len() };
    let event_len = match &event {
        EventBody::Text(text) => {
            let inner = text_len(text);
            key_len(6) + encoded_len_varint(inner as u64) + inner
        }
        EventBody::Encoded(event) => event.len(),
    };
    let len = header.stream_field.len()
        + if seq == 0 { 0 } else { key_len(2) + encoded_len_varint(seq) }
        + key_len(3)
        + encoded_len_varint(item_id_len as u64)
        + item_id_len
        + tag_field.len()
        + event_len;
    let mut buf = BytesMut::with_capacity(len);
    buf.put_slice(&header.stream_field);
    if seq != 0 {
        encode_key(2, WireType::Varint, &mut buf);
        encode_varint(seq, &mut buf);
    }
    encode_key(3, WireType::LengthDelimited, &mut buf);
    encode_varint(item_id_len as u64, &mut buf);
    buf.put_slice(header.key.as_bytes());
    buf.put_u8(b':');
    buf.put_slice(number.as_bytes());
    buf.put_slice(tag_field);
    match event {
        EventBody::Text(text) => {
            encode_key(6, WireType::LengthDelimited, &mut buf);
            encode_varint(text_len(text) as u64, &mut buf);
            if !text.is_empty() {
                encode_key(1, WireType::LengthDelimited, &mut buf);
                encode_varint(text.len() as u64, &mut buf);
                buf.put_slice(text.as_bytes());
            }
        }
        EventBody::Encoded(event) => buf.put_slice(event),
    }
    buf.freeze()
}

fn splice(header: &StreamHeader, msg: &impl Message) -> Bytes {
    let mut buf = BytesMut::with_capacity(header.stream_field.len() + msg.encoded_len());
    buf.put_slice(&header.stream_field);
    msg.encode_raw(&mut buf);
    buf.freeze()
}

/// How deeply a JSON value may nest (arrays and objects) to travel as a `google.protobuf.Value`
/// or `Struct`. Each JSON level costs two or three protobuf message levels (`Value`, then
/// `ListValue` or `Struct` and its map entry), and decoders refuse messages nested deeper than
/// 100 (prost, prost-reflect, the C++ and Java runtimes): a deeper value would be published and
/// then fail every consumer's decode. Measured with prost: objects in a `BlockEvent`'s value decode
/// up to 32 levels and in a `ToolCall`'s arguments up to 33; 30 leaves a margin.
pub const MAX_VALUE_DEPTH: usize = 30;

/// The error of a block or tool call whose value nests deeper than [`MAX_VALUE_DEPTH`]
/// (`what`: "payload nests", "arguments nest").
fn too_deep_error(what: &str) -> String {
    format!("{what} deeper than {MAX_VALUE_DEPTH} levels, which protobuf consumers could not decode")
}

/// Converts a JSON value into a `google.protobuf.Value`; `None` when it nests more than
/// [`MAX_VALUE_DEPTH`] arrays or objects deep (checked in the same pass).
pub fn json_to_value(v: &serde_json::Value) -> Option<prost_types::Value> {
    value_within(v, MAX_VALUE_DEPTH)
}

/// [`json_to_value`] with `levels` arrays or objects allowed (a scalar nests 0).
fn value_within(v: &serde_json::Value, levels: usize) -> Option<prost_types::Value> {
    use prost_types::value::Kind;
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => {
            let inner = levels.checked_sub(1)?;
            let values = a.iter().map(|c| value_within(c, inner)).collect::<Option<_>>()?;
            Kind::ListValue(prost_types::ListValue { values })
        }
        serde_json::Value::Object(o) => {
            let inner = levels.checked_sub(1)?;
            let fields = o.iter().map(|(k, c)| Some((k.clone(), value_within(c, inner)?))).collect::<Option<_>>()?;
            Kind::StructValue(prost_types::Struct { fields })
        }
    };
    Some(prost_types::Value { kind: Some(kind) })
}

/// The `Struct` a converted JSON object is; `None` for any other value.
fn into_struct(value: prost_types::Value) -> Option<prost_types::Struct> {
    match value.kind {
        Some(prost_types::value::Kind::StructValue(s)) => Some(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{PipelineLimits, StreamState, TagSpec};
    use std::borrow::Cow;

    fn setup() -> (Pipeline, OutputEncoder, StreamHeader) {
        let tags = vec![
            TagSpec::new("app:Mode.Switch:v1.2", TagKind::Block),
            TagSpec::new("thinking", TagKind::Channel),
            TagSpec::new("tool", TagKind::ToolCall),
        ];
        let pipeline = Pipeline::new(tags, PipelineLimits::default()).unwrap();
        let encoder = OutputEncoder::new(&pipeline, &OutputSubjects::default());
        let identity = StreamIdentity {
            message_id: Cow::Borrowed("m-1"),
            stream_id: Cow::Borrowed("s-1"),
            session_id: Cow::Borrowed("sess"),
            ..Default::default()
        };
        let key = identity.key(&mut String::new()).into();
        (pipeline, encoder, StreamHeader::new(&identity, key, Vocabulary::Legacy))
    }

    #[test]
    fn filtered_text_is_encoded_exactly_as_prost_encodes_it() {
        let (_, _, header) = setup();
        let long = "é".repeat(100);
        for seq in [0, 1, 300, u64::MAX] {
            for delta in ["", "a", long.as_str()] {
                for (text, omitted) in [("", false), ("whole <text>", false), ("", true)] {
                    for finish in [
                        None,
                        Some(Finish { reason: "stop", text_omitted: false, error: None }),
                        Some(Finish { reason: "", text_omitted: true, error: None }),
                        Some(Finish { reason: "error", text_omitted: false, error: Some("quota <exceeded>") }),
                        Some(Finish { reason: "error", text_omitted: true, error: Some(long.as_str()) }),
                    ] {
                        let msg = proto::FilteredText {
                            stream: None,
                            seq,
                            delta: delta.to_owned(),
                            text: text.to_owned(),
                            r#final: finish.is_some(),
                            finish_reason: finish.map(|f| f.reason.to_owned()).unwrap_or_default(),
                            text_omitted: omitted || finish.is_some_and(|f| f.text_omitted),
                            error: finish.and_then(|f| f.error).unwrap_or_default().to_owned(),
                        };
                        let ours = filtered_text(&header, seq, delta, text, omitted, finish);
                        assert_eq!(ours, splice(&header, &msg), "{seq} {delta:?} {text:?} {finish:?}");
                        let decoded = proto::FilteredText::decode(ours).unwrap();
                        assert_eq!(decoded.delta, delta);
                        assert!(decoded.stream.is_some());
                    }
                }
            }
        }
    }

    /// What `encode` writes.
    fn encoded(encode: impl FnOnce(&mut BytesMut)) -> BytesMut {
        let mut buf = BytesMut::new();
        encode(&mut buf);
        buf
    }

    #[test]
    fn item_events_are_encoded_exactly_as_prost_encodes_them() {
        let (_, encoder, header) = setup();
        let tag_ref = proto::TagRef { package: "app".into(), r#type: "Mode.Switch".into(), version: "v1.2".into() };
        let (block_tag, thinking_tag) = (&encoder.tags[0].tag_field, &encoder.tags[1].tag_field);
        let long = "é".repeat(100);
        for seq in [0, 1, 300, u64::MAX] {
            for number in [1, 130, u32::MAX] {
                let item = Item { tag: crate::scanner::TagId(0), number };
                let item_id = format!("m-1/s-1:{number}");
                for text in ["", "a", long.as_str()] {
                    let block = |event| proto::BlockEvent {
                        stream: None,
                        seq,
                        item_id: item_id.clone(),
                        tag: Some(tag_ref.clone()),
                        event: Some(event),
                    };
                    let delta = proto::block_event::Event::Delta(proto::BlockDelta { raw: text.to_owned() });
                    let ours = item_event(&header, seq, item, block_tag, EventBody::Text(text));
                    assert_eq!(ours, splice(&header, &block(delta)), "block delta {seq} {number} {text:?}");
                    let completed = proto::block_event::Event::Completed(proto::BlockCompleted {
                        raw: text.to_owned(),
                        success: !text.is_empty(),
                        ..Default::default()
                    });
                    let ours = item_event(
                        &header,
                        seq,
                        item,
                        block_tag,
                        EventBody::Encoded(&encoded(|b| completed.encode(b))),
                    );
                    assert_eq!(ours, splice(&header, &block(completed)), "block completed {seq} {number} {text:?}");

                    let thinking = |event| proto::ThinkingText {
                        stream: None,
                        seq,
                        item_id: item_id.clone(),
                        tag: "thinking".into(),
                        event: Some(event),
                    };
                    let delta = proto::thinking_text::Event::Delta(proto::ThinkingDelta { text: text.to_owned() });
                    let ours = item_event(&header, seq, item, thinking_tag, EventBody::Text(text));
                    assert_eq!(ours, splice(&header, &thinking(delta)), "thinking delta {seq} {number} {text:?}");
                    let ended = proto::thinking_text::Event::Ended(proto::ThinkingEnded { closed: text.is_empty() });
                    let ours =
                        item_event(&header, seq, item, thinking_tag, EventBody::Encoded(&encoded(|b| ended.encode(b))));
                    assert_eq!(ours, splice(&header, &thinking(ended)), "thinking ended {seq} {number} {text:?}");
                }
            }
        }
    }

    #[test]
    fn block_subject_escapes_dots_in_parts() {
        let (_, encoder, _) = setup();
        assert_eq!(encoder.block_subject(0), Some("chat.structured.app.Mode%2ESwitch.v1%2E2"));
    }

    /// The publications of one stream of `deltas`, then a final, with visible text as geppetto
    /// JSON (so with `cumulative_text = "every"`, as the configuration forces).
    fn geppetto_stream(
        tags: Vec<TagSpec>,
        max_text_bytes: usize,
        vocabulary: Vocabulary,
        deltas: &[&str],
    ) -> Vec<Publication> {
        let limits = PipelineLimits {
            cumulative_text: crate::pipeline::CumulativeText::Every,
            max_text_bytes,
            ..Default::default()
        };
        let mut pipeline = Pipeline::new(tags, limits).unwrap();
        let mut encoder =
            OutputEncoder::with_text_encoding(&pipeline, &OutputSubjects::default(), TextEncoding::GeppettoJson);
        let identity =
            StreamIdentity { message_id: Cow::Borrowed("m"), stream_id: Cow::Borrowed("s"), ..Default::default() };
        let header = StreamHeader::new(&identity, identity.key(&mut String::new()).into(), vocabulary);
        let mut s = StreamState::new();
        let mut pubs = Vec::new();
        let mut sink = |o: Output<'_>| pubs.push(encoder.encode(&header, &o));
        for delta in deltas {
            pipeline.feed(&mut s, delta, &mut sink);
        }
        pipeline.finish(&mut s, None, "stop", &mut sink);
        pubs
    }

    #[test]
    fn geppetto_sequence_numbers_text_events_only_without_gaps() {
        let tags = vec![TagSpec::new("thinking", TagKind::Channel), TagSpec::new("core:x:v1", TagKind::Block)];
        let deltas = ["a ", "<thinking>hm</thinking>", "b ", "<core:x:v1>k: v</core:x:v1>", "c"];
        let pubs = geppetto_stream(tags, PipelineLimits::default().max_text_bytes, Vocabulary::Canonical, &deltas);
        let sequences: Vec<(String, Option<u64>)> = pubs
            .iter()
            .filter(|p| p.type_name == GEPPETTO_EVENT_TYPE)
            .map(|p| serde_json::from_slice::<serde_json::Value>(&p.payload).unwrap())
            .map(|e| (e["type"].as_str().unwrap().to_owned(), e["sequence"].as_u64()))
            .collect();
        let expected = [
            ("text-delta", Some(1)),
            ("text-delta", Some(2)),
            ("text-delta", Some(3)),
            ("text-segment-finished", None),
        ];
        assert_eq!(sequences, expected.map(|(t, n)| (t.to_owned(), n)));
        assert!(pubs.len() > 4, "block and thinking outputs lie between them");
    }

    #[test]
    fn geppetto_events_say_when_the_cumulative_text_is_omitted() {
        let pubs = geppetto_stream(Vec::new(), 8, Vocabulary::Legacy, &["hello ", "world, ", "again"]);
        let events: Vec<(String, String, Option<bool>)> = pubs
            .iter()
            .map(|p| serde_json::from_slice::<serde_json::Value>(&p.payload).unwrap())
            .map(|e| {
                let text = e.get("completion").or(e.get("text")).and_then(|t| t.as_str()).unwrap().to_owned();
                (e["type"].as_str().unwrap().to_owned(), text, e.get("text_omitted").and_then(|o| o.as_bool()))
            })
            .collect();
        let expected = [
            ("partial", "hello ", None),
            ("partial", "", Some(true)),
            ("partial", "", Some(true)),
            ("final", "", Some(true)),
        ];
        assert_eq!(events, expected.map(|(t, c, o)| (t.to_owned(), c.to_owned(), o)));
    }

    #[test]
    fn streams_end_as_they_ended_upstream_with_the_error_text() {
        use crate::pipeline::Ending;
        let endings = [
            (Ending { reason: "error", error: Some("quota <exceeded>") }, "error"),
            (Ending { reason: "error", error: Some("") }, "error"),
            (Ending::from("interrupt"), "interrupt"),
            (Ending::from("error"), "final"),
            (Ending::from("stop"), "final"),
        ];
        for vocabulary in [Vocabulary::Legacy, Vocabulary::Canonical] {
            for (ending, kind) in endings {
                let (mut pipeline, _, _) = setup();
                let identity = StreamIdentity {
                    message_id: Cow::Borrowed("m"),
                    stream_id: Cow::Borrowed("s"),
                    ..Default::default()
                };
                let header = StreamHeader::new(&identity, identity.key(&mut String::new()).into(), vocabulary);
                let subjects = OutputSubjects::default();
                let mut json = OutputEncoder::with_text_encoding(&pipeline, &subjects, TextEncoding::GeppettoJson);
                let mut protobuf = OutputEncoder::new(&pipeline, &subjects);
                let (mut events, mut messages) = (Vec::new(), Vec::new());
                let mut s = StreamState::new();
                pipeline.feed(&mut s, "so far <", &mut |_: Output<'_>| {});
                pipeline.finish(&mut s, None, ending, &mut |o: Output<'_>| {
                    events.push(json.encode(&header, &o));
                    messages.push(protobuf.encode(&header, &o));
                });
                let last: serde_json::Value = serde_json::from_slice(&events.last().unwrap().payload).unwrap();
                let kind = match (kind, vocabulary) {
                    ("final", Vocabulary::Canonical) => "text-segment-finished",
                    (kind, _) => kind,
                };
                assert_eq!(last["type"], kind, "{ending:?} {vocabulary:?}");
                // The held-back `<` is the last delta; the whole text comes with it.
                assert_eq!((&last["delta"], &last["text"]), (&"<".into(), &"so far <".into()), "{last}");
                assert_eq!(last["meta"]["message_id"], "m");
                assert_eq!(last.get("correlation").is_some(), vocabulary == Vocabulary::Canonical, "{last}");
                assert_eq!(last.get("error_string").and_then(|e| e.as_str()), ending.error);
                assert_eq!(last.get("error").is_some(), ending.error.is_some());
                let message = proto::FilteredText::decode(messages.last().unwrap().payload.clone()).unwrap();
                assert!(message.r#final);
                assert_eq!(
                    (message.finish_reason.as_str(), message.error.as_str()),
                    (ending.reason, ending.error.unwrap_or(""))
                );
            }
        }
    }

    /// A publish over the server's `max_payload` fails for good while the input is acknowledged:
    /// every output must fit, with its bulk left out when it would not.
    #[test]
    fn outputs_over_the_payload_bound_go_with_their_bulk_left_out() {
        let (mut pipeline, _, header) = setup();
        let entries: String = (0..150).map(|i| format!("k{i}: value number {i}\n")).collect();
        let block = format!("<app:Mode.Switch:v1.2>\n{entries}</app:Mode.Switch:v1.2>");
        let tool = format!(r#"<tool>{{"tool_name":"t","arguments":{{"x":"{}"}}}}</tool>"#, "a".repeat(2_500));
        let prose = "word ".repeat(500);
        // (bound, whether the block's raw payload fits it alone)
        for (limit, raw_fits) in [(2_000, false), (4_000, true)] {
            for encoding in [TextEncoding::Protobuf, TextEncoding::GeppettoJson] {
                let mut encoder = OutputEncoder::with_text_encoding(&pipeline, &OutputSubjects::default(), encoding)
                    .with_max_payload(limit);
                let mut published = Vec::new();
                let mut s = StreamState::new();
                // In deltas of 500 bytes, as events within the bound would bring them.
                let whole = format!("{prose}{block}{tool}{prose}");
                for piece in whole.as_bytes().chunks(500) {
                    let piece = std::str::from_utf8(piece).unwrap();
                    pipeline.feed(&mut s, piece, &mut |o: Output<'_>| published.push(encoder.encode(&header, &o)));
                }
                pipeline.finish(&mut s, None, "stop", &mut |o: Output<'_>| published.push(encoder.encode(&header, &o)));
                let at = format!("{limit} {encoding:?}");
                assert!(published.iter().all(|p| p.payload.len() <= limit), "{at}: every output fits");
                // The final's cumulative text (5,000 bytes of prose).
                let last = published.last().unwrap();
                match encoding {
                    TextEncoding::Protobuf => {
                        let text = proto::FilteredText::decode(last.payload.clone()).unwrap();
                        assert!(text.r#final && text.text_omitted && text.text.is_empty(), "{at}: {text:?}");
                        assert_eq!(text.finish_reason, "stop");
                    }
                    TextEncoding::GeppettoJson => {
                        let event: serde_json::Value = serde_json::from_slice(&last.payload).unwrap();
                        assert_eq!(
                            (&event["type"], &event["text"], &event["text_omitted"]),
                            (&"final".into(), &"".into(), &true.into()),
                            "{at}"
                        );
                    }
                }
                let completed = published
                    .iter()
                    .filter(|p| p.type_name == proto::names::BLOCK_EVENT)
                    .map(|p| proto::BlockEvent::decode(p.payload.clone()).unwrap())
                    .find_map(|e| match e.event {
                        Some(proto::block_event::Event::Completed(c)) => Some(c),
                        _ => None,
                    })
                    .expect("the block completed");
                assert!(completed.payload_omitted && !completed.success, "{at}: {completed:?}");
                assert!(completed.error.contains("message size limit"), "{at}: {}", completed.error);
                assert!(completed.value.is_none() && completed.typed.is_none());
                assert_eq!(completed.raw.len() == entries.len() + 1, raw_fits, "{at}: raw kept when it fits");
                let call = published.iter().find(|p| p.type_name == proto::names::TOOL_CALL).expect("the call");
                let call = proto::ToolCall::decode(call.payload.clone()).unwrap();
                assert!(call.payload_omitted && !call.success && call.arguments.is_none(), "{at}: {call:?}");
                assert_eq!(call.raw.is_empty(), !raw_fits, "{at}");
                assert!(encoder.stats().outputs_trimmed >= 3, "{at}");
            }
        }
        // A subject's own limit, lower than the server's, bounds that subject's outputs only.
        let mut encoder =
            OutputEncoder::new(&pipeline, &OutputSubjects::default()).with_subject_limit("chat.tools", 1_000);
        let mut published = Vec::new();
        let mut s = StreamState::new();
        pipeline
            .feed(&mut s, &format!("{block}{tool}"), &mut |o: Output<'_>| published.push(encoder.encode(&header, &o)));
        let sizes =
            |type_name: &str| published.iter().filter(|p| p.type_name == type_name).map(|p| p.payload.len()).max();
        assert!(sizes(proto::names::TOOL_CALL).unwrap() <= 1_000);
        assert!(sizes(proto::names::BLOCK_EVENT).unwrap() > 1_000, "other subjects keep the server's bound");
        assert_eq!(encoder.stats().outputs_trimmed, 1);
        // A subject that several kinds share is bounded for each of them.
        let shared = OutputSubjects { thinking: "chat.side".into(), tools: "chat.side".into(), ..Default::default() };
        let mut encoder = OutputEncoder::new(&pipeline, &shared).with_subject_limit("chat.side", 1_000);
        assert_eq!(encoder.subjects().iter().filter(|s| &***s == "chat.side").count(), 1);
        let mut s = StreamState::new();
        let mut calls = Vec::new();
        pipeline.feed(&mut s, &tool, &mut |o: Output<'_>| calls.push(encoder.encode(&header, &o)));
        assert!(calls.iter().all(|p| p.payload.len() <= 1_000), "the tool call is bounded too");
        assert_eq!(payload_bound(1 << 20), (1 << 20) - OUTPUT_HEADER_ALLOWANCE);
        assert_eq!(payload_bound(2_048), 1_536);
        // Unbounded (the default), the same input goes whole.
        let mut encoder = OutputEncoder::new(&pipeline, &OutputSubjects::default());
        let mut s = StreamState::new();
        pipeline.feed(&mut s, &block, &mut |o: Output<'_>| {
            encoder.encode(&header, &o);
        });
        assert_eq!(encoder.stats().outputs_trimmed, 0);
    }

    #[test]
    fn values_nested_too_deep_for_protobuf_decoders_fail_their_block_or_call_instead() {
        let arrays = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        let objects = |depth: usize| format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
        for (depth, fits) in [(MAX_VALUE_DEPTH, true), (MAX_VALUE_DEPTH + 1, false)] {
            let (mut pipeline, mut encoder, header) = setup();
            let mut s = StreamState::new();
            let mut pubs = Vec::new();
            let mut sink = |o: Output<'_>| pubs.push(encoder.encode(&header, &o));
            let text = format!(
                r#"<app:Mode.Switch:v1.2>{}</app:Mode.Switch:v1.2><tool>{{"tool_name":"x","arguments":{}}}</tool>"#,
                arrays(depth),
                objects(depth)
            );
            pipeline.feed(&mut s, &text, &mut sink);
            pipeline.finish(&mut s, None, "stop", &mut sink);
            let (mut completed, mut tool) = (None, None);
            for p in &pubs {
                // Every message published decodes, whatever it carries.
                match p.type_name {
                    proto::names::BLOCK_EVENT => match proto::BlockEvent::decode(p.payload.clone()).unwrap().event {
                        Some(proto::block_event::Event::Completed(c)) => completed = Some(c),
                        Some(proto::block_event::Event::Snapshot(snapshot)) => {
                            assert_eq!(snapshot.value.is_some(), fits)
                        }
                        _ => {}
                    },
                    proto::names::TOOL_CALL => tool = Some(proto::ToolCall::decode(p.payload.clone()).unwrap()),
                    _ => drop(proto::FilteredText::decode(p.payload.clone()).unwrap()),
                }
            }
            let (completed, tool) = (completed.unwrap(), tool.unwrap());
            assert_eq!((completed.success, completed.value.is_some()), (fits, fits), "{depth}: {}", completed.error);
            assert_eq!((tool.success, tool.arguments.is_some()), (fits, fits), "{depth}: {}", tool.error);
            if !fits {
                assert!(completed.error.contains("nests deeper than 30 levels"), "{}", completed.error);
                assert!(tool.error.contains("arguments nest"), "{}", tool.error);
                assert_eq!(encoder.stats().too_deep, 1, "the block is counted");
            }
        }
        // Without the limit: a call's arguments a few levels deeper are published undecodable.
        let value: serde_json::Value = serde_json::from_str(&objects(MAX_VALUE_DEPTH + 4)).unwrap();
        let call =
            proto::ToolCall { arguments: value_within(&value, usize::MAX).and_then(into_struct), ..Default::default() };
        assert!(proto::ToolCall::decode(call.encode_to_vec().as_slice()).is_err());
    }

    #[test]
    fn messages_decode_with_the_generated_types() {
        let (mut pipeline, mut encoder, header) = setup();
        let mut s = StreamState::new();
        let mut pubs = Vec::new();
        let mut sink = |o: Output<'_>| pubs.push(encoder.encode(&header, &o));
        pipeline.feed(
            &mut s,
            r#"hi <app:Mode.Switch:v1.2>k: v</app:Mode.Switch:v1.2><thinking>t</thinking><tool>{"tool_name":"x","arguments":{"a":1}}</tool>"#,
            &mut sink,
        );
        pipeline.finish(&mut s, None, "stop", &mut sink);

        let text = proto::FilteredText::decode(pubs[0].payload.clone()).unwrap();
        assert_eq!(text.delta, "hi ");
        assert_eq!(text.seq, 1);
        let stream = text.stream.unwrap();
        assert_eq!((stream.message_id.as_str(), stream.stream_id.as_str()), ("m-1", "s-1"));
        assert_eq!(stream.session_id, "sess");
        assert_eq!(pubs[0].msg_id, "m-1/s-1:1");

        let completed = proto::BlockEvent::decode(pubs[3].payload.clone()).unwrap();
        assert_eq!(pubs[3].subject.as_ref(), "chat.structured.app.Mode%2ESwitch.v1%2E2");
        assert_eq!(completed.item_id, "m-1/s-1:1");
        assert_eq!(completed.tag.unwrap().r#type, "Mode.Switch");
        match completed.event {
            Some(proto::block_event::Event::Completed(c)) => assert!(c.success && c.raw == "k: v"),
            other => panic!("{other:?}"),
        }

        let think = proto::ThinkingText::decode(pubs[5].payload.clone()).unwrap();
        assert_eq!(pubs[5].subject.as_ref(), "chat.thinking");
        assert_eq!(think.tag, "thinking");

        let tool = proto::ToolCall::decode(pubs[7].payload.clone()).unwrap();
        assert_eq!(pubs[7].subject.as_ref(), "chat.tools");
        assert_eq!((tool.tool_name.as_str(), tool.server_name.as_str(), tool.success), ("x", "local", true));
        assert!(tool.arguments.unwrap().fields.contains_key("a"));

        let last = proto::FilteredText::decode(pubs.last().unwrap().payload.clone()).unwrap();
        assert!(last.r#final);
        assert_eq!(last.text, "hi ");
        assert_eq!(last.finish_reason, "stop");
        assert_eq!(last.seq, pubs.len() as u64);
    }
}
