//! The Docker path of the harness: a NATS server in a container, through testcontainers.
//!
//! Used instead of the binary when `STRUCTURED_SINK_TEST_DOCKER=1`. Only single servers started
//! with [`super::NatsServer::start`] or a builder are supported: restarting, stopping, lame-duck
//! mode and clusters need the binary and panic with that message. The image is `nats` at
//! [`IMAGE_TAG`] (override with `STRUCTURED_SINK_TEST_NATS_TAG`). The project's own machines cannot
//! run Docker, so this path is exercised only where Docker is available.

use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::SyncRunner;
use testcontainers::{Container, GenericImage, ImageExt};

/// The `nats` image tag used by default.
pub const IMAGE_TAG: &str = "2.10-alpine";

/// Whether the harness was told to use Docker.
pub fn requested() -> bool {
    std::env::var_os("STRUCTURED_SINK_TEST_DOCKER").is_some_and(|v| v == "1")
}

/// A running NATS container, removed on drop. The container lives on its own thread: the
/// blocking testcontainers API cannot run (or drop) inside the tests' tokio runtimes.
pub struct NatsContainer {
    /// The client port on the host.
    pub port: u16,
    stop: Option<std::sync::mpsc::Sender<()>>,
    owner: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for NatsContainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsContainer").field("port", &self.port).finish()
    }
}

impl Drop for NatsContainer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(owner) = self.owner.take() {
            let _ = owner.join();
        }
    }
}

/// Starts a NATS container with `config` (nats-server configuration text) and JetStream when
/// asked; panics with a clear message when Docker cannot start it.
pub fn start(config: &str, jetstream: bool) -> NatsContainer {
    let tag = std::env::var("STRUCTURED_SINK_TEST_NATS_TAG").unwrap_or_else(|_| IMAGE_TAG.to_owned());
    let mut args = vec!["-c".to_owned(), "/etc/structured-sink-test.conf".to_owned()];
    if jetstream {
        args.push("-js".to_owned());
    }
    let config = config.as_bytes().to_vec();
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let owner = std::thread::spawn(move || {
        let started = GenericImage::new("nats", &tag)
            .with_exposed_port(4222.tcp())
            .with_wait_for(WaitFor::message_on_stderr("Server is ready"))
            .with_copy_to("/etc/structured-sink-test.conf", config)
            .with_cmd(args)
            .start()
            .map_err(|e| format!("the nats:{tag} container did not start ({e})"))
            .and_then(|c: Container<GenericImage>| {
                let port = c.get_host_port_ipv4(4222.tcp()).map_err(|e| e.to_string())?;
                Ok((c, port))
            });
        match started {
            Ok((container, port)) => {
                let _ = port_tx.send(Ok(port));
                // Until the server is dropped; then the container is removed on this thread.
                let _ = stop_rx.recv();
                drop(container);
            }
            Err(e) => {
                let _ = port_tx.send(Err(e));
            }
        }
    });
    match port_rx.recv() {
        Ok(Ok(port)) => NatsContainer { port, stop: Some(stop_tx), owner: Some(owner) },
        Ok(Err(e)) => panic!("STRUCTURED_SINK_TEST_DOCKER=1 is set but {e}; unset it to use the nats-server binary"),
        Err(_) => panic!("STRUCTURED_SINK_TEST_DOCKER=1 is set but the container thread failed"),
    }
}
