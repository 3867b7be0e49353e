//! Subject names and the escaping of values that become subject tokens.
//!
//! A NATS subject is a list of tokens separated by `.`; a token may not be empty or contain `.`,
//! `*`, `>` or whitespace. Values we put into a token (tag parts, message ids) are escaped so that
//! they always stay exactly one token and the mapping can be reversed: every byte outside
//! `[A-Za-z0-9_-]` is written as `%XX` (two upper-case hex digits). `%` itself becomes `%25`, so
//! the escaping is unambiguous. Example: version `v1.2` becomes `v1%2E2`.
//!
//! It also reads the two numbers the service needs from a JetStream ack subject ([`ack_position`]).

use std::borrow::Cow;

/// Whether `b` may appear unescaped in a token.
fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// Escapes `value` into one valid subject token (see the module documentation). An empty value
/// becomes `%`, a token no escape can produce, so it is still a token.
pub fn escape_token(value: &str) -> Cow<'_, str> {
    if value.is_empty() {
        return Cow::Borrowed("%");
    }
    if value.bytes().all(is_plain) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for b in value.bytes() {
        if is_plain(b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Cow::Owned(out)
}

/// Reverses [`escape_token`]; `None` for a token it cannot have produced.
pub fn unescape_token(token: &str) -> Option<String> {
    if token == "%" {
        return Some(String::new());
    }
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = token.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The partition of a subject token among `count`, as the NATS server computes it for a
/// `{{partition(count, i)}}` mapping: FNV-1a 32-bit of the token, modulo `count`. Message ids are
/// escaped with [`escape_token`] first, so both partition modes agree on every id.
pub fn partition_of(token: &str, count: u32) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for b in token.bytes() {
        hash ^= u32::from(b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash % count.max(1)
}

/// Whether `subject` is a valid subject to publish to: non-empty tokens, no wildcards, no
/// whitespace.
pub fn is_valid_publish_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject
            .split('.')
            .all(|t| !t.is_empty() && t != "*" && t != ">" && !t.bytes().any(|b| b.is_ascii_whitespace()))
}

/// Whether a subscription `pattern` (which may hold `*` and a final `>`) matches `subject`.
pub fn pattern_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for p in pattern.split('.') {
        match (p, subject_tokens.next()) {
            (">", Some(_)) => return true,
            (_, None) => return false,
            ("*", Some(_)) => {}
            (p, Some(s)) if p == s => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

/// Whether two subscription patterns can match a common subject (used to refuse input subjects
/// that would receive the service's own output).
pub fn patterns_overlap(a: &str, b: &str) -> bool {
    let (mut ta, mut tb) = (a.split('.'), b.split('.'));
    loop {
        match (ta.next(), tb.next()) {
            (Some(">"), Some(_)) | (Some(_), Some(">")) => return true,
            (None, None) => return true,
            (None, _) | (_, None) => return false,
            (Some(x), Some(y)) if x == "*" || y == "*" || x == y => {}
            _ => return false,
        }
    }
}

/// Where a JetStream message stands, from its ack subject (the reply subject the server gives
/// it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckPosition {
    /// The message's sequence in its stream.
    pub stream_sequence: u64,
    /// How many times it has been delivered, this delivery included.
    pub delivered: u64,
    /// The delivery's sequence in its consumer: one more for every delivery, redeliveries
    /// included, so a jump means deliveries that did not reach this client.
    pub consumer_sequence: u64,
}

/// The position a JetStream ack subject carries, in either form of NATS ADR-15:
/// `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>`
/// (7 tokens after the prefix), or 9 or more with `<domain>.<account hash>.` before the stream
/// (and possibly more after `<pending>`); `None` for any other subject.
///
/// Why not async-nats' `Message::info`: it parses every token, the timestamp into a date, about
/// 1,600 instructions per event (callgrind over the bench's JetStream input); these three numbers
/// are all the service uses. Stream and consumer names hold no `.`, so the tokens are positional,
/// as async-nats reads them.
pub fn ack_position(reply: &str) -> Option<AckPosition> {
    let tokens = reply.strip_prefix("$JS.ACK.")?.as_bytes();
    // Where each of the first eight tokens starts (one past a dot), and how many there are: one
    // pass over the bytes, which `split('.')` (a searcher per token) took five times as long for.
    let mut starts = [0; 8];
    let mut count = 1;
    for (at, &b) in tokens.iter().enumerate() {
        if b == b'.' {
            if let Some(start) = starts.get_mut(count) {
                *start = at + 1;
            }
            count += 1;
        }
    }
    let delivered = match count {
        7 => 2,
        9.. => 4,
        _ => return None,
    };
    // Each token ends one before the next one's start; the consumer sequence is never the last.
    let token = |i: usize| &tokens[starts[i]..starts[i + 1] - 1];
    Some(AckPosition {
        delivered: decimal(token(delivered))?,
        stream_sequence: decimal(token(delivered + 1))?,
        consumer_sequence: decimal(token(delivered + 2))?,
    })
}

/// A non-empty run of ASCII digits as a `u64`; `None` for anything else or an overflow.
fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        let digit = d.checked_sub(b'0').filter(|&d| d <= 9)?;
        n.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_positions_are_read_from_both_forms_of_the_ack_subject() {
        let at = |stream_sequence, delivered, consumer_sequence| {
            Some(AckPosition { stream_sequence, delivered, consumer_sequence })
        };
        // The form nats-server 2.9 sends: stream, consumer, delivered, stream sequence, consumer
        // sequence, timestamp, pending.
        assert_eq!(ack_position("$JS.ACK.chat.sink-p0.1.4711.4700.1764000000000000000.12"), at(4711, 1, 4700));
        // With domain and account hash, and with the trailing random token.
        assert_eq!(ack_position("$JS.ACK._.ACCHASH.chat.sink-p0.3.18446744073709551615.9.1764.0"), at(u64::MAX, 3, 9));
        assert_eq!(ack_position("$JS.ACK.hub.ACCHASH.chat.sink-p0.2.77.9.1764.0.xyz"), at(77, 2, 9));
        assert_eq!(ack_position("$JS.ACK.hub.ACCHASH.chat.sink-p0.2.77.9.1764.0.xyz.more"), at(77, 2, 9));
        // Anything else: a subject of another kind, a wrong number of tokens, a number that is
        // not one.
        for reply in [
            "_INBOX.abc.def",
            "$JS.ACK",
            "$JS.ACK.chat.sink-p0.1.4711.4700.1764",
            "$JS.ACK.hub.ACCHASH.chat.sink-p0.2.77.9",
            "$JS.ACK.chat.sink-p0.x.4711.4700.1764.12",
            "$JS.ACK.chat.sink-p0.1.-4711.4700.1764.12",
            "$JS.ACK.chat.sink-p0.1..4700.1764.12",
            "$JS.ACK.chat.sink-p0.1.18446744073709551616.4700.1764.12",
            "$JS.ACK.chat.sink-p0.1.+4711.4700.1764.12",
            "$JS.ACK.chat.sink-p0.1.4711.4700.1764.12.",
            "$JS.ACK.chat.sink-p0.1.4711.x4700.1764.12",
            "$JS.NAK.chat.sink-p0.1.4711.4700.1764.12",
        ] {
            assert_eq!(ack_position(reply), None, "{reply}");
        }
    }

    proptest::proptest! {
        /// Any subject is read without a panic, and the three numbers of an ack subject in
        /// either form come back as written.
        #[test]
        fn ack_positions_round_trip_and_anything_else_is_refused_quietly(
            delivered: u64,
            stream_sequence: u64,
            consumer_sequence: u64,
            domain in proptest::bool::ANY,
            noise in "[$A-Za-z0-9._-]{0,60}",
        ) {
            let _ = ack_position(&noise);
            let _ = ack_position(&format!("$JS.ACK.{noise}"));
            let prefix = if domain { "hub.ACCHASH." } else { "" };
            let reply = format!("$JS.ACK.{prefix}chat.sink-p0.{delivered}.{stream_sequence}.{consumer_sequence}.1764.3");
            let expected = AckPosition { delivered, stream_sequence, consumer_sequence };
            proptest::prop_assert_eq!(ack_position(&reply), Some(expected));
        }
    }

    #[test]
    fn plain_tokens_are_kept() {
        assert_eq!(escape_token("agent_mode-switch9"), "agent_mode-switch9");
    }

    #[test]
    fn dots_wildcards_spaces_and_percent_are_escaped_reversibly() {
        for v in ["v1.2", "a*b", "a>b", "a b", "50%", "", "é", "x.y.z"] {
            let e = escape_token(v);
            assert!(!e.contains('.') && !e.contains('*') && !e.contains('>') && !e.contains(' '), "{e}");
            assert!(is_valid_publish_subject(&format!("chat.{e}")), "{e}");
            assert_eq!(unescape_token(&e).as_deref(), Some(v));
        }
        assert_eq!(escape_token("v1.2"), "v1%2E2");
        assert_ne!(escape_token("a.b"), escape_token("a%2Eb"));
    }

    #[test]
    fn partition_matches_fnv1a_32() {
        // Reference values of FNV-1a 32-bit.
        assert_eq!(partition_of("", u32::MAX), 0x811c_9dc5);
        assert_eq!(partition_of("a", u32::MAX), 0xe40c_292c);
        assert_eq!(partition_of("foobar", u32::MAX), 0xbf9c_f968);
        assert!(partition_of("3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071", 64) < 64);
    }

    #[test]
    fn subject_patterns() {
        assert!(pattern_matches("chat.*", "chat.x"));
        assert!(pattern_matches("chat.>", "chat.x.y"));
        assert!(!pattern_matches("chat.*", "chat.x.y"));
        assert!(!pattern_matches("chat", "chat.filtered"));
        assert!(patterns_overlap("chat.>", "chat.filtered"));
        assert!(patterns_overlap("*.filtered", "chat.filtered"));
        assert!(patterns_overlap(">", "chat.structured.a.b.c"));
        assert!(!patterns_overlap("chat", "chat.filtered"));
        assert!(!patterns_overlap("chat.raw.*", "chat.filtered"));
    }
}
