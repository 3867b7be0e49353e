//! Table tests per scanner state, and every split position of the interesting strings.

use super::*;

/// What the scanner reported, with adjacent text and adjacent payload merged.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    Text(String),
    Open(u16),
    Payload(u16, String),
    Close(u16),
    Unclosed(u16),
}

#[derive(Default)]
struct Rec(Vec<Ev>);

impl ScanSink for Rec {
    fn text(&mut self, text: &str) {
        assert!(!text.is_empty(), "empty text reported");
        match self.0.last_mut() {
            Some(Ev::Text(t)) => t.push_str(text),
            _ => self.0.push(Ev::Text(text.to_owned())),
        }
    }
    fn open(&mut self, tag: TagId) {
        self.0.push(Ev::Open(tag.0));
    }
    fn payload(&mut self, tag: TagId, raw: &str) {
        assert!(!raw.is_empty(), "empty payload reported");
        match self.0.last_mut() {
            Some(Ev::Payload(t, p)) if *t == tag.0 => p.push_str(raw),
            _ => self.0.push(Ev::Payload(tag.0, raw.to_owned())),
        }
    }
    fn close(&mut self, tag: TagId) {
        self.0.push(Ev::Close(tag.0));
    }
    fn unclosed(&mut self, tag: TagId) {
        self.0.push(Ev::Unclosed(tag.0));
    }
}

fn tags() -> TagSet {
    TagSet::new([
        ("core:x:v1", CloseRule::Exact),
        ("thinking", CloseRule::Exact),
        ("think", CloseRule::Exact),
        ("tool", CloseRule::OutsideJsonStrings),
    ])
    .unwrap()
}

fn scan(chunks: &[&str]) -> Vec<Ev> {
    let tags = tags();
    let mut scanner = TagScanner::new();
    let mut rec = Rec::default();
    for c in chunks {
        scanner.feed(&tags, c, &mut rec);
        assert!(scanner.held_len() <= tags.max_open_len(), "held {} bytes", scanner.held_len());
    }
    scanner.finish(&tags, &mut rec);
    rec.0
}

/// Scans `input` whole and at every split into two and three pieces; all must agree.
fn scan_all_splits(input: &str) -> Vec<Ev> {
    let whole = scan(&[input]);
    let cuts: Vec<usize> = (0..=input.len()).filter(|&i| input.is_char_boundary(i)).collect();
    for &a in &cuts {
        assert_eq!(scan(&[&input[..a], &input[a..]]), whole, "split at {a} of {input:?}");
        for &b in cuts.iter().filter(|&&b| b > a) {
            assert_eq!(scan(&[&input[..a], &input[a..b], &input[b..]]), whole, "splits {a},{b} of {input:?}");
        }
    }
    whole
}

fn text(s: &str) -> Ev {
    Ev::Text(s.to_owned())
}
fn payload(t: u16, s: &str) -> Ev {
    Ev::Payload(t, s.to_owned())
}

#[test]
fn plain_text_passes_through_whole() {
    assert_eq!(scan_all_splits("hello, world"), vec![text("hello, world")]);
    assert_eq!(scan(&[]), vec![]);
    assert_eq!(scan(&["", "", ""]), vec![]);
}

#[test]
fn block_is_captured_at_every_split() {
    assert_eq!(
        scan_all_splits("a <core:x:v1>x: 1</core:x:v1> b"),
        vec![text("a "), Ev::Open(0), payload(0, "x: 1"), Ev::Close(0), text(" b")]
    );
}

#[test]
fn stray_less_than_signs_are_text() {
    for s in ["a < b", "<b>bold</b>", "<user@example.com>", "x<3", "<", "a<", "<<", "<thinkin", "<core:x:v2>"] {
        assert_eq!(scan_all_splits(s), vec![text(s)], "{s:?}");
    }
}

#[test]
fn a_stray_lt_does_not_hold_back_what_follows() {
    let tags = tags();
    let mut scanner = TagScanner::new();
    let mut rec = Rec::default();
    scanner.feed(&tags, "x < y and more", &mut rec);
    assert_eq!(rec.0, vec![text("x < y and more")]);
    assert_eq!(scanner.held_len(), 0);
    scanner.feed(&tags, " then <co", &mut rec);
    assert_eq!(scanner.held_len(), 3, "only the possible tag prefix is held");
    scanner.feed(&tags, "de>", &mut rec);
    assert_eq!(scanner.held_len(), 0);
    assert_eq!(rec.0, vec![text("x < y and more then <code>")]);
}

#[test]
fn unregistered_well_formed_tags_pass_through() {
    assert_eq!(scan_all_splits("<other:y:v1>keep</other:y:v1>"), vec![text("<other:y:v1>keep</other:y:v1>")]);
}

#[test]
fn double_lt_and_lt_inside_word_still_capture() {
    assert_eq!(
        scan_all_splits("<<core:x:v1>p</core:x:v1>"),
        vec![text("<"), Ev::Open(0), payload(0, "p"), Ev::Close(0)]
    );
    assert_eq!(
        scan_all_splits("a<b<core:x:v1>p</core:x:v1>c"),
        vec![text("a<b"), Ev::Open(0), payload(0, "p"), Ev::Close(0), text("c")]
    );
}

