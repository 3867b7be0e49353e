//! The generated protobuf types of schema v1 (`proto/structuredsink/v1/*.proto`) and their
//! descriptors. Generated code is never edited; conversions live in [`super::outbound`].

#![allow(missing_docs, clippy::all)]

use std::sync::OnceLock;

use prost_reflect::DescriptorPool;

include!(concat!(env!("OUT_DIR"), "/structuredsink.v1.rs"));

/// The encoded `FileDescriptorSet` of every file under `proto/`, with its imports.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/structuredsink_descriptor.bin"));

/// The descriptor pool of schema v1, for reflection (proto3 JSON, typed blocks).
pub fn descriptor_pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| DescriptorPool::decode(FILE_DESCRIPTOR_SET).expect("the built-in descriptor set decodes"))
}

/// Full protobuf names of the published message types.
pub mod names {
    /// `structuredsink.v1.FilteredText`
    pub const FILTERED_TEXT: &str = "structuredsink.v1.FilteredText";
    /// `structuredsink.v1.BlockEvent`
    pub const BLOCK_EVENT: &str = "structuredsink.v1.BlockEvent";
    /// `structuredsink.v1.ThinkingText`
    pub const THINKING_TEXT: &str = "structuredsink.v1.ThinkingText";
    /// `structuredsink.v1.ToolCall`
    pub const TOOL_CALL: &str = "structuredsink.v1.ToolCall";
}
