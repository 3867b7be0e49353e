//! A registered block type: the protobuf message a block tag's payload converts into.
//!
//! Owns the per-type API the pipeline and the codec use: conversion of a parsed payload (strict
//! for `completed`, partial for `snapshot`), the `Any` encoding, and the subject override. The
//! conversion rules themselves are in [`super::convert`]; how types are found is in
//! [`super::SchemaRegistry`].

use prost_reflect::{DynamicMessage, MessageDescriptor};

use super::convert::{self, ConversionError, Mode};

/// A block type declared by `option (structuredsink.v1.block)` on a message.
#[derive(Debug, Clone)]
pub struct BlockType {
    tag: String,
    descriptor: MessageDescriptor,
    subject: Option<String>,
    /// How deep messages may nest in a converted payload.
    max_depth: usize,
}

impl BlockType {
    /// A block type for `tag` typed by `descriptor`, published on `subject` when set.
    pub(crate) fn new(tag: String, descriptor: MessageDescriptor, subject: Option<String>) -> Self {
        BlockType { tag, descriptor, subject, max_depth: convert::MAX_NESTING_DEPTH }
    }

    /// Sets how deep messages may nest in a converted payload (the root is at depth 1). A
    /// deeper payload fails [`convert`](Self::convert) with `TooDeep`, and its deeper messages
    /// are left out of [`convert_partial`](Self::convert_partial).
    pub(crate) fn set_max_depth(&mut self, depth: usize) {
        self.max_depth = depth;
    }

    /// The nesting limit of conversions.
    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// The block tag, `package:type:version`.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The message the payload converts into.
    pub fn descriptor(&self) -> &MessageDescriptor {
        &self.descriptor
    }

    /// The subject set by the option's `subject`, replacing the default
    /// `chat.structured.<package>.<type>.<version>`; `None` when the default applies.
    pub fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// The type URL of [`to_any`](Self::to_any): `type.googleapis.com/<full message name>`.
    pub fn type_url(&self) -> String {
        convert::type_url(&self.descriptor)
    }

    /// Converts a parsed payload into the message, failing on the first problem with an error
    /// naming the field path (the rules are in the [`convert`] module doc).
    pub fn convert(&self, value: &serde_json::Value) -> Result<DynamicMessage, ConversionError> {
        convert::convert(&self.descriptor, value, Mode::Strict, self.max_depth)
    }

    /// Converts a payload that is still streaming, for a live snapshot: the same rules, but a
    /// field, list element or map entry that does not convert (or is not known) is left out
    /// instead of failing the whole. `None` only when the value is not a mapping (for example
    /// `null` before the first key arrives).
    pub fn convert_partial(&self, value: &serde_json::Value) -> Option<DynamicMessage> {
        convert::convert(&self.descriptor, value, Mode::Partial, self.max_depth).ok()
    }

    /// Encodes `message` as `google.protobuf.Any`, with the type URL of the message's own type
    /// (which is this block type's message when it came from [`convert`](Self::convert)).
    pub fn to_any(&self, message: &DynamicMessage) -> prost_types::Any {
        debug_assert_eq!(
            prost_reflect::ReflectMessage::descriptor(message),
            self.descriptor,
            "a message of another type"
        );
        convert::to_any(message)
    }
}
