//! The whole per-event path of the service, offline, in events/s: geppetto JSON decoding
//! (`codec::inbound::decode`, then `into_owned` as the dispatcher does to cross into a shard),
//! `StreamTable::apply` (pipeline, captures, snapshots) and protobuf encoding of every output (the
//! table calls the encoder; publications are counted, then dropped as the worker drops them after
//! publishing). Built exactly as `replay` and the service build it: `Config::default()`,
//! `load_schemas`, `processing`.
//!
//! The workload is synthetic agent output in geppetto's legacy (`partial`/`final`, 3 streams in 4)
//! and canonical (`text-delta`/`text-segment-finished`, 1 in 4) vocabularies, encoded the way Go's
//! `encoding/json` writes it (`<` as `\u003c`), with cumulative `completion`/`text` fields, full
//! `meta`, and about 4-character deltas of text that mixes prose, a `<thinking>` section, a YAML
//! mode-switch block, a tool call and a YAML citations block.
//!
//! Variants: 100 streams one after another; 1,000 streams interleaved round-robin (the table
//! holds 1,000 open streams); and, on the interleaved workload, decoding alone and the table alone
//! (events decoded beforehand) to split the cost; and the interleaved workload without the
//! cumulative fields, to show what they cost. About 200 events per stream. Without `--bench`
//! (`cargo test --all-targets`) the workloads are 10 and 50 streams of 40 events.
//!
//! A last group measures what `NatsSink::publish` adds per output (a fresh `HeaderMap` with three
//! headers and a `Subject` copied from the publication) against prepared headers and subjects.
//!
//! Run: `cargo bench --bench pipeline` (add `-- --quick` for a short run). The workload generator
//! is shared with `benches/e2e.rs` (`benches/workload`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use async_nats::{HeaderMap, Subject};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use structured_sink::codec::inbound::{decode, InboundEvent};
use structured_sink::codec::outbound::{OutputEncoder, Publication};
use structured_sink::config::Config;
use structured_sink::pipeline::Pipeline;
use structured_sink::shard::table::{Disposition, InputPosition, StreamTable, TableLimits};

mod workload;
use workload::stream_events;

// ---------------------------------------------------------------------------------------------

/// The service's processing, built as `replay` and the service build it.
struct Processing {
    pipeline: Pipeline,
    encoder: OutputEncoder,
    max_event_bytes: usize,
    finished_memory: usize,
}

impl Processing {
    fn new() -> Self {
        let config = Config::default();
        let registry = config.load_schemas().expect("built-in schemas load");
        let (pipeline, encoder) = config.processing(&registry).expect("default processing");
        Processing {
            pipeline,
            encoder,
            max_event_bytes: config.input.max_event_bytes,
            finished_memory: config.shards.finished_memory,
        }
    }

    /// A fresh table (one shard's worth) that can hold every stream of the workload.
    fn table(&self) -> StreamTable {
        let limits =
            TableLimits { idle_timeout: Duration::MAX, max_streams: 1_000_000, finished_memory: self.finished_memory };
        StreamTable::new(self.pipeline.clone(), self.encoder.clone(), limits)
    }
}

/// What a run produced, so that nothing is optimised away and the mix can be reported.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    events: u64,
    publications: u64,
    payload_bytes: u64,
}

impl Tally {
    fn count(&mut self, p: Publication) {
        self.publications += 1;
        self.payload_bytes += p.payload.len() as u64;
        black_box(&p);
    }
}

/// Decodes and applies every event as the service does (decode, `into_owned`, apply).
fn run_full(proc_: &Processing, table: &mut StreamTable, events: &[Vec<u8>]) -> Tally {
    let now = Instant::now();
    let mut tally = Tally::default();
    let mut outputs = Vec::new();
    for payload in events {
        let event = decode(payload, proc_.max_event_bytes).expect("valid event").into_owned();
        let d = table.apply(&event, InputPosition::default(), now, &mut |p| outputs.push(p), &mut |_| {});
        debug_assert_eq!(d, Disposition::Applied);
        for p in outputs.drain(..) {
            tally.count(p);
        }
        tally.events += 1;
    }
    tally
}

fn run_apply(table: &mut StreamTable, events: &[InboundEvent<'static>]) -> Tally {
    let now = Instant::now();
    let mut tally = Tally::default();
    let mut outputs = Vec::new();
    for event in events {
        table.apply(event, InputPosition::default(), now, &mut |p| outputs.push(p), &mut |_| {});
        for p in outputs.drain(..) {
            tally.count(p);
        }
        tally.events += 1;
    }
    tally
}

/// `streams` streams of `per_stream` events (about), one after another or interleaved.
fn workload(streams: usize, per_stream: usize, interleaved: bool) -> Vec<Vec<u8>> {
    workload_with(streams, per_stream, interleaved, true)
}

/// Like [`workload`]; without `cumulative`, deltas carry no `completion`/`text`.
fn workload_with(streams: usize, per_stream: usize, interleaved: bool, cumulative: bool) -> Vec<Vec<u8>> {
    let all: Vec<Vec<Vec<u8>>> = (0..streams).map(|i| stream_events(1, i, per_stream, cumulative).1).collect();
    if !interleaved {
        return all.into_iter().flatten().collect();
    }
    let mut iters: Vec<_> = all.into_iter().map(|v| v.into_iter()).collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for it in iters.iter_mut() {
            if let Some(e) = it.next() {
                out.push(e);
            }
        }
        if out.len() == before {
            return out;
        }
    }
}