#[test]
fn first_exact_close_ends_the_block_and_near_misses_are_payload() {
    assert_eq!(
        scan_all_splits("<core:x:v1>abc</core:x:v1>>rest"),
        vec![Ev::Open(0), payload(0, "abc"), Ev::Close(0), text(">rest")]
    );
    assert_eq!(
        scan_all_splits("<core:x:v1>a</core:x:v1!>b</Core:x:v1>c</core:x:v1"),
        vec![Ev::Open(0), payload(0, "a</core:x:v1!>b</Core:x:v1>c</core:x:v1"), Ev::Unclosed(0)]
    );
    assert_eq!(scan_all_splits("<core:x:v1></</core:x:v1>"), vec![Ev::Open(0), payload(0, "</"), Ev::Close(0)]);
}

#[test]
fn no_nesting_inside_a_block() {
    assert_eq!(
        scan_all_splits("<core:x:v1><thinking>t</thinking></core:x:v1>"),
        vec![Ev::Open(0), payload(0, "<thinking>t</thinking>"), Ev::Close(0)]
    );
}

#[test]
fn empty_and_back_to_back_blocks() {
    assert_eq!(scan_all_splits("<core:x:v1></core:x:v1>"), vec![Ev::Open(0), Ev::Close(0)]);
    assert_eq!(
        scan_all_splits("<core:x:v1>a</core:x:v1><core:x:v1>b</core:x:v1>"),
        vec![Ev::Open(0), payload(0, "a"), Ev::Close(0), Ev::Open(0), payload(0, "b"), Ev::Close(0)]
    );
}

#[test]
fn tags_sharing_a_prefix_are_told_apart() {
    assert_eq!(scan_all_splits("<think>a</think>"), vec![Ev::Open(2), payload(2, "a"), Ev::Close(2)]);
    assert_eq!(scan_all_splits("<thinking>a</thinking>"), vec![Ev::Open(1), payload(1, "a"), Ev::Close(1)]);
    // The close of `think` inside `thinking` is payload.
    assert_eq!(
        scan_all_splits("<thinking>a</think>b</thinking>"),
        vec![Ev::Open(1), payload(1, "a</think>b"), Ev::Close(1)]
    );
}

#[test]
fn tool_close_inside_json_string_is_payload() {
    let input = r#"<tool>{"a": "x</tool>y", "b": "q\"</tool>"}</tool>after"#;
    assert_eq!(
        scan_all_splits(input),
        vec![Ev::Open(3), payload(3, r#"{"a": "x</tool>y", "b": "q\"</tool>"}"#), Ev::Close(3), text("after")]
    );
    // An escaped backslash ends the escape: the quote after it closes the string.
    let input = r#"<tool>{"a": "\\"}</tool>z"#;
    assert_eq!(scan_all_splits(input), vec![Ev::Open(3), payload(3, r#"{"a": "\\"}"#), Ev::Close(3), text("z")]);
}

#[test]
fn end_of_stream_releases_held_bytes() {
    assert_eq!(scan(&["text <core:x"]), vec![text("text <core:x")]);
    assert_eq!(scan(&["<"]), vec![text("<")]);
    assert_eq!(scan(&["<core:x:v1>abc</core:x"]), vec![Ev::Open(0), payload(0, "abc</core:x"), Ev::Unclosed(0)]);
}

#[test]
fn multibyte_text_around_tags() {
    assert_eq!(
        scan_all_splits("é<core:x:v1>ü€😀</core:x:v1>日本"),
        vec![text("é"), Ev::Open(0), payload(0, "ü€😀"), Ev::Close(0), text("日本")]
    );
}

#[test]
fn held_bytes_never_exceed_the_longest_open_tag() {
    let tags = tags();
    let mut scanner = TagScanner::new();
    let mut rec = Rec::default();
    for b in "<core:x:v".bytes() {
        scanner.feed(&tags, std::str::from_utf8(&[b]).unwrap(), &mut rec);
        assert!(scanner.held_len() < tags.max_open_len());
    }
    assert_eq!(scanner.held_len(), 9);
    assert!(rec.0.is_empty());
}

#[test]
fn invalid_names_are_refused() {
    assert!(matches!(TagSet::new([("", CloseRule::Exact)]), Err(TagSetError::InvalidName(_))));
    assert!(matches!(TagSet::new([("a b", CloseRule::Exact)]), Err(TagSetError::InvalidName(_))));
    assert!(matches!(TagSet::new([("a>", CloseRule::Exact)]), Err(TagSetError::InvalidName(_))));
    assert!(matches!(TagSet::new([("a", CloseRule::Exact), ("a", CloseRule::Exact)]), Err(TagSetError::Duplicate(_))));
}

#[test]
fn no_registered_tags_means_plain_relay() {
    let tags = TagSet::new([]).unwrap();
    let mut scanner = TagScanner::new();
    let mut rec = Rec::default();
    scanner.feed(&tags, "a <", &mut rec);
    scanner.finish(&tags, &mut rec);
    assert_eq!(rec.0, vec![text("a <")]);
}
