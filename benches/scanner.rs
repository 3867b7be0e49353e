//! Scanner throughput in bytes/s for several delta sizes and text shapes, beside a naive
//! baseline that accumulates the text and searches it again on every delta.
//!
//! Run: `cargo bench --bench scanner`. Figures are recorded in BENCHMARKS.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use structured_sink::scanner::{CloseRule, ScanSink, TagId, TagScanner, TagSet};

/// Counts what the scanner reports, so that nothing is optimised away.
#[derive(Default)]
struct Count {
    text: usize,
    payload: usize,
    events: usize,
}

impl ScanSink for Count {
    fn text(&mut self, text: &str) {
        self.text += text.len();
    }
    fn open(&mut self, _: TagId) {
        self.events += 1;
    }
    fn payload(&mut self, _: TagId, raw: &str) {
        self.payload += raw.len();
    }
    fn close(&mut self, _: TagId) {
        self.events += 1;
    }
    fn unclosed(&mut self, _: TagId) {
        self.events += 1;
    }
}

const TAGS: [&str; 4] = ["myapp:ModeSwitch:v1", "geppetto:citations:v1", "thinking", "tool"];

fn tag_set() -> TagSet {
    TagSet::new(TAGS.iter().map(|t| (*t, if *t == "tool" { CloseRule::OutsideJsonStrings } else { CloseRule::Exact })))
        .unwrap()
}

/// Deterministic prose: words, punctuation and newlines, no `<`.
fn prose(len: usize) -> String {
    let words = ["the", "model", "streams", "tokens", "while", "users", "read", "answers,", "quickly.", "and\n"];
    let mut out = String::with_capacity(len + 16);
    let mut i = 7usize;
    while out.len() < len {
        i = i.wrapping_mul(1103515245).wrapping_add(12345);
        out.push_str(words[(i >> 16) % words.len()]);
        out.push(' ');
    }
    out.truncate(len);
    out
}

/// Prose with one YAML block per KiB.
fn one_block_per_kib(len: usize) -> String {
    let block = "<myapp:ModeSwitch:v1>\n```yaml\nnew_mode: research\n```\n</myapp:ModeSwitch:v1>";
    let mut out = String::with_capacity(len + 1024);
    while out.len() < len {
        out.push_str(&prose(1024 - block.len()));
        out.push_str(block);
    }
    out.truncate(len);
    out
}

/// Text entirely inside one block.
fn inside_blocks(len: usize) -> String {
    let mut out = String::from("<myapp:ModeSwitch:v1>");
    out.push_str(&prose(len - out.len()));
    out
}

fn scan(tags: &TagSet, input: &str, delta: usize) -> Count {
    let mut scanner = TagScanner::new();
    let mut count = Count::default();
    for chunk in input.as_bytes().chunks(delta) {
        // The inputs are ASCII, so every chunk is a valid str.
        scanner.feed(tags, std::str::from_utf8(chunk).unwrap(), &mut count);
    }
    scanner.finish(tags, &mut count);
    count
}

/// The naive approach: accumulate, then search the whole text for every open tag on each delta.
fn naive(input: &str, delta: usize) -> usize {
    let opens: Vec<String> = TAGS.iter().map(|t| format!("<{t}>")).collect();
    let mut acc = String::new();
    let mut found = 0;
    for chunk in input.as_bytes().chunks(delta) {
        acc.push_str(std::str::from_utf8(chunk).unwrap());
        for open in &opens {
            found += acc.find(open.as_str()).map_or(0, |i| i + 1);
        }
    }
    found
}

fn scanner(c: &mut Criterion) {
    let tags = tag_set();
    let size = 64 * 1024;
    for (shape, input) in
        [("prose", prose(size)), ("one_block_per_kib", one_block_per_kib(size)), ("inside_blocks", inside_blocks(size))]
    {
        let mut group = c.benchmark_group(format!("scanner/{shape}"));
        group.throughput(Throughput::Bytes(input.len() as u64));
        for delta in [1usize, 4, 16, 64, 4096] {
            group.bench_with_input(BenchmarkId::from_parameter(delta), &delta, |b, &delta| {
                b.iter(|| black_box(scan(&tags, black_box(&input), delta)))
            });
        }
        group.finish();
    }
    let input = prose(size);
    let mut group = c.benchmark_group("naive_baseline/prose");
    group.throughput(Throughput::Bytes(input.len() as u64));
    group.bench_with_input(BenchmarkId::from_parameter(4096), &4096usize, |b, &delta| {
        b.iter(|| black_box(naive(black_box(&input), delta)))
    });
    group.finish();
}

criterion_group!(benches, scanner);
criterion_main!(benches);
