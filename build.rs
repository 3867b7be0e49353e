//! Compiles `proto/` with protox (a pure-Rust protobuf compiler, so no `protoc` is needed) and
//! generates Rust with prost-build. The descriptor set is kept for reflection (proto3 JSON in
//! `replay`, typed blocks).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let files = ["proto/structuredsink/v1/events.proto"];
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("structuredsink_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
