//! A single pass over an event's JSON that reads the fields the decoder uses and skips the rest,
//! for the events agents actually send; serde_json decides everything else.
//!
//! [`read`] returns `Some` only for a payload serde_json accepts, with exactly the fields serde
//! would give (the `properties::event_decoding` property checks this against serde on generated,
//! mutated and fuzzed payloads). Whenever it meets something it does not handle, it returns
//! `None` and the caller asks serde_json, which then gives the answer and every error:
//! a value of an unexpected type, a duplicate field, an escaped key, a non-ASCII key, a surrogate
//! escape in a string it decodes, and anything that is not well-formed JSON. It is strict where
//! serde is strict (UTF-8 of decoded strings, keys and `text`; escapes and control characters
//! everywhere; number grammar; nothing after the object) and checks no more than serde does where
//! serde is lenient (UTF-8 of skipped strings).
//!
//! Why it exists: serde_json spent about 12,100 instructions per typical event (959 bytes, most
//! of it the cumulative `completion` that geppetto repeats in every delta), half of what the
//! service added to a relay. This pass compares sixteen bytes at a time ([`Chunk`]: SSE2 on
//! x86-64, NEON on aarch64, through `wide`'s safe API): one chunk holds nearly every key and id.
//! A string with escapes (Go escapes every `<`, `>`, `&`, quote and newline of model text) goes
//! by blocks of sixty-four bytes ([`Block`]: two AVX2 halves where the CPU has AVX2, chosen at run
//! time through `pulp`'s safe API, else four chunks), whose escaped bytes come from word
//! arithmetic on the mask of backslashes, so that only the escapes' kinds are checked one by one. Decoded
//! strings borrow from the payload unless they hold escapes, and their UTF-8 is checked in one
//! call over the stretch they occupy. It knows nothing of the event's meaning: [`Fields`] is what
//! serde's derive would produce.

use std::borrow::Cow;

use wide::u8x16;

/// The fields of an event that the decoder uses: top level, `meta` and `correlation` flattened.
/// `text` is its raw JSON (decoded only by the events that use it).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Fields<'a> {
    pub kind: Option<Cow<'a, str>>,
    pub delta: Option<Cow<'a, str>>,
    pub text: Option<&'a str>,
    pub finish_reason: Option<Cow<'a, str>>,
    pub message_id: Option<Cow<'a, str>>,
    pub session_id: Option<Cow<'a, str>>,
    pub run_id: Option<Cow<'a, str>>,
    pub inference_id: Option<Cow<'a, str>>,
    pub turn_id: Option<Cow<'a, str>>,
    pub stop_reason: Option<Cow<'a, str>>,
    pub segment_id: Option<Cow<'a, str>>,
    pub provider_call_id: Option<Cow<'a, str>>,
    pub error_string: Option<Cow<'a, str>>,
}

/// The string fields, by index into the pieces [`read`] collects (each also its bit among the
/// fields seen; the three containers take the bits after them).
const TYPE: usize = 0;
const DELTA: usize = 1;
const FINISH_REASON: usize = 2;
const MESSAGE_ID: usize = 3;
const SESSION_ID: usize = 4;
const RUN_ID: usize = 5;
const INFERENCE_ID: usize = 6;
const TURN_ID: usize = 7;
const STOP_REASON: usize = 8;
const SEGMENT_ID: usize = 9;
const PROVIDER_CALL_ID: usize = 10;
const ERROR_STRING: usize = 11;
const STRING_FIELDS: usize = 12;
const TEXT: usize = 12;
const META: usize = 13;
const CORRELATION: usize = 14;

/// A string field as read: where it is in the payload (its UTF-8 not yet checked), or its text
/// decoded from escapes.
enum ReadString {
    Plain { start: usize, end: usize },
    Decoded(String),
}

/// Reads `payload` as one JSON object; `None` means "ask serde_json" (see the module
/// documentation), never "invalid".
///
/// Inlined by demand into its one caller on the service's path (`decode`): called, it returns
/// [`Fields`] (some 400 bytes) through memory, which cost about 300 instructions per event
/// (callgrind), and the compiler's choice changed with unrelated edits of `decode`.
#[inline(always)]
pub(super) fn read(payload: &[u8]) -> Option<Fields<'_>> {
    let mut reader = Reader { bytes: payload, at: 0 };
    let mut pieces: [Option<ReadString>; STRING_FIELDS] = Default::default();
    let mut text = None;
    // Known fields seen so far, a bit each: serde refuses a field named twice (even after a
    // `null`), so a second one is left to serde. (Each object's fields have their own bits.)
    let mut seen = 0u32;
    reader.object(|reader, key| match key {
        b"text" => {
            first(&mut seen, TEXT)?;
            reader.raw_text(&mut text)
        }
        b"meta" => {
            first(&mut seen, META)?;
            reader.nested(|reader, key| reader.known_string(meta_field(key), &mut seen, &mut pieces))
        }
        b"correlation" => {
            first(&mut seen, CORRELATION)?;
            reader.nested(|reader, key| reader.known_string(correlation_field(key), &mut seen, &mut pieces))
        }
        _ => reader.known_string(top_field(key), &mut seen, &mut pieces),
    })?;
    reader.whitespace();
    // serde_json refuses anything after the value but white space.
    if reader.at != payload.len() {
        return None;
    }
    // One UTF-8 check over the stretch between the first and the last plain string, rather than
    // one per string (each costs a call and its set-up): in the order producers write fields, the
    // long cumulative text comes after all of them. Whatever lies between is checked too, which
    // is stricter than serde (it does not check skipped strings): a failure here leaves the
    // payload to serde, never refuses it.
    let spans = pieces.iter().flatten().filter_map(|p| match p {
        ReadString::Plain { start, end } => Some((*start, *end)),
        ReadString::Decoded(_) => None,
    });
    let (low, high) = spans.fold((payload.len(), 0), |(low, high), (start, end)| (low.min(start), high.max(end)));
    let checked = if low < high { utf8(&payload[low..high])? } else { "" };
    let mut take = |field: usize| -> Option<Option<Cow<'_, str>>> {
        Some(match pieces[field].take() {
            None => None,
            // Quotes (ASCII) on both sides: the span starts and ends on character boundaries.
            Some(ReadString::Plain { start, end }) => Some(Cow::Borrowed(checked.get(start - low..end - low)?)),
            Some(ReadString::Decoded(text)) => Some(Cow::Owned(text)),
        })
    };
    Some(Fields {
        kind: take(TYPE)?,
        delta: take(DELTA)?,
        text,
        finish_reason: take(FINISH_REASON)?,
        message_id: take(MESSAGE_ID)?,
        session_id: take(SESSION_ID)?,
        run_id: take(RUN_ID)?,
        inference_id: take(INFERENCE_ID)?,
        turn_id: take(TURN_ID)?,
        stop_reason: take(STOP_REASON)?,
        segment_id: take(SEGMENT_ID)?,
        provider_call_id: take(PROVIDER_CALL_ID)?,
        error_string: take(ERROR_STRING)?,
    })
}

