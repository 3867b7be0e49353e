//! Pipeline rules, one test per rule, and the chunking-invariance property.

use super::*;
use proptest::prelude::*;

use crate::properties::{merge, Rec, Recorder as Sink};

fn specs() -> Vec<TagSpec> {
    vec![
        TagSpec::new("core:x:v1", TagKind::Block),
        TagSpec { max_capture_bytes: Some(8), ..TagSpec::new("small:y:v1", TagKind::Block) },
        TagSpec::new("thinking", TagKind::Channel),
        TagSpec::new("tool", TagKind::ToolCall),
    ]
}

fn pipeline(limits: PipelineLimits) -> Pipeline {
    Pipeline::new(specs(), limits).unwrap()
}

/// Runs one stream: each chunk is one delta, then a final without text.
fn run_with(limits: PipelineLimits, chunks: &[&str]) -> Sink {
    let mut p = pipeline(limits);
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    for c in chunks {
        p.feed(&mut s, c, &mut sink);
    }
    p.finish(&mut s, None, "stop", &mut sink);
    sink
}

fn run(chunks: &[&str]) -> Vec<Rec> {
    run_with(PipelineLimits::default(), chunks).outs
}

fn t(s: &str) -> Rec {
    Rec::Text(s.into())
}
fn fin(delta: &str, text: &str) -> Rec {
    Rec::Final(delta.into(), Some(text.into()), "stop".into())
}

#[test]
fn text_is_released_in_the_same_event_byte_for_byte() {
    let mut p = pipeline(PipelineLimits::default());
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    p.feed(&mut s, "a <core:x:v1>x</core:x:v1> b", &mut sink);
    assert_eq!(
        sink.outs,
        vec![t("a "), Rec::Started(1), Rec::Delta(1, "x".into()), Rec::Completed(1, "x".into(), None), t(" b")]
    );
    p.finish(&mut s, None, "stop", &mut sink);
    assert_eq!(sink.outs.last(), Some(&fin("", "a  b")));
}

#[test]
fn seq_starts_at_one_and_counts_every_output() {
    let sink = run_with(PipelineLimits::default(), &["a<core:x:v1>", "q</core:x:v1>b"]);
    assert_eq!(sink.seqs, (1..=sink.seqs.len() as u64).collect::<Vec<_>>());
}

#[test]
fn adjacent_text_is_coalesced_and_empty_text_never_emitted() {
    assert_eq!(run(&["a < b <", "z"]), vec![t("a < b "), t("<z"), fin("", "a < b <z")]);
    assert_eq!(run(&["a <", "c"]), vec![t("a "), fin("<c", "a <c")], "`<c` may still become `<core:x:v1>`");
    assert_eq!(run(&["", "x", "", ""]), vec![t("x"), fin("", "x")]);
}

#[test]
fn order_inside_one_event_is_kept_with_several_blocks() {
    let out = run(&["p<core:x:v1>1</core:x:v1>q<core:x:v1>2</core:x:v1>r"]);
    assert_eq!(
        out,
        vec![
            t("p"),
            Rec::Started(1),
            Rec::Delta(1, "1".into()),
            Rec::Completed(1, "1".into(), None),
            t("q"),
            Rec::Started(2),
            Rec::Delta(2, "2".into()),
            Rec::Completed(2, "2".into(), None),
            t("r"),
            fin("", "pqr"),
        ]
    );
}

#[test]
fn empty_block_gets_started_and_completed() {
    assert_eq!(
        run(&["<core:x:v1></core:x:v1>"]),
        vec![Rec::Started(1), Rec::Completed(1, String::new(), None), fin("", "")]
    );
}

#[test]
fn unregistered_tags_consume_no_item_number() {
    let out = run(&["<other:y:v1>o</other:y:v1><core:x:v1>k</core:x:v1>"]);
    assert_eq!(out[0], t("<other:y:v1>o</other:y:v1>"));
    assert_eq!(out[1], Rec::Started(1));
}

