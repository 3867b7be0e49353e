//! Decoding of geppetto event JSON (one event per NATS message), in both vocabularies.
//!
//! Legacy (geppetto up to v0.11.22): `partial` {delta, completion}, `final` {text}, `interrupt`
//! {text}, `error` {error_string}. Canonical (v0.11.23 and later): `text-delta` {delta, text,
//! sequence, correlation}, `text-segment-finished` {text, finish_reason, correlation}. Every other
//! type is not text: it is passed through untouched (`provider-call-finished` also ends the
//! segments of its call still open). `meta` carries `message_id` (required),
//! `session_id` (or the older `run_id`), `inference_id`, `turn_id`. The stream id is
//! `correlation.segment_id`, else `correlation.provider_call_id`, else `meta.message_id`; the
//! stream's key ([`StreamIdentity::key`], which state, acknowledgements and output ids are kept
//! under) adds its message id, so that a stream id another message reuses names another stream.
//!
//! Strings borrow from the payload when they hold no JSON escapes (Go's encoder writes `<` as
//! `\u003c`, so text with tags is usually decoded into an owned string). Errors never quote the
//! payload: they name the problem and its position only, so they are safe to log. A decoded event
//! can be detached from its payload ([`DetachedEvent`]: borrowed strings become positions) to
//! cross a task boundary beside the payload, and attached again there.

mod reader;

use std::borrow::Cow;

use reader::Fields;
use serde::Deserialize;
use serde_json::value::RawValue;

/// Why a payload is not an acceptable event. Safe to log: no payload text is included.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload exceeds `max_event_bytes`.
    #[error("event of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Payload size.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The payload is not JSON (or not UTF-8, or nested too deeply).
    #[error("invalid JSON at line {line} column {column}")]
    InvalidJson {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
    },
    /// The payload is JSON but not an object.
    #[error("event is not a JSON object")]
    NotAnObject,
    /// A field has the wrong type (the position says where).
    #[error("wrong field type at line {line} column {column}")]
    WrongFieldType {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
    },
    /// The event has no `type`.
    #[error("event has no type")]
    MissingType,
    /// `meta.message_id` is absent or empty.
    #[error("event has no meta.message_id")]
    MissingMessageId,
    /// The message id (or stream id) is longer than [`MAX_ID_BYTES`], holds control characters or
    /// begins with a space, so it cannot travel safely in headers and logs.
    #[error("message id is invalid: {0}")]
    InvalidMessageId(&'static str),
    /// Another id (session, inference, turn, provider call) or a finish reason is longer than
    /// [`MAX_ID_BYTES`]. Each open stream keeps its ids and every output carries them: a huge one
    /// would be held for the stream's life and make its outputs too large to publish.
    #[error("{0} is longer than 256 bytes")]
    FieldTooLong(&'static str),
    /// A text event lacks the field that carries its text.
    #[error("{kind} event has no {field}")]
    MissingField {
        /// The event type.
        kind: &'static str,
        /// The missing field.
        field: &'static str,
    },
}

impl DecodeError {
    /// A short, stable reason code for headers and metric labels.
    pub fn code(&self) -> &'static str {
        match self {
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::InvalidJson { .. } => "invalid_json",
            DecodeError::NotAnObject => "not_an_object",
            DecodeError::WrongFieldType { .. } => "wrong_field_type",
            DecodeError::MissingType => "missing_type",
            DecodeError::MissingMessageId => "missing_message_id",
            DecodeError::MissingField { .. } => "missing_field",
            DecodeError::InvalidMessageId(_) => "invalid_message_id",
            DecodeError::FieldTooLong(_) => "field_too_long",
        }
    }
}

/// The identity of the stream an event belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamIdentity<'a> {
    /// `meta.message_id`: the routing and partition key.
    pub message_id: Cow<'a, str>,
    /// The stream id (see the module documentation).
    pub stream_id: Cow<'a, str>,
    /// Whether the message id holds `%` or `/`, which [`StreamIdentity::key`] escapes (found by
    /// the scan that checks the id, so that no event scans it again). An identity built by hand
    /// must set it to match its message id.
    pub message_id_escapes: bool,
    /// `meta.session_id`, or `meta.run_id` from older producers.
    pub session_id: Cow<'a, str>,
    /// `meta.inference_id`.
    pub inference_id: Cow<'a, str>,
    /// `meta.turn_id`.
    pub turn_id: Cow<'a, str>,
    /// `correlation.provider_call_id` (empty when absent): the provider call a segment belongs to.
    pub provider_call_id: Cow<'a, str>,
}

impl StreamIdentity<'_> {
    /// The stream id when the stream has one of its own (a segment or provider call): `None` when
    /// the stream is its message.
    pub fn own_stream_id(&self) -> Option<&str> {
        // Most streams that are their message borrow both ids from one place in the payload.
        let same = (self.stream_id.as_ptr(), self.stream_id.len()) == (self.message_id.as_ptr(), self.message_id.len())
            || *self.stream_id == *self.message_id;
        (!same).then_some(&*self.stream_id)
    }

    /// The stream's key, which its state, acknowledgements and output ids are kept under:
    /// `<message id>/<stream id>` for a stream with an id of its own (a segment or provider call),
    /// else the message id. A `%` or `/` in the message id is written `%25` or `%2F`, so that no
    /// two streams share a key: a key holds an unescaped `/` exactly when its stream has an id of
    /// its own, and the message id ends there. Segment and provider call ids are unique only
    /// within their inference (geppetto numbers a tool loop's provider calls from its caller's
    /// index, 0 for each call when none is set, and each call has a message id of its own), and
    /// any producer may reuse another's: keyed by stream id alone, a second stream would be taken
    /// for the first one's late events, and its outputs would share `Nats-Msg-Id`s with it.
    ///
    /// Written into `scratch` unless it is the message id as it stands (so a key costs no
    /// allocation once `scratch` has grown to fit).
    pub fn key<'s>(&'s self, scratch: &'s mut String) -> &'s str {
        // `decode` sets the flag from its scan; an identity built by hand must set it too, or two
        // streams could share a key. Checked where it costs nothing (debug builds, the tests).
        debug_assert_eq!(
            self.message_id_escapes,
            self.message_id.contains(['%', '/']),
            "message_id_escapes disagrees with the message id {:?}",
            self.message_id
        );
        let own = self.own_stream_id();
        if own.is_none() && !self.message_id_escapes {
            return &self.message_id;
        }
        scratch.clear();
        if self.message_id_escapes {
            for c in self.message_id.chars() {
                match c {
                    '%' => scratch.push_str("%25"),
                    '/' => scratch.push_str("%2F"),
                    c => scratch.push(c),
                }
            }
        } else {
            scratch.push_str(&self.message_id);
        }
        if let Some(own) = own {
            scratch.push('/');
            scratch.push_str(own);
        }
        scratch
    }
}

