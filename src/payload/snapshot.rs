//! Live snapshots of one block's payload while it streams, in linear total work.
//!
//! Owns [`PayloadFormat`] and [`Snapshotter`]: when to (re)parse a growing payload, how much work
//! that may cost, and deduplication of the values it yields. It does not know about tags, events
//! or publishing; the pipeline decides what to do with a snapshot. The final value of a block
//! never depends on snapshots: [`Snapshotter::complete`] decodes the whole text from scratch.
//!
//! # Spacing and cost
//! A snapshot attempt happens only when the payload has grown by
//! `max(min_growth, 25 %)` since the previous attempt (`min_growth` defaults to
//! [`MIN_GROWTH_BYTES`]). Attempt sizes therefore grow at least geometrically (×1.25), so the
//! sizes of all attempts sum to less than 5× the payload, whatever its shape or chunking.
//!
//! * **YAML** re-parses the fence body (found line by line by a `FenceTracker`, never
//!   rescanning the head) cut at the last newline, and only in a push that brought a newline.
//!   Trailing lines that open a nested value (`key:`, a bare `-`) are held back, so a key does
//!   not show as `null` and then turn into a mapping or sequence. A failed strict parse is
//!   retried once with the repair of [`super::yaml`]. If neither parses, there is no snapshot.
//!   Only mappings and sequences are reported (a half-written payload that parses as a scalar is
//!   prose, not a value).
//! * **JSON** feeds every delta to a [`PartialJson`] (linear) and builds a value, O(its size),
//!   at the same spacing and only when the parser reports a visible change.
//! * **Raw** payloads have no snapshots: the raw text is the value, and the block's own deltas
//!   already carry it.
//!
//! [`Snapshotter::parsed_bytes`] counts the work: bytes handed to the YAML parser, scanned by the
//! repair or the hold-back, fed to the partial JSON parser, and, for each JSON value built, the
//! bytes it was built from. As a hard backstop, an attempt whose cost would take this counter
//! above `budget` × the bytes received is skipped (default [`BUDGET_FACTOR`], set with
//! [`Snapshotter::with_budget`]; each skip is counted by [`Snapshotter::budget_skips`]), so the
//! counter stays below `budget + 1` × the payload size for any payload.
//!
//! Deduplication: a JSON value is built only when the partial parser's exact change flag is set;
//! a YAML candidate is compared with the last returned one (O(value), less than the parse that
//! produced it) and returned only when different.

use memchr::memchr;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::fence::FenceTracker;
use super::partial_json::PartialJson;
use super::yaml::{parse_strict, repair};
use super::{decode, PayloadError};

/// Default minimum growth, in bytes, between two snapshot attempts.
pub const MIN_GROWTH_BYTES: usize = 256;

/// Default snapshot budget: work may never exceed this many times the bytes received.
pub const BUDGET_FACTOR: usize = 7;

/// How a block's payload is decoded (the `payload` key of a `block` tag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PayloadFormat {
    /// YAML, optionally inside a code fence; the default.
    #[default]
    Yaml,
    /// JSON, found by the extraction chain; snapshots from the partial parser.
    Json,
    /// The text as is, as a JSON string.
    Raw,
}

/// Produces deduplicated live snapshots of one block's payload; see the module doc.
#[derive(Debug, Clone)]
pub struct Snapshotter {
    format: PayloadFormat,
    min_growth: usize,
    /// Work allowed per byte received; see [`Snapshotter::with_budget`].
    budget: usize,
    /// Attempts skipped because they would have exceeded the budget.
    budget_skips: u64,
    engine: Engine,
    /// Bytes pushed so far.
    received: usize,
    /// Payload size at the last attempt; growth is measured from it.
    last_attempt: usize,
    parsed_bytes: usize,
    /// The last YAML snapshot returned, for deduplication.
    last: Option<Value>,
}

/// Per-format state.
#[derive(Debug, Clone)]
enum Engine {
    /// The text so far (YAML must be re-parsed) and where its fence body lies.
    Yaml {
        text: String,
        fence: FenceTracker,
        /// Whether an attempt already saw the closed fence (the body cannot change any more).
        settled: bool,
    },
    Json(PartialJson),
    Raw,
}