/// `bytes` as text when they are UTF-8, exactly as `std::str::from_utf8` decides, by SIMD where
/// the CPU has it: the raw `text` of a `text-delta` is the whole answer so far, which std's check
/// took 773 instructions per event of the bench workload to go through and this one about 340
/// (callgrind, BENCHMARKS.md, twentieth session).
pub(super) fn utf8(bytes: &[u8]) -> Option<&str> {
    simdutf8::basic::from_utf8(bytes).ok()
}

/// The string field a top-level key names.
fn top_field(key: &[u8]) -> Option<usize> {
    match key {
        b"type" => Some(TYPE),
        b"delta" => Some(DELTA),
        b"finish_reason" => Some(FINISH_REASON),
        b"error_string" => Some(ERROR_STRING),
        _ => None,
    }
}

/// The string field a key of `meta` names.
fn meta_field(key: &[u8]) -> Option<usize> {
    match key {
        b"message_id" => Some(MESSAGE_ID),
        b"session_id" => Some(SESSION_ID),
        b"run_id" => Some(RUN_ID),
        b"inference_id" => Some(INFERENCE_ID),
        b"turn_id" => Some(TURN_ID),
        b"stop_reason" => Some(STOP_REASON),
        _ => None,
    }
}

/// The string field a key of `correlation` names.
fn correlation_field(key: &[u8]) -> Option<usize> {
    match key {
        b"segment_id" => Some(SEGMENT_ID),
        b"provider_call_id" => Some(PROVIDER_CALL_ID),
        _ => None,
    }
}

/// Marks field `bit` as seen; `None` if it was already.
fn first(seen: &mut u32, bit: usize) -> Option<()> {
    let mask = 1 << bit;
    if *seen & mask != 0 {
        return None;
    }
    *seen |= mask;
    Some(())
}

/// A position in the payload. Every method returns `None` for "not handled here".
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

/// Sixteen bytes of the payload, compared all at once (SSE2 on x86-64, NEON on aarch64; `wide`
/// falls back to plain code elsewhere). Each comparison gives a mask with bit `i` set for byte
/// `i`, so the first match is its trailing zeros, and a match at any byte is `mask != 0`.
#[derive(Clone, Copy)]
pub(super) struct Chunk(u8x16);

impl Chunk {
    /// The sixteen bytes at `at`; `None` when fewer are left.
    #[inline]
    pub(super) fn at(bytes: &[u8], at: usize) -> Option<Chunk> {
        let sixteen: [u8; 16] = bytes.get(at..at + 16)?.try_into().ok()?;
        Some(Chunk(u8x16::new(sixteen)))
    }

    /// The bytes equal to `b`.
    #[inline]
    pub(super) fn equal(self, b: u8) -> u32 {
        self.0.simd_eq(u8x16::splat(b)).to_bitmask()
    }

    /// The bytes below `limit` (which is above 0).
    #[inline]
    pub(super) fn below(self, limit: u8) -> u32 {
        // x < limit exactly when min(x, limit - 1) is x (SSE2 has an unsigned minimum, not an
        // unsigned comparison).
        self.0.min(u8x16::splat(limit - 1)).simd_eq(self.0).to_bitmask()
    }

    /// Each byte the lesser of this chunk's and `other`'s.
    #[inline]
    fn least(self, other: Chunk) -> Chunk {
        Chunk(self.0.min(other.0))
    }

    /// The bytes at or above `limit`.
    #[inline]
    pub(super) fn at_least(self, limit: u8) -> u32 {
        self.0.max(u8x16::splat(limit)).simd_eq(self.0).to_bitmask()
    }

    /// The bytes that end a run of plain string content: `"`, `\` and control characters (below
    /// 0x20).
    #[inline]
    fn string_stops(self) -> u32 {
        self.equal(b'"') | self.equal(b'\\') | self.below(0x20)
    }
}

/// The string stops ([`Chunk::string_stops`]) among the sixteen bytes from `at` (`at` at most the
/// payload's length): bit `i` for byte `at + i`, none past the end of the payload.
#[inline]
fn stops_from(bytes: &[u8], at: usize) -> u32 {
    match Chunk::at(bytes, at) {
        Some(chunk) => chunk.string_stops(),
        // Fewer than sixteen left: the payload's last sixteen bytes, shifted, or for a payload
        // shorter than that, one byte at a time.
        None => match bytes.len().checked_sub(16) {
            Some(last) => Chunk::at(bytes, last).map_or(0, Chunk::string_stops) >> (at - last),
            None => bytes[at..]
                .iter()
                .enumerate()
                .filter(|(_, &b)| matches!(b, b'"' | b'\\' | 0..=0x1f))
                .fold(0, |stops, (i, _)| stops | 1 << i),
        },
    }
}

/// Sixty-four bytes of a string's content as masks, bit `i` for byte `i`: what a string with
/// escapes is read by, so that finding which bytes are escaped costs a few word operations per
/// block ([`escaped_bytes`]) instead of a branch per escape.
struct Block {
    quotes: u64,
    backslashes: u64,
    controls: u64,
    /// What the block's bytes may be after a backslash, for blocks with one: made by the AVX2
    /// blocks only (the chunk blocks leave the escapes to be checked one by one).
    classes: Option<EscapeClasses>,
}

/// Which bytes of a block may follow a backslash, as masks like a block's (bit `i` for byte `i`),
/// so that a block's escapes are checked by a few word operations instead of a branch per
/// escape: the kind of each escape (a plain one or `\u`) is as unpredictable as the text, and
/// those branches' mispredictions took about half of the block loop's time (CPU-clock samples
/// over the bench, nineteenth session).
#[derive(Clone, Copy)]
struct EscapeClasses {
    /// `"`, `\`, `/`, `b`, `f`, `n`, `r`, `t` and `u`.
    escape: u64,
    /// `u`.
    unicode: u64,
    /// Hex digits.
    hex: u64,
}

impl EscapeClasses {
    fn shifted(self, shift: usize) -> EscapeClasses {
        EscapeClasses { escape: self.escape >> shift, unicode: self.unicode >> shift, hex: self.hex >> shift }
    }
}

impl Block {
    /// The sixty-four bytes from `at`; past the end of the payload, no bytes (no stop, so a
    /// string running off the end finds no closing quote). `None` when `at` is past the end.
    #[inline(always)]
    fn from(bytes: &[u8], at: usize, blocks: impl Blocks) -> Option<Block> {
        if at >= bytes.len() {
            return None;
        }
        if let Some(block) = blocks.at(bytes, at) {
            return Some(block);
        }
        // Fewer than sixty-four left (once per string at most): the payload's last sixty-four
        // bytes, their masks shifted so that bit 0 is byte `at`; the bits shifted in are bytes
        // past the end, which are no stop. (A copy into a padded block cost a `memcpy` call.)
        if let Some(last) = bytes.len().checked_sub(64) {
            let block = blocks.at(bytes, last)?;
            let shift = at - last;
            return Some(Block {
                quotes: block.quotes >> shift,
                backslashes: block.backslashes >> shift,
                controls: block.controls >> shift,
                classes: block.classes.map(|classes| classes.shifted(shift)),
            });
        }
        // A payload shorter than a block: its bytes, then white space, which is no stop.
        let mut padded = [b' '; 64];
        padded[..bytes.len() - at].copy_from_slice(&bytes[at..]);
        blocks.at(&padded, 0)
    }
}