#[test]
fn thinking_is_a_channel_never_visible() {
    assert_eq!(
        run(&["a<think", "ing>deep ", "thought</thinking>b"]),
        vec![
            t("a"),
            Rec::ThinkStart(1),
            Rec::Think(1, "deep ".into()),
            Rec::Think(1, "thought".into()),
            Rec::ThinkEnd(1, true),
            t("b"),
            fin("", "ab"),
        ]
    );
}

#[test]
fn tool_calls_parse_in_order_with_defaults_and_errors() {
    let out = run(&[
        r#"<tool>{"tool_name":"search","arguments":{"q":"</tool>"}}</tool>"#,
        r#"<tool>{"tool_name":"fetch","server_name":"web","arguments":{}}</tool><tool>not json</tool>"#,
    ]);
    assert_eq!(out[0], Rec::Tool(1, Ok(("search".into(), "local".into(), serde_json::json!({"q": "</tool>"})))));
    assert_eq!(out[1], Rec::Tool(2, Ok(("fetch".into(), "web".into(), serde_json::json!({})))));
    assert!(matches!(&out[2], Rec::Tool(3, Err(e)) if e.starts_with("invalid tool call JSON")), "{:?}", out[2]);
}

#[test]
fn unclosed_block_fails_and_drop_removes_its_text() {
    assert_eq!(
        run(&["a<core:x:v1>half"]),
        vec![
            t("a"),
            Rec::Started(1),
            Rec::Delta(1, "half".into()),
            Rec::Completed(1, "half".into(), Some("missing close tag </core:x:v1>".into())),
            fin("", "a"),
        ]
    );
}

#[test]
fn unclosed_block_restore_puts_text_back() {
    let limits = PipelineLimits { malformed: MalformedPolicy::Restore, ..PipelineLimits::default() };
    let out = merge(run_with(limits, &["a<core:x:v1>half</core:x"]).outs);
    assert_eq!(
        out,
        vec![
            t("a"),
            Rec::Started(1),
            Rec::Delta(1, "half</core:x".into()),
            Rec::Completed(1, "half</core:x".into(), Some("missing close tag </core:x:v1>".into())),
            fin("<core:x:v1>half</core:x", "a<core:x:v1>half</core:x"),
        ]
    );
}

