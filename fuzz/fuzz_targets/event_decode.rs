//! Geppetto event decoding of arbitrary bytes (`structured_sink::properties::event_decoding`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|payload: &[u8]| {
    structured_sink::properties::event_decoding(payload);
});
