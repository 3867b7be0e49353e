//! The scanner and pipeline fed arbitrary bytes in arbitrary chunkings: no panic, held-back
//! bytes within their bound, the same outputs as a single-chunk run
//! (`structured_sink::properties::chunking_invariance`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<u8>, Vec<u16>, bool, bool)| {
    let (bytes, cuts, restore, unescape) = input;
    let cuts: Vec<usize> = cuts.into_iter().map(usize::from).collect();
    structured_sink::properties::chunking_invariance(&bytes, &cuts, restore, unescape);
});
