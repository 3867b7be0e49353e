//! The block types shipped with structured-sink: their generated Rust types and their `.proto`
//! sources.
//!
//! Owns the link between `proto/` and the runtime registry: the sources are embedded with
//! `include_str!` so that [`super::SchemaRegistry`] compiles them together with the user's files
//! (which may `import "structuredsink/v1/options.proto"`), and `build.rs` compiles the same files
//! into the Rust types below for downstream handlers. It does not know how blocks are converted
//! or published.
//!
//! | tag | message | Rust type |
//! |-----|---------|-----------|
//! | `geppetto:citations:v1` | `geppetto.v1.Citations` | [`geppetto::Citations`] |
//! | `pinocchio:agent_mode_switch:v1` | `pinocchio.v1.AgentModeSwitch` | [`pinocchio::AgentModeSwitch`] |

/// Generated types of package `geppetto.v1` (`proto/geppetto/v1/*.proto`).
#[allow(missing_docs, clippy::all)]
pub mod geppetto {
    include!(concat!(env!("OUT_DIR"), "/geppetto.v1.rs"));
}

/// Generated types of package `pinocchio.v1` (`proto/pinocchio/v1/*.proto`).
#[allow(missing_docs, clippy::all)]
pub mod pinocchio {
    include!(concat!(env!("OUT_DIR"), "/pinocchio.v1.rs"));
}

/// Name (as imported) of the file that defines the `(structuredsink.v1.block)` option.
pub const OPTIONS_FILE: &str = "structuredsink/v1/options.proto";

/// Full name of the `(structuredsink.v1.block)` extension of `google.protobuf.MessageOptions`.
pub const BLOCK_OPTION: &str = "structuredsink.v1.block";

/// Field number of the `(structuredsink.v1.block)` extension, from the 50000-99999 range that
/// protobuf leaves to an organization's own options.
pub const BLOCK_OPTION_NUMBER: u32 = 56201;

/// Tag of the built-in citations block.
pub const CITATIONS_TAG: &str = "geppetto:citations:v1";

/// Tag of the built-in agent mode switch block.
pub const AGENT_MODE_SWITCH_TAG: &str = "pinocchio:agent_mode_switch:v1";

/// The embedded sources, as `(name as imported, text)`: the options first, then the built-in
/// block types. The registry compiles all of them before any user file.
pub const SOURCES: &[(&str, &str)] = &[
    (OPTIONS_FILE, include_str!("../../proto/structuredsink/v1/options.proto")),
    // The output schema too, so that one pool resolves both our messages and the typed payloads
    // inside their `Any` fields (proto3 JSON of `replay` needs that).
    ("structuredsink/v1/events.proto", include_str!("../../proto/structuredsink/v1/events.proto")),
    ("geppetto/v1/citations.proto", include_str!("../../proto/geppetto/v1/citations.proto")),
    ("pinocchio/v1/agent_mode_switch.proto", include_str!("../../proto/pinocchio/v1/agent_mode_switch.proto")),
];

/// The embedded source of `name`, if it is one of [`SOURCES`].
pub fn source(name: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == name).map(|(_, text)| *text)
}