fn describe(name: &str, events: &[Vec<u8>], tally: Tally, elapsed: Duration) {
    let bytes: usize = events.iter().map(Vec::len).sum();
    eprintln!(
        "[{name}] {} events, mean {} B/event, {} publications ({:.2}/event, mean {} B), one cold pass {:.0} events/s",
        events.len(),
        bytes / events.len().max(1),
        tally.publications,
        tally.publications as f64 / tally.events.max(1) as f64,
        tally.payload_bytes / tally.publications.max(1),
        events.len() as f64 / elapsed.as_secs_f64()
    );
}

fn bench_pipeline(c: &mut Criterion) {
    let proc_ = Processing::new();
    // `cargo test --all-targets` runs this binary without `--bench` (each benchmark once, in a
    // debug build): small workloads there.
    let full = std::env::args().any(|a| a == "--bench");
    let (seq_streams, streams, per_stream) = if full { (100, 1000, 200) } else { (10, 50, 40) };
    let sequential = workload(seq_streams, per_stream, false);
    let interleaved = workload(streams, per_stream, true);

    let lean_events = workload_with(streams, per_stream, true, false);
    for (name, events) in [
        ("sequential_streams", &sequential),
        ("interleaved_streams", &interleaved),
        ("interleaved_streams_no_cumulative_fields", &lean_events),
    ] {
        let start = Instant::now();
        let tally = run_full(&proc_, &mut proc_.table(), events);
        describe(name, events, tally, start.elapsed());
    }

    let mut group = c.benchmark_group("pipeline");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));

    group.throughput(Throughput::Elements(sequential.len() as u64));
    group.bench_function("decode+apply+encode/sequential_streams", |b| {
        b.iter_batched_ref(|| proc_.table(), |table| run_full(&proc_, table, &sequential), BatchSize::PerIteration)
    });

    group.throughput(Throughput::Elements(interleaved.len() as u64));
    group.bench_function("decode+apply+encode/interleaved_streams", |b| {
        b.iter_batched_ref(|| proc_.table(), |table| run_full(&proc_, table, &interleaved), BatchSize::PerIteration)
    });

    // The same events without the cumulative `completion`/`text` fields on deltas.
    let lean = workload_with(streams, per_stream, true, false);
    group.throughput(Throughput::Elements(lean.len() as u64));
    group.bench_function("decode+apply+encode/interleaved_streams_no_cumulative_fields", |b| {
        b.iter_batched_ref(|| proc_.table(), |table| run_full(&proc_, table, &lean), BatchSize::PerIteration)
    });
    group.throughput(Throughput::Elements(interleaved.len() as u64));

    // The split: decoding alone, and the table alone on events decoded beforehand.
    group.bench_function("decode_only/interleaved_streams", |b| {
        b.iter(|| {
            let mut n = 0usize;
            for payload in &interleaved {
                let event = decode(payload, proc_.max_event_bytes).expect("valid event").into_owned();
                n += black_box(&event).stream.stream_id.len();
            }
            n
        })
    });
    let decoded: Vec<InboundEvent<'static>> =
        interleaved.iter().map(|p| decode(p, proc_.max_event_bytes).expect("valid event").into_owned()).collect();
    group.bench_function("apply+encode_only/interleaved_streams", |b| {
        b.iter_batched_ref(|| proc_.table(), |table| run_apply(table, &decoded), BatchSize::PerIteration)
    });
    group.finish();

    // What the service adds per publication on top of the table: the NATS headers and subject of
    // every output, built entry by entry (as `NatsSink::publish` did until the third session)
    // against a prepared map cloned per output (as it does now, one template per output type).
    let mut sample = Vec::new();
    run_apply_collect(&mut proc_.table(), &decoded[..decoded.len().min(20_000)], &mut sample);
    let mut group = c.benchmark_group("publish_overhead");
    group.throughput(Throughput::Elements(sample.len() as u64));
    group.bench_function("headers_built_entry_by_entry", |b| {
        b.iter(|| {
            let mut n = 0usize;
            for p in &sample {
                let mut headers = HeaderMap::new();
                headers.insert("Content-Type", p.content_type);
                headers.insert("Structured-Sink-Type", p.type_name);
                headers.insert(async_nats::header::NATS_MESSAGE_ID, p.msg_id.as_str());
                let subject = Subject::from(p.subject.as_ref());
                n += black_box((&headers, &subject)).1.len();
            }
            n
        })
    });
    let prepared: HeaderMap = {
        let mut h = HeaderMap::new();
        h.insert("Content-Type", "application/x-protobuf");
        h.insert("Structured-Sink-Type", "structuredsink.v1.FilteredText");
        h
    };
    let subject = Subject::from("chat.filtered");
    group.bench_function("header_template_cloned_plus_msg_id", |b| {
        b.iter(|| {
            let mut n = 0usize;
            for p in &sample {
                let mut headers = prepared.clone();
                headers.insert(async_nats::header::NATS_MESSAGE_ID, p.msg_id.as_str());
                let subject = subject.clone();
                n += black_box((&headers, &subject)).1.len();
            }
            n
        })
    });
    group.finish();
}

fn run_apply_collect(table: &mut StreamTable, events: &[InboundEvent<'static>], out: &mut Vec<Publication>) {
    let now = Instant::now();
    for event in events {
        table.apply(event, InputPosition::default(), now, &mut |p| out.push(p), &mut |_| {});
    }
}

criterion_group!(benches, bench_pipeline);
criterion_main!(benches);
