//! Test support shared by the integration tests: a real `nats-server` per test and a throw-away
//! certificate authority for TLS tests.
//!
//! [`NatsServer`] starts the real binary (from `NATS_SERVER_BIN`, else `PATH`, else Debian's
//! `/usr/sbin/nats-server`; tests of pinned-client priority groups take `NATS_SERVER_PINNED_BIN`
//! when set) on a random loopback port with JetStream and a temporary store, and kills it on
//! drop; [`NatsCluster`] does the same for a routed cluster of several nodes.
//! [`TestPki`] makes a CA, a server and a client certificate with the `openssl` command.
//! [`OtlpCollector`] receives OTLP/HTTP trace exports on a loopback port. [`jwt::Operator`]
//! makes the JWTs and credentials files of NATS decentralized authentication.
//! Nothing here knows about the service under test: tests connect to the URLs and do the rest.
//!
//! Without a `nats-server` binary (or `openssl`, for TLS tests) these helpers panic with a
//! message that says how to install one; the tests never skip silently. With
//! `STRUCTURED_SINK_TEST_DOCKER=1`, single servers run as a `nats` container through
//! testcontainers instead ([`container`]); restarts and clusters need the binary.

// Each test module uses a different part of this support code, so parts of it (and of these
// re-exports) are unused in any one build of the test binary.
#![allow(dead_code, unused_imports)]

mod collector;
mod container;
pub mod jwt;
mod nats_server;
mod pki;

pub use collector::{attribute, OtlpCollector};
pub use nats_server::{find_nats_server, free_ports, http_get, NatsCluster, NatsServer, NatsServerBuilder};
pub use pki::TestPki;

/// The repository's root.
pub fn repo() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A `docker` client on PATH whose daemon answers, or why not.
pub fn docker_with_daemon() -> Result<std::path::PathBuf, String> {
    let docker = find_on_path("docker").ok_or("docker not found on PATH")?;
    let info = std::process::Command::new(&docker)
        .arg("info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    if !info.is_ok_and(|s| s.success()) {
        return Err(format!("{}: the daemon is not reachable (`docker info` failed)", docker.display()));
    }
    Ok(docker)
}

/// The stand-ins `deploy/image-check.sh --docker --stand-ins` makes, for machines that cannot pull
/// the images they stand for: the runtime base image (the Dockerfile's `RUNTIME_IMAGE`) and the
/// compose stack's NATS image. The builder's stand-in takes the official name itself.
pub const STANDIN_RUNTIME: &str = "localhost/structured-sink-standin/runtime";
pub const STANDIN_NATS: &str = "localhost/structured-sink-standin/nats";

/// Whether the daemon behind `docker` holds `image`.
pub fn docker_has_image(docker: &std::path::Path, image: &str) -> bool {
    std::process::Command::new(docker)
        .args(["image", "inspect", image])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The first file called `name` in a directory of `PATH`.
pub fn find_on_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Sends SIGTERM to `child`, as an orchestrator stops the service, without a `kill` program
/// (the load tool in `benches/e2e.rs` stops its service process the same way).
pub fn sigterm(child: &std::process::Child) -> std::io::Result<()> {
    rustix::process::kill_process(rustix::process::Pid::from_child(child), rustix::process::Signal::TERM)?;
    Ok(())
}
