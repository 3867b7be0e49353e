//! Typed blocks: block types declared in protobuf, the conversion of parsed payloads into them,
//! and prompt instructions generated from the same schemas.
//!
//! A `.proto` message becomes the type of a block tag with
//! `option (structuredsink.v1.block) = { tag: "myapp:ModeSwitch:v1" };` (the option is defined in
//! `proto/structuredsink/v1/options.proto`, field number [`builtin::BLOCK_OPTION_NUMBER`]).
//! [`SchemaRegistry::load`] compiles the built-in schemas ([`builtin`]) and the user's `.proto`
//! files in-process and registers every such message as a [`BlockType`];
//! [`BlockType::convert`] turns a payload's value (from [`crate::payload`]) into the message, and
//! [`BlockType::to_any`] encodes it for `BlockCompleted.typed`; [`prompt::render_prompt`] tells a
//! model what to write.
//!
//! This module owns schema loading, conversion and prompt text. It does not know where payloads
//! come from, when snapshots are taken, or how events are published (the pipeline and the codec
//! call into it); it uses protox and prost-reflect, so it sits beside the codec, outside the pure
//! core.

mod block_type;
pub mod builtin;
mod comments;
pub mod convert;
pub mod prompt;
mod registry;

#[cfg(test)]
mod tests;

pub use block_type::BlockType;
pub use convert::{ConversionError, ConversionErrorKind, MAX_NESTING_DEPTH, QUOTE_LIMIT};
pub use prompt::render_prompt;
pub use registry::{SchemaError, SchemaRegistry, MAX_PROTO_FILES};