/// How a block's masks are made: by four SSE2 (or NEON) chunks anywhere, or by two AVX2 halves
/// where the CPU has AVX2 (checked once, at run time). Both give the same masks (tested), and
/// both skip the control-character mask when the block's least byte is no control character:
/// a string holds none, so only a block with one (white space after the closing quote, or a
/// refused string) builds that mask.
trait Blocks: Copy {
    /// The masks of the sixty-four bytes from `at`; `None` when fewer are left.
    fn at(self, bytes: &[u8], at: usize) -> Option<Block>;
}

/// Blocks as four [`Chunk`]s: SSE2 on x86-64 (every x86-64 CPU has it), NEON on aarch64.
#[derive(Clone, Copy)]
struct ChunkBlocks;

impl Blocks for ChunkBlocks {
    #[inline(always)]
    fn at(self, bytes: &[u8], at: usize) -> Option<Block> {
        let bytes = bytes.get(at..at + 64)?;
        let chunk = |i: usize| Chunk::at(bytes, 16 * i);
        let chunks = [chunk(0)?, chunk(1)?, chunk(2)?, chunk(3)?];
        let mut block = Block { quotes: 0, backslashes: 0, controls: 0, classes: None };
        for (i, chunk) in chunks.iter().enumerate() {
            block.quotes |= u64::from(chunk.equal(b'"')) << (16 * i);
            block.backslashes |= u64::from(chunk.equal(b'\\')) << (16 * i);
        }
        let least = chunks[0].least(chunks[1]).least(chunks[2].least(chunks[3]));
        if least.below(0x20) != 0 {
            for (i, chunk) in chunks.iter().enumerate() {
                block.controls |= u64::from(chunk.below(0x20)) << (16 * i);
            }
        }
        Some(block)
    }
}

/// Blocks as two AVX2 halves of thirty-two bytes, through `pulp`'s safe API: the token proves
/// the CPU has AVX2, and only code run under [`pulp::x86::V3::vectorize`] compiles these
/// comparisons to single instructions (elsewhere they would be calls).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2Blocks(pulp::x86::V3);

#[cfg(target_arch = "x86_64")]
impl Blocks for Avx2Blocks {
    #[inline(always)]
    fn at(self, bytes: &[u8], at: usize) -> Option<Block> {
        use std::arch::x86_64::__m256i;
        let Avx2Blocks(cpu) = self;
        let (low, high) = bytes.get(at..at + 64)?.split_at(32);
        let half = |bytes: &[u8]| -> Option<__m256i> { Some(pulp::cast::<[u8; 32], __m256i>(bytes.try_into().ok()?)) };
        let (low, high) = (half(low)?, half(high)?);
        let splat = |b: u8| cpu.avx._mm256_set1_epi8(b as i8);
        // Bit `i` for byte `i` of the half (the sign bits of the comparison's bytes).
        let mask = |bytes: __m256i| u64::from(cpu.avx2._mm256_movemask_epi8(bytes) as u32);
        let equal = |half: __m256i, b: u8| mask(cpu.avx2._mm256_cmpeq_epi8(half, splat(b)));
        // x < 0x20 exactly when min(x, 0x1f) is x (AVX2 has an unsigned minimum, not an unsigned
        // comparison).
        let control =
            |half: __m256i| mask(cpu.avx2._mm256_cmpeq_epi8(cpu.avx2._mm256_min_epu8(half, splat(0x1f)), half));
        let mut block = Block {
            quotes: equal(low, b'"') | equal(high, b'"') << 32,
            backslashes: equal(low, b'\\') | equal(high, b'\\') << 32,
            controls: 0,
            classes: None,
        };
        if control(cpu.avx2._mm256_min_epu8(low, high)) != 0 {
            block.controls = control(low) | control(high) << 32;
        }
        if block.backslashes != 0 {
            // Each byte's classes, as the classes of its low nibble and of its high nibble ANDed
            // (one table lookup each, `vpshufb`): see [`NIBBLE_CLASSES`].
            let table = |nibbles: [u8; 16]| pulp::cast::<[[u8; 16]; 2], __m256i>([nibbles, nibbles]);
            let (low_table, high_table) = (table(NIBBLE_CLASSES.0), table(NIBBLE_CLASSES.1));
            let nibble = splat(0x0f);
            let classes = |half: __m256i| {
                let low_nibbles = cpu.avx2._mm256_and_si256(half, nibble);
                let high_nibbles = cpu.avx2._mm256_and_si256(cpu.avx2._mm256_srli_epi16::<4>(half), nibble);
                cpu.avx2._mm256_and_si256(
                    cpu.avx2._mm256_shuffle_epi8(low_table, low_nibbles),
                    cpu.avx2._mm256_shuffle_epi8(high_table, high_nibbles),
                )
            };
            let (low, high) = (classes(low), classes(high));
            // The bytes with any of `bits` (those whose `classes & bits` is not zero).
            let any = |classes: __m256i, bits: u8| {
                let none = cpu.avx2._mm256_cmpeq_epi8(cpu.avx2._mm256_and_si256(classes, splat(bits)), splat(0));
                u64::from(!(cpu.avx2._mm256_movemask_epi8(none) as u32))
            };
            let mask = |bits: u8| any(low, bits) | any(high, bits) << 32;
            block.classes =
                Some(EscapeClasses { escape: mask(CLASS_ESCAPE), unicode: mask(CLASS_UNICODE), hex: mask(CLASS_HEX) });
        }
        Some(block)
    }
}

/// A byte's escape classes (bits of `CLASS_*`) are those of its low nibble's entry in the first
/// table ANDed with those of its high nibble's entry in the second: each class bit stands for a
/// set of high nibbles times a set of low nibbles, and the classes are unions of such bits.
///
/// | bit | bytes | high nibbles | low nibbles |
/// |---|---|---|---|
/// | 0x01 | `"` `/` | 2 | 2, F |
/// | 0x02 | `\` | 5 | C |
/// | 0x04 | `b` `f` `n` | 6 | 2, 6, E |
/// | 0x08 | `r` `t` `u` | 7 | 2, 4, 5 |
/// | 0x10 | `u` | 7 | 5 |
/// | 0x20 | `0` to `9` | 3 | 0 to 9 |
/// | 0x40 | `A` to `F`, `a` to `f` | 4, 6 | 1 to 6 |
///
/// Bytes from 0x80 have high nibbles 8 to F, whose entries are empty.
#[cfg(target_arch = "x86_64")]
const NIBBLE_CLASSES: ([u8; 16], [u8; 16]) = (
    [0x20, 0x60, 0x6d, 0x60, 0x68, 0x78, 0x64, 0x20, 0x20, 0x20, 0x00, 0x00, 0x02, 0x00, 0x04, 0x01],
    [0x00, 0x00, 0x01, 0x20, 0x40, 0x02, 0x44, 0x18, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00],
);
/// What may follow a backslash.
#[cfg(target_arch = "x86_64")]
const CLASS_ESCAPE: u8 = 0x0f;
/// `u`.
#[cfg(target_arch = "x86_64")]
const CLASS_UNICODE: u8 = 0x10;
/// Hex digits.
#[cfg(target_arch = "x86_64")]
const CLASS_HEX: u8 = 0x60;

