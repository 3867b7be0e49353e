//! `healthcheck`: the container image's health probe, a single file built with plain `rustc` in
//! the image's builder stage (it is not part of the crate).
//!
//! The runtime image has no shell, curl or wget, so Docker's `HEALTHCHECK` (and the compose
//! healthchecks) run this program in exec form instead. It sends `GET /healthz` to the service's
//! own HTTP endpoint and exits 0 on `200`, 1 on anything else (another status, a refused
//! connection, a timeout). Kubernetes does not use it: its probes are `httpGet` probes.
//!
//! Where it connects, first match wins:
//! 1. the first argument: `HOST:PORT` or `HOST:PORT/PATH` (e.g. `127.0.0.1:9464/readyz`);
//! 2. the port of `STRUCTURED_SINK__HTTP__LISTEN` (the service's `http.listen` set through the
//!    environment), on loopback when it listens on all addresses;
//! 3. `127.0.0.1:9464/healthz`, the service's default.
//!
//! It knows nothing of the service but that address; std only, so it builds anywhere `rustc` does.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

/// The service's default `http.listen` port.
const DEFAULT_PORT: u16 = 9464;
/// Connect, write and read each get this long; Docker's own timeout is the outer bound.
const TIMEOUT: Duration = Duration::from_secs(2);
/// A status line fits in this many bytes; the body is never read.
const STATUS_LINE_MAX: usize = 256;

fn main() -> ExitCode {
    let target = std::env::args().nth(1).unwrap_or_else(|| {
        let listen = std::env::var("STRUCTURED_SINK__HTTP__LISTEN").unwrap_or_default();
        format!("{}/healthz", local_address(&listen))
    });
    match probe(&target) {
        Ok(()) => ExitCode::SUCCESS,
        Err(reason) => {
            eprintln!("healthcheck: {target}: {reason}");
            ExitCode::FAILURE
        }
    }
}

/// The address to probe for a service listening on `listen` (`HOST:PORT`): loopback when it
/// listens on every address (`0.0.0.0`, `[::]`) or when `listen` is empty or unreadable.
fn local_address(listen: &str) -> String {
    let Some((host, port)) = listen.trim().rsplit_once(':') else {
        return format!("127.0.0.1:{DEFAULT_PORT}");
    };
    let port = port.parse::<u16>().unwrap_or(DEFAULT_PORT);
    match host {
        "" | "0.0.0.0" => format!("127.0.0.1:{port}"),
        "[::]" => format!("[::1]:{port}"),
        host => format!("{host}:{port}"),
    }
}

/// One `GET` to `target` (`HOST:PORT[/PATH]`); `Ok` when the status is 200.
fn probe(target: &str) -> Result<(), String> {
    let (authority, path) = match target.find('/') {
        Some(slash) => target.split_at(slash),
        None => (target, "/healthz"),
    };
    let address: SocketAddr = authority
        .to_socket_addrs()
        .map_err(|e| format!("bad address: {e}"))?
        .next()
        .ok_or("the address resolves to nothing")?;
    let mut stream = TcpStream::connect_timeout(&address, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(|e| format!("send: {e}"))?;

    let mut head = Vec::with_capacity(STATUS_LINE_MAX);
    let mut buffer = [0u8; STATUS_LINE_MAX];
    while !head.contains(&b'\n') && head.len() < STATUS_LINE_MAX {
        let read = stream.read(&mut buffer).map_err(|e| format!("receive: {e}"))?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&buffer[..read]);
    }
    let head = String::from_utf8_lossy(&head);
    let status_line = head.lines().next().unwrap_or_default();
    // `HTTP/1.1 200 OK`: the second word is the status code.
    match status_line.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        Some(_) => Err(format!("unhealthy: {status_line}")),
        None => Err("no HTTP status line in the answer".to_owned()),
    }
}
