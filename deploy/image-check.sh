#!/usr/bin/env bash
#
# Builds the image and runs it under the end-to-end load tool: the image's binary, started in a
# container with the load tool's configuration, must deliver every predicted output of a
# core-NATS run and a JetStream run, once each, and exit 0 on SIGTERM (`podman run` and
# `docker run` pass the signal on).
#
#     deploy/image-check.sh [--docker] [--stand-ins] [-- BUILD_ARGS...]        (as root)
#
# e.g. `deploy/image-check.sh -- --build-arg PGO=0` for the plain build.
#
# Two engines:
#   default   buildah builds (given deploy/Dockerfile.dockerignore with --ignorefile) and podman
#             runs: for machines without a Docker daemon;
#   --docker  the Docker daemon builds (`docker build` with BuildKit, which reads the ignore file
#             and the cache mounts itself, as operators build) and runs. `DOCKER` names the
#             client (default `docker`); it must be able to build with BuildKit (Docker 23 or
#             later with the buildx component, or a Docker 20.10 client).
#
# --stand-ins first makes local stand-ins for the two base images, for machines that cannot pull
# them: `rust:1.95-bookworm` (Debian bookworm minbase from debootstrap, a C toolchain and
# ca-certificates with this machine's extra certificate authorities, Rust installed by
# rustup-init as the official image installs it) and `localhost/structured-sink-standin/runtime`
# (bookworm minbase with tzdata and user 65532, in place of distroless cc, which has no shell).
# The official builder has more (procps among others); the stand-in has only what the build needs.
# It also makes `localhost/structured-sink-standin/nats` for the compose stack's NATS image
# (bookworm minbase with Debian's nats-server as its entry point and busybox's wget for the
# healthcheck), which the compose test (`tests/it/compose.rs`) uses, with the runtime stand-in,
# when they are present.
#
# Needs nats-server and cargo, and buildah and podman with runc (default) or a Docker daemon
# (--docker); debootstrap and curl with --stand-ins.
set -euo pipefail

# Wrapper mode: the load tool runs its `--service-bin` as `BIN --config FILE serve`; this script
# is that binary, and runs the image instead. The image's user (65532) must read the file: a
# readable copy is mounted at the same path. runc, cgroupfs and explicit ulimits let podman run in
# sandboxes where crun or its defaults are refused; they are harmless elsewhere.
if [ "${1:-}" = --config ]; then
    copy=$(mktemp /tmp/image-check-config-XXXXXX.toml)
    cp "$2" "$copy"
    chmod 0644 "$copy"
    if [ "${IMAGE_CHECK_ENGINE:-podman}" = docker ]; then
        exec "${DOCKER:-docker}" run --rm --network host --ulimit nofile=20000:20000 --no-healthcheck \
            -v "$copy:$2:ro" "$IMAGE_CHECK_IMAGE" "$@"
    fi
    exec podman --runtime runc --cgroup-manager=cgroupfs run --rm --network host \
        --ulimit nofile=20000:20000 --ulimit nproc=1000:1000 --no-healthcheck \
        -v "$copy:$2:ro" "$IMAGE_CHECK_IMAGE" "$@"
fi

cd "$(dirname "$0")/.."
rust_version=$(sed -n 's/^ARG RUST_VERSION=//p' deploy/Dockerfile)
tag=localhost/structured-sink:check
standin_runtime=localhost/structured-sink-standin/runtime
standin_nats=localhost/structured-sink-standin/nats
engine=podman
stand_ins=
while [ $# -gt 0 ]; do
    case $1 in
        --docker) engine=docker ;;
        --stand-ins) stand_ins=1 ;;
        --) shift; break ;;
        *) echo "image-check: unknown argument $1 (usage: image-check.sh [--docker] [--stand-ins] [-- BUILD_ARGS...])" >&2; exit 2 ;;
    esac
    shift
done
docker=${DOCKER:-docker}
# The engine's client for images: both take `import [--change ...] - NAME` and `image inspect`.
client=podman
[ "$engine" = docker ] && client=$docker
step() { echo "image-check: $*" >&2; }
# A root file system as an image, with Dockerfile instructions such as `ENV` (`--change`).
import_image() {
    local dir=$1 name=$2
    shift 2
    tar -C "$dir" -c . | "$client" import "$@" - "$name" >/dev/null
}
work=
# The wrapper's configuration copies, and with --stand-ins the root file systems being made.
cleanup() {
    rm -f /tmp/image-check-config-*.toml
    if [ -n "$work" ]; then
        umount "$work/builder/proc" 2>/dev/null || true
        rm -rf "$work"
    fi
}
trap cleanup EXIT

