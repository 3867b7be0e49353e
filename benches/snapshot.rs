//! Live snapshot cost per payload size.
//!
//! Streams YAML and JSON payloads of 1 KiB, 16 KiB, 256 KiB and 1 MiB through a
//! [`Snapshotter`] in 16-byte deltas, the way a model's output arrives, and reports throughput
//! in payload bytes. Linear total work shows as a flat throughput across sizes; a quadratic
//! re-parse would show throughput falling with size. The final `complete` is not measured.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use structured_sink::payload::{PayloadFormat, Snapshotter};

/// Payload sizes measured.
const SIZES: [usize; 4] = [1 << 10, 16 << 10, 256 << 10, 1 << 20];

/// Size of each streamed delta.
const DELTA: usize = 16;

/// About `size` bytes of fenced YAML: a list of small records.
fn yaml_payload(size: usize) -> String {
    let mut text = String::from("```yaml\nitems:\n");
    let mut i = 0;
    while text.len() < size.saturating_sub(4) {
        text.push_str(&format!("  - name: item {i}\n    value: {i}\n    tags: [a, b]\n"));
        i += 1;
    }
    text.push_str("```\n");
    text
}

/// About `size` bytes of fenced JSON: an array of small records under a key.
fn json_payload(size: usize) -> String {
    let mut text = String::from("```json\n{\"items\": [");
    let mut i = 0;
    while text.len() < size.saturating_sub(8) {
        if i > 0 {
            text.push_str(",\n");
        }
        text.push_str(&format!("{{\"name\": \"item {i}\", \"value\": {i}, \"tags\": [\"a\", \"b\"]}}"));
        i += 1;
    }
    text.push_str("]}\n```\n");
    text
}

/// Pushes `text` (ASCII) in [`DELTA`]-byte deltas; returns how many snapshots came out.
fn stream(format: PayloadFormat, text: &str) -> usize {
    let mut snapshotter = Snapshotter::new(format);
    text.as_bytes()
        .chunks(DELTA)
        .filter_map(|delta| {
            // The payloads are ASCII, so every 16-byte cut is a char boundary.
            let delta = std::str::from_utf8(delta).unwrap_or_default();
            snapshotter.push(black_box(delta))
        })
        .count()
}

fn snapshot_cost(c: &mut Criterion) {
    for (name, format, payload) in [
        ("yaml", PayloadFormat::Yaml, yaml_payload as fn(usize) -> String),
        ("json", PayloadFormat::Json, json_payload),
    ] {
        let mut group = c.benchmark_group(format!("snapshot/{name}"));
        for size in SIZES {
            let text = payload(size);
            group.throughput(Throughput::Bytes(text.len() as u64));
            if size >= 256 << 10 {
                // Keep the large cases within a reasonable wall time.
                group.sample_size(10);
            }
            group.bench_with_input(BenchmarkId::from_parameter(size), &text, |b, text| {
                b.iter(|| stream(format, text));
            });
        }
        group.finish();
    }
}

criterion_group!(benches, snapshot_cost);
criterion_main!(benches);
