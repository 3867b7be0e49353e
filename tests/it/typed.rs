//! Typed extraction end to end: block types declared in `.proto` files reach `completed` events
//! as `Any`, in `replay` and in the service; the prompt text round-trips through the pipeline.

use std::process::Command;

use serde_json::Value;
use structured_sink::config::Config;
use structured_sink::typed::{prompt::example_yaml, SchemaRegistry};

use crate::service::test_config;
use crate::support::NatsServer;

const MODE_SWITCH_PROTO: &str = r#"syntax = "proto3";
package myapp.v1;
import "structuredsink/v1/options.proto";

// Switches the agent to another mode.
message ModeSwitch {
  option (structuredsink.v1.block) = { tag: "myapp:ModeSwitch:v1" };
  // The mode to switch to.
  string new_mode = 1;
  // Why.
  string reason = 2;
}
"#;

fn event(message_id: &str, kind: &str, text: &str) -> String {
    let field = if kind == "partial" { "delta" } else { "text" };
    serde_json::json!({"type": kind, "meta": {"message_id": message_id}, field: text}).to_string()
}

fn replay(config: &Config, lines: &[String]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut err = Vec::new();
    structured_sink::replay::replay(config, lines.join("\n").as_bytes(), &mut out, &mut err).unwrap();
    assert!(err.is_empty(), "{}", String::from_utf8_lossy(&err));
    String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn completed(records: &[Value]) -> Vec<&Value> {
    records.iter().filter_map(|r| r["message"].get("completed")).collect()
}

#[test]
fn a_proto_supplied_only_through_configuration_types_its_block() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("myapp")).unwrap();
    std::fs::write(dir.path().join("myapp/mode_switch.proto"), MODE_SWITCH_PROTO).unwrap();
    let mut config = Config::default();
    config.schemas.dirs = vec![dir.path().to_owned()];
    let good =
        "Switching.<myapp:ModeSwitch:v1>\n```yaml\nnew_mode: research\nreason: sources\n```\n</myapp:ModeSwitch:v1>";
    let bad = "<myapp:ModeSwitch:v1>\nnew_mode: research\nmood: happy\n</myapp:ModeSwitch:v1>";
    let records = replay(
        &config,
        &[
            event("a", "partial", &good[..20]),
            event("a", "partial", &good[20..]),
            event("a", "final", good),
            event("b", "final", bad),
        ],
    );
    let done = completed(&records);
    assert_eq!(done.len(), 2);
    assert_eq!(done[0]["success"], true, "{}", done[0]);
    assert_eq!(done[0]["typed"]["@type"], "type.googleapis.com/myapp.v1.ModeSwitch");
    assert_eq!(done[0]["typed"]["new_mode"], "research");
    assert_eq!(done[0]["value"]["reason"], "sources");
    assert_ne!(done[1]["success"], true, "false is the proto3 default, so it is omitted");
    let error = done[1]["error"].as_str().unwrap();
    assert!(error.contains("mood") && error.contains("myapp.v1.ModeSwitch"), "{error}");
}

#[test]
fn builtin_types_are_typed_without_configuration() {
    let text = "<pinocchio:agent_mode_switch:v1>\n```yaml\nmode_switch:\n  analysis: needs code\n  new_mode: coding\n```\n</pinocchio:agent_mode_switch:v1>";
    let records = replay(&Config::default(), &[event("m", "final", text)]);
    let done = completed(&records);
    assert_eq!(done[0]["success"], true, "{}", done[0]);
    assert_eq!(done[0]["typed"]["@type"], "type.googleapis.com/pinocchio.v1.AgentModeSwitch");
    assert_eq!(done[0]["typed"]["mode_switch"]["new_mode"], "coding");
}

#[test]
fn the_prompt_example_of_every_builtin_type_goes_through_the_pipeline() {
    let registry = SchemaRegistry::builtin();
    for block in registry.block_types() {
        let tag = block.tag();
        let text = format!("Here.\n<{tag}>\n```yaml\n{}```\n</{tag}>\nDone.", example_yaml(block));
        let records = replay(&Config::default(), &[event("p", "final", &text)]);
        let done = completed(&records);
        assert_eq!(done.len(), 1, "{tag}");
        assert_eq!(done[0]["success"], true, "{tag}: {}", done[0]);
        assert_eq!(done[0]["typed"]["@type"], block.type_url());
        let visible = records.iter().rev().find(|r| r["subject"] == "chat.filtered").unwrap();
        assert_eq!(visible["message"]["text"], "Here.\n\nDone.");
    }
}

#[test]
fn large_yaml_blocks_stream_snapshots_that_grow() {
    let mut payload = String::from("```yaml\nitems:\n");
    for i in 0..400 {
        payload.push_str(&format!("  - name: item {i}\n"));
    }
    payload.push_str("```\n");
    let text = format!("<geppetto:citations:v1>{payload}</geppetto:citations:v1>");
    let lines: Vec<String> =
        text.as_bytes().chunks(16).map(|c| event("s", "partial", std::str::from_utf8(c).unwrap())).collect();
    let mut config = Config::default();
    config.tags.push(structured_sink::config::TagConfig::new(
        "geppetto:citations:v1",
        structured_sink::pipeline::TagKind::Block,
    ));
    let records = replay(&config, &lines);
    let sizes: Vec<usize> = records
        .iter()
        .filter_map(|r| r["message"].get("snapshot"))
        .map(|s| s["value"]["items"].as_array().map_or(0, Vec::len))
        .collect();
    assert!(sizes.len() >= 3, "{sizes:?}");
    assert!(sizes.windows(2).all(|w| w[0] < w[1]), "snapshots only when changed: {sizes:?}");
}

fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_structured-sink"));
    command.env_remove("STRUCTURED_SINK_CONFIG");
    command
}

#[test]
fn prompt_command_prints_the_builtin_instructions() {
    let output = binary().arg("prompt").output().unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    let expected = structured_sink::typed::render_prompt(&SchemaRegistry::builtin(), &[]).unwrap();
    assert_eq!(stdout, expected);
    insta::assert_snapshot!("prompt_builtin", stdout);
    let output = binary().args(["prompt", "nope:x:v1"]).output().unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("nope:x:v1"));
}

#[test]
fn a_schema_error_stops_start_up_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("broken.proto"),
        "syntax = \"proto3\";\npackage x;\nmessage M {\n  strin name = 1;\n}\n",
    )
    .unwrap();
    let output =
        binary().args(["--set", &format!("schemas.dirs=[\"{}\"]", dir.path().display()), "prompt"]).output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("broken.proto:4"), "{stderr}");
}

#[tokio::test]
async fn the_running_service_answers_prompt_requests() {
    let server = NatsServer::start();
    let service = structured_sink::service::RunningService::start(test_config(&server.url())).await.unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let reply = client.request("structured-sink.prompt", r#"["geppetto:citations:v1"]"#.into()).await.unwrap();
    let text = String::from_utf8(reply.payload.to_vec()).unwrap();
    assert!(text.contains("<geppetto:citations:v1>") && text.contains("</geppetto:citations:v1>"), "{text}");
    assert!(!text.contains("pinocchio"), "only the requested type");
    let reply = client.request("structured-sink.prompt", "".into()).await.unwrap();
    assert!(String::from_utf8_lossy(&reply.payload).contains("pinocchio:agent_mode_switch:v1"));
    service.shutdown().await.unwrap();
}