impl Snapshotter {
    /// A snapshotter for a block whose payload is in `format`, with the default spacing.
    pub fn new(format: PayloadFormat) -> Self {
        let engine = match format {
            PayloadFormat::Yaml => Engine::Yaml { text: String::new(), fence: FenceTracker::default(), settled: false },
            PayloadFormat::Json => Engine::Json(PartialJson::new()),
            PayloadFormat::Raw => Engine::Raw,
        };
        Snapshotter {
            format,
            min_growth: MIN_GROWTH_BYTES,
            budget: BUDGET_FACTOR,
            budget_skips: 0,
            engine,
            received: 0,
            last_attempt: 0,
            parsed_bytes: 0,
            last: None,
        }
    }

    /// Sets the minimum growth between attempts (at least 1). Smaller values give earlier
    /// snapshots of small payloads; the 25 % rule and the budget still bound the total work.
    pub fn with_min_growth(mut self, bytes: usize) -> Self {
        self.min_growth = bytes.max(1);
        self
    }

    /// Sets the budget: snapshot work stays within `factor` × the bytes received (0 disables
    /// snapshots in effect). An attempt over it is skipped and counted, never partly run.
    pub fn with_budget(mut self, factor: usize) -> Self {
        self.budget = factor;
        self
    }

    /// Attempts skipped so far because they would have exceeded the budget.
    pub fn budget_skips(&self) -> u64 {
        self.budget_skips
    }

    /// The format this snapshotter decodes.
    pub fn format(&self) -> PayloadFormat {
        self.format
    }

    /// Bytes pushed so far.
    pub fn received_bytes(&self) -> usize {
        self.received
    }

    /// Snapshot work so far, in bytes (see the module doc for what counts).
    pub fn parsed_bytes(&self) -> usize {
        self.parsed_bytes
    }

    /// Appends the next delta of the payload. Returns a snapshot when an attempt was due and its
    /// value differs from the last one returned.
    pub fn push(&mut self, delta: &str) -> Option<Value> {
        self.received += delta.len();
        let candidate = match &mut self.engine {
            Engine::Raw => None,
            Engine::Json(parser) => {
                parser.feed(delta);
                self.parsed_bytes += delta.len();
                let size = parser.fed_bytes();
                if !parser.has_changed() || !due(size, self.last_attempt, self.min_growth) {
                    return None;
                }
                if !affordable(self.parsed_bytes, size, self.received, self.budget) {
                    self.budget_skips += 1;
                    return None;
                }
                self.last_attempt = size;
                self.parsed_bytes += size;
                // The parser's change flag is exact, so no comparison with the last value.
                return parser.snapshot_if_changed();
            }
            Engine::Yaml { text, fence, settled } => {
                if *settled {
                    // The fence closed and was parsed: later text cannot change the value.
                    return None;
                }
                text.push_str(delta);
                // Only a delta with a newline can complete a line; the fence tracker reads each
                // complete line once.
                memchr(b'\n', delta.as_bytes())?;
                let size = fence.advance(text);
                if !due(size, self.last_attempt, self.min_growth) {
                    return None;
                }
                self.last_attempt = size;
                let body = fence.body(text);
                // The hold-back scan reads at most the body: it too must fit the budget.
                if !affordable(self.parsed_bytes, body.len(), self.received, self.budget) {
                    self.budget_skips += 1;
                    return None;
                }
                *settled = fence.is_closed();
                let (body, scanned) = settled_yaml(body);
                self.parsed_bytes += scanned;
                let mut work = Work {
                    parsed: &mut self.parsed_bytes,
                    received: self.received,
                    budget: self.budget,
                    refused: false,
                };
                let candidate = yaml_snapshot(body, &mut work);
                if work.over_budget() {
                    self.budget_skips += 1;
                }
                candidate
            }
        }?;
        if self.last.as_ref() == Some(&candidate) {
            return None;
        }
        self.last = Some(candidate.clone());
        Some(candidate)
    }

    /// The final value of the complete payload `raw`: [`super::decode`] in this format.
    /// Independent of every snapshot taken.
    pub fn complete(&self, raw: &str) -> Result<Value, PayloadError> {
        decode(self.format, raw)
    }
}

/// Whether the payload grew enough since the last attempt: `max(min_growth, 25 %)`.
fn due(size: usize, last_attempt: usize, min_growth: usize) -> bool {
    size.saturating_sub(last_attempt) >= min_growth.max(last_attempt / 4)
}

/// Whether spending `cost` more keeps the work within `budget` × `received`.
fn affordable(parsed: usize, cost: usize, received: usize, budget: usize) -> bool {
    parsed.saturating_add(cost) <= budget.saturating_mul(received)
}

/// The work account of one YAML attempt: spends only what the budget allows and remembers
/// whether something was refused.
struct Work<'a> {
    parsed: &'a mut usize,
    received: usize,
    budget: usize,
    refused: bool,
}

