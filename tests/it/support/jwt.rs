//! NATS decentralized authentication for tests: an operator, an account and users as nkeys, their
//! JWTs signed here, the server's `operator`/`resolver` settings, and user credentials files, as
//! `nsc` would make them (no `nsc` needed).
//!
//! A JWT is `base64url(header).base64url(claims).base64url(ed25519 signature)`, signed by the
//! issuer's nkey: the operator signs itself and the account, the account signs its users. Only
//! the claims the server checks are written. It knows nothing of the service.

use std::path::{Path, PathBuf};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use nkeys::KeyPair;
use serde_json::{json, Value};

/// An operator with one account whose JWT the server preloads.
pub struct Operator {
    operator: KeyPair,
    account: KeyPair,
}

impl Operator {
    /// New operator and account keys.
    pub fn generate() -> Operator {
        Operator { operator: KeyPair::new_operator(), account: KeyPair::new_account() }
    }

    /// The server configuration trusting this operator, its account preloaded in a memory
    /// resolver; the operator's JWT is written to `dir`.
    pub fn server_config(&self, dir: &Path) -> String {
        let operator = self.operator.public_key();
        let operator_jwt = encode(
            &self.operator,
            json!({"sub": operator, "name": "test-operator", "nats": {"type": "operator", "version": 2}}),
        );
        let account = self.account.public_key();
        let account_jwt = encode(
            &self.operator,
            json!({"sub": account, "name": "test-account", "nats": {
                "limits": {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                           "wildcards": true, "conn": -1, "leaf": -1},
                "default_permissions": {"pub": {}, "sub": {}},
                "type": "account", "version": 2
            }}),
        );
        let path = dir.join("operator.jwt");
        std::fs::write(&path, operator_jwt).expect("write the operator JWT");
        format!(
            "operator: \"{}\"\nresolver: MEMORY\nresolver_preload: {{ {account}: \"{account_jwt}\" }}\n",
            path.display()
        )
    }

    /// A credentials file, in `dir`, for a new user of this operator's account.
    pub fn user_credentials(&self, dir: &Path, name: &str) -> PathBuf {
        write_credentials(dir, name, &self.account)
    }

    /// A credentials file, in `dir`, for a user signed by an account the server does not know.
    pub fn stranger_credentials(&self, dir: &Path, name: &str) -> PathBuf {
        write_credentials(dir, name, &KeyPair::new_account())
    }
}

/// A new user, its JWT issued by `account`, written as a `.creds` file.
fn write_credentials(dir: &Path, name: &str, account: &KeyPair) -> PathBuf {
    let user = KeyPair::new_user();
    let jwt = encode(
        account,
        json!({"sub": user.public_key(), "name": name, "nats": {
            "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2
        }}),
    );
    let seed = user.seed().expect("the user's seed");
    let text = format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    );
    let path = dir.join(format!("{name}.creds"));
    std::fs::write(&path, text).expect("write the credentials file");
    path
}

/// `claims` with the issuer, issue time and an id added, as a JWT signed by `issuer`.
fn encode(issuer: &KeyPair, mut claims: Value) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    claims["iss"] = json!(issuer.public_key());
    claims["iat"] = json!(now);
    claims["jti"] = json!(format!("test-{}-{now}", claims["sub"].as_str().unwrap_or_default()));
    let header = URL_SAFE_NO_PAD.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let body = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signed = format!("{header}.{body}");
    let signature = issuer.sign(signed.as_bytes()).expect("sign the JWT");
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
}