/// What an event asks the pipeline to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventAction<'a> {
    /// A text delta.
    Delta(Cow<'a, str>),
    /// The end of the stream, with the upstream's whole text when it sent one.
    Finish {
        /// The final text (`final.text`, `interrupt.text`, `text-segment-finished.text`).
        text: Option<Cow<'a, str>>,
        /// `stop_reason`/`finish_reason`, or `interrupt`/`error`.
        reason: Cow<'a, str>,
        /// The upstream's error text (`error.error_string`, empty when absent) when an `error`
        /// event ended the stream; `None` for every other event.
        error: Option<Cow<'a, str>>,
    },
    /// The end of a provider call (`provider-call-finished`): forwarded unchanged like any event
    /// that is not text, and every segment of that call still open ends with `reason` (the
    /// event's `finish_class`, else its `stop_reason`, else `provider-call-finished`). No more text
    /// of the call comes: geppetto sends it after the call's last event, and a segment still open
    /// then was cut short (a cancelled or failed call, whose segment some providers never finish).
    CallFinished {
        /// Why the segments ended.
        reason: Cow<'a, str>,
    },
    /// Not a text event: forwarded unchanged to the pass-through subject when one is set.
    PassThrough,
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundEvent<'a> {
    /// The event's `type` as sent.
    pub kind: Cow<'a, str>,
    /// Its stream.
    pub stream: StreamIdentity<'a>,
    /// What it asks for.
    pub action: EventAction<'a>,
}

/// A string that borrows from the payload when it holds no escapes. (A plain `Option<Cow<str>>`
/// field always allocates: serde borrows only a `Cow` it deserializes directly.)
#[derive(Deserialize, Default)]
#[serde(transparent)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

impl InboundEvent<'_> {
    /// Whether the event ends every open stream of its message: an `error` or `interrupt` event
    /// that names no segment or provider call (its stream id is its message id). The canonical
    /// vocabulary keeps these two in their legacy shape, without `correlation`, and geppetto may
    /// send one while a text segment is still open: a provider error in the middle of a segment,
    /// which not every provider's path closes with `text-segment-finished` first.
    pub fn ends_message(&self) -> bool {
        matches!(self.kind.as_ref(), "error" | "interrupt") && self.stream.own_stream_id().is_none()
    }

    /// The same event owning its strings.
    pub fn into_owned(self) -> InboundEvent<'static> {
        let own = |c: Cow<'_, str>| Cow::Owned(c.into_owned());
        InboundEvent {
            kind: own(self.kind),
            stream: StreamIdentity {
                message_id: own(self.stream.message_id),
                stream_id: own(self.stream.stream_id),
                message_id_escapes: self.stream.message_id_escapes,
                session_id: own(self.stream.session_id),
                inference_id: own(self.stream.inference_id),
                turn_id: own(self.stream.turn_id),
                provider_call_id: own(self.stream.provider_call_id),
            },
            action: match self.action {
                EventAction::Delta(d) => EventAction::Delta(own(d)),
                EventAction::Finish { text, reason, error } => {
                    EventAction::Finish { text: text.map(own), reason: own(reason), error: error.map(own) }
                }
                EventAction::CallFinished { reason } => EventAction::CallFinished { reason: own(reason) },
                EventAction::PassThrough => EventAction::PassThrough,
            },
        }
    }

    /// The event with every string that borrows from `payload` replaced by its position there, to
    /// cross a task boundary beside the payload without copying those strings (only strings that
    /// held escapes, or come from elsewhere, are owned). `payload` must be the one it was decoded
    /// from; [`DetachedEvent::attach`] to the same payload gives the event back.
    pub fn detach(self, payload: &[u8]) -> DetachedEvent {
        let piece = |c: Cow<'_, str>| Piece::new(c, payload);
        DetachedEvent {
            kind: piece(self.kind),
            message_id_escapes: self.stream.message_id_escapes,
            identity: [
                piece(self.stream.message_id),
                piece(self.stream.stream_id),
                piece(self.stream.session_id),
                piece(self.stream.inference_id),
                piece(self.stream.turn_id),
                piece(self.stream.provider_call_id),
            ],
            action: match self.action {
                EventAction::Delta(d) => DetachedAction::Delta(piece(d)),
                EventAction::Finish { text, reason, error } => {
                    DetachedAction::Finish { text: text.map(piece), reason: piece(reason), error: error.map(piece) }
                }
                EventAction::CallFinished { reason } => DetachedAction::CallFinished { reason: piece(reason) },
                EventAction::PassThrough => DetachedAction::PassThrough,
            },
        }
    }
}

/// An event detached from its payload ([`InboundEvent::detach`]).
#[derive(Debug, Clone)]
pub struct DetachedEvent {
    kind: Piece,
    /// Message, stream, session, inference, turn and provider call ids.
    identity: [Piece; 6],
    message_id_escapes: bool,
    action: DetachedAction,
}

