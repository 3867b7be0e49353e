//! An OTLP/HTTP trace receiver on a loopback port, standing in for an OpenTelemetry collector:
//! it accepts `POST /v1/traces` with a protobuf `ExportTraceServiceRequest`, answers `200 OK`,
//! and keeps every request it decoded for the test to inspect. It serves plain HTTP, or HTTPS
//! with a certificate the test gives it (rustls with ring).
//!
//! It speaks just enough HTTP/1.1 for an exporter (keep-alive, `Content-Length` or chunked
//! bodies, no compression) and records anything else it was sent as an error instead of
//! answering it, so that a test sees why no spans arrived; a TLS handshake that fails is
//! recorded as a refused connection, not an error. It knows nothing of the service.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// What the receiver was sent so far.
#[derive(Default)]
struct Received {
    requests: Vec<ExportTraceServiceRequest>,
    /// Each request's headers, names in lowercase, in arrival order.
    headers: Vec<Vec<(String, String)>>,
    errors: Vec<String>,
    /// TLS connections whose handshake failed.
    refused: usize,
}

/// A running receiver; its threads end with the test process.
pub struct OtlpCollector {
    port: u16,
    tls: bool,
    received: Arc<Mutex<Received>>,
}

impl OtlpCollector {
    /// Binds a free loopback port and starts accepting plain HTTP connections.
    pub fn start() -> OtlpCollector {
        OtlpCollector::listen(None)
    }

    /// Binds a free loopback port and starts accepting HTTPS connections, presenting the
    /// certificate chain in `cert_file` with the key in `key_file` (PEM files).
    pub fn start_tls(cert_file: &Path, key_file: &Path) -> OtlpCollector {
        let chain: Vec<_> = CertificateDer::pem_file_iter(cert_file)
            .expect("read the collector's certificate")
            .collect::<Result<_, _>>()
            .expect("parse the collector's certificate");
        let key = PrivateKeyDer::from_pem_file(key_file).expect("read the collector's key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("the collector's certificate and key");
        OtlpCollector::listen(Some(Arc::new(config)))
    }

    fn listen(tls: Option<Arc<rustls::ServerConfig>>) -> OtlpCollector {
        let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind a loopback port for the collector");
        let port = listener.local_addr().expect("local address").port();
        let serves_tls = tls.is_some();
        let received = Arc::new(Mutex::new(Received::default()));
        let shared = received.clone();
        std::thread::spawn(move || {
            for connection in listener.incoming() {
                let Ok(connection) = connection else { continue };
                let (shared, tls) = (shared.clone(), tls.clone());
                std::thread::spawn(move || {
                    let served = match tls {
                        None => serve(connection, &shared),
                        Some(config) => {
                            let mut session = rustls::ServerConnection::new(config).expect("a TLS session");
                            let mut connection = connection;
                            if session.complete_io(&mut connection).is_err() {
                                shared.lock().unwrap().refused += 1;
                                return;
                            }
                            serve(rustls::StreamOwned::new(session, connection), &shared)
                        }
                    };
                    if let Err(error) = served {
                        shared.lock().unwrap().errors.push(error);
                    }
                });
            }
        });
        OtlpCollector { port, tls: serves_tls, received }
    }

    /// The base URL to configure as the OTLP endpoint (the exporter appends `/v1/traces`):
    /// `https://` when it serves TLS.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// How many TLS connections were refused in the handshake (a client that did not trust the
    /// certificate, say).
    pub fn refused(&self) -> usize {
        self.received.lock().unwrap().refused
    }

    /// The headers of every request received so far (names in lowercase).
    pub fn request_headers(&self) -> Vec<Vec<(String, String)>> {
        self.received.lock().unwrap().headers.clone()
    }

    /// Every span received so far with its resource's attributes, in arrival order. Panics with
    /// the receiver's errors if it refused anything.
    pub fn spans(&self) -> Vec<(Vec<KeyValue>, Span)> {
        let received = self.received.lock().unwrap();
        assert!(received.errors.is_empty(), "the collector refused requests: {:?}", received.errors);
        let mut spans = Vec::new();
        for request in &received.requests {
            for resource_spans in &request.resource_spans {
                let resource = resource_spans.resource.as_ref().map(|r| r.attributes.clone()).unwrap_or_default();
                for scope_spans in &resource_spans.scope_spans {
                    spans.extend(scope_spans.spans.iter().map(|span| (resource.clone(), span.clone())));
                }
            }
        }
        spans
    }

    /// The spans received so far whose attribute `key` is `value` (see [`attribute`]).
    pub fn spans_where(&self, key: &str, value: &str) -> Vec<(Vec<KeyValue>, Span)> {
        let mut spans = self.spans();
        spans.retain(|(_, span)| attribute(&span.attributes, key).as_deref() == Some(value));
        spans
    }
}

/// The value of attribute `key` as text (strings as they are, numbers and booleans formatted).
pub fn attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    match value {
        AnyValue { value: Some(any_value::Value::StringValue(s)) } => Some(s.clone()),
        AnyValue { value: Some(any_value::Value::IntValue(i)) } => Some(i.to_string()),
        AnyValue { value: Some(any_value::Value::BoolValue(b)) } => Some(b.to_string()),
        AnyValue { value: Some(any_value::Value::DoubleValue(d)) } => Some(d.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Answers the requests of one connection until the client closes it.
fn serve(connection: impl Read + Write, received: &Mutex<Received>) -> Result<(), String> {
    let mut reader = BufReader::new(connection);
    loop {
        let mut request_line = String::new();
        match reader.read_line(&mut request_line) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            // A TLS client may close the connection between requests without a close_notify.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && request_line.is_empty() => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
        let (mut length, mut chunked, mut content_type) = (None, false, String::new());
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).map_err(|e| e.to_string())?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let Some((name, value)) = line.split_once(':') else { return Err(format!("bad header line {line:?}")) };
            let (name, value) = (name.to_ascii_lowercase(), value.trim());
            headers.push((name.clone(), value.to_owned()));
            match name.as_str() {
                "content-length" => length = Some(value.parse::<usize>().map_err(|e| e.to_string())?),
                "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                "content-type" => content_type = value.to_owned(),
                "content-encoding" => return Err(format!("compressed body ({value}) not supported")),
                _ => {}
            }
        }
        let body = match (length, chunked) {
            (_, true) => read_chunked(&mut reader)?,
            (Some(length), false) => {
                let mut body = vec![0; length];
                reader.read_exact(&mut body).map_err(|e| e.to_string())?;
                body
            }
            (None, false) => Vec::new(),
        };
        if !request_line.starts_with("POST /v1/traces ") {
            return Err(format!("unexpected request {:?}", request_line.trim_end()));
        }
        if content_type != "application/x-protobuf" {
            return Err(format!("unexpected content type {content_type:?}"));
        }
        let request = ExportTraceServiceRequest::decode(body.as_slice()).map_err(|e| e.to_string())?;
        let mut received = received.lock().unwrap();
        received.requests.push(request);
        received.headers.push(headers);
        drop(received);
        let writer = reader.get_mut();
        writer
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n")
            .and_then(|()| writer.flush())
            .map_err(|e| e.to_string())?;
    }
}

/// Reads a chunked body up to its last, empty chunk.
fn read_chunked(reader: &mut impl BufRead) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).map_err(|e| e.to_string())?;
        let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16).map_err(|e| e.to_string())?;
        let mut chunk = vec![0; size + 2];
        reader.read_exact(&mut chunk).map_err(|e| e.to_string())?;
        if size == 0 {
            return Ok(body);
        }
        body.extend_from_slice(&chunk[..size]);
    }
}
