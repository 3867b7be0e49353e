//! Streaming decoder for upstreams that double-escape their text (the streaming proxy convention).
//!
//! It owns at most one incomplete escape sequence between deltas (12 bytes: a surrogate pair) and
//! decodes `\n \t \r \\ \" \/ \b \f \uXXXX` in one left-to-right pass, before tag scanning. It
//! knows nothing of tags or streams. Rules: `\\n` is a backslash then `n`; an escape that is not
//! one of the above (including a lone surrogate) passes through literally; an incomplete escape at
//! the end of the stream is released literally.

/// The longest escape: a surrogate pair `\uD83D\uDE00`.
pub(crate) const MAX_ESCAPE_LEN: usize = 12;

/// The per-stream escape decoder.
#[derive(Debug, Clone, Default)]
pub struct Unescaper {
    /// An incomplete escape (ASCII, starts with `\`) held from the previous delta.
    pending: String,
}

/// What the bytes at a backslash turned out to be.
enum Escape {
    /// A complete escape of this many bytes.
    Decoded(char, usize),
    /// Could still become a valid escape: wait for more input.
    Incomplete,
    /// Not a valid escape: the backslash is literal text.
    Literal,
}

impl Unescaper {
    /// Bytes currently held back.
    pub fn held_len(&self) -> usize {
        self.pending.len()
    }

    /// Decodes `input`, appending the result to `out`; an incomplete escape at its end is held.
    pub fn feed(&mut self, mut input: &str, out: &mut String) {
        if !self.pending.is_empty() {
            // Decide the held escape with at most one escape's worth of new bytes. Escapes are
            // ASCII, so a cut inside a multi-byte character only ever meets `Literal`.
            let held = std::mem::take(&mut self.pending);
            let take = input.len().min(MAX_ESCAPE_LEN);
            let mut joined = Vec::with_capacity(held.len() + take);
            joined.extend_from_slice(held.as_bytes());
            joined.extend_from_slice(&input.as_bytes()[..take]);
            match decode(&joined) {
                Escape::Decoded(ch, len) => {
                    out.push(ch);
                    input = &input[len - held.len()..];
                }
                Escape::Incomplete => {
                    // Only possible when all of `input` was taken: no escape is longer.
                    self.pending = held;
                    self.pending.push_str(input);
                    return;
                }
                Escape::Literal => {
                    // The held backslash is text; what followed it is decoded afresh (it may hold
                    // another backslash, as in `\uD83D\x`).
                    out.push('\\');
                    self.feed(&held[1..], out);
                    self.feed(input, out);
                    return;
                }
            }
        }
        while let Some(i) = memchr::memchr(b'\\', input.as_bytes()) {
            out.push_str(&input[..i]);
            match decode(&input.as_bytes()[i..]) {
                Escape::Decoded(ch, len) => {
                    out.push(ch);
                    input = &input[i + len..];
                }
                Escape::Incomplete => {
                    self.pending.push_str(&input[i..]);
                    return;
                }
                Escape::Literal => {
                    out.push('\\');
                    input = &input[i + 1..];
                }
            }
        }
        out.push_str(input);
    }

    /// Ends the stream: an incomplete escape is released literally.
    pub fn finish(&mut self, out: &mut String) {
        out.push_str(&self.pending);
        self.pending.clear();
    }
}

/// Decodes the escape at the start of `b` (which starts with a backslash).
fn decode(b: &[u8]) -> Escape {
    debug_assert_eq!(b.first(), Some(&b'\\'));
    let Some(&kind) = b.get(1) else {
        return Escape::Incomplete;
    };
    let simple = match kind {
        b'n' => '\n',
        b't' => '\t',
        b'r' => '\r',
        b'\\' => '\\',
        b'"' => '"',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'u' => return decode_unicode(b),
        _ => return Escape::Literal,
    };
    Escape::Decoded(simple, 2)
}