/// The closing quote of a string with escapes, from `base` (where no backslash escapes the first
/// byte): blocks of sixty-four bytes, by AVX2 where the CPU has it. Such strings are most of what
/// an event holds (the cumulative `completion`/`text` of model text, which grows with the
/// answer), so the wider comparisons pay: with them and the skipped control-character masks,
/// callgrind counted decoding at 4,963 instructions per event of the bench workload instead of
/// 5,677, and at 9,431 instead of 12,161 with 1,500-event streams. The AVX2 blocks also class
/// their bytes ([`EscapeClasses`]), which checks a block's escapes without a branch each: a few
/// more instructions (5,076 per event), a quarter less time in this loop with 1,500-event streams
/// (CPU-clock samples, BENCHMARKS.md, nineteenth session).
fn escaped_string_end(bytes: &[u8], base: usize) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = pulp::x86::V3::try_new() {
        return cpu.vectorize(|| escaped_string_end_by(bytes, base, Avx2Blocks(cpu)));
    }
    escaped_string_end_by(bytes, base, ChunkBlocks)
}

/// [`escaped_string_end`] with the given blocks: the escaped bytes of each block come from word
/// arithmetic on its backslashes ([`escaped_bytes`]), so only the escapes' kinds are checked one
/// by one.
#[inline(always)]
fn escaped_string_end_by(bytes: &[u8], mut base: usize, blocks: impl Blocks) -> Option<usize> {
    let mut carry = 0;
    loop {
        let block = Block::from(bytes, base, blocks)?;
        let escaped = escaped_bytes(block.backslashes, &mut carry);
        let ends = block.quotes & !escaped;
        // The bytes before the closing quote, or all of them when it lies further on.
        let before_end = (ends & ends.wrapping_neg()).wrapping_sub(1);
        if block.controls & before_end != 0 {
            return None;
        }
        let escapes = escaped & before_end;
        if escapes != 0 {
            match block.classes {
                Some(classes) => escapes_valid_by_masks(bytes, base, escapes, classes)?,
                None => escapes_valid(bytes, base, escapes)?,
            }
        }
        if ends != 0 {
            return Some(base + ends.trailing_zeros() as usize);
        }
        base += 64;
    }
}

/// Checks the escapes of the block at `base` one by one: `escapes` has bit `i` set when byte
/// `base + i` follows an escaping backslash. `None` when one is not what serde accepts.
#[inline(always)]
fn escapes_valid(bytes: &[u8], base: usize, mut escapes: u64) -> Option<()> {
    while escapes != 0 {
        let at = base + escapes.trailing_zeros() as usize;
        match ESCAPES[usize::from(*bytes.get(at)?)] {
            Escape::Single => {}
            // Go writes `<`, `>` and `&` as `\u003c`, `\u003e` and `\u0026`. Hex digits are no
            // stop, so they cannot have disturbed the block's masks.
            Escape::Unicode => {
                let digits = bytes.get(at + 1..at + 5)?;
                if !digits.iter().all(|&d| HEX_DIGITS[usize::from(d)]) {
                    return None;
                }
            }
            Escape::Invalid => return None,
        }
        escapes &= escapes - 1;
    }
    Some(())
}

/// [`escapes_valid`] by the block's class masks: every escaped byte may follow a backslash, and
/// the four bytes after each `u` are hex digits. Bytes past the end of the payload are in no
/// class (the masks of a shifted last block have no bits there; a padded short payload is padded
/// with spaces), so an escape or digits cut off by the end are refused, as they are one by one.
/// Only a `\u` in the block's last four bytes, whose digits run into the next block, is checked
/// one by one.
#[inline(always)]
fn escapes_valid_by_masks(bytes: &[u8], base: usize, escapes: u64, classes: EscapeClasses) -> Option<()> {
    if escapes & !classes.escape != 0 {
        return None;
    }
    let unicode = escapes & classes.unicode;
    if unicode != 0 {
        let digits = unicode << 1 | unicode << 2 | unicode << 3 | unicode << 4;
        if digits & !classes.hex != 0 {
            return None;
        }
        escapes_valid(bytes, base, unicode & !(u64::MAX >> 4))?;
    }
    Some(())
}

/// The bytes escaped by a backslash (the one after each run of an odd number of them, and every
/// second one of a run), given the block's backslashes and `carry`, 1 when the previous block
/// ended in such a run (it escapes this block's first byte). simdjson's branch-free method:
/// adding each odd-starting run's start to the backslashes carries through the run, which tells
/// apart runs by the parity of where they start.
#[inline]
fn escaped_bytes(backslashes: u64, carry: &mut u64) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    // An escaped first byte escapes nothing.
    let backslashes = backslashes & !*carry;
    let follows_backslash = backslashes << 1 | *carry;
    let odd_starts = backslashes & !EVEN & !follows_backslash;
    let (even_runs, overflow) = odd_starts.overflowing_add(backslashes);
    *carry = u64::from(overflow);
    (EVEN ^ (even_runs << 1)) & follows_backslash
}

/// What may follow a backslash in a JSON string.
#[derive(Clone, Copy)]
enum Escape {
    /// `"`, `\`, `/`, `b`, `f`, `n`, `r` or `t`.
    Single,
    /// `u`, then four hex digits.
    Unicode,
    /// Anything else: serde refuses it.
    Invalid,
}

static ESCAPES: [Escape; 256] = {
    let mut table = [Escape::Invalid; 256];
    let singles = *b"\"\\/bfnrt";
    let mut i = 0;
    while i < singles.len() {
        table[singles[i] as usize] = Escape::Single;
        i += 1;
    }
    table[b'u' as usize] = Escape::Unicode;
    table
};

/// The key bytes read here: printable ASCII but `"` and `\` (a key holding anything else is left
/// to serde), for keys longer than a chunk. Tables, this and [`HEX_DIGITS`]: together they made
/// decoding 6% cheaper than the comparisons they replace (callgrind over the bench workload).
static PLAIN_KEY_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = b' ';
    while b <= b'~' {
        table[b as usize] = b != b'"' && b != b'\\';
        b += 1;
    }
    table
};

/// Which bytes are hexadecimal digits (a `\u` escape is checked on every `<`, `>` and `&` Go
/// writes).
static HEX_DIGITS: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = (b as u8).is_ascii_hexdigit();
        b += 1;
    }
    table
};

/// Which containers enclose the value being skipped: one bit per level (set for an object),
/// so that nesting costs no recursion and no allocation up to 64 levels (serde_json skips values
/// without a depth limit, and so must this).
#[derive(Default)]
struct Nesting {
    /// The innermost 64 levels, innermost in bit 0.
    recent: u64,
    /// Levels below those.
    older: Vec<u64>,
    depth: usize,
}

impl Nesting {
    fn push(&mut self, object: bool) {
        if self.depth > 0 && self.depth % 64 == 0 {
            self.older.push(self.recent);
            self.recent = 0;
        }
        self.recent = (self.recent << 1) | u64::from(object);
        self.depth += 1;
    }

    /// Leaves the innermost level; whether it was an object. `None` when there is none.
    fn pop(&mut self) -> Option<bool> {
        self.depth = self.depth.checked_sub(1)?;
        let object = self.recent & 1 == 1;
        self.recent >>= 1;
        if self.depth > 0 && self.depth % 64 == 0 {
            self.recent = self.older.pop()?;
        }
        Some(object)
    }