impl Work<'_> {
    /// Spends `cost` if affordable; false (and remembered) if not.
    fn spend(&mut self, cost: usize) -> bool {
        if affordable(*self.parsed, cost, self.received, self.budget) {
            *self.parsed += cost;
            true
        } else {
            self.refused = true;
            false
        }
    }

    fn over_budget(&self) -> bool {
        self.refused
    }
}

/// One YAML attempt on `body`: strict, then repaired, each only if affordable. Only mappings
/// and sequences count as snapshots.
fn yaml_snapshot(body: &str, work: &mut Work<'_>) -> Option<Value> {
    if body.trim().is_empty() || !work.spend(body.len()) {
        return None;
    }
    let value = match parse_strict(body) {
        Ok(value) => value,
        // The repair scans the body once; its output is parsed only if that is affordable.
        Err(_) if work.spend(body.len()) => {
            let repaired = repair(body)?;
            if !work.spend(repaired.len()) {
                return None;
            }
            parse_strict(&repaired).ok()?
        }
        Err(_) => return None,
    };
    matches!(value, Value::Object(_) | Value::Array(_)).then_some(value)
}

/// Cuts trailing lines that open a nested value (`key:`, `- key:`, a bare `-`) off a YAML body
/// ending at a newline, and returns the rest with the number of bytes examined.
fn settled_yaml(body: &str) -> (&str, usize) {
    let mut end = body.len();
    loop {
        let kept = body[..end].trim_end();
        let line_start = kept.rfind('\n').map_or(0, |i| i + 1);
        let line = kept[line_start..].trim();
        let opens = line.ends_with(':') || line == "-" || line.ends_with(" -");
        if !opens || line.starts_with('#') {
            return (&body[..end], body.len() - line_start);
        }
        end = line_start;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Pushes `text` in `chunk`-byte deltas (ASCII text) and collects the snapshots.
    fn stream(snapshotter: &mut Snapshotter, text: &str, chunk: usize) -> Vec<Value> {
        text.as_bytes().chunks(chunk).filter_map(|c| snapshotter.push(std::str::from_utf8(c).expect("ascii"))).collect()
    }

    #[test]
    fn format_deserializes_lowercase_with_yaml_default() {
        #[derive(Deserialize)]
        struct Tag {
            #[serde(default)]
            payload: PayloadFormat,
        }
        let parse = |s: &str| serde_json::from_str::<Tag>(s).map(|t| t.payload);
        assert_eq!(parse("{}").ok(), Some(PayloadFormat::Yaml));
        assert_eq!(parse(r#"{"payload": "json"}"#).ok(), Some(PayloadFormat::Json));
        assert_eq!(parse(r#"{"payload": "raw"}"#).ok(), Some(PayloadFormat::Raw));
        assert_eq!(parse(r#"{"payload": "yaml"}"#).ok(), Some(PayloadFormat::Yaml));
        assert!(parse(r#"{"payload": "Yaml"}"#).is_err());
    }

    #[test]
    fn spacing_rule() {
        assert!(!due(255, 0, 256));
        assert!(due(256, 0, 256));
        assert!(!due(1000 + 255, 1000, 256));
        assert!(due(4096 + 1024, 4096, 256));
        assert!(!due(4096 + 1023, 4096, 256));
    }

    #[test]
    fn settled_yaml_holds_back_openers() {
        assert_eq!(settled_yaml("a: 1\nb:\n").0, "a: 1\n");
        assert_eq!(settled_yaml("a: 1\nb:\n  c:\n\n").0, "a: 1\n");
        assert_eq!(settled_yaml("a: 1\nl:\n  -\n").0, "a: 1\n");
        assert_eq!(settled_yaml("a: 1\nl:\n  - x\n").0, "a: 1\nl:\n  - x\n");
        assert_eq!(settled_yaml("u: 'x:'\n").0, "u: 'x:'\n");
        assert_eq!(settled_yaml("a: 1\n# note:\n").0, "a: 1\n# note:\n");
        assert_eq!(settled_yaml("k:\n"), ("", 3));
    }

    #[test]
    fn yaml_snapshots_grow_and_dedup() {
        let mut snapshotter = Snapshotter::new(PayloadFormat::Yaml).with_min_growth(1);
        let text = "Sure:\n```yaml\ncitations:\n  - title: A\n    year: 2020\n  - title: B\n```\nbye\n";
        let snapshots = stream(&mut snapshotter, text, 3);
        assert_eq!(
            snapshots,
            vec![
                json!({"citations": [{"title": "A"}]}),
                json!({"citations": [{"title": "A", "year": 2020}]}),
                json!({"citations": [{"title": "A", "year": 2020}, {"title": "B"}]}),
            ]
        );
        for pair in snapshots.windows(2) {
            assert_ne!(pair[0], pair[1], "consecutive snapshots differ");
        }
        assert_eq!(
            snapshotter.complete(text),
            Ok(json!({"citations": [{"title": "A", "year": 2020}, {"title": "B"}]}))
        );
    }

    #[test]
    fn yaml_waits_for_newline_and_growth() {
        let mut snapshotter = Snapshotter::new(PayloadFormat::Yaml);
        assert_eq!(snapshotter.push("a: 1"), None, "no newline, no attempt");
        let mut got = Vec::new();
        for i in 0..40 {
            got.extend(snapshotter.push(&format!("\nkey_{i:04}: some value here")));
        }
        // Lines of 26 bytes, each completed by the next push: attempts once 256 bytes of
        // complete lines have arrived, then every 256 bytes (25 % is less up to 1 KiB): at 265,
        // 525 and 785 bytes; the last 234 bytes are not enough for another.
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0].as_object().map(|m| m.len()), Some(11));
        assert!(snapshotter.parsed_bytes() < 8 * snapshotter.received_bytes());
    }

    #[test]
    fn yaml_snapshot_uses_repair_and_skips_unparsable() {
        let mut snapshotter = Snapshotter::new(PayloadFormat::Yaml).with_min_growth(1);
        assert_eq!(snapshotter.push("m:\n\ta: 1\n"), Some(json!({"m": {"a": 1}})));
        assert_eq!(snapshotter.push("\tb: [1,\n"), None, "unclosed flow: no snapshot");
        assert_eq!(
            snapshotter.push("\t  2]\n\tc: a long enough value\n"),
            Some(json!({"m": {"a": 1, "b": [1, 2], "c": "a long enough value"}}))
        );
    }

    #[test]
    fn json_snapshots_dedup_and_complete() {
        let mut snapshotter = Snapshotter::new(PayloadFormat::Json).with_min_growth(1);
        let text = "```json\n{\"a\": 1, \"b\": \"xy\", \"c\": [true]}\n```";
        let snapshots = stream(&mut snapshotter, text, 4);
        assert!(!snapshots.is_empty());
        for pair in snapshots.windows(2) {
            assert_ne!(pair[0], pair[1], "consecutive snapshots differ");
        }
        assert_eq!(snapshots.last(), Some(&json!({"a": 1, "b": "xy", "c": [true]})));
        assert_eq!(snapshotter.complete(text), Ok(json!({"a": 1, "b": "xy", "c": [true]})));
        // Whitespace after the value changes nothing.
        assert_eq!(snapshotter.push("\n\n"), None);
    }

    #[test]
    fn unchanged_values_are_not_repeated() {
        let mut yaml = Snapshotter::new(PayloadFormat::Yaml).with_min_growth(1);
        assert_eq!(yaml.push("a: 1\n"), Some(json!({"a": 1})));
        let before = yaml.parsed_bytes();
        for _ in 0..8 {
            assert_eq!(yaml.push("# a comment line that changes nothing\n"), None);
        }
        assert!(yaml.parsed_bytes() > before, "attempts ran, their equal values were dropped");
        // Enough new bytes for the 25 % spacing.
        let more = format!("b: 2\n#{}\n", "-".repeat(100));
        assert_eq!(yaml.push(&more), Some(json!({"a": 1, "b": 2})));

        // A duplicate key with the same value is a visible change to the parser, not to us.
        let mut json = Snapshotter::new(PayloadFormat::Json).with_min_growth(1);
        assert_eq!(json.push("{\"a\": 1, "), Some(json!({"a": 1})));
        assert_eq!(json.push("\"a\": 1, "), None);
        assert_eq!(json.push("\"b\": 2}"), Some(json!({"a": 1, "b": 2})));
    }

    #[test]
    fn raw_has_no_snapshots_and_completes_as_string() {
        let mut snapshotter = Snapshotter::new(PayloadFormat::Raw).with_min_growth(1);
        assert_eq!(snapshotter.push("a: 1\n"), None);
        assert_eq!(snapshotter.complete("```\nx\n```"), Ok(json!("```\nx\n```")));
        assert_eq!(snapshotter.parsed_bytes(), 0);
    }

    #[test]
    fn complete_ignores_snapshot_state() {
        let text = "a: 1\nb:\n  - x\n";
        let mut streamed = Snapshotter::new(PayloadFormat::Yaml).with_min_growth(1);
        stream(&mut streamed, text, 1);
        let fresh = Snapshotter::new(PayloadFormat::Yaml);
        assert_eq!(streamed.complete(text), fresh.complete(text));
    }

    /// About `size` bytes of YAML: a list of small records.
    fn big_yaml(size: usize) -> String {
        let mut text = String::from("```yaml\nitems:\n");
        let mut i = 0;
        while text.len() < size - 8 {
            text.push_str(&format!("  - name: item {i}\n    value: {i}\n    tags: [a, b]\n    note: \"q: {i}\"\n"));
            i += 1;
        }
        text.push_str("```\n");
        text
    }

    /// About `size` bytes of JSON: an array of small records under a key.
    fn big_json(size: usize) -> String {
        let mut text = String::from("```json\n{\"items\": [");
        let mut i = 0;
        while text.len() < size - 16 {
            if i > 0 {
                text.push_str(",\n");
            }
            text.push_str(&format!(
                "{{\"name\": \"item {i}\", \"value\": {i}, \"tags\": [\"a\", \"b\"], \"ok\": true}}"
            ));
            i += 1;
        }
        text.push_str("]}\n```\n");
        text
    }

    #[test]
    fn one_mib_yaml_in_16_byte_deltas_stays_under_8x() {
        let text = big_yaml(1 << 20);
        let mut snapshotter = Snapshotter::new(PayloadFormat::Yaml);
        let snapshots = stream(&mut snapshotter, &text, 16);
        let ratio = snapshotter.parsed_bytes() as f64 / text.len() as f64;
        assert!(ratio < 8.0, "parsed {ratio:.2}× the payload");
        assert!(snapshots.len() >= 10, "{} snapshots", snapshots.len());
        assert_eq!(snapshotter.received_bytes(), text.len());
    }

    #[test]
    fn one_mib_json_in_16_byte_deltas_stays_under_8x() {
        let text = big_json(1 << 20);
        let mut snapshotter = Snapshotter::new(PayloadFormat::Json);
        let snapshots = stream(&mut snapshotter, &text, 16);
        let ratio = snapshotter.parsed_bytes() as f64 / text.len() as f64;
        assert!(ratio < 8.0, "parsed {ratio:.2}× the payload");
        assert!(snapshots.len() >= 10, "{} snapshots", snapshots.len());
        let complete = snapshotter.complete(&text).expect("valid JSON");
        let total = complete["items"].as_array().map_or(0, Vec::len);
        let last = snapshots.last().expect("snapshots");
        let shown = last["items"].as_array().map_or(0, Vec::len);
        assert!(shown > total / 2 && shown <= total, "{shown} of {total} items");
    }

    #[test]
    fn adversarial_yaml_stays_under_8x() {
        // Every line needs the repair and the document never parses (unclosed flow sequence
        // first), so each attempt would cost three passes without the budget.
        let mut text = String::from("a: [\n");
        while text.len() < 256 * 1024 {
            text.push_str("\tkey:value\n");
        }
        let mut snapshotter = Snapshotter::new(PayloadFormat::Yaml).with_min_growth(1);
        let snapshots = stream(&mut snapshotter, &text, 16);
        assert!(snapshots.is_empty());
        assert!(snapshotter.parsed_bytes() < 8 * text.len());
    }

    #[test]
    fn a_smaller_budget_skips_and_counts_attempts() {
        let mut text = String::from("a: [\n");
        while text.len() < 64 * 1024 {
            text.push_str("\tkey:value\n");
        }
        let mut generous = Snapshotter::new(PayloadFormat::Yaml).with_min_growth(1);
        stream(&mut generous, &text, 16);
        let mut tight = Snapshotter::new(PayloadFormat::Yaml).with_min_growth(1).with_budget(2);
        stream(&mut tight, &text, 16);
        assert!(tight.parsed_bytes() <= 2 * text.len(), "{} > 2 × {}", tight.parsed_bytes(), text.len());
        assert!(
            tight.budget_skips() > generous.budget_skips(),
            "{} vs {}",
            tight.budget_skips(),
            generous.budget_skips()
        );

        // A budget of 0 turns snapshots off: every due attempt is skipped and counted.
        let mut off = Snapshotter::new(PayloadFormat::Json).with_budget(0);
        let value = big_json(4096);
        assert!(stream(&mut off, &value, 16).is_empty());
        assert!(off.budget_skips() > 0);
        assert!(off.complete(&value).is_ok(), "the final value never depends on the budget");
    }
}
