//! The operator's NATS connection settings: one typed section, its defaults, its validation and
//! a masked copy for printing.
//!
//! This file owns the meaning of every connection key (the `///` docs below are the operator's
//! reference) and the rules that reject a configuration before any connection is tried. It does
//! not read files, environment or flags (the config module layers those and hands us this
//! section) and does not touch the network.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::BusError;

/// What [`NatsConfig::masked`] puts in place of a secret.
pub const MASK: &str = "***";

/// How the service connects to NATS.
///
/// Key names carry their unit (`_ms`). Only one way of authenticating may be configured:
/// a credentials file, an nkey seed, a user and password, or a token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// NATS server URLs, for example `nats://10.0.0.1:4222` or `tls://nats.example:4222`
    /// (`host:port` alone means `nats://host:port`). The client tries them in random order and
    /// fails over between them; servers a cluster advertises are added automatically.
    /// Credentials may be given in a URL (`nats://user:password@host:4222`, or
    /// `nats://token@host:4222`, percent-encoded where needed); every URL that carries some must
    /// carry the same, they count as one kind of authentication, and they are masked wherever the
    /// configuration or a server address is printed or logged. Must not be empty. One URL may be
    /// given as a plain string (`STRUCTURED_SINK__NATS__SERVERS=nats://nats:4222`).
    /// Default: `["nats://127.0.0.1:4222"]`.
    #[serde(deserialize_with = "one_or_many")]
    pub servers: Vec<String>,

    /// Name this connection reports to the server; it appears in the server's connection list
    /// (`nats server report connections`, `/connz`). Must not be empty.
    /// Default: `"structured-sink"`.
    pub client_name: String,

    /// Path to a NATS credentials file (`.creds`, a user JWT and its nkey seed) for servers
    /// that use decentralized (operator/account) authentication. The file is read at start-up.
    /// Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credentials_file: Option<PathBuf>,

    /// Secret. Nkey seed of a user (a string starting with `SU`) for servers configured with
    /// nkey authentication. Prefer an environment variable over a file for this value.
    /// Default: unset.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "lenient_string")]
    pub nkey_seed: Option<String>,

    /// User name for user/password authentication; set together with `password`.
    /// Default: unset.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "lenient_string")]
    pub user: Option<String>,

    /// Secret. Password for user/password authentication; set together with `user`.
    /// Default: unset.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "lenient_string")]
    pub password: Option<String>,

    /// Secret. Token for token authentication (server setting `authorization { token: ... }`).
    /// Default: unset.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "lenient_string")]
    pub token: Option<String>,

    /// TLS settings. TLS is used whenever the server requires it or a URL starts with `tls://`,
    /// whatever these settings say; they choose which certificates are trusted and presented.
    pub tls: TlsConfig,

    /// How long one connection attempt (TCP, TLS and the NATS handshake) may take before it
    /// counts as failed, in milliseconds. Must be greater than 0. Default: `5000`.
    pub connect_timeout_ms: u64,

    /// When `false`, start-up fails with a clear error if no server can be reached on the
    /// first try. When `true`, start-up waits, retrying in the background, until a server
    /// accepts the connection: meanwhile `/healthz` answers and `/readyz` says not ready.
    /// Default: `false`.
    pub retry_on_initial_connect: bool,

    /// Upper bound of the reconnect backoff, in milliseconds. After a disconnect the first
    /// attempt is immediate, then the delay doubles from 100 ms until it reaches this cap; each
    /// delay is shortened by up to 20 % at random, so replicas do not reconnect in lockstep.
    /// Must be greater than 0. Default: `4000`.
    pub reconnect_delay_max_ms: u64,

    /// How many reconnect attempts in a row (one per server tried) the client makes before it
    /// gives up and closes the connection. Unset means retry forever, which suits a service
    /// under a supervisor that checks `/readyz`. `0` is rejected (the client library would
    /// read it as "forever"; leave the key unset for that). Default: unset (forever).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_reconnects: Option<usize>,

    /// Messages each subscription buffers between the network and the service. When the
    /// service falls this far behind, the client drops further messages for that
    /// subscription and reports a slow consumer (logged as a warning and counted). Must be
    /// greater than 0. Default: `65536`.
    pub subscription_capacity: usize,

    /// How often the client pings the server to detect a dead connection, in milliseconds.
    /// Must be greater than 0. Default: `60000`.
    pub ping_interval_ms: u64,
}

