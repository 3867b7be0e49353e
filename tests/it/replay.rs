//! `structured-sink replay` on the bundled example transcript: the binary as a user runs it.

use std::process::Command;

use serde_json::Value;

fn replay_example() -> (Vec<Value>, String) {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = Command::new(env!("CARGO_BIN_EXE_structured-sink"))
        .args(["--config", &format!("{root}/examples/replay.toml"), "replay"])
        .arg(format!("{root}/examples/transcripts/conversation.jsonl"))
        .env_remove("STRUCTURED_SINK_CONFIG")
        .output()
        .expect("the binary runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let records = stdout.lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect();
    (records, String::from_utf8(output.stderr).unwrap())
}

fn messages<'a>(records: &'a [Value], subject: &'a str, stream: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    records
        .iter()
        .filter(move |r| r["subject"] == subject && r["message"]["stream"]["stream_id"] == stream)
        .map(|r| &r["message"])
}

const LEGACY: &str = "3f2a9c1e-5b7d-4e8a-9b10-2c3d4e5f6071";
const CANONICAL: &str = "openai:run-2:provider-call:0:msg_def:0:text";

#[test]
fn replay_filters_the_example_conversation() {
    let (records, stderr) = replay_example();
    assert_eq!(stderr, "line 6: event has no meta.message_id\n");

    // Visible text: the deltas add up to the final's whole text, with every block removed.
    let filtered: Vec<&Value> = messages(&records, "chat.filtered", LEGACY).collect();
    let joined: String = filtered.iter().map(|m| m["delta"].as_str().unwrap_or_default()).collect();
    let last = filtered.last().unwrap();
    assert_eq!(last["final"], true);
    assert_eq!(last["finish_reason"], "stop");
    let expected = "Let me check the current mode.\n\n\nSwitching now. \nNote that a < b and <b>bold</b> stay as text.";
    assert_eq!(last["text"], expected);
    assert_eq!(joined, expected);

    // Sequence numbers of one stream run 1, 2, 3, ... across all subjects, in publish order.
    let seqs: Vec<u64> = records
        .iter()
        .filter(|r| r["message"]["stream"]["stream_id"] == LEGACY)
        .map(|r| r["message"]["seq"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());

    let thinking: String =
        messages(&records, "chat.thinking", LEGACY).filter_map(|m| m["delta"]["text"].as_str()).collect();
    assert_eq!(thinking, "The user wants research; switching is cheap.");

    let block: Vec<&Value> = messages(&records, "chat.structured.myapp.ModeSwitch.v1", LEGACY).collect();
    assert!(block.first().unwrap().get("started").is_some());
    let completed = &block.last().unwrap()["completed"];
    assert_eq!(completed["success"], true);
    assert_eq!(completed["raw"], "\n```yaml\nnew_mode: research\nreason: the user asked for sources\n```\n");
    let streamed: String = block.iter().filter_map(|m| m["delta"]["raw"].as_str()).collect();
    assert_eq!(streamed, completed["raw"].as_str().unwrap(), "deltas add up to the payload");

    let tool: Vec<&Value> = messages(&records, "chat.tools", LEGACY).collect();
    assert_eq!(tool.len(), 1);
    assert_eq!(tool[0]["tool_name"], "search");
    assert_eq!(tool[0]["server_name"], "local");
    assert_eq!(tool[0]["arguments"]["query"], "streaming parsers </tool> in JSON");

    // The canonical-vocabulary stream is keyed by its segment and interleaves without mixing.
    let last = messages(&records, "chat.filtered", CANONICAL).last().unwrap();
    assert_eq!(last["text"], "Sources:  done.");
    let citations = messages(&records, "chat.structured.geppetto.citations.v1", CANONICAL).last().unwrap();
    // Item ids begin with the stream's key: its message id, then its segment id.
    assert_eq!(citations["item_id"], format!("9b1d7f00-0000-4000-8000-000000000002/{CANONICAL}:1"));
    assert_eq!(citations["completed"]["success"], true);
}

#[test]
fn replay_output_is_deterministic_and_matches_the_snapshot() {
    let (first, _) = replay_example();
    let (second, _) = replay_example();
    assert_eq!(first, second);
    let text: String = first.iter().map(|r| format!("{r}\n")).collect();
    insta::assert_snapshot!("replay_conversation", text);
}