    fn innermost_is_object(&self) -> bool {
        self.recent & 1 == 1
    }
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn expect(&mut self, b: u8) -> Option<()> {
        (self.next()? == b).then_some(())
    }

    #[inline]
    fn whitespace(&mut self) {
        // Go's encoder writes none: one comparison for the usual byte (every JSON token starts
        // above the space).
        if self.peek().is_some_and(|b| b > b' ') {
            return;
        }
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    /// An object whose keys are plain ASCII: calls `field` with each key, positioned at its value.
    fn object(&mut self, mut field: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        self.whitespace();
        self.expect(b'{')?;
        self.whitespace();
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(());
        }
        loop {
            let key = self.key()?;
            self.whitespace();
            self.expect(b':')?;
            self.whitespace();
            field(self, key)?;
            self.whitespace();
            match self.next()? {
                b',' => self.whitespace(),
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// `meta` or `correlation`: an object, or `null` (which serde reads as absent).
    fn nested(&mut self, field: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        match self.peek()? {
            b'n' => self.null(),
            _ => self.object(field),
        }
    }

    /// A key without escapes, all ASCII and no control characters (serde decodes and checks
    /// keys; anything else is left to it).
    fn key(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.at;
        let len = match Chunk::at(self.bytes, start).map(|chunk| (chunk, chunk.equal(b'"'))) {
            // Keys are short: one chunk holds the closing quote of nearly all of them.
            Some((chunk, quotes)) if quotes != 0 => {
                let len = quotes.trailing_zeros() as usize;
                let refused = chunk.below(0x20) | chunk.at_least(0x7f) | chunk.equal(b'\\');
                (refused & !(u32::MAX << len) == 0).then_some(len)?
            }
            // A long key, or the last bytes of the payload: a byte at a time.
            _ => {
                let rest = &self.bytes[start..];
                let len = rest.iter().position(|&b| !PLAIN_KEY_BYTES[usize::from(b)])?;
                (rest[len] == b'"').then_some(len)?
            }
        };
        self.at = start + len + 1;
        Some(&self.bytes[start..start + len])
    }

    /// `null`, for a field serde reads as absent.
    fn null(&mut self) -> Option<()> {
        self.expect_rest(b"null")
    }

    /// The value of a member whose key names `field` (read into `pieces`, once), or of any other
    /// member (skipped).
    fn known_string(
        &mut self,
        field: Option<usize>,
        seen: &mut u32,
        pieces: &mut [Option<ReadString>; STRING_FIELDS],
    ) -> Option<()> {
        let Some(field) = field else {
            // Most skipped values are strings (`model`, the cumulative `completion`).
            if self.peek() == Some(b'"') {
                self.at += 1;
                return self.string_end().map(drop);
            }
            return self.skip_value();
        };
        first(seen, field)?;
        self.string_field(&mut pieces[field])
    }

    /// A string field: `null` (absent) or a string: where it is, or its decoded text when it
    /// holds escapes.
    fn string_field(&mut self, slot: &mut Option<ReadString>) -> Option<()> {
        if self.next()? != b'"' {
            self.at -= 1;
            return self.null();
        }
        let start = self.at;
        let (end, escaped) = self.string_end()?;
        *slot = Some(if escaped {
            ReadString::Decoded(unescape(&self.bytes[start..end])?)
        } else {
            ReadString::Plain { start, end }
        });
        Some(())
    }

    /// `text`: `null` (absent) or a string, kept as raw JSON with its quotes. serde keeps it as a
    /// raw value, which it checks for UTF-8 (a value of another type is left to serde).
    fn raw_text(&mut self, slot: &mut Option<&'a str>) -> Option<()> {
        let start = self.at;
        if self.next()? != b'"' {
            self.at -= 1;
            return self.null();
        }
        let (end, _) = self.string_end()?;
        *slot = Some(utf8(&self.bytes[start..=end])?);
        Some(())
    }

    /// Moves past the closing quote of the string whose content starts here; returns the
    /// position of that quote and whether the string holds escapes. Escapes are checked as serde
    /// checks them (`\u` with four hex digits, or one of `"\/bfnrt`); control characters are
    /// refused; UTF-8 is not checked here.
    fn string_end(&mut self) -> Option<(usize, bool)> {
        // Locals, not `self.at`: the loops keep their position in a register.
        let bytes = self.bytes;
        // Plain content a chunk at a time: most strings (ids, types, names) hold no escape, and
        // their closing quote is their first stop.
        let mut base = self.at;
        loop {
            let stops = stops_from(bytes, base);
            if stops == 0 {
                base += 16;
                if base >= bytes.len() {
                    return None;
                }
                continue;
            }
            let at = base + stops.trailing_zeros() as usize;
            if bytes[at] == b'"' {
                self.at = at + 1;
                return Some((at, false));
            }
            // An escape (or a control character, which the blocks refuse): Go escapes every 20
            // to 30 bytes of model text, so the rest goes by blocks, whose escapes cost no branch
            // each to find.
            break;
        }
        // No backslash before `base`, so nothing escapes its first byte.
        let end = escaped_string_end(bytes, base)?;
        self.at = end + 1;
        // The loop above left the chunks at the first backslash: escapes were met.
        Some((end, true))
    }

    /// Skips any JSON value, as serde_json checks it when it ignores one: strings (escapes and
    /// control characters, not UTF-8), numbers, literals, arrays and objects to any depth.
    fn skip_value(&mut self) -> Option<()> {
        let mut nesting = Nesting::default();
        loop {
            // A value.
            self.whitespace();
            match self.next()? {
                b'"' => {
                    self.string_end()?;
                }
                b'-' => self.skip_number()?,
                b'0'..=b'9' => {
                    self.at -= 1;
                    self.skip_number()?;
                }
                b'n' => self.expect_rest(b"ull")?,
                b't' => self.expect_rest(b"rue")?,
                b'f' => self.expect_rest(b"alse")?,
                open @ (b'[' | b'{') => {
                    self.whitespace();
                    let (close, object) = if open == b'{' { (b'}', true) } else { (b']', false) };
                    if self.peek()? == close {
                        self.at += 1;
                    } else {
                        nesting.push(object);
                        if object {
                            self.skip_key()?;
                        }
                        continue;
                    }
                }
                _ => return None,
            }
            // After a value: a comma and the next one, or the end of containers.
            loop {
                if nesting.depth == 0 {
                    return Some(());
                }
                self.whitespace();
                match self.next()? {
                    b',' => {
                        if nesting.innermost_is_object() {
                            self.whitespace();
                            self.skip_key()?;
                        }
                        break;
                    }
                    b'}' if nesting.innermost_is_object() => {
                        nesting.pop()?;
                    }
                    b']' if !nesting.innermost_is_object() => {
                        nesting.pop()?;
                    }
                    _ => return None,
                }
            }
        }
    }

    /// The key of a member of a skipped object and its colon (serde checks such keys as it
    /// checks skipped strings).
    fn skip_key(&mut self) -> Option<()> {
        self.expect(b'"')?;
        self.string_end()?;
        self.whitespace();
        self.expect(b':')
    }

    /// `rest` is next (and consumed).
    fn expect_rest(&mut self, rest: &[u8]) -> Option<()> {
        self.bytes[self.at..].starts_with(rest).then(|| self.at += rest.len())
    }

    /// A number after its optional minus sign: `0` or digits not starting with `0`, then an
    /// optional fraction and exponent, each with at least one digit.
    fn skip_number(&mut self) -> Option<()> {
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.first_digit()?;
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            self.first_digit()?;
            self.digits();
        }
        // A digit right after a leading zero is not JSON ("01").
        match self.peek() {
            Some(b'0'..=b'9') => None,
            _ => Some(()),
        }
    }

    fn first_digit(&mut self) -> Option<()> {
        self.next()?.is_ascii_digit().then_some(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
    }
}

/// The content of a string with escapes, decoded. Surrogate escapes (a character outside the
/// basic plane, or a lone half that serde refuses) are left to serde.
fn unescape(raw: &[u8]) -> Option<String> {
    let mut out = Vec::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(at) = memchr::memchr(b'\\', rest) {
        out.extend_from_slice(&rest[..at]);
        let (&kind, tail) = rest[at + 1..].split_first()?;
        rest = tail;
        match kind {
            b'"' | b'\\' | b'/' => out.push(kind),
            b'b' => out.push(0x08),
            b'f' => out.push(0x0c),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'u' => {
                let digits = rest.get(..4)?;
                let code = digits.iter().try_fold(0u32, |code, &d| Some(code << 4 | char::from(d).to_digit(16)?))?;
                let c = char::from_u32(code)?; // None for surrogates
                out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                rest = &rest[4..];
            }
            _ => return None,
        }
    }
    out.extend_from_slice(rest);
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agrees(payload: &[u8]) -> Option<Fields<'_>> {
        crate::codec::inbound::reader_agrees_with_serde(payload).unwrap();
        read(payload)
    }

    #[test]
    fn reads_the_events_agents_send_in_one_pass() {
        let events: [&[u8]; 6] = [
            r#"{"type":"partial","meta":{"model":"gpt-4o-mini","message_id":"3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071","session_id":"sess-1","inference_id":"inf-1","turn_id":"turn-1"},"delta":" \u003ctool\u003e","completion":"prefix \u003cthinking\u003e\nit\u0026s \"quoted\" caf\u00e9 é — \u2028 \\ end \u003ctool\u003e"}"#.as_bytes(),
            br#"{"type":"text-delta","meta":{"message_id":"m","session_id":"s"},"correlation":{"session_id":"s","run_id":"r","turn_id":"t","provider_call_id":"openai:r:provider-call:0","segment_id":"seg"},"delta":"x","text":"so far \u003cx\u003e","sequence":7}"#,
            br#"{"type":"final","meta":{"model":"m","stop_reason":"stop","usage":{"input_tokens":120,"output_tokens":42},"duration_ms":1834,"temperature":0.7,"message_id":"m"},"text":"Hello world"}"#,
            br#"{"type":"error","error":{},"meta":{"message_id":"m"},"error_string":"boom"}"#,
            br#"{"type":"text-segment-finished","meta":{"message_id":"m"},"correlation":null,"text":"whole","finish_reason":"length"}"#,
            b" \n{ \"type\" : \"partial\" , \"meta\" : { \"message_id\" : \"m\" } , \"delta\" : null , \"extra\" : [ 1 , -2.5e-3 , true , false , null , { } , [ ] ] } \r\n",
        ];
        for event in events {
            let fields = agrees(event).unwrap_or_else(|| panic!("left to serde: {}", String::from_utf8_lossy(event)));
            assert!(fields.message_id.is_some());
        }
        let partial = agrees(events[0]).unwrap();
        assert_eq!(partial.delta.as_deref(), Some(" <tool>"));
        assert!(matches!(partial.message_id, Some(Cow::Borrowed(_))), "no escapes: borrowed");
        assert!(matches!(partial.delta, Some(Cow::Owned(_))), "escapes: decoded");
        let canonical = agrees(events[1]).unwrap();
        assert_eq!(canonical.text, Some(r#""so far \u003cx\u003e""#), "raw, quotes included");
        assert_eq!(canonical.segment_id.as_deref(), Some("seg"));
    }

    #[test]
    fn leaves_what_it_does_not_handle_to_serde() {
        let cases: [&[u8]; 16] = [
            br#"{"t\u0079pe":"partial","meta":{"message_id":"m"}}"#,
            br#"{"type":"partial","type":"final","meta":{"message_id":"m"}}"#,
            br#"{"type":null,"type":"final","meta":{"message_id":"m"}}"#,
            br#"{"type":"partial","meta":{"message_id":"m","message_id":"n"}}"#,
            br#"{"type":"partial","meta":["m"]}"#,
            br#"{"type":7,"meta":{"message_id":"m"}}"#,
            br#"{"type":"partial","meta":{"message_id":"m"},"delta":"\ud83d\ude00"}"#,
            br#"{"type":"partial","meta":{"message_id":"m"},"delta":"\ud800"}"#,
            b"{\"type\":\"partial\",\"meta\":{\"message_id\":\"m\"},\"delta\":\"\xff\"}",
            b"{\"type\":\"partial\",\"meta\":{\"message_id\":\"m\"},\"delta\":\"a\x01\"}",
            br#"{"type":"partial","meta":{"message_id":"m"}} x"#,
            br#"{"type":"partial","meta":{"message_id":"m"},}"#,
            "{\"kl\u{e9}\":1,\"type\":\"partial\",\"meta\":{\"message_id\":\"m\"}}".as_bytes(),
            br#"{"type":"partial","meta":{"message_id":"m"},"extra":01}"#,
            br#"{"type":"partial","meta":{"message_id":"m"},"extra":"\x"}"#,
            br#"["partial",{"message_id":"m"}]"#,
        ];
        for case in cases {
            assert_eq!(agrees(case), None, "{}", String::from_utf8_lossy(case));
        }
    }

    #[test]
    fn is_as_lenient_as_serde_in_skipped_strings_and_values() {
        // serde does not check the UTF-8 of a string it skips, nor limit the depth of a value it
        // skips; neither does the reader, and both read the same fields.
        let invalid_utf8 =
            b"{\"type\":\"partial\",\"meta\":{\"message_id\":\"m\"},\"delta\":\"d\",\"completion\":\"\xff\xfe\"}";
        assert!(agrees(invalid_utf8).is_some());
        let deep = format!(
            r#"{{"type":"partial","meta":{{"message_id":"m"}},"delta":"d","extra":{}1{}}}"#,
            "[{\"k\":".repeat(100_000),
            "}]".repeat(100_000)
        );
        assert!(agrees(deep.as_bytes()).is_some());
        let unbalanced = format!(r#"{{"type":"partial","meta":{{"message_id":"m"}},"extra":{}}}"#, "[".repeat(70));
        assert_eq!(agrees(unbalanced.as_bytes()), None);
    }

    /// The scalar meaning of each comparison, for every byte value in every lane.
    #[test]
    fn chunk_comparisons_mark_exactly_the_matching_bytes() {
        for lane in 0..16 {
            for b in 0..=255u8 {
                let mut sixteen = [b'a'; 16];
                sixteen[lane] = b;
                let chunk = Chunk::at(&sixteen, 0).unwrap();
                let bit = |hit: bool| if hit { 1u32 << lane } else { 0 };
                assert_eq!(chunk.equal(b'"'), bit(b == b'"'), "{b:#x} at {lane}");
                assert_eq!(chunk.equal(b), bit(true) | if b == b'a' { 0xffff } else { 0 });
                assert_eq!(chunk.below(0x20), bit(b < 0x20), "{b:#x} at {lane}");
                assert_eq!(chunk.below(1), bit(b == 0), "{b:#x} at {lane}");
                assert_eq!(chunk.at_least(0x7f), bit(b >= 0x7f), "{b:#x} at {lane}");
                assert_eq!(chunk.string_stops(), bit(matches!(b, b'"' | b'\\' | 0..=0x1f)), "{b:#x} at {lane}");
            }
        }
        assert!(Chunk::at(&[0; 15], 0).is_none());
        assert!(Chunk::at(&[0; 20], 5).is_none());
    }

    /// From every position of payloads longer and shorter than a chunk: a chunk's stops, the
    /// shifted last chunk, or the bytes one at a time all mean the same.
    #[test]
    fn stops_from_any_position_match_a_byte_by_byte_scan() {
        let text = b"ab\"cd\\e\x01fghijklmnopq\"rstuvwxyz0123\n456789ABCDEF\"";
        for len in 0..=text.len() {
            let bytes = &text[..len];
            for at in 0..=len {
                let expected = bytes[at..]
                    .iter()
                    .take(16)
                    .enumerate()
                    .filter(|(_, &b)| matches!(b, b'"' | b'\\' | 0..=0x1f))
                    .fold(0u32, |m, (i, _)| m | 1 << i);
                assert_eq!(stops_from(bytes, at), expected, "len {len}, at {at}");
            }
        }
    }

    /// The block makers this CPU can run: SSE2 (or NEON) chunks always, AVX2 where present; with
    /// whether the maker classes the bytes of blocks with a backslash ([`EscapeClasses`]).
    fn block_makers(check: impl Fn(&str, bool, &dyn Fn(&[u8], usize) -> Option<Block>)) {
        check("chunks", false, &|bytes, at| Block::from(bytes, at, ChunkBlocks));
        #[cfg(target_arch = "x86_64")]
        match pulp::x86::V3::try_new() {
            Some(cpu) => check("avx2", true, &|bytes, at| cpu.vectorize(|| Block::from(bytes, at, Avx2Blocks(cpu)))),
            None => eprintln!("this CPU has no AVX2: only the chunk blocks were checked"),
        }
    }

    /// From every position of payloads longer and shorter than a block, with and without control
    /// characters: a block's masks, the shifted last block or the padded short payload all mark
    /// exactly the quotes, backslashes and control characters a byte-by-byte scan finds, and
    /// nothing past the end, whichever instructions made them.
    #[test]
    fn blocks_from_any_position_match_a_byte_by_byte_scan() {
        let plain = b"ab\"cd\\efghijklmnopq\"rstuvwxyz0123 456789ABCDEFG/@`\"\\\\ \xc3\xa9 \x7f\xff".repeat(3);
        let mut with_controls = plain.clone();
        for at in [3, 31, 32, 40, 63, 64, 65, 100, 127, 150] {
            with_controls[at] = [0x00, b'\n', 0x1f, b'\t'][at % 4];
        }
        let mask = |bytes: &[u8], at: usize, wanted: fn(u8) -> bool| {
            bytes[at..].iter().take(64).enumerate().filter(|(_, &b)| wanted(b)).fold(0u64, |m, (i, _)| m | 1 << i)
        };
        block_makers(|name, classes_escapes, block_from| {
            for text in [&plain, &with_controls] {
                for len in 0..=text.len() {
                    let bytes = &text[..len];
                    assert!(block_from(bytes, len).is_none(), "{name}, len {len}: past the end");
                    for at in 0..len {
                        let block = block_from(bytes, at).unwrap();
                        let context = format!("{name}, len {len}, at {at}");
                        assert_eq!(block.quotes, mask(bytes, at, |b| b == b'"'), "quotes, {context}");
                        assert_eq!(block.backslashes, mask(bytes, at, |b| b == b'\\'), "backslashes, {context}");
                        assert_eq!(block.controls, mask(bytes, at, |b| b < 0x20), "controls, {context}");
                        if let Some(classes) = block.classes {
                            assert_eq!(classes.escape, mask(bytes, at, may_follow_a_backslash), "escapes, {context}");
                            assert_eq!(classes.unicode, mask(bytes, at, |b| b == b'u'), "unicode, {context}");
                            assert_eq!(classes.hex, mask(bytes, at, |b| b.is_ascii_hexdigit()), "hex, {context}");
                        }
                        // The AVX2 blocks class the bytes of every block with a backslash (a shifted
                        // last block may have lost its backslashes and kept its classes).
                        if classes_escapes && block.backslashes != 0 {
                            assert!(block.classes.is_some(), "classes made, {context}");
                        }
                    }
                }
            }
        });
    }

    /// What may follow a backslash in a JSON string.
    fn may_follow_a_backslash(b: u8) -> bool {
        matches!(b, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' | b'u')
    }

    /// The nibble tables class every byte value as a byte-by-byte test does: a block of a
    /// backslash and sixty-three copies of the value, for each of the 256 values.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn escape_classes_of_every_byte_value_match_a_byte_by_byte_test() {
        let Some(cpu) = pulp::x86::V3::try_new() else {
            eprintln!("this CPU has no AVX2: the escape classes are not made here");
            return;
        };
        for value in 0..=255u8 {
            let mut bytes = [value; 64];
            bytes[0] = b'\\';
            let block = cpu.vectorize(|| Block::from(&bytes, 0, Avx2Blocks(cpu))).unwrap();
            let classes = block.classes.expect("a block with a backslash is classed");
            let all_but_first = |class: bool| if class { u64::MAX << 1 } else { 0 };
            let context = format!("byte {value:#04x}");
            assert_eq!(classes.escape >> 1 << 1, all_but_first(may_follow_a_backslash(value)), "escape, {context}");
            assert_eq!(classes.unicode >> 1 << 1, all_but_first(value == b'u'), "unicode, {context}");
            assert_eq!(classes.hex >> 1 << 1, all_but_first(value.is_ascii_hexdigit()), "hex, {context}");
        }
    }

    /// The closing quote of strings with escapes, from every start and with a bad byte or escape
    /// at every position, is where a byte-by-byte reading finds it (or `None` where it refuses
    /// the string), by the chunk blocks and by the blocks chosen at run time (AVX2 where present).
    #[test]
    fn escaped_string_ends_match_a_byte_by_byte_reading() {
        fn byte_by_byte(bytes: &[u8], mut at: usize) -> Option<usize> {
            loop {
                match *bytes.get(at)? {
                    b'"' => return Some(at),
                    b'\\' => match *bytes.get(at + 1)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => at += 2,
                        b'u' if bytes.get(at + 2..at + 6)?.iter().all(u8::is_ascii_hexdigit) => at += 6,
                        _ => return None,
                    },
                    0..=0x1f => return None,
                    _ => at += 1,
                }
            }
        }
        let content = r#"ab\u003cc\n\\\"d\\\\e\/\t caf\u00e9 "#.repeat(5);
        let mut payloads = Vec::new();
        let bad = [
            "",
            "\x01",
            "\n",
            "\\x",
            "\\u00g0",
            "\\u00",
            "\\",
            "\"",
            "\\\\",
            "\\\"",
            "\\U0041",
            "\\u0A1f",
            "\\uFFFF",
            "\\u00G0",
            "\\u:000",
            "\\u123",
            "\\u000g",
            "\\a",
            "\\é",
            "\\u\\u0041",
        ];
        for bad in bad {
            for cut in 0..=content.len() {
                payloads.push(format!(r#""{}{bad}{}","next":1}}"#, &content[..cut], &content[cut..]));
                // Cut off by the end of the payload.
                payloads.push(format!(r#""{}{bad}"#, &content[..cut]));
            }
        }
        for payload in &payloads {
            let bytes = payload.as_bytes();
            for start in 1..bytes.len() {
                let expected = byte_by_byte(bytes, start);
                assert_eq!(
                    escaped_string_end_by(bytes, start, ChunkBlocks),
                    expected,
                    "chunks: {payload} from {start}"
                );
                assert_eq!(escaped_string_end(bytes, start), expected, "chosen at run time: {payload} from {start}");
            }
        }
    }

    /// The escaped bytes of runs of backslashes of every length, across block boundaries, as a
    /// byte-by-byte reading finds them: a byte is escaped when the one before is a backslash
    /// that is not escaped itself.
    #[test]
    fn escaped_bytes_match_a_byte_by_byte_reading() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for density in 1..8u64 {
            for _ in 0..300 {
                let backslash: Vec<bool> = (0..320)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        state % 8 < density
                    })
                    .collect();
                let mut expected = vec![false; backslash.len()];
                let mut escaping = false;
                for (i, &b) in backslash.iter().enumerate() {
                    expected[i] = escaping;
                    escaping = b && !escaping;
                }
                let mut carry = 0;
                for (block, bits) in backslash.chunks(64).enumerate() {
                    let mask = bits.iter().rev().fold(0u64, |mask, &b| mask << 1 | u64::from(b));
                    let escaped = escaped_bytes(mask, &mut carry);
                    for (i, &want) in expected[block * 64..][..bits.len()].iter().enumerate() {
                        assert_eq!(escaped >> i & 1 == 1, want, "density {density}, byte {}", block * 64 + i);
                    }
                }
            }
        }
    }

    /// Escaped strings go by blocks of sixty-four bytes: escapes, backslash runs, bad bytes and
    /// the closing quote at every position relative to them, and strings cut off by the end of
    /// the payload, give serde's verdict.
    #[test]
    fn escaped_strings_are_read_the_same_wherever_blocks_fall() {
        let content = r#"ab\u003cc\n\\\"d\\\\e\/\t"#.repeat(6);
        let same_verdict = |payload: &str| {
            let read = agrees(payload.as_bytes());
            let serde = crate::codec::inbound::read_with_serde(payload.as_bytes());
            assert_eq!(read.is_some(), serde.is_ok(), "{payload}");
        };
        for pad in 1..=64 {
            let id = "m".repeat(pad);
            for bad in ["", "\x01", "\\x", "\\u00g0", "\\u00", "\\", "\"", "\\\\", "\\\""] {
                for cut in 0..=content.len() {
                    let broken = format!("{}{bad}{}", &content[..cut], &content[cut..]);
                    // Decoded (and so unescaped too) and skipped (checked by the blocks alone).
                    for field in ["delta", "completion"] {
                        same_verdict(&format!(
                            r#"{{"type":"partial","meta":{{"message_id":"{id}"}},"{field}":"{broken}"}}"#
                        ));
                    }
                }
            }
            let whole = format!(r#"{{"type":"partial","meta":{{"message_id":"{id}"}},"completion":"{content}"}}"#);
            for end in 0..=whole.len() {
                same_verdict(&whole[..end]);
            }
        }
    }

    /// Strings ending, or escapes and bad bytes falling, at every position relative to the
    /// chunks, in payloads of every length around a chunk's.
    #[test]
    fn strings_are_read_the_same_wherever_chunks_fall() {
        let contents: [&str; 8] = [
            "",
            "plain",
            r#"a\"b"#,
            r"\\",
            r"x\u003cy\u003e",
            "0123456789abcdef0123456789abcdef",
            r#"\u0026\n\t\"\/\b\f\r\\z"#,
            "caf\u{e9} \u{2014}",
        ];
        // These shapes are all the reader's own: it must accept exactly what serde accepts.
        let same_verdict = |payload: &str| {
            let read = agrees(payload.as_bytes());
            let serde = crate::codec::inbound::read_with_serde(payload.as_bytes());
            assert_eq!(read.is_some(), serde.is_ok(), "{payload}");
        };
        for pad in 1..40 {
            let id = "m".repeat(pad);
            for content in contents {
                for tail in ["", "}", "}    ", "}                 "] {
                    same_verdict(&format!(
                        r#"{{"type":"partial","meta":{{"message_id":"{id}"}},"delta":"{content}","completion":"{content}"{tail}"#
                    ));
                    // A bad byte or escape, or a backslash or quote, before each character.
                    for bad in ["\x01", "\\x", "\\u00g0", "\\", "\""] {
                        for cut in (0..=content.len()).filter(|&cut| content.is_char_boundary(cut)) {
                            let broken = format!("{}{bad}{}", &content[..cut], &content[cut..]);
                            same_verdict(&format!(
                                r#"{{"type":"partial","meta":{{"message_id":"{id}"}},"delta":"{broken}"{tail}"#
                            ));
                        }
                    }
                }
            }
        }
    }

    /// The SIMD check decides as std's does, for valid and broken sequences at every position
    /// relative to its blocks (up to 64 bytes) and at the very end of the input.
    #[test]
    fn utf8_checks_agree_with_std_wherever_the_bytes_fall() {
        let sequences: [&[u8]; 14] = [
            b"a",
            "é".as_bytes(),
            "€".as_bytes(),
            "😀".as_bytes(),
            b"\xc3",             // cut short
            b"\xe2\x82",         // cut short
            b"\xf0\x9f\x98",     // cut short
            b"\xc0\xaf",         // overlong
            b"\xe0\x80\xaf",     // overlong
            b"\xed\xa0\x80",     // surrogate
            b"\xf4\x90\x80\x80", // above U+10FFFF
            b"\x80",             // continuation alone
            b"\xff",
            b"\xc3\x28", // a lead byte without its continuation
        ];
        for sequence in sequences {
            for before in 0..=70 {
                for after in [0, 1, 3, 17, 64] {
                    let mut bytes = vec![b'x'; before];
                    bytes.extend_from_slice(sequence);
                    bytes.extend(std::iter::repeat_n(b'y', after));
                    assert_eq!(
                        utf8(&bytes),
                        std::str::from_utf8(&bytes).ok(),
                        "{sequence:?} after {before}, then {after}"
                    );
                }
            }
        }
    }
}