/// TLS settings of the NATS connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// Refuse to talk to a server without TLS: TLS is set up even when the server does not ask
    /// for it, and connecting fails if it cannot be. Default: `false` (TLS is still used when
    /// the server requires it or a URL starts with `tls://`).
    pub required: bool,

    /// PEM file with the certificate authorities that sign the server's certificate. When set,
    /// only these are trusted (the system's roots are not loaded). Default: unset (the
    /// system's roots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,

    /// PEM file with the client certificate presented to servers that verify clients
    /// (`verify: true` in the server's `tls` block). Set together with `key_file`.
    /// Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,

    /// PEM file with the private key of `cert_file` (PKCS#8, PKCS#1 or SEC1). Set together
    /// with `cert_file`. Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            servers: vec!["nats://127.0.0.1:4222".to_owned()],
            client_name: "structured-sink".to_owned(),
            credentials_file: None,
            nkey_seed: None,
            user: None,
            password: None,
            token: None,
            tls: TlsConfig::default(),
            connect_timeout_ms: 5_000,
            retry_on_initial_connect: false,
            reconnect_delay_max_ms: 4_000,
            max_reconnects: None,
            // async-nats' own default; see REFERENCE.md ("a subscription buffers 65,536").
            subscription_capacity: 65_536,
            ping_interval_ms: 60_000,
        }
    }
}

impl NatsConfig {
    /// A copy fit for printing and logging: the nkey seed, password, token and any password or
    /// token written into a server URL are replaced by [`MASK`]. Unset secrets stay unset, so
    /// the copy still shows which kind of authentication is configured.
    pub fn masked(&self) -> NatsConfig {
        let mask = |secret: &Option<String>| secret.as_ref().map(|_| MASK.to_owned());
        NatsConfig {
            servers: self.servers.iter().map(|url| mask_url_secret(url)).collect(),
            nkey_seed: mask(&self.nkey_seed),
            password: mask(&self.password),
            token: mask(&self.token),
            ..self.clone()
        }
    }

