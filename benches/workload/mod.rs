//! The synthetic agent workload both benches run (`pipeline` offline, `e2e` through NATS):
//! geppetto events in the legacy (`partial`/`final`, 3 streams in 4) and canonical
//! (`text-delta`/`text-segment-finished`, 1 in 4) vocabularies, encoded the way Go's
//! `encoding/json` writes them (`<` as `\u003c`), with full `meta`, optional cumulative
//! `completion`/`text` fields, and about 4-character deltas of text that mixes prose, a
//! `<thinking>` section, a YAML mode-switch block, a tool call and a YAML citations block.
//! Deterministic: the same run and stream index give the same events.

/// A small deterministic generator (SplitMix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

pub const WORDS: &[&str] = &[
    "the",
    "model",
    "streams",
    "tokens",
    "while",
    "users",
    "read",
    "answers,",
    "quickly.",
    "and",
    "a",
    "service",
    "filters",
    "blocks",
    "from",
    "text;",
    "each",
    "delta",
    "is",
    "small",
    "so",
    "latency",
    "matters",
    "—",
    "café",
    "x < y",
    "results",
    "show",
    "that",
    "NATS",
    "subjects",
    "carry",
    "events",
    "to",
    "subscribers.",
];

pub fn prose(rng: &mut Rng, len: usize) -> String {
    let mut out = String::with_capacity(len + 16);
    while out.len() < len {
        out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        out.push(if rng.below(12) == 0 { '\n' } else { ' ' });
    }
    out
}

pub const THINKING: &str = "<thinking>The user asks for a literature review; research mode fits better, \
and I should look up recent papers before answering.</thinking>\n";
pub const MODE_SWITCH: &str = "<pinocchio:agent_mode_switch:v1>\n```yaml\nmode_switch:\n  analysis: The user wants a \
literature review, so research mode fits.\n  new_mode: research\n```\n</pinocchio:agent_mode_switch:v1>\n";
pub const TOOL_CALL: &str = "<tool>{\"tool_name\":\"search\",\"server_name\":\"web\",\"arguments\":{\"query\":\"nats \
jetstream ack latency < 1ms\",\"limit\":5}}</tool>\n";
pub const CITATIONS: &str = "<geppetto:citations:v1>\n```yaml\ncitations:\n  - title: Attention Is All You Need\n    \
authors: [Vaswani, Shazeer, Parmar]\n    year: 2017\n    url: https://arxiv.org/abs/1706.03762\n  - title: \
Streaming LLM Output\n    authors: [Doe]\n```\n</geppetto:citations:v1>\n";

/// One response of about `target` bytes: prose with thinking, a YAML block, a tool call and
/// citations mixed in, ending in prose.
pub fn response(rng: &mut Rng, target: usize) -> String {
    let specials = [THINKING, MODE_SWITCH, TOOL_CALL, CITATIONS];
    let mut out = String::with_capacity(target + 512);
    let mut k = rng.below(4) as usize;
    while out.len() < target {
        let len = 40 + rng.below(160) as usize;
        out.push_str(&prose(rng, len));
        if out.len() < target {
            out.push_str(specials[k % specials.len()]);
            k += 1;
        }
    }
    out.push_str(&prose(rng, 20));
    out
}

/// Deltas of 2 to 6 bytes (4 on average), cut at character boundaries.
pub fn deltas(rng: &mut Rng, text: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + 2 + rng.below(5) as usize).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(text[start..end].to_owned());
        start = end;
    }
    out
}

/// A JSON string as Go's `encoding/json` writes it (`<`, `>`, `&` escaped).
pub fn go_json(s: &str) -> String {
    serde_json::to_string(s)
        .expect("a string serializes")
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
}

/// The message id of stream `index` in run `run` (a UUID whose last group is the index).
pub fn message_id(run: u32, index: usize) -> String {
    format!("{run:08x}-5b7d-4e8a-9b10-{index:012x}")
}

pub fn legacy_meta(mid: &str, index: usize) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","message_id":"{mid}","session_id":"sess-{index}","inference_id":"inf-{index}","turn_id":"turn-1"}}"#
    )
}

/// One stream's events as JSON payloads; `cumulative` adds `completion`/`text` to every delta.
/// Returns the stream key the service will use (as in `Nats-Msg-Id`) and the events.
pub fn stream_events(run: u32, index: usize, events: usize, cumulative: bool) -> (String, Vec<Vec<u8>>) {
    let mut rng = Rng(0x5eed ^ (u64::from(run) << 32) ^ index as u64);
    let text = response(&mut rng, events.saturating_sub(1).max(1) * 4);
    let pieces = deltas(&mut rng, &text);
    let mid = message_id(run, index);
    let canonical = index % 4 == 3;
    let segment = format!("openai:run-{index}:provider-call:0:msg_{index:x}:0:text");
    let key = if canonical { format!("{mid}/{segment}") } else { mid.clone() };
    let meta = legacy_meta(&mid, index);
    let correlation = format!(
        r#"{{"session_id":"sess-{index}","run_id":"run-{index}","turn_id":"turn-1","provider_call_id":"openai:run-{index}:provider-call:0","segment_id":"{segment}"}}"#
    );
    let mut out = Vec::with_capacity(pieces.len() + 1);
    let mut so_far = String::with_capacity(text.len());
    for (n, piece) in pieces.iter().enumerate() {
        so_far.push_str(piece);
        let json = match (canonical, cumulative) {
            (false, true) => format!(
                r#"{{"type":"partial","meta":{meta},"delta":{},"completion":{}}}"#,
                go_json(piece),
                go_json(&so_far)
            ),
            (false, false) => format!(r#"{{"type":"partial","meta":{meta},"delta":{}}}"#, go_json(piece)),
            (true, true) => format!(
                r#"{{"type":"text-delta","meta":{{"message_id":"{mid}","session_id":"sess-{index}"}},"correlation":{correlation},"delta":{},"text":{},"sequence":{}}}"#,
                go_json(piece),
                go_json(&so_far),
                n + 1
            ),
            (true, false) => format!(
                r#"{{"type":"text-delta","meta":{{"message_id":"{mid}","session_id":"sess-{index}"}},"correlation":{correlation},"delta":{},"sequence":{}}}"#,
                go_json(piece),
                n + 1
            ),
        };
        out.push(json.into_bytes());
    }
    let last = if canonical {
        format!(
            r#"{{"type":"text-segment-finished","meta":{{"message_id":"{mid}","session_id":"sess-{index}"}},"correlation":{correlation},"text":{},"finish_reason":"stop"}}"#,
            go_json(&text)
        )
    } else {
        format!(
            r#"{{"type":"final","meta":{{"model":"gpt-4o-mini","stop_reason":"stop","usage":{{"input_tokens":120,"output_tokens":{}}},"duration_ms":1834,"message_id":"{mid}","session_id":"sess-{index}","inference_id":"inf-{index}","turn_id":"turn-1"}},"text":{}}}"#,
            pieces.len(),
            go_json(&text)
        )
    };
    out.push(last.into_bytes());
    (key, out)
}
