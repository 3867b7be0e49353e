//! Header values for outputs, built without async-nats' per-character scan.
//!
//! async-nats checks every `HeaderValue` it builds from text for CR and LF, one `char` at a time
//! against a two-character pattern: inserting a 40-byte `Nats-Msg-Id` cost 817 instructions that
//! way, 395 this way (callgrind over the e2e bench, BENCHMARKS.md, seventeenth session). This
//! module makes the same check with `memchr2` and then moves the text into the value through the
//! value's serde `Deserialize` (a transparent newtype of `String`), which moves the string without
//! scanning it again. It knows nothing of the domain; callers decide what text goes in.

use async_nats::header::HeaderValue;
use serde::de::value::{Error as ValueError, StringDeserializer};
use serde::Deserialize;

/// `text` as a header value, or `None` when it holds CR or LF (which would end the header line
/// and let the text forge headers, so async-nats refuses it too, by panicking).
pub fn header_value(text: String) -> Option<HeaderValue> {
    if memchr::memchr2(b'\r', b'\n', text.as_bytes()).is_some() {
        return None;
    }
    // A `String` deserializer only ever yields the string it holds: this cannot fail.
    HeaderValue::deserialize(StringDeserializer::<ValueError>::new(text)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_holds_its_text_unchanged() {
        for text in ["s-1:1", "", "3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071:123", "ünïcödé:7", "a b\tc"] {
            let value = header_value(text.to_owned()).expect("no CR or LF");
            assert_eq!(value.as_str(), text);
            assert_eq!(value, HeaderValue::from(text), "the same value as async-nats' own conversion");
        }
    }

    #[test]
    fn text_with_a_line_break_is_refused() {
        for text in ["a\rb", "a\nb", "\r\n", "id:1\r\nNats-Expected-Stream: other", "x\n"] {
            assert_eq!(header_value(text.to_owned()), None, "{text:?}");
            assert!(text.parse::<HeaderValue>().is_err(), "async-nats refuses {text:?} too");
        }
    }
}