if [ -n "$stand_ins" ]; then
    work=$(mktemp -d /tmp/image-check-rootfs-XXXXXX)
    step "stand-in for rust:$rust_version-bookworm"
    debootstrap --variant=minbase --include=ca-certificates,gcc,libc6-dev,make,curl,pkg-config \
        bookworm "$work/builder" http://deb.debian.org/debian >/dev/null
    # Certificate authorities this machine adds (an egress proxy's), so that the build can fetch.
    cp -r /usr/local/share/ca-certificates/. "$work/builder/usr/local/share/ca-certificates/"
    chroot "$work/builder" update-ca-certificates >/dev/null
    cp /etc/resolv.conf "$work/builder/etc/resolv.conf"
    curl -sSfo "$work/builder/tmp/rustup-init" https://static.rust-lang.org/rustup/dist/x86_64-unknown-linux-gnu/rustup-init
    chmod +x "$work/builder/tmp/rustup-init"
    mount -t proc proc "$work/builder/proc" # rustup-init reads /proc/self/exe
    env -i PATH=/usr/local/cargo/bin:/usr/sbin:/usr/bin:/sbin:/bin RUSTUP_HOME=/usr/local/rustup \
        CARGO_HOME=/usr/local/cargo chroot "$work/builder" /tmp/rustup-init -y --no-modify-path \
        --profile minimal --default-toolchain "$rust_version"
    umount "$work/builder/proc"
    rm "$work/builder/tmp/rustup-init"
    chmod -R a+w "$work/builder/usr/local/rustup" "$work/builder/usr/local/cargo"
    import_image "$work/builder" "docker.io/library/rust:$rust_version-bookworm" \
        --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV RUSTUP_HOME=/usr/local/rustup' --change 'ENV CARGO_HOME=/usr/local/cargo'
    step "stand-in for the distroless runtime"
    debootstrap --variant=minbase --include=ca-certificates,tzdata bookworm "$work/runtime" \
        http://deb.debian.org/debian >/dev/null
    echo 'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >>"$work/runtime/etc/passwd"
    echo 'nonroot:x:65532:' >>"$work/runtime/etc/group"
    import_image "$work/runtime" "$standin_runtime"
    step "stand-in for the compose stack's nats:2.11-alpine"
    debootstrap --variant=minbase --include=ca-certificates,nats-server,busybox bookworm "$work/nats" \
        http://deb.debian.org/debian >/dev/null
    ln -s /bin/busybox "$work/nats/usr/local/bin/wget"
    import_image "$work/nats" "$standin_nats" --change 'ENTRYPOINT ["/usr/sbin/nats-server"]'
fi
# Stand-ins made by an earlier run are used; else the engine pulls what is missing.
runtime_args=()
if "$client" image inspect "$standin_runtime" >/dev/null 2>&1; then
    runtime_args=(--build-arg "RUNTIME_IMAGE=$standin_runtime")
fi

step "building $tag with $engine"
if [ "$engine" = docker ]; then
    DOCKER_BUILDKIT=1 "$docker" build -f deploy/Dockerfile -t "$tag" "${runtime_args[@]}" "$@" .
else
    buildah bud --isolation chroot --format docker --layers -f deploy/Dockerfile \
        --ignorefile deploy/Dockerfile.dockerignore -t "$tag" "${runtime_args[@]}" "$@" .
fi

e2e=$(cargo build --release --locked --bench e2e --message-format=json \
    | sed -n 's/.*"executable":"\([^"]*\/e2e-[0-9a-f]*\)".*/\1/p' | tail -n 1)
export IMAGE_CHECK_IMAGE=$tag IMAGE_CHECK_ENGINE=$engine DOCKER=$docker
self=$(realpath "$0")
for mode in core jetstream; do
    step "the image under the load tool, $mode"
    # `--profile-service`: the service's rounds only (no relay), and any output missing,
    # duplicated, unexpected or dead-lettered fails the run, as in deploy/pgo-build.sh's training.
    "$e2e" --bench --service-bin "$self" --profile-service --idle-streams 0 --quick --rounds 1 --mode "$mode"
done
step "passed: $tag ($engine)"
