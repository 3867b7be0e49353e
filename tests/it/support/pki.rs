//! A throw-away certificate authority for TLS tests, made with the `openssl` command.
//!
//! [`TestPki::generate`] writes, in a temporary directory, a CA and two leaf certificates signed
//! by it: one for the server (SAN `IP:127.0.0.1`, `DNS:localhost`, server auth) and one for a
//! client (client auth), each with its ECDSA P-256 key in PKCS#8 PEM. It also writes a second,
//! unrelated CA (same name, other key) for tests that must fail verification. It knows nothing
//! of NATS except the server's `tls` block it can render.
//!
//! Without `openssl` it panics saying how to install it; TLS tests never pass by skipping.

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

const CA_CONFIG: &str = "\
[req]
distinguished_name = dn
prompt = no
x509_extensions = v3_ca
[dn]
CN = structured-sink test CA
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
";

const LEAF_REQUEST_CONFIG: &str = "\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = structured-sink test
";

const LEAF_EXTENSIONS: &str = "\
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectAltName = DNS:structured-sink-test-client
authorityKeyIdentifier = keyid
";

/// A CA with a server and a client certificate, in a temporary directory removed on drop.
#[derive(Debug)]
pub struct TestPki {
    dir: TempDir,
}

impl TestPki {
    /// Generates the CA, the server and client certificates and an unrelated second CA.
    /// Panics if `openssl` is missing or fails.
    pub fn generate() -> TestPki {
        let dir = tempfile::Builder::new().prefix("test-pki-").tempdir().expect("temp dir");
        let pki = TestPki { dir };
        pki.write("ca.cnf", CA_CONFIG);
        pki.write("leaf.cnf", LEAF_REQUEST_CONFIG);
        pki.write("leaf-ext.cnf", LEAF_EXTENSIONS);
        const EC_KEY: &str = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
        for ca in ["ca", "other-ca"] {
            pki.openssl(&format!("req -x509 {EC_KEY} -days 2 -config ca.cnf -keyout {ca}-key.pem -out {ca}.pem"));
        }
        for leaf in ["server", "client"] {
            pki.openssl(&format!("req -new {EC_KEY} -config leaf.cnf -keyout {leaf}-key.pem -out {leaf}.csr"));
            pki.openssl(&format!(
                "x509 -req -in {leaf}.csr -days 2 -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
                 -extfile leaf-ext.cnf -extensions {leaf} -out {leaf}.pem"
            ));
        }
        pki
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.dir.path().join(name), text).expect("write openssl config");
    }

    /// Runs `openssl` with `command_line` split at whitespace (no argument here has spaces),
    /// in the PKI directory.
    fn openssl(&self, command_line: &str) {
        let output = Command::new("openssl")
            .args(command_line.split_whitespace())
            .current_dir(self.dir.path())
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `openssl` ({e}): TLS tests need it to make test certificates; \
                     install it with `apt-get install openssl`"
                )
            });
        assert!(output.status.success(), "openssl {command_line} failed: {}", String::from_utf8_lossy(&output.stderr));
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The directory holding all files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate that signed the server and client certificates.
    pub fn ca_file(&self) -> PathBuf {
        self.path("ca.pem")
    }

    /// A CA certificate with the same name as [`ca_file`](TestPki::ca_file) but another key,
    /// which signed nothing here: trusting it instead must fail verification.
    pub fn other_ca_file(&self) -> PathBuf {
        self.path("other-ca.pem")
    }

    /// The server certificate (valid for 127.0.0.1 and localhost).
    pub fn server_cert_file(&self) -> PathBuf {
        self.path("server.pem")
    }

    /// The server's private key.
    pub fn server_key_file(&self) -> PathBuf {
        self.path("server-key.pem")
    }

    /// The client certificate.
    pub fn client_cert_file(&self) -> PathBuf {
        self.path("client.pem")
    }

    /// The client's private key.
    pub fn client_key_file(&self) -> PathBuf {
        self.path("client-key.pem")
    }

    /// A nats-server `tls { ... }` block with the server certificate; with `verify_clients`,
    /// clients must present a certificate signed by the CA.
    pub fn server_tls_config(&self, verify_clients: bool) -> String {
        format!(
            "tls {{\n  cert_file: \"{cert}\"\n  key_file: \"{key}\"\n  ca_file: \"{ca}\"\n  \
             verify: {verify_clients}\n  timeout: 5\n}}\n",
            cert = self.server_cert_file().display(),
            key = self.server_key_file().display(),
            ca = self.ca_file().display(),
        )
    }
}