#[derive(Debug, Clone)]
enum DetachedAction {
    Delta(Piece),
    Finish { text: Option<Piece>, reason: Piece, error: Option<Piece> },
    CallFinished { reason: Piece },
    PassThrough,
}

/// A string of a detached event: a position in the payload, or owned.
#[derive(Debug, Clone)]
enum Piece {
    Span { start: u32, len: u32 },
    Owned(Box<str>),
}

impl Piece {
    fn new(text: Cow<'_, str>, payload: &[u8]) -> Piece {
        let range = payload.as_ptr_range();
        match text {
            Cow::Borrowed(s) if range.contains(&s.as_ptr()) && s.len() <= range.end as usize - s.as_ptr() as usize => {
                // In bounds, so both fit in u32 for any payload under 4 GiB (max_event_bytes is
                // far below); larger ones are kept owned.
                let start = s.as_ptr() as usize - range.start as usize;
                match (u32::try_from(start), u32::try_from(s.len())) {
                    (Ok(start), Ok(len)) => Piece::Span { start, len },
                    _ => Piece::Owned(s.into()),
                }
            }
            other => Piece::Owned(other.into_owned().into_boxed_str()),
        }
    }

    fn attach<'a>(&'a self, payload: &'a [u8]) -> Cow<'a, str> {
        match self {
            Piece::Owned(s) => Cow::Borrowed(s),
            Piece::Span { start, len } => {
                let bytes = payload.get(*start as usize..*start as usize + *len as usize);
                // Both hold only for the payload the event was detached from: anything else is a
                // bug, not input.
                let text = bytes.map(reader::utf8).expect("attached to a payload shorter than its own");
                Cow::Borrowed(text.expect("attached to a payload other than its own"))
            }
        }
    }
}

impl DetachedEvent {
    /// The event again, borrowing from `payload`, which must be the payload it was detached from
    /// (panics otherwise).
    pub fn attach<'a>(&'a self, payload: &'a [u8]) -> InboundEvent<'a> {
        let [message_id, stream_id, session_id, inference_id, turn_id, provider_call_id] = &self.identity;
        InboundEvent {
            kind: self.kind.attach(payload),
            stream: StreamIdentity {
                message_id: message_id.attach(payload),
                stream_id: stream_id.attach(payload),
                message_id_escapes: self.message_id_escapes,
                session_id: session_id.attach(payload),
                inference_id: inference_id.attach(payload),
                turn_id: turn_id.attach(payload),
                provider_call_id: provider_call_id.attach(payload),
            },
            action: match &self.action {
                DetachedAction::Delta(d) => EventAction::Delta(d.attach(payload)),
                DetachedAction::Finish { text, reason, error } => EventAction::Finish {
                    text: text.as_ref().map(|t| t.attach(payload)),
                    reason: reason.attach(payload),
                    error: error.as_ref().map(|e| e.attach(payload)),
                },
                DetachedAction::CallFinished { reason } => EventAction::CallFinished { reason: reason.attach(payload) },
                DetachedAction::PassThrough => EventAction::PassThrough,
            },
        }
    }

    /// `meta.message_id`, without attaching the rest.
    pub fn message_id<'a>(&'a self, payload: &'a [u8]) -> Cow<'a, str> {
        self.identity[0].attach(payload)
    }
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Str<'a>>,
    #[serde(borrow, default)]
    meta: Option<Object<WireMeta<'a>>>,
    #[serde(borrow, default)]
    correlation: Option<Object<WireCorrelation<'a>>>,
    #[serde(borrow, default)]
    delta: Option<Str<'a>>,
    /// Cumulative on deltas (`text-delta`), whole on finals: kept raw and decoded only for the
    /// events that use it, so a delta does not unescape and copy the whole text so far.
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    finish_reason: Option<Str<'a>>,
    #[serde(borrow, default)]
    error_string: Option<Str<'a>>,
}

#[derive(Deserialize, Default)]
struct WireMeta<'a> {
    #[serde(borrow, default)]
    message_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    session_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    run_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    inference_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    turn_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    stop_reason: Option<Str<'a>>,
}

#[derive(Deserialize, Default)]
struct WireCorrelation<'a> {
    #[serde(borrow, default)]
    segment_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    provider_call_id: Option<Str<'a>>,
}

/// A struct read from a JSON object only. serde's derive also takes an array, field by field in
/// declaration order (`["partial",{"message_id":"m"},null,"hi"]` would be a delta): no producer
/// means that, and the reader refuses it too.
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Visitor<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Object)
            }
        }
        deserializer.deserialize_map(Visitor(std::marker::PhantomData))
    }
}