#[test]
fn unclosed_thinking_ends_unclosed_and_tool_fails() {
    let out = run(&["<thinking>hm"]);
    assert_eq!(out[2], Rec::ThinkEnd(1, false));
    let out = run(&[r#"<tool>{"tool_name":"x"}"#]);
    assert_eq!(out[0], Rec::Tool(1, Err("missing close tag </tool>".into())));
}

#[test]
fn capture_limit_fails_the_block_and_the_stream_continues() {
    let mut p = pipeline(PipelineLimits::default());
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    p.feed(&mut s, "<small:y:v1>12345", &mut sink);
    p.feed(&mut s, "6789abc</small:y:v1>after<core:x:v1>ok</core:x:v1>", &mut sink);
    p.finish(&mut s, None, "stop", &mut sink);
    assert_eq!(
        sink.outs,
        vec![
            Rec::Started(1),
            Rec::Delta(1, "12345".into()),
            Rec::Delta(1, "678".into()),
            Rec::Completed(1, "12345678".into(), Some("payload exceeds 8 bytes".into())),
            t("after"),
            Rec::Started(2),
            Rec::Delta(2, "ok".into()),
            Rec::Completed(2, "ok".into(), None),
            fin("", "after"),
        ]
    );
    assert_eq!(p.stats().capture_overflows, 1);
    assert!(s.heap_bytes() < 1024);
}

#[test]
fn capture_limit_never_splits_a_character() {
    let out = run(&["<small:y:v1>1234567é</small:y:v1>"]);
    assert_eq!(out[2], Rec::Completed(1, "1234567".into(), Some("payload exceeds 8 bytes".into())));
}

#[test]
fn final_only_stream_filters_the_whole_text() {
    let mut p = pipeline(PipelineLimits::default());
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    p.finish(&mut s, Some("hi <core:x:v1>k</core:x:v1> there"), "stop", &mut sink);
    assert_eq!(
        sink.outs,
        vec![
            t("hi "),
            Rec::Started(1),
            Rec::Delta(1, "k".into()),
            Rec::Completed(1, "k".into(), None),
            fin(" there", "hi  there"),
        ]
    );
}

#[test]
fn final_text_extending_the_deltas_supplies_only_the_tail() {
    let mut p = pipeline(PipelineLimits::default());
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    p.feed(&mut s, "Hello <core:x", &mut sink);
    let report = p.finish(&mut s, Some("Hello <core:x:v1>v</core:x:v1> world"), "stop", &mut sink);
    assert!(!report.diverged);
    assert_eq!(sink.outs.last(), Some(&fin(" world", "Hello  world")));
}

#[test]
fn diverging_final_text_loses_to_the_deltas() {
    let mut p = pipeline(PipelineLimits::default());
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    p.feed(&mut s, "Hello wor", &mut sink);
    let report = p.finish(&mut s, Some("Goodbye world"), "stop", &mut sink);
    assert!(report.diverged);
    assert_eq!(p.stats().diverged_finals, 1);
    assert_eq!(sink.outs, vec![t("Hello wor"), fin("", "Hello wor")]);
}

#[test]
fn held_prefix_is_released_in_the_final_delta() {
    assert_eq!(run(&["x <core:x:v"]), vec![t("x "), fin("<core:x:v", "x <core:x:v")]);
}

#[test]
fn the_error_text_reaches_the_final_cut_to_whole_characters() {
    let long = format!("{}é", "e".repeat(MAX_ERROR_BYTES - 1));
    for (error, expected) in [
        (None, None),
        (Some(""), Some("")),
        (Some("upstream <failed>"), Some("upstream <failed>")),
        // The two-byte character would end one byte past the bound: it is left out whole.
        (Some(long.as_str()), Some(&long[..MAX_ERROR_BYTES - 1])),
    ] {
        let mut p = pipeline(PipelineLimits::default());
        let mut s = StreamState::new();
        p.feed(&mut s, "a", &mut |_: Output<'_>| {});
        let mut finishes = Vec::new();
        p.finish(&mut s, None, Ending { reason: "error", error }, &mut |o: Output<'_>| {
            if let OutputKind::Text { finish: Some(finish), .. } = o.kind {
                finishes.push((finish.reason.to_owned(), finish.error.map(str::to_owned)));
            }
        });
        assert_eq!(finishes, [("error".to_owned(), expected.map(str::to_owned))]);
        let cut = error.is_some_and(|e| e.len() > MAX_ERROR_BYTES);
        assert_eq!(p.stats().error_texts_cut, u64::from(cut), "the cut is counted");
    }
}

#[test]
fn two_interleaved_streams_do_not_mix() {
    let mut p = pipeline(PipelineLimits::default());
    let (mut a, mut b) = (StreamState::new(), StreamState::new());
    let (mut sa, mut sb) = (Sink::default(), Sink::default());
    p.feed(&mut a, "A1 <core:x", &mut sa);
    p.feed(&mut b, "B1 <thin", &mut sb);
    p.feed(&mut a, ":v1>pa</core:x:v1>A2", &mut sa);
    p.feed(&mut b, "king>tb</thinking>B2", &mut sb);
    p.finish(&mut a, None, "stop", &mut sa);
    p.finish(&mut b, None, "stop", &mut sb);
    assert_eq!(sa.outs.last(), Some(&fin("", "A1 A2")));
    assert_eq!(sb.outs.last(), Some(&fin("", "B1 B2")));
    assert!(sa.outs.contains(&Rec::Completed(1, "pa".into(), None)));
    assert!(sb.outs.contains(&Rec::Think(1, "tb".into())));
}

#[test]
fn utf8_split_inside_multibyte_characters() {
    let input = "é <core:x:v1>€😀</core:x:v1> 日本";
    let bytes = input.as_bytes();
    let whole = run(&[input]);
    for cut in 0..=bytes.len() {
        let mut p = pipeline(PipelineLimits::default());
        let mut s = StreamState::new();
        let mut sink = Sink::default();
        p.feed_bytes(&mut s, &bytes[..cut], &mut sink);
        assert!(s.held_len() <= 3 + p.tag_set().max_open_len());
        p.feed_bytes(&mut s, &bytes[cut..], &mut sink);
        p.finish(&mut s, None, "stop", &mut sink);
        assert_eq!(merge(sink.outs), merge(whole.clone()), "cut at byte {cut}");
    }
    // One byte at a time too.
    let mut p = pipeline(PipelineLimits::default());
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    for b in bytes {
        p.feed_bytes(&mut s, std::slice::from_ref(b), &mut sink);
    }
    p.finish(&mut s, None, "stop", &mut sink);
    assert_eq!(merge(sink.outs), merge(whole));
}

#[test]
fn invalid_and_truncated_utf8_become_replacement_characters() {
    let mut p = pipeline(PipelineLimits::default());
    let mut s = StreamState::new();
    let mut sink = Sink::default();
    p.feed_bytes(&mut s, b"a\xffb\xe2\x82", &mut sink);
    p.finish(&mut s, None, "stop", &mut sink);
    assert_eq!(sink.outs, vec![t("a\u{FFFD}b"), fin("\u{FFFD}", "a\u{FFFD}b\u{FFFD}")]);
}

#[test]
fn unescape_decodes_before_scanning_across_chunks() {
    let limits = PipelineLimits { unescape_text: true, ..PipelineLimits::default() };
    let out = run_with(limits, &["line\\", "n\\u003ccore:x:v1\\u003e", "a\\\\nb\\u003c/core:x:v1>", "end\\"]).outs;
    assert_eq!(
        merge(out),
        vec![
            t("line\n"),
            Rec::Started(1),
            Rec::Delta(1, "a\\nb".into()),
            Rec::Completed(1, "a\\nb".into(), None),
            fin("end\\", "line\nend\\"),
        ]
    );
}

#[test]
fn cumulative_text_policies() {
    let every = PipelineLimits { cumulative_text: CumulativeText::Every, ..PipelineLimits::default() };
    let mut p = pipeline(every);
    let mut s = StreamState::new();
    let mut texts = Vec::new();
    let mut sink = |o: Output<'_>| {
        if let OutputKind::Text { text, .. } = o.kind {
            texts.push(text.map(str::to_owned));
        }
    };
    p.feed(&mut s, "ab", &mut sink);
    p.feed(&mut s, "cd", &mut sink);
    p.finish(&mut s, None, "stop", &mut sink);
    assert_eq!(texts, vec![Some("ab".into()), Some("abcd".into()), Some("abcd".into())]);

    let never = PipelineLimits { cumulative_text: CumulativeText::Never, ..PipelineLimits::default() };
    assert_eq!(run_with(never, &["ab"]).outs.last(), Some(&Rec::Final(String::new(), None, "stop".into())));

    let small = PipelineLimits { max_text_bytes: 3, ..PipelineLimits::default() };
    let mut p = pipeline(small);
    let mut s = StreamState::new();
    let mut omitted = None;
    p.feed(&mut s, "abcd", &mut |_: Output<'_>| {});
    p.finish(&mut s, None, "stop", &mut |o: Output<'_>| {
        if let OutputKind::Text { text, finish: Some(f), .. } = o.kind {
            omitted = Some((text.is_none(), f.text_omitted));
        }
    });
    assert_eq!(omitted, Some((true, true)));
    assert_eq!(p.stats().text_overflows, 1);
}

#[test]
fn block_names_must_be_triples() {
    let bad = vec![TagSpec::new("core:x", TagKind::Block)];
    assert!(matches!(Pipeline::new(bad, PipelineLimits::default()), Err(TagSpecError::NotATriple(_))));
    let bad = vec![TagSpec::new("a:b:c", TagKind::Channel)];
    assert!(matches!(Pipeline::new(bad, PipelineLimits::default()), Err(TagSpecError::ColonOutsideBlock(_))));
}

#[test]
fn stream_state_stays_small() {
    let size = std::mem::size_of::<StreamState>();
    assert!(size < 256, "StreamState is {size} bytes");
    let mut p = pipeline(PipelineLimits { cumulative_text: CumulativeText::Never, ..PipelineLimits::default() });
    let mut s = StreamState::new();
    for _ in 0..1000 {
        p.feed(&mut s, "some prose < with a stray sign ", &mut |_: Output<'_>| {});
    }
    p.feed(&mut s, "<core:x:", &mut |_: Output<'_>| {});
    assert!(size + s.heap_bytes() < 1024, "{} heap bytes", s.heap_bytes());
}

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,6}",
        Just("<".to_owned()),
        Just("<<".to_owned()),
        Just(">".to_owned()),
        Just("é€😀".to_owned()),
        Just("<core:x:v1>".to_owned()),
        Just("</core:x:v1>".to_owned()),
        Just("</core:x:v1!>".to_owned()),
        Just("<core:x:v".to_owned()),
        Just("<small:y:v1>".to_owned()),
        Just("</small:y:v1>".to_owned()),
        Just("<thinking>".to_owned()),
        Just("</thinking>".to_owned()),
        Just("<tool>".to_owned()),
        Just("</tool>".to_owned()),
        Just(r#"{"tool_name":"t","arguments":{"a":"</tool>"}}"#.to_owned()),
        Just("\"".to_owned()),
        Just("\\".to_owned()),
        Just("<other:y:v1>".to_owned()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any chunking of any input gives the same visible text, thinking, payloads and outcomes as
    /// a single-chunk run, and never holds more than one tag's worth of bytes.
    #[test]
    fn chunking_invariance(pieces in prop::collection::vec(piece(), 0..24), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12), restore in any::<bool>(), as_bytes in any::<bool>()) {
        let input: String = pieces.concat();
        let limits = PipelineLimits {
            malformed: if restore { MalformedPolicy::Restore } else { MalformedPolicy::Drop },
            ..PipelineLimits::default()
        };
        let whole = run_with(limits.clone(), &[&input]).outs;

        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(input.len() + 1)).collect();
        if !as_bytes {
            // `feed` takes whole characters; `feed_bytes` takes any cut.
            for p in &mut points {
                while !input.is_char_boundary(*p) {
                    *p -= 1;
                }
            }
        }
        points.push(input.len());
        points.sort_unstable();
        let mut p = pipeline(limits);
        let mut s = StreamState::new();
        let mut sink = Sink::default();
        let mut last = 0;
        for &cut in &points {
            if as_bytes {
                p.feed_bytes(&mut s, &input.as_bytes()[last..cut], &mut sink);
            } else {
                p.feed(&mut s, &input[last..cut], &mut sink);
            }
            prop_assert!(s.held_len() <= 3 + p.tag_set().max_open_len());
            last = cut;
        }
        p.finish(&mut s, None, "stop", &mut sink);
        prop_assert_eq!(merge(sink.outs), merge(whole));
    }
}

#[test]
fn a_snapshot_budget_of_zero_turns_snapshots_off() {
    let tags = vec![TagSpec { payload: PayloadFormat::Json, ..TagSpec::new("j:x:v1", TagKind::Block) }];
    let items: Vec<String> = (0..300).map(|i| i.to_string()).collect();
    let body = format!(r#"{{"items":[{}]}}"#, items.join(","));
    for (budget, snapshotted) in [(PipelineLimits::default().snapshot_budget, true), (0, false)] {
        let mut p =
            Pipeline::new(tags.clone(), PipelineLimits { snapshot_budget: budget, ..Default::default() }).unwrap();
        let (mut s, mut sink) = (StreamState::new(), Sink::default());
        p.feed(&mut s, "<j:x:v1>", &mut sink);
        for chunk in body.as_bytes().chunks(16) {
            p.feed(&mut s, std::str::from_utf8(chunk).unwrap(), &mut sink);
        }
        p.feed(&mut s, "</j:x:v1>", &mut sink);
        p.finish(&mut s, None, "stop", &mut sink);
        let snapshots = sink.outs.iter().filter(|r| matches!(r, Rec::Snapshot(..))).count();
        assert_eq!(snapshots > 0, snapshotted, "budget {budget}: {snapshots} snapshots");
        assert_eq!(p.stats().snapshot_budget_skips, 0, "budget {budget}: nothing counted as skipped");
    }
}