/// Decodes `\uXXXX`, joining a high surrogate with a following `\uXXXX` low surrogate.
fn decode_unicode(b: &[u8]) -> Escape {
    let unit = match hex4(&b[2..]) {
        Hex::Value(v) => v,
        Hex::Partial => return Escape::Incomplete,
        Hex::Invalid => return Escape::Literal,
    };
    match unit {
        0xD800..=0xDBFF => {
            let next = &b[6..];
            for (i, want) in [b'\\', b'u'].into_iter().enumerate() {
                match next.get(i) {
                    None => return Escape::Incomplete,
                    Some(&c) if c != want => return Escape::Literal,
                    Some(_) => {}
                }
            }
            match hex4(&next[2..]) {
                Hex::Value(low @ 0xDC00..=0xDFFF) => {
                    let code = 0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00);
                    char::from_u32(code).map_or(Escape::Literal, |c| Escape::Decoded(c, 12))
                }
                Hex::Partial => Escape::Incomplete,
                Hex::Value(_) | Hex::Invalid => Escape::Literal,
            }
        }
        0xDC00..=0xDFFF => Escape::Literal,
        _ => char::from_u32(u32::from(unit)).map_or(Escape::Literal, |c| Escape::Decoded(c, 6)),
    }
}

enum Hex {
    Value(u16),
    Partial,
    Invalid,
}

/// Reads four hex digits from the start of `b`.
fn hex4(b: &[u8]) -> Hex {
    let mut v: u16 = 0;
    for i in 0..4 {
        let Some(&c) = b.get(i) else {
            return Hex::Partial;
        };
        let Some(d) = char::from(c).to_digit(16) else {
            return Hex::Invalid;
        };
        v = v << 4 | d as u16;
    }
    Hex::Value(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str]) -> String {
        let mut u = Unescaper::default();
        let mut out = String::new();
        for c in chunks {
            u.feed(c, &mut out);
        }
        u.finish(&mut out);
        out
    }

    /// Every split of `input` into two and three pieces (at char boundaries) decodes alike.
    fn all_splits(input: &str) -> String {
        let whole = run(&[input]);
        let cuts: Vec<usize> = (0..=input.len()).filter(|&i| input.is_char_boundary(i)).collect();
        for &a in &cuts {
            assert_eq!(run(&[&input[..a], &input[a..]]), whole, "split at {a} of {input:?}");
            for &b in cuts.iter().filter(|&&b| b >= a) {
                assert_eq!(run(&[&input[..a], &input[a..b], &input[b..]]), whole, "splits {a},{b} of {input:?}");
            }
        }
        whole
    }

    #[test]
    fn simple_escapes_decode() {
        assert_eq!(all_splits(r#"a\nb\tc\rd\\e\"f\/g\bh\fi"#), "a\nb\tc\rd\\e\"f/g\u{8}h\u{c}i");
    }

    #[test]
    fn escaped_backslash_then_n_is_backslash_n() {
        assert_eq!(all_splits(r"\\n"), "\\n");
        assert_eq!(all_splits(r"\\\n"), "\\\n");
    }

    #[test]
    fn unicode_escapes_and_surrogate_pairs_decode() {
        assert_eq!(all_splits(r"\u003cx\u003e \u00e9"), "<x> é");
        assert_eq!(all_splits(r"smile \ud83d\ude00!"), "smile 😀!");
    }

    #[test]
    fn invalid_escapes_pass_through_literally() {
        assert_eq!(all_splits(r"\R \x \u12G4"), r"\R \x \u12G4");
        assert_eq!(all_splits(r"lone \ud800 high"), r"lone \ud800 high");
        assert_eq!(all_splits(r"lone \udc00 low"), r"lone \udc00 low");
        assert_eq!(all_splits(r"\ud83d\n"), "\\ud83d\n");
        assert_eq!(all_splits(r"\ud83d\u0041"), "\\ud83dA");
        assert_eq!(all_splits("\\é"), "\\é");
    }

    #[test]
    fn incomplete_escape_is_held_then_released_at_end() {
        let mut u = Unescaper::default();
        let mut out = String::new();
        u.feed("abc\\", &mut out);
        assert_eq!(out, "abc");
        assert_eq!(u.held_len(), 1);
        u.finish(&mut out);
        assert_eq!(out, "abc\\");
        assert_eq!(run(&["x\\u00"]), "x\\u00");
        assert_eq!(run(&["x\\ud83d\\u"]), "x\\ud83d\\u");
    }
}