fn non_empty(v: Option<Cow<'_, str>>) -> Option<Cow<'_, str>> {
    v.filter(|s| !s.is_empty())
}

fn cow(v: Option<Str<'_>>) -> Option<Cow<'_, str>> {
    v.map(|s| s.0)
}

/// The longest message id, stream id, other id or finish reason accepted.
pub const MAX_ID_BYTES: usize = 256;

/// `value` (empty when absent), refused when longer than [`MAX_ID_BYTES`].
fn bounded<'a>(field: &'static str, value: Option<Cow<'a, str>>) -> Result<Cow<'a, str>, DecodeError> {
    match value {
        Some(value) if value.len() > MAX_ID_BYTES => Err(DecodeError::FieldTooLong(field)),
        value => Ok(value.unwrap_or_default()),
    }
}

/// A finishing event's reason: `stop` when absent or empty; refused when longer than
/// [`MAX_ID_BYTES`].
fn finish_reason<'a>(field: &'static str, value: Option<Cow<'a, str>>) -> Result<Cow<'a, str>, DecodeError> {
    let reason = bounded(field, value)?;
    Ok(if reason.is_empty() { Cow::Borrowed("stop") } else { reason })
}

/// Checks an id; returns whether it holds `%` or `/` (which a stream key escapes in a message id).
fn check_id(id: &str) -> Result<bool, DecodeError> {
    if id.len() > MAX_ID_BYTES {
        return Err(DecodeError::InvalidMessageId("longer than 256 bytes"));
    }
    // An id leads each output's `Nats-Msg-Id`, whose leading spaces the server drops: ` a` would
    // share its ids with `a`, and a stream deduplicating by them would drop one message's outputs.
    if id.starts_with(' ') {
        return Err(DecodeError::InvalidMessageId("begins with a space"));
    }
    // Control characters (`Cc`) are C0 (bytes below 0x20), DEL and C1 (U+0080 to U+009F, encoded
    // as 0xC2 0x80..0x9F): a scan of the bytes first, of the characters only when one may be there.
    let IdScan { controls, separators } = scan_id(id.as_bytes());
    if controls && id.chars().any(char::is_control) {
        return Err(DecodeError::InvalidMessageId("contains control characters"));
    }
    Ok(separators)
}

/// What a scan of an id's bytes found.
#[derive(Debug, PartialEq, Eq)]
struct IdScan {
    /// A byte below 0x20, DEL (0x7f) or 0xc2 (the lead byte of C1 controls): a control character
    /// may be there.
    controls: bool,
    /// `%` or `/`.
    separators: bool,
}

/// Scans `bytes` sixteen at a time (ids are checked on every event). The last sixteen bytes are
/// one chunk, overlapping the one before: a byte seen twice changes no answer, and no byte is
/// left to a loop of its own.
fn scan_id(bytes: &[u8]) -> IdScan {
    let Some(last) = bytes.len().checked_sub(16) else {
        return IdScan {
            controls: bytes.iter().any(|&b| b < 0x20 || b == 0x7f || b == 0xc2),
            separators: bytes.iter().any(|&b| b == b'%' || b == b'/'),
        };
    };
    let (mut controls, mut separators) = (0, 0);
    let mut at = 0;
    loop {
        let chunk = reader::Chunk::at(bytes, at.min(last)).expect("sixteen bytes from at most `last`");
        controls |= chunk.below(0x20) | chunk.equal(0x7f) | chunk.equal(0xc2);
        separators |= chunk.equal(b'%') | chunk.equal(b'/');
        if at >= last {
            break;
        }
        at += 16;
    }
    IdScan { controls: controls != 0, separators: separators != 0 }
}

/// Decodes one event payload. `max_event_bytes` bounds the payload size.
pub fn decode(payload: &[u8], max_event_bytes: usize) -> Result<InboundEvent<'_>, DecodeError> {
    if payload.len() > max_event_bytes {
        return Err(DecodeError::TooLarge { size: payload.len(), limit: max_event_bytes });
    }
    // The common shapes in one pass of our own; serde_json for everything else, and for errors.
    let fields = match reader::read(payload) {
        Some(fields) => fields,
        None => read_with_serde(payload)?,
    };
    let kind = non_empty(fields.kind).ok_or(DecodeError::MissingType)?;
    let message_id = non_empty(fields.message_id).ok_or(DecodeError::MissingMessageId)?;
    let provider_call_id = non_empty(fields.provider_call_id);
    let stream_id =
        non_empty(fields.segment_id).or_else(|| provider_call_id.clone()).unwrap_or_else(|| message_id.clone());
    let message_id_escapes = check_id(&message_id)?;
    // Most streams are identified by their message id, checked just now.
    if (stream_id.as_ptr(), stream_id.len()) != (message_id.as_ptr(), message_id.len()) {
        check_id(&stream_id)?;
    }
    let stream = StreamIdentity {
        message_id,
        stream_id,
        message_id_escapes,
        session_id: bounded("meta.session_id", non_empty(fields.session_id).or(fields.run_id))?,
        inference_id: bounded("meta.inference_id", fields.inference_id)?,
        turn_id: bounded("meta.turn_id", fields.turn_id)?,
        provider_call_id: bounded("correlation.provider_call_id", provider_call_id)?,
    };
    let action = match kind.as_ref() {
        "partial" | "text-delta" => EventAction::Delta(fields.delta.ok_or(DecodeError::MissingField {
            kind: if kind == "partial" { "partial" } else { "text-delta" },
            field: "delta",
        })?),
        "final" => EventAction::Finish {
            text: whole_text(payload, fields.text)?,
            reason: finish_reason("meta.stop_reason", fields.stop_reason)?,
            error: None,
        },
        "text-segment-finished" => EventAction::Finish {
            text: whole_text(payload, fields.text)?,
            reason: finish_reason("finish_reason", fields.finish_reason)?,
            error: None,
        },
        "interrupt" => EventAction::Finish {
            text: whole_text(payload, fields.text)?,
            reason: Cow::Borrowed("interrupt"),
            error: None,
        },
        // Some even when empty: the error event ended the stream, which a final with the stop
        // reason `error` does not tell.
        "error" => EventAction::Finish {
            text: None,
            reason: Cow::Borrowed("error"),
            error: Some(fields.error_string.unwrap_or_default()),
        },
        "provider-call-finished" => EventAction::CallFinished { reason: call_end_reason(payload) },
        _ => EventAction::PassThrough,
    };
    Ok(InboundEvent { kind, stream, action })
}

/// The fields as serde_json reads them: the reference for [`reader::read`], and the decoder of
/// every payload that reader leaves to it. Cold and out of line: the rare path, kept out of
/// `decode`, into which the reader is inlined.
#[cold]
#[inline(never)]
fn read_with_serde(payload: &[u8]) -> Result<Fields<'_>, DecodeError> {
    let Object(wire): Object<Wire<'_>> = serde_json::from_slice(payload).map_err(|e| classify(payload, &e))?;
    let meta = wire.meta.map(|Object(meta)| meta).unwrap_or_default();
    let correlation = wire.correlation.map(|Object(correlation)| correlation).unwrap_or_default();
    Ok(Fields {
        kind: cow(wire.kind),
        delta: cow(wire.delta),
        text: wire.text.map(RawValue::get),
        finish_reason: cow(wire.finish_reason),
        message_id: cow(meta.message_id),
        session_id: cow(meta.session_id),
        run_id: cow(meta.run_id),
        inference_id: cow(meta.inference_id),
        turn_id: cow(meta.turn_id),
        stop_reason: cow(meta.stop_reason),
        segment_id: cow(correlation.segment_id),
        provider_call_id: cow(correlation.provider_call_id),
        error_string: cow(wire.error_string),
    })
}

