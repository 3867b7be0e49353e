#!/usr/bin/env bash
#
# Builds the `structured-sink` binary with profile-guided optimisation (PGO): LLVM lays out and
# inlines the hot path (event decoding, the scanner, the shard loop, publishing) from counts of a
# real run instead of guesses. BENCHMARKS.md has what it gained and how that was measured.
#
#     deploy/pgo-build.sh [OUTPUT]        (default: $CARGO_TARGET_DIR/pgo/structured-sink)
#
# Four steps, all under $CARGO_TARGET_DIR/pgo (default target/pgo):
#   1. the binary built with `-Cprofile-generate` (instrumented: it counts every branch);
#   2. the end-to-end load tool (`benches/e2e.rs`, an ordinary release build) runs that binary as
#      its own process (`--service-bin`) against a local nats-server: core NATS, then JetStream,
#      on the bench's synthetic agent streams (prose, thinking, YAML blocks, tool calls, both
#      event vocabularies). Every output is checked, so a binary that misbehaves fails here. The
#      binary writes its counts when it exits on SIGTERM;
#   3. `llvm-profdata merge` (rustup's `llvm-tools`, which matches rustc's LLVM exactly; installed
#      when missing) turns the counts into one profile;
#   4. the binary rebuilt with `-Cprofile-use`, exactly as `cargo build --release --bin
#      structured-sink` otherwise (the profile names functions by their symbols, so steps 1 and 4
#      must build the same crate graph: the same command, features and RUSTFLAGS).
#
# Needs cargo through rustup, nats-server (`NATS_SERVER_BIN`, else on PATH, else
# /usr/sbin/nats-server; any version with JetStream) and the time of three release builds. Extra
# RUSTFLAGS (such as `-Ctarget-cpu=...`) are kept in both builds.
set -euo pipefail

cd "$(dirname "$0")/.."
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
work=$target/pgo
out=$(realpath -m "${1:-$work/structured-sink}")
flags=${RUSTFLAGS:-}

host=$(rustc -vV | sed -n 's/^host: //p')
profdata=$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata
if [ ! -x "$profdata" ]; then
    echo "pgo-build: installing rustup's llvm-tools (llvm-profdata)" >&2
    rustup component add llvm-tools
fi

step() { echo "pgo-build: $*" >&2; }

step "1/4 instrumented binary"
rm -rf "$work/profiles"
mkdir -p "$work/profiles"
RUSTFLAGS="$flags -Cprofile-generate=$work/profiles" \
    cargo build --release --locked --bin structured-sink --target-dir "$work/generate"

step "2/4 training run (the load tool drives the instrumented binary)"
e2e=$(cargo build --release --locked --bench e2e --message-format=json \
    | sed -n 's/.*"executable":"\([^"]*\/e2e-[0-9a-f]*\)".*/\1/p' | tail -n 1)
if [ -z "$e2e" ] || [ ! -x "$e2e" ]; then
    echo "pgo-build: could not find the e2e load tool's executable" >&2
    exit 1
fi
instrumented=$work/generate/release/structured-sink
"$e2e" --bench --service-bin "$instrumented" --profile-service --idle-streams 0 --rounds 2
"$e2e" --bench --service-bin "$instrumented" --profile-service --idle-streams 0 --mode jetstream
if ! compgen -G "$work/profiles/*.profraw" > /dev/null; then
    echo "pgo-build: the training run left no profile in $work/profiles" >&2
    exit 1
fi

step "3/4 merging the profile"
"$profdata" merge -o "$work/structured-sink.profdata" "$work/profiles"

step "4/4 optimised binary"
# Functions the training never ran keep LLVM's usual heuristics; warnings about them would drown
# the build's output.
RUSTFLAGS="$flags -Cprofile-use=$work/structured-sink.profdata -Cllvm-args=-pgo-warn-missing-function=false" \
    cargo build --release --locked --bin structured-sink --target-dir "$work/use"
install -D -m 0755 "$work/use/release/structured-sink" "$out"
step "done: $out"