    /// Checks the settings that can be checked without touching the network or the file
    /// system, and names the offending key (relative to this section, e.g. `tls.key_file`).
    ///
    /// Rejected: no servers or a server URL that does not parse; an empty client name; more
    /// than one kind of authentication; a user without a password or the reverse; an nkey
    /// seed that is not a user seed; a client certificate without its key or the reverse;
    /// zero timeouts, intervals, backoff cap or buffer size; `max_reconnects = 0`.
    pub fn validate(&self) -> Result<(), BusError> {
        if self.servers.is_empty() {
            return Err(BusError::config(
                "servers",
                "at least one server URL is needed, e.g. [\"nats://127.0.0.1:4222\"]",
            ));
        }
        for (index, url) in self.servers.iter().enumerate() {
            if let Err(error) = url.parse::<async_nats::ServerAddr>() {
                return Err(BusError::config(
                    format!("servers[{index}]"),
                    format!("`{}` is not a NATS server URL: {error}", mask_url_secret(url)),
                ));
            }
        }
        if self.client_name.trim().is_empty() {
            return Err(BusError::config("client_name", "must not be empty"));
        }

        self.validate_auth()?;

        match (&self.tls.cert_file, &self.tls.key_file) {
            (Some(_), None) => {
                return Err(BusError::config(
                    "tls.key_file",
                    "tls.cert_file is set, so its private key file must be set too",
                ))
            }
            (None, Some(_)) => {
                return Err(BusError::config(
                    "tls.cert_file",
                    "tls.key_file is set, so the certificate file it belongs to must be set too",
                ))
            }
            _ => {}
        }

        let positive = [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("reconnect_delay_max_ms", self.reconnect_delay_max_ms),
            ("ping_interval_ms", self.ping_interval_ms),
            ("subscription_capacity", self.subscription_capacity as u64),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(BusError::config(key, "must be greater than 0"));
            }
        }
        if self.max_reconnects == Some(0) {
            return Err(BusError::config(
                "max_reconnects",
                "0 is not allowed: leave the key unset to retry forever, or give a positive limit",
            ));
        }
        Ok(())
    }

    /// The credentials the server URLs carry, percent-decoded: the same in every URL that carries
    /// any (a connection presents one set to whichever server it reaches), or an error naming the
    /// first URL that differs. async-nats does not read them from the URLs itself.
    pub(crate) fn url_credentials(&self) -> Result<Option<UrlCredentials>, BusError> {
        let mut found: Option<(usize, UrlCredentials)> = None;
        for (index, url) in self.servers.iter().enumerate() {
            let Ok(address) = url.parse::<async_nats::ServerAddr>() else { continue };
            let Some(user) = address.username() else { continue };
            let credentials = match address.password() {
                Some(password) => {
                    UrlCredentials::UserPassword { user: percent_decoded(user), password: percent_decoded(password) }
                }
                None => UrlCredentials::Token(percent_decoded(user)),
            };
            match &found {
                None => found = Some((index, credentials)),
                Some((first, known)) if *known != credentials => {
                    return Err(BusError::config(
                        format!("servers[{index}]"),
                        format!("carries other credentials than servers[{first}]; one connection presents one set to every server"),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(found.map(|(_, credentials)| credentials))
    }

    fn validate_auth(&self) -> Result<(), BusError> {
        match (&self.user, &self.password) {
            (Some(_), None) => {
                return Err(BusError::config("password", "`user` is set, so `password` must be set too"))
            }
            (None, Some(_)) => return Err(BusError::config("user", "`password` is set, so `user` must be set too")),
            _ => {}
        }
        let in_url = self.url_credentials()?.is_some();
        let kinds: Vec<&str> = [
            in_url.then_some("servers"),
            self.credentials_file.is_some().then_some("credentials_file"),
            self.nkey_seed.is_some().then_some("nkey_seed"),
            self.user.is_some().then_some("user"),
            self.token.is_some().then_some("token"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let [first, second, ..] = kinds.as_slice() {
            return Err(BusError::config(
                *second,
                format!(
                    "only one kind of authentication may be set, \
                     but both `{first}` and `{second}` are"
                ),
            ));
        }
        if let Some(seed) = &self.nkey_seed {
            // A user seed is base32 text starting with `SU`; the seed itself is never echoed.
            let shape_ok = seed.len() == 58
                && seed.starts_with("SU")
                && seed.bytes().all(|b| b.is_ascii_uppercase() || (b'2'..=b'7').contains(&b));
            if !shape_ok {
                return Err(BusError::config(
                    "nkey_seed",
                    "not a user nkey seed (expected 58 base32 characters starting with `SU`)",
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Debug for NatsConfig {
    /// Debug output goes to logs, so it shows the [masked](NatsConfig::masked) copy.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let masked = self.masked();
        f.debug_struct("NatsConfig")
            .field("servers", &masked.servers)
            .field("client_name", &masked.client_name)
            .field("credentials_file", &masked.credentials_file)
            .field("nkey_seed", &masked.nkey_seed)
            .field("user", &masked.user)
            .field("password", &masked.password)
            .field("token", &masked.token)
            .field("tls", &masked.tls)
            .field("connect_timeout_ms", &masked.connect_timeout_ms)
            .field("retry_on_initial_connect", &masked.retry_on_initial_connect)
            .field("reconnect_delay_max_ms", &masked.reconnect_delay_max_ms)
            .field("max_reconnects", &masked.max_reconnects)
            .field("subscription_capacity", &masked.subscription_capacity)
            .field("ping_interval_ms", &masked.ping_interval_ms)
            .finish()
    }
}

/// Credentials written into a server URL.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum UrlCredentials {
    /// `user:password@`.
    UserPassword { user: String, password: String },
    /// `token@`.
    Token(String),
}

/// `text` with its `%XX` escapes decoded (a URL's user information); an escape that is not two
/// hex digits stays as written.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .filter(|hex| hex.iter().all(u8::is_ascii_hexdigit))
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A list of strings, or one string as a list of one.
fn one_or_many<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(url) => vec![url],
        OneOrMany::Many(urls) => urls,
    })
}

/// Masks the secret part of the user info in a server URL: the password of `user:password@`,
/// or the whole of `token@`. Anything that is not such a URL is returned unchanged.
pub(crate) fn mask_url_secret(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return mask_authority(url, "");
    };
    mask_authority(&url[scheme_end..], &url[..scheme_end])
}

fn mask_authority(rest: &str, prefix: &str) -> String {
    // The last `@` ends the user information, even past a `/`: a password written with a raw `/`
    // (or `?`, `#`) is not a valid URL, and the error that says so must not print it. A NATS URL
    // has no path that could hold an `@` of its own.
    let Some(at) = rest.rfind('@') else {
        return format!("{prefix}{rest}");
    };
    let userinfo = &rest[..at];
    let masked = match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:{MASK}"),
        None => MASK.to_owned(),
    };
    format!("{prefix}{masked}{}", &rest[at..])
}

/// Reads a secret or name as a string even when a layer typed it: a TOML file may write
/// `token = 12345` or `user = true`. Both are taken as the text of the value. (The environment
/// and `--set` hand these keys over as strings already, see `config::VERBATIM_KEYS`.)
fn lenient_string<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Lenient {
        Text(String),
        Unsigned(u64),
        Signed(i64),
        Float(f64),
        Flag(bool),
    }
    Ok(Option::<Lenient>::deserialize(deserializer)?.map(|v| match v {
        Lenient::Text(s) => s,
        Lenient::Unsigned(n) => n.to_string(),
        Lenient::Signed(n) => n.to_string(),
        Lenient::Float(n) => n.to_string(),
        Lenient::Flag(b) => b.to_string(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: &str = "SUANQDPB2RUOE4ETUA26CNX7FUKE5ZZKFCQIIW63OX225F2CO7UEXTM7ZY";

    fn key_of(result: Result<(), BusError>) -> String {
        match result {
            Err(BusError::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid_and_documented_values() {
        let config = NatsConfig::default();
        config.validate().expect("defaults must be valid");
        assert_eq!(config.servers, ["nats://127.0.0.1:4222"]);
        assert_eq!(config.client_name, "structured-sink");
        assert_eq!(config.subscription_capacity, 65_536);
        assert_eq!(config.max_reconnects, None);
        assert!(!config.retry_on_initial_connect);
        assert!(!config.tls.required);
    }

    #[test]
    fn empty_section_deserializes_to_defaults() {
        let config: NatsConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, NatsConfig::default());
        let config: NatsConfig = serde_json::from_str(r#"{"tls":{"required":true}}"#).unwrap();
        assert!(config.tls.required);
        assert_eq!(config.servers, NatsConfig::default().servers);
    }

    #[test]
    fn unknown_keys_are_rejected_and_named() {
        let error = serde_json::from_str::<NatsConfig>(r#"{"server":["x"]}"#).unwrap_err();
        assert!(error.to_string().contains("unknown field `server`"), "{error}");
        let error = serde_json::from_str::<NatsConfig>(r#"{"tls":{"ca":"x"}}"#).unwrap_err();
        assert!(error.to_string().contains("unknown field `ca`"), "{error}");
    }

    #[test]
    fn serialization_round_trips() {
        let config = NatsConfig {
            token: Some("t".into()),
            max_reconnects: Some(10),
            tls: TlsConfig { ca_file: Some("/ca.pem".into()), ..TlsConfig::default() },
            ..NatsConfig::default()
        };
        let text = serde_json::to_string(&config).unwrap();
        assert!(!text.contains("nkey_seed"), "unset options are left out: {text}");
        assert_eq!(serde_json::from_str::<NatsConfig>(&text).unwrap(), config);
    }

    #[test]
    fn validation_names_the_offending_key() {
        let base = NatsConfig::default;
        let cases: Vec<(&str, NatsConfig)> = vec![
            ("servers", NatsConfig { servers: vec![], ..base() }),
            ("servers[1]", NatsConfig { servers: vec!["nats://a:4222".into(), "http://b:80".into()], ..base() }),
            ("client_name", NatsConfig { client_name: " ".into(), ..base() }),
            (
                "token",
                NatsConfig { user: Some("u".into()), password: Some("p".into()), token: Some("t".into()), ..base() },
            ),
            (
                "nkey_seed",
                NatsConfig { credentials_file: Some("/x.creds".into()), nkey_seed: Some(SEED.into()), ..base() },
            ),
            ("password", NatsConfig { user: Some("u".into()), ..base() }),
            ("user", NatsConfig { password: Some("p".into()), ..base() }),
            ("nkey_seed", NatsConfig { nkey_seed: Some("SAnotaseed".into()), ..base() }),
            (
                "tls.key_file",
                NatsConfig { tls: TlsConfig { cert_file: Some("c.pem".into()), ..TlsConfig::default() }, ..base() },
            ),
            (
                "tls.cert_file",
                NatsConfig { tls: TlsConfig { key_file: Some("k.pem".into()), ..TlsConfig::default() }, ..base() },
            ),
            ("connect_timeout_ms", NatsConfig { connect_timeout_ms: 0, ..base() }),
            ("reconnect_delay_max_ms", NatsConfig { reconnect_delay_max_ms: 0, ..base() }),
            ("ping_interval_ms", NatsConfig { ping_interval_ms: 0, ..base() }),
            ("subscription_capacity", NatsConfig { subscription_capacity: 0, ..base() }),
            ("max_reconnects", NatsConfig { max_reconnects: Some(0), ..base() }),
            (
                "servers[1]",
                NatsConfig { servers: vec!["nats://u:p@a:4222".into(), "nats://u:q@b:4222".into()], ..base() },
            ),
            (
                "user",
                NatsConfig {
                    servers: vec!["nats://t@a".into()],
                    user: Some("u".into()),
                    password: Some("p".into()),
                    ..base()
                },
            ),
        ];
        for (expected, config) in cases {
            assert_eq!(key_of(config.validate()), expected, "{config:?}");
        }
    }

    #[test]
    fn each_single_kind_of_authentication_is_valid() {
        let base = NatsConfig::default;
        let configs = [
            NatsConfig { credentials_file: Some("/x.creds".into()), ..base() },
            NatsConfig { nkey_seed: Some(SEED.into()), ..base() },
            NatsConfig { user: Some("u".into()), password: Some("p".into()), ..base() },
            NatsConfig { token: Some("t".into()), ..base() },
            NatsConfig {
                servers: vec!["tls://a:4222".into(), "b".into(), "nats://u:p@c:4222".into()],
                tls: TlsConfig {
                    required: true,
                    ca_file: Some("ca.pem".into()),
                    cert_file: Some("c.pem".into()),
                    key_file: Some("k.pem".into()),
                },
                ..base()
            },
        ];
        for config in configs {
            config.validate().unwrap_or_else(|e| panic!("{config:?}: {e}"));
        }
    }

    #[test]
    fn validation_errors_never_echo_secrets() {
        let config = NatsConfig { nkey_seed: Some("SUsecretbutmalformed".into()), ..NatsConfig::default() };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.contains("nkey_seed"), "{message}");
        assert!(!message.contains("secretbut"), "{message}");

        let config = NatsConfig { servers: vec!["http://u:hunter2@b:80".into()], ..NatsConfig::default() };
        let message = config.validate().unwrap_err().to_string();
        assert!(!message.contains("hunter2"), "{message}");
    }

    #[test]
    fn credentials_in_server_urls_are_read_percent_decoded_and_must_agree() {
        let of = |servers: &[&str]| {
            NatsConfig { servers: servers.iter().map(|s| s.to_string()).collect(), ..NatsConfig::default() }
                .url_credentials()
                .unwrap()
        };
        assert!(of(&["nats://a:4222", "b:4222"]).is_none());
        assert!(
            of(&["nats://a:4222", "nats://sink:p%40ss%2Fw%3Ard@b:4222"])
                == Some(UrlCredentials::UserPassword { user: "sink".into(), password: "p@ss/w:rd".into() })
        );
        assert!(of(&["nats://tok%25en@a", "nats://tok%25en@b"]) == Some(UrlCredentials::Token("tok%en".into())));
        assert_eq!(percent_decoded("100%"), "100%", "an incomplete escape stays as written");
        assert_eq!(percent_decoded("%zz%4"), "%zz%4");
        assert_eq!(percent_decoded("%+1%-1"), "%+1%-1", "two hex digits, no sign");
        let differing =
            NatsConfig { servers: vec!["nats://u:p@a".into(), "nats://u:q@b".into()], ..NatsConfig::default() };
        let error = differing.validate().unwrap_err().to_string();
        assert!(error.contains("servers[1]") && !error.contains(":p@") && !error.contains(":q@"), "{error}");
    }

    #[test]
    fn masked_replaces_every_secret_and_keeps_the_rest() {
        let config = NatsConfig {
            servers: vec![
                "nats://alice:s3cret@a:4222".into(),
                "nats://tok3n@b:4222".into(),
                "c:4222".into(),
                "alice:pw@d:4222".into(),
            ],
            nkey_seed: Some(SEED.into()),
            user: Some("alice".into()),
            password: Some("s3cret".into()),
            token: Some("tok3n".into()),
            credentials_file: Some("/etc/nats/user.creds".into()),
            ..NatsConfig::default()
        };
        let masked = config.masked();
        assert_eq!(masked.servers, ["nats://alice:***@a:4222", "nats://***@b:4222", "c:4222", "alice:***@d:4222"]);
        // A raw `/` in a password makes the URL invalid; the error must not print it either.
        assert_eq!(mask_url_secret("nats://alice:pa/ss#w@a:4222"), "nats://alice:***@a:4222");
        let invalid = NatsConfig { servers: vec!["nats://alice:pa/ss#w@a:4222".into()], ..NatsConfig::default() };
        let error = invalid.validate().map(|_| ()).unwrap_err().to_string();
        assert!(!error.contains("pa/ss"), "{error}");
        assert_eq!(masked.nkey_seed.as_deref(), Some(MASK));
        assert_eq!(masked.password.as_deref(), Some(MASK));
        assert_eq!(masked.token.as_deref(), Some(MASK));
        assert_eq!(masked.user.as_deref(), Some("alice"));
        assert_eq!(masked.credentials_file, config.credentials_file);

        let printed = format!("{config:?} {}", serde_json::to_string(&masked).unwrap());
        for secret in ["s3cret", "tok3n", SEED] {
            assert!(!printed.contains(secret), "{secret} leaked: {printed}");
        }
        assert_eq!(NatsConfig::default().masked(), NatsConfig::default());
    }
}
