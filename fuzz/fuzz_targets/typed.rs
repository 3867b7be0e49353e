//! Protobuf-typed conversion of arbitrary JSON into every registered block type, including a
//! recursive one (`structured_sink::properties::typed_conversion`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|json: &[u8]| {
    structured_sink::properties::typed_conversion(json);
});
