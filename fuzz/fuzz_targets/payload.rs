//! Payload parsing (YAML, the JSON chain, partial JSON) and live-snapshot cost of arbitrary text
//! in arbitrary chunkings (`structured_sink::properties::{payload_parsing, snapshots_are_bounded}`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (String, Vec<u16>, u8)| {
    let (text, cuts, budget) = input;
    let cuts: Vec<usize> = cuts.into_iter().map(usize::from).collect();
    structured_sink::properties::payload_parsing(&text, &cuts);
    structured_sink::properties::snapshots_are_bounded(&text, &cuts, usize::from(budget % 10));
});