/// Whether the single-pass reader gives exactly what serde_json gives for `payload` (or leaves
/// it to serde): the property `properties::event_decoding` checks for every payload it sees.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn reader_agrees_with_serde(payload: &[u8]) -> Result<(), String> {
    let Some(read) = reader::read(payload) else { return Ok(()) };
    match read_with_serde(payload) {
        Ok(reference) if reference == read => Ok(()),
        Ok(reference) => Err(format!("the reader read {read:?}, serde {reference:?}")),
        Err(e) => Err(format!("the reader accepted what serde refuses: {e}")),
    }
}

/// Decodes the `text` field of a finishing event, kept raw by the first pass. An error is a wrong
/// field type, or invalid JSON for a string that cannot be decoded (a lone surrogate escape), as
/// in any other field; positioned at the value in the whole payload.
fn whole_text<'a>(payload: &'a [u8], raw: Option<&'a str>) -> Result<Option<Cow<'a, str>>, DecodeError> {
    let Some(raw) = raw else { return Ok(None) };
    match serde_json::from_str::<Str<'a>>(raw) {
        Ok(text) => Ok(Some(text.0)),
        Err(e) => {
            // `raw` borrows from `payload`: its offset gives the position.
            let offset = (raw.as_ptr() as usize).saturating_sub(payload.as_ptr() as usize).min(payload.len());
            let before = &payload[..offset];
            let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
            let column = offset - before.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
            Err(match e.classify() {
                serde_json::error::Category::Data => DecodeError::WrongFieldType { line, column },
                _ => DecodeError::InvalidJson { line, column },
            })
        }
    }
}

/// Why a provider call ended, for the segments it leaves open: its `finish_class`, else its
/// `stop_reason` (both top-level in `provider-call-finished`), else `provider-call-finished`. A
/// field of another type, or longer than [`MAX_ID_BYTES`], is passed over rather than refused:
/// the event is forwarded unchanged anyway. Read apart, once per provider call, so that the
/// reader of every event need not know these fields.
#[cold]
fn call_end_reason(payload: &[u8]) -> Cow<'_, str> {
    #[derive(Deserialize)]
    struct CallEnd<'a> {
        #[serde(borrow, default)]
        finish_class: Option<&'a RawValue>,
        #[serde(borrow, default)]
        stop_reason: Option<&'a RawValue>,
    }
    fn string(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
        non_empty(cow(serde_json::from_str(raw?.get()).ok())).filter(|s| s.len() <= MAX_ID_BYTES)
    }
    serde_json::from_slice::<CallEnd<'_>>(payload)
        .ok()
        .and_then(|end| string(end.finish_class).or_else(|| string(end.stop_reason)))
        .unwrap_or(Cow::Borrowed("provider-call-finished"))
}

