//! Compiles `proto/` with protox (a pure-Rust protobuf compiler, so no `protoc` is needed) and
//! generates Rust with prost-build: one file per package (`structuredsink.v1.rs`,
//! `geppetto.v1.rs`, `pinocchio.v1.rs`), included by `src/codec/proto.rs` and
//! `src/typed/builtin.rs`. The descriptor set of all of them, with their imports, is kept as
//! `structuredsink_descriptor.bin` for reflection (proto3 JSON in `replay`, typed blocks).
//!
//! The block options (`structuredsink/v1/options.proto`) and the built-in block types are also
//! embedded as source by `src/typed/builtin.rs`, so that the runtime schema registry compiles
//! them together with the user's `.proto` files; this build compiles them to catch schema errors
//! at build time and to generate their Rust types.

use std::path::PathBuf;

/// Every schema file shipped in `proto/`, relative to it.
const FILES: [&str; 4] = [
    "structuredsink/v1/events.proto",
    "structuredsink/v1/options.proto",
    "geppetto/v1/citations.proto",
    "pinocchio/v1/agent_mode_switch.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(FILES.iter().map(|f| format!("proto/{f}")), ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("structuredsink_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