/// Maps a serde error to a reason that quotes nothing from the payload.
fn classify(payload: &[u8], e: &serde_json::Error) -> DecodeError {
    let (line, column) = (e.line(), e.column());
    match e.classify() {
        serde_json::error::Category::Data => {
            // A top-level value that is not an object fails as "invalid type" too; tell the two
            // apart by the first non-blank byte.
            match payload.iter().find(|b| !b.is_ascii_whitespace()) {
                Some(b'{') => DecodeError::WrongFieldType { line, column },
                _ => DecodeError::NotAnObject,
            }
        }
        _ => DecodeError::InvalidJson { line, column },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MID: &str = "3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071";

    #[test]
    fn the_chunk_wise_id_scan_finds_what_a_byte_wise_one_finds() {
        let suspect = |b: u8| b < 0x20 || b == 0x7f || b == 0xc2;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..40 {
            for _ in 0..200 {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        // Mostly printable, sometimes a byte near the suspects.
                        match seed % 16 {
                            0 => [0x00, 0x1f, 0x20, 0x25, 0x2f, 0x7e, 0x7f, 0x80, 0xc1, 0xc2, 0xc3, 0xff]
                                [(seed >> 8) as usize % 12],
                            _ => b'a' + (seed >> 8) as u8 % 26,
                        }
                    })
                    .collect();
                let expected = IdScan {
                    controls: bytes.iter().any(|&b| suspect(b)),
                    separators: bytes.iter().any(|&b| b == b'%' || b == b'/'),
                };
                assert_eq!(scan_id(&bytes), expected, "{bytes:?}");
            }
        }
    }

    #[test]
    fn legacy_partial_with_go_escapes() {
        let json = format!(
            r#"{{"type":"partial","meta":{{"model":"m","message_id":"{MID}","run_id":"run-1","turn_id":"t"}},"delta":"\u003cx\u003e","completion":"c"}}"#
        );
        let ev = decode(json.as_bytes(), 1 << 20).unwrap();
        assert_eq!(ev.action, EventAction::Delta("<x>".into()));
        assert_eq!(ev.stream.message_id, MID);
        assert_eq!(ev.stream.stream_id, MID);
        assert_eq!(ev.stream.session_id, "run-1");
        assert_eq!(ev.stream.turn_id, "t");
    }

    #[test]
    fn a_streams_key_holds_its_message_id_and_no_two_streams_share_one() {
        let key = |json: &str| decode(json.as_bytes(), 1 << 20).unwrap().stream.key(&mut String::new()).to_owned();
        let delta = |message: &str, correlation: &str| {
            key(&format!(r#"{{"type":"text-delta","meta":{{"message_id":"{message}"}}{correlation},"delta":"x"}}"#))
        };
        // A stream that is its message is keyed by its message id as it stands, nothing written.
        let json = format!(r#"{{"type":"partial","meta":{{"message_id":"{MID}"}},"delta":"x"}}"#);
        let event = decode(json.as_bytes(), 1 << 20).unwrap();
        let mut scratch = String::new();
        assert_eq!(event.stream.key(&mut scratch), MID);
        assert!(scratch.is_empty());
        // A segment or provider call: after its message id.
        assert_eq!(delta("m", r#","correlation":{"segment_id":"s","provider_call_id":"p"}"#), "m/s");
        assert_eq!(delta("m", r#","correlation":{"provider_call_id":"p"}"#), "m/p");
        // A segment id equal to its message id names the message's own stream.
        assert_eq!(delta("m", r#","correlation":{"segment_id":"m"}"#), "m");
        // `/` and `%` in a message id are escaped: these four streams share no key.
        let keys = [
            delta("a", r#","correlation":{"segment_id":"b/c"}"#),
            delta("a/b", r#","correlation":{"segment_id":"c"}"#),
            delta("a/b/c", ""),
            delta("a%2Fb", r#","correlation":{"segment_id":"c"}"#),
        ];
        assert_eq!(keys, ["a/b/c", "a%2Fb/c", "a%2Fb%2Fc", "a%252Fb/c"]);
    }

    #[test]
    fn detached_events_keep_positions_of_borrowed_strings_and_attach_unchanged() {
        let json = format!(
            r#"{{"type":"final","meta":{{"message_id":"{MID}","session_id":"s\u003c1","turn_id":"t"}},"text":"a \u003cb\u003e c"}}"#
        );
        let payload = json.as_bytes();
        let event = decode(payload, 1 << 20).unwrap();
        let detached = event.clone().detach(payload);
        let debug = format!("{detached:?}");
        // Positions: type, message id (twice, as stream id), turn id. Owned: the escaped session
        // id and text, the absent inference and provider call ids (empty) and the default
        // reason, which are not in the payload.
        assert_eq!(debug.matches("Span").count(), 4, "{debug}");
        assert_eq!(debug.matches("Owned").count(), 5, "{debug}");
        assert_eq!(detached.attach(payload), event);
        assert_eq!(detached.message_id(payload), MID);
        // Strings from another buffer are copied, never taken as positions in this payload.
        let other = decode(payload, 1 << 20).unwrap().into_owned();
        assert_eq!(other.detach(payload).attach(payload), event);
    }

    #[test]
    #[should_panic(expected = "attached to a payload")]
    fn attaching_to_another_payload_is_a_bug_that_panics() {
        let json = format!(r#"{{"type":"partial","meta":{{"message_id":"{MID}"}},"delta":"plain"}}"#);
        let detached = decode(json.as_bytes(), 1 << 20).unwrap().detach(json.as_bytes());
        let _ = detached.attach(b"short");
    }

    #[test]
    fn ids_with_control_characters_or_a_leading_space_are_refused_and_others_accepted() {
        for bad in [r"a\tb", r"a\u007fb", r"a\u0085b", r"\u009f", r"\u0000", " a", r"\u0020a"] {
            let json = format!(r#"{{"type":"partial","meta":{{"message_id":"{bad}"}},"delta":"x"}}"#);
            assert_eq!(decode(json.as_bytes(), 1 << 20).unwrap_err().code(), "invalid_message_id", "{bad}");
        }
        // U+00A0 shares the 0xC2 lead byte with C1 controls; U+00C2 and é share nothing with them.
        for good in [r"a\u00a0b", r"\u00c2", "café", "a~b", "a b", "a "] {
            let json = format!(r#"{{"type":"partial","meta":{{"message_id":"{good}"}},"delta":"x"}}"#);
            assert!(decode(json.as_bytes(), 1 << 20).is_ok(), "{good}");
        }
    }

    #[test]
    fn ids_and_reasons_longer_than_the_bound_are_refused_by_name() {
        let long = "x".repeat(MAX_ID_BYTES + 1);
        let fits = "x".repeat(MAX_ID_BYTES);
        let cases = [
            (r#""meta":{"message_id":"m","session_id":"$"},"delta":"d""#, "partial", "meta.session_id"),
            (r#""meta":{"message_id":"m","run_id":"$"},"delta":"d""#, "partial", "meta.session_id"),
            (r#""meta":{"message_id":"m","inference_id":"$"},"delta":"d""#, "partial", "meta.inference_id"),
            (r#""meta":{"message_id":"m","turn_id":"$"},"delta":"d""#, "partial", "meta.turn_id"),
            (
                r#""meta":{"message_id":"m"},"correlation":{"segment_id":"s","provider_call_id":"$"},"delta":"d""#,
                "text-delta",
                "correlation.provider_call_id",
            ),
            (r#""meta":{"message_id":"m","stop_reason":"$"},"text":"t""#, "final", "meta.stop_reason"),
            (r#""meta":{"message_id":"m"},"finish_reason":"$""#, "text-segment-finished", "finish_reason"),
        ];
        for (fields, kind, field) in cases {
            let event = |value: &str| format!(r#"{{"type":"{kind}",{}}}"#, fields.replace('$', value));
            let error = decode(event(&long).as_bytes(), 1 << 20).unwrap_err();
            assert_eq!(error, DecodeError::FieldTooLong(field));
            assert_eq!(error.code(), "field_too_long");
            assert_eq!(error.to_string(), format!("{field} is longer than 256 bytes"));
            assert!(decode(event(&fits).as_bytes(), 1 << 20).is_ok(), "{field}: 256 bytes fit");
        }
        // The reason of a call's end is passed over, as one of another type is.
        let end = format!(
            r#"{{"type":"provider-call-finished","meta":{{"message_id":"m"}},"finish_class":"{long}","stop_reason":"s"}}"#
        );
        assert_eq!(decode(end.as_bytes(), 1 << 20).unwrap().action, EventAction::CallFinished { reason: "s".into() });
    }

    #[test]
    fn borrowed_when_no_escapes() {
        let json = format!(r#"{{"type":"partial","meta":{{"message_id":"{MID}"}},"delta":"plain"}}"#);
        let ev = decode(json.as_bytes(), 1 << 20).unwrap();
        assert!(matches!(ev.action, EventAction::Delta(Cow::Borrowed("plain"))));
    }

    #[test]
    fn only_errors_and_interrupts_without_correlation_end_their_message() {
        let ends = |json: &str| decode(json.as_bytes(), 1 << 20).unwrap().ends_message();
        assert!(ends(r#"{"type":"error","meta":{"message_id":"m"},"error_string":"boom"}"#));
        assert!(ends(r#"{"type":"interrupt","meta":{"message_id":"m"},"text":"x"}"#));
        // A correlation that names a segment or provider call ends that stream only.
        assert!(!ends(r#"{"type":"error","meta":{"message_id":"m"},"correlation":{"segment_id":"s"}}"#));
        assert!(!ends(r#"{"type":"interrupt","meta":{"message_id":"m"},"correlation":{"provider_call_id":"p"}}"#));
        // An empty segment id names none.
        assert!(ends(r#"{"type":"interrupt","meta":{"message_id":"m"},"correlation":{"segment_id":""}}"#));
        for other in [
            r#"{"type":"final","meta":{"message_id":"m"},"text":"x"}"#,
            r#"{"type":"text-segment-finished","meta":{"message_id":"m"},"finish_reason":"interrupt"}"#,
            r#"{"type":"partial","meta":{"message_id":"m"},"delta":"x"}"#,
            r#"{"type":"run-failed","meta":{"message_id":"m"}}"#,
        ] {
            assert!(!ends(other), "{other}");
        }
    }

    #[test]
    fn a_provider_call_finished_names_its_call_and_why_it_ended() {
        let event = |fields: &str| {
            let json = format!(
                r#"{{"type":"provider-call-finished","meta":{{"message_id":"m"}},"correlation":{{"provider_call_id":"p1"}}{fields}}}"#
            );
            decode(json.as_bytes(), 1 << 20).unwrap().into_owned()
        };
        let reason = |fields: &str| match event(fields).action {
            EventAction::CallFinished { reason } => reason.into_owned(),
            other => panic!("{other:?}"),
        };
        assert_eq!(event("").stream.provider_call_id, "p1");
        assert_eq!(event("").stream.stream_id, "p1");
        assert_eq!(reason(r#","stop_reason":"error","finish_class":"failed""#), "failed");
        assert_eq!(reason(r#","stop_reason":"max_tokens""#), "max_tokens");
        assert_eq!(reason(r#","finish_class":"can\u0063elled""#), "cancelled");
        // Neither, empty, or not a string: the event still goes through, with the default.
        for fields in ["", r#","finish_class":"""#, r#","finish_class":7,"stop_reason":{}"#] {
            assert_eq!(reason(fields), "provider-call-finished", "{fields}");
        }
        // The provider call id survives a trip across tasks.
        let json = r#"{"type":"text-delta","meta":{"message_id":"m"},"correlation":{"segment_id":"s","provider_call_id":"p1"},"delta":"x"}"#;
        let delta = decode(json.as_bytes(), 1 << 20).unwrap();
        assert_eq!(delta.clone().detach(json.as_bytes()).attach(json.as_bytes()), delta);
        assert_eq!(delta.stream.provider_call_id, "p1");
    }

    #[test]
    fn legacy_final_interrupt_error() {
        let json = format!(
            r#"{{"type":"final","meta":{{"stop_reason":"length","message_id":"{MID}","session_id":"s"}},"text":"Hello"}}"#
        );
        let ev = decode(json.as_bytes(), 1 << 20).unwrap();
        assert_eq!(ev.action, EventAction::Finish { text: Some("Hello".into()), reason: "length".into(), error: None });
        assert_eq!(ev.stream.session_id, "s");
        let json = format!(r#"{{"type":"interrupt","meta":{{"message_id":"{MID}"}},"text":"x"}}"#);
        assert_eq!(
            decode(json.as_bytes(), 1 << 20).unwrap().action,
            EventAction::Finish { text: Some("x".into()), reason: "interrupt".into(), error: None }
        );
        let json = format!(r#"{{"type":"error","error":{{}},"meta":{{"message_id":"{MID}"}},"error_string":"boom"}}"#);
        assert_eq!(
            decode(json.as_bytes(), 1 << 20).unwrap().action,
            EventAction::Finish { text: None, reason: "error".into(), error: Some("boom".into()) }
        );
        // Escaped as Go writes it, by the reader and by serde_json (an escaped key sends the
        // reader there); one without text is empty.
        for json in [
            format!(r#"{{"type":"error","meta":{{"message_id":"{MID}"}},"error_string":"say \"\u003cno\u003e\""}}"#),
            format!(
                r#"{{"type":"error","meta":{{"message_id":"{MID}"}},"error_string":"say \"\u003cno\u003e\"","\u0078":1}}"#
            ),
        ] {
            assert!(reader::read(json.as_bytes()).is_some() != json.contains("u0078"), "{json}");
            let ev = decode(json.as_bytes(), 1 << 20);
            assert_eq!(
                ev.map(|e| e.action).ok(),
                Some(EventAction::Finish { text: None, reason: "error".into(), error: Some(r#"say "<no>""#.into()) }),
                "{json}"
            );
        }
        let json = format!(r#"{{"type":"error","meta":{{"message_id":"{MID}"}}}}"#);
        assert_eq!(
            decode(json.as_bytes(), 1 << 20).unwrap().action,
            EventAction::Finish { text: None, reason: "error".into(), error: Some("".into()) }
        );
    }

    #[test]
    fn canonical_vocabulary_uses_segment_then_provider_call() {
        let json = format!(
            r#"{{"type":"text-delta","meta":{{"message_id":"{MID}","session_id":"sess-1"}},"correlation":{{"session_id":"sess-1","run_id":"run-1","provider_call_id":"pc","segment_id":"seg"}},"delta":" suffix","text":"prefix  suffix","sequence":7}}"#
        );
        let ev = decode(json.as_bytes(), 1 << 20).unwrap();
        assert_eq!(ev.stream.stream_id, "seg");
        assert_eq!(ev.action, EventAction::Delta(" suffix".into()));
        let json = format!(
            r#"{{"type":"text-segment-finished","meta":{{"message_id":"{MID}"}},"correlation":{{"provider_call_id":"pc"}},"text":"t","finish_reason":"stop"}}"#
        );
        let ev = decode(json.as_bytes(), 1 << 20).unwrap();
        assert_eq!(ev.stream.stream_id, "pc");
        assert_eq!(ev.action, EventAction::Finish { text: Some("t".into()), reason: "stop".into(), error: None });
    }

    #[test]
    fn other_types_pass_through() {
        let json = format!(r#"{{"type":"tool-call","meta":{{"message_id":"{MID}"}},"tool_call":{{"id":"1"}}}}"#);
        assert_eq!(decode(json.as_bytes(), 1 << 20).unwrap().action, EventAction::PassThrough);
    }

    #[test]
    fn bad_input_is_named_without_quoting_it() {
        let cases: &[(&[u8], &str)] = &[
            (b"not json at all SECRET", "invalid_json"),
            (b"[1,2]", "not_an_object"),
            (b"\"SECRET\"", "not_an_object"),
            // serde's derive takes an array for a struct, field by field: never an event.
            (br#"["partial",{"message_id":"m"},null,"SECRET"]"#, "not_an_object"),
            (br#" ["tool-call",{"message_id":"m"}]"#, "not_an_object"),
            (br#"{"type":"partial","meta":["m"],"delta":"SECRET"}"#, "wrong_field_type"),
            (br#"{"type":"partial","meta":{"message_id":"m"},"correlation":["s"],"delta":"x"}"#, "wrong_field_type"),
            (br#"{"type":"partial","meta":{"message_id":"m"},"delta":5}"#, "wrong_field_type"),
            (br#"{"type":"partial","meta":{"message_id":"m"}}"#, "missing_field"),
            (br#"{"type":"partial","meta":{}}"#, "missing_message_id"),
            (br#"{"type":"partial","meta":{"message_id":""},"delta":"x"}"#, "missing_message_id"),
            (br#"{"meta":{"message_id":"m"}}"#, "missing_type"),
            (br#"{"type":"partial","meta":{"message_id":"m"},"delta":"\ud800"}"#, "invalid_json"),
            (br#"{"type":"final","meta":{"message_id":"m"},"text":"\ud800"}"#, "invalid_json"),
            (br#"{"type":"final","meta":{"message_id":"m"},"text":5}"#, "wrong_field_type"),
            (b"\xff\xfe", "invalid_json"),
            (br#"{"type":"partial","meta":{"message_id":"a\r\nX-Evil: 1"},"delta":"x"}"#, "invalid_message_id"),
        ];
        for (payload, code) in cases {
            let err = decode(payload, 1 << 20).unwrap_err();
            assert_eq!(err.code(), *code, "{err}");
            assert!(!err.to_string().contains("SECRET"));
        }
        // Deep nesting: skipped iteratively in unknown fields, refused in known ones.
        let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let deep = format!(r#"{{"type":"partial","meta":{{"message_id":"m"}},"delta":"d","x":{}}}"#, nest(100_000));
        assert!(decode(deep.as_bytes(), 1 << 20).is_ok());
        let deep = format!(r#"{{"type":"partial","meta":{{"message_id":"m"}},"delta":{}}}"#, nest(100_000));
        assert_eq!(decode(deep.as_bytes(), 1 << 20).unwrap_err().code(), "wrong_field_type");
        let long = format!(r#"{{"type":"partial","meta":{{"message_id":"{}"}},"delta":"x"}}"#, "m".repeat(10_000));
        assert_eq!(decode(long.as_bytes(), 1 << 20).unwrap_err().code(), "invalid_message_id");
        assert_eq!(decode(b"{}", 1).unwrap_err(), DecodeError::TooLarge { size: 2, limit: 1 });
    }

    #[test]
    fn text_is_decoded_only_for_finishing_events() {
        // A delta's cumulative text is not decoded: not even a wrong type fails it.
        let delta = r#"{"type":"text-delta","meta":{"message_id":"m"},"delta":"x","text":42}"#;
        assert_eq!(decode(delta.as_bytes(), 1 << 20).unwrap().action, EventAction::Delta("x".into()));
        let fin = r#"{"type":"text-segment-finished","meta":{"message_id":"m"},"text":"a\nb"}"#;
        let EventAction::Finish { text, .. } = decode(fin.as_bytes(), 1 << 20).unwrap().action else { panic!() };
        assert_eq!(text.as_deref(), Some("a\nb"));
        let null = r#"{"type":"final","meta":{"message_id":"m"},"text":null}"#;
        assert_eq!(
            decode(null.as_bytes(), 1 << 20).unwrap().action,
            EventAction::Finish { text: None, reason: "stop".into(), error: None }
        );
        let wrong = "{\"type\":\"final\",\n\"meta\":{\"message_id\":\"m\"},\"text\":[1]}";
        assert_eq!(decode(wrong.as_bytes(), 1 << 20), Err(DecodeError::WrongFieldType { line: 2, column: 34 }));
    }
}
