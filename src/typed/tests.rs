//! Tests of the typed module across its parts: loading, conversion, `Any`, prompts.

use std::path::{Path, PathBuf};

use prost::Message as _;
use prost_reflect::{DynamicMessage, MapKey, Value};
use serde_json::json;

use super::builtin::{self, geppetto, pinocchio};
use super::*;
use crate::payload::{self, PayloadFormat};

/// A user schema exercising every kind of field the converter handles.
const MODE_PROTO: &str = r#"syntax = "proto3";

package myapp.v1;

import "structuredsink/v1/options.proto";
import "google/protobuf/timestamp.proto";

// Switch the assistant to another mode.
message ModeSwitch {
  option (structuredsink.v1.block) = { tag: "myapp:ModeSwitch:v1", subject: "myapp.modes" };

  // The mode to switch to.
  string new_mode = 1;
  // Why the switch is needed.
  string reason = 2;
  // How urgent the switch is.
  Urgency urgency = 3;
  Details details = 4;
  repeated Step steps = 5;
  map<string, int32> weights = 6;
  bytes blob = 7;
  uint32 count = 8;
  float ratio = 9;
  // Who the switch is for.
  oneof target {
    string user = 10;
    string team = 11;
  }
  google.protobuf.Timestamp at = 12;
  optional bool confirmed = 13;
  map<int32, Step> by_rank = 14;
}

enum Urgency {
  URGENCY_UNSPECIFIED = 0;
  URGENCY_LOW = 1;
  URGENCY_HIGH = 2;
}

message Details {
  // A free-form note.
  string note = 1;
  repeated int64 ids = 2;
}

message Step {
  string name = 1;
  int32 order = 2;
}

// A tree, to test the depth limit.
message Node {
  option (structuredsink.v1.block) = { tag: "myapp:node:v1" };

  string name = 1;
  Node child = 2;
}
"#;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, text).unwrap();
    path
}

/// A registry with [`MODE_PROTO`] loaded from a temporary directory.
fn user_registry() -> (tempfile::TempDir, SchemaRegistry) {
    registry_of("myapp/v1/mode.proto", MODE_PROTO)
}

/// A registry with one file, `proto` at `path`, loaded from a temporary directory.
fn registry_of(path: &str, proto: &str) -> (tempfile::TempDir, SchemaRegistry) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), path, proto);
    let registry = SchemaRegistry::load(&[dir.path().to_owned()]).unwrap();
    (dir, registry)
}

fn mode_switch(registry: &SchemaRegistry) -> &BlockType {
    registry.block_type("myapp:ModeSwitch:v1").unwrap()
}

fn field(message: &DynamicMessage, name: &str) -> Value {
    message.get_field_by_name(name).unwrap().into_owned()
}

fn load_error(files: &[(&str, &str)]) -> (tempfile::TempDir, SchemaError) {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        write(dir.path(), name, text);
    }
    let err = SchemaRegistry::load(&[dir.path().to_owned()]).unwrap_err();
    (dir, err)
}

// ---- loading -----------------------------------------------------------------------------

#[test]
fn registry_is_shareable_across_threads() {
    fn shareable<T: Send + Sync + Clone>() {}
    shareable::<SchemaRegistry>();
    shareable::<BlockType>();
}

#[test]
fn builtin_registry_has_the_shipped_types() {
    let registry = SchemaRegistry::builtin();
    assert_eq!(registry.tags().collect::<Vec<_>>(), [builtin::CITATIONS_TAG, builtin::AGENT_MODE_SWITCH_TAG]);
    let citations = registry.block_type(builtin::CITATIONS_TAG).unwrap();
    assert_eq!(citations.descriptor().full_name(), "geppetto.v1.Citations");
    assert_eq!(citations.subject(), None);
    let ext = registry.descriptor_pool().get_extension_by_name(builtin::BLOCK_OPTION).unwrap();
    assert_eq!(ext.number(), builtin::BLOCK_OPTION_NUMBER);
}

#[test]
fn loads_user_types_from_a_directory() {
    let (_dir, registry) = user_registry();
    assert_eq!(
        registry.tags().collect::<Vec<_>>(),
        ["geppetto:citations:v1", "myapp:ModeSwitch:v1", "myapp:node:v1", "pinocchio:agent_mode_switch:v1"]
    );
    let mode = mode_switch(&registry);
    assert_eq!(mode.tag(), "myapp:ModeSwitch:v1");
    assert_eq!(mode.descriptor().full_name(), "myapp.v1.ModeSwitch");
    assert_eq!(mode.subject(), Some("myapp.modes"));
    assert_eq!(registry.block_type("myapp:node:v1").unwrap().subject(), None);
    assert!(registry.block_type("myapp:Other:v1").is_none());
}

#[test]
fn files_import_each_other_relative_to_their_directory() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "shared/v1/common.proto",
        "syntax = \"proto3\";\npackage shared.v1;\nmessage Reason { string text = 1; }\n",
    );
    write(
        dir.path(),
        "app/v1/block.proto",
        "syntax = \"proto3\";\npackage app.v1;\nimport \"structuredsink/v1/options.proto\";\n\
         import \"shared/v1/common.proto\";\n\
         message Block {\n  option (structuredsink.v1.block) = { tag: \"app:block:v1\" };\n  shared.v1.Reason reason = 1;\n}\n",
    );
    let registry = SchemaRegistry::load(&[dir.path().to_owned()]).unwrap();
    let block = registry.block_type("app:block:v1").unwrap();
    let msg = block.convert(&json!({"reason": {"text": "t"}})).unwrap();
    let Value::Message(reason) = field(&msg, "reason") else { panic!() };
    assert_eq!(field(&reason, "text"), Value::String("t".into()));
}

#[test]
fn a_syntax_error_names_file_and_line() {
    let (dir, err) = load_error(&[(
        "myapp/bad.proto",
        "syntax = \"proto3\";\npackage myapp;\nmessage Broken {\n  string = 1;\n}\n",
    )]);
    let path = dir.path().join("myapp/bad.proto");
    let text = err.to_string();
    assert!(text.starts_with(&format!("{}:4:", path.display())), "{text}");
    assert!(matches!(&err, SchemaError::Compile { file: Some(f), .. } if *f == path), "{err:?}");
}

#[test]
fn an_unresolved_type_names_file_and_line() {
    let (dir, err) = load_error(&[(
        "myapp/types.proto",
        "syntax = \"proto3\";\npackage myapp;\n\nmessage Uses {\n  Missing thing = 1;\n}\n",
    )]);
    let text = err.to_string();
    assert!(text.starts_with(&format!("{}:5:", dir.path().join("myapp/types.proto").display())), "{text}");
    assert!(text.contains("Missing"), "{text}");
}

#[test]
fn duplicate_tags_name_both_declarations() {
    let block = |package: &str| {
        format!(
            "syntax = \"proto3\";\npackage {package};\nimport \"structuredsink/v1/options.proto\";\n\
             message Mode {{\n  option (structuredsink.v1.block) = {{ tag: \"myapp:ModeSwitch:v1\" }};\n  string new_mode = 1;\n}}\n"
        )
    };
    let (dir, err) = load_error(&[("a/mode.proto", &block("a")), ("b/mode.proto", &block("b"))]);
    let text = err.to_string();
    assert!(matches!(err, SchemaError::DuplicateTag { ref tag, .. } if tag == "myapp:ModeSwitch:v1"), "{err:?}");
    assert!(text.contains(&format!("a.Mode ({}:4)", dir.path().join("a/mode.proto").display())), "{text}");
    assert!(text.contains(&format!("b.Mode ({}:4)", dir.path().join("b/mode.proto").display())), "{text}");
}

#[test]
fn a_duplicate_of_a_builtin_tag_is_an_error() {
    let (_dir, err) = load_error(&[(
        "mine.proto",
        "syntax = \"proto3\";\npackage mine;\nimport \"structuredsink/v1/options.proto\";\n\
         message Cites {\n  option (structuredsink.v1.block) = { tag: \"geppetto:citations:v1\" };\n}\n",
    )]);
    let text = err.to_string();
    assert!(text.contains("geppetto.v1.Citations (built-in geppetto/v1/citations.proto:"), "{text}");
    assert!(text.contains("mine.Cites ("), "{text}");
}

#[test]
fn an_invalid_tag_or_subject_names_the_message() {
    let decl = |option: &str| {
        format!(
            "syntax = \"proto3\";\npackage p;\nimport \"structuredsink/v1/options.proto\";\n\n\
             message M {{\n  option (structuredsink.v1.block) = {{ {option} }};\n}}\n"
        )
    };
    let (dir, err) = load_error(&[("m.proto", &decl("tag: \"not-a-triple\""))]);
    assert!(matches!(err, SchemaError::InvalidTag { .. }), "{err:?}");
    assert!(err.to_string().starts_with(&format!("{}:5: message p.M", dir.path().join("m.proto").display())), "{err}");

    let (_dir, err) = load_error(&[("m.proto", &decl("tag: \"p:m:v1\", subject: \"a.*\""))]);
    assert!(matches!(err, SchemaError::InvalidSubject { .. }), "{err:?}");
}

#[test]
fn a_vendored_copy_of_a_builtin_is_skipped_but_a_changed_one_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), builtin::OPTIONS_FILE, builtin::source(builtin::OPTIONS_FILE).unwrap());
    write(dir.path(), "myapp/v1/mode.proto", MODE_PROTO);
    let registry = SchemaRegistry::load(&[dir.path().to_owned()]).unwrap();
    assert!(registry.block_type("myapp:ModeSwitch:v1").is_some());

    write(dir.path(), builtin::OPTIONS_FILE, "syntax = \"proto3\";\npackage structuredsink.v1;\n");
    let err = SchemaRegistry::load(&[dir.path().to_owned()]).unwrap_err();
    assert!(matches!(err, SchemaError::ShadowsBuiltin { ref name, .. } if name == builtin::OPTIONS_FILE), "{err:?}");
}

#[test]
fn a_missing_directory_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let err = SchemaRegistry::load(std::slice::from_ref(&missing)).unwrap_err();
    assert!(matches!(err, SchemaError::Io { ref path, .. } if *path == missing), "{err:?}");
}

// ---- conversion --------------------------------------------------------------------------

#[test]
fn converts_snake_case_and_camel_case_names() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    for value in [json!({"new_mode": "review", "reason": "done"}), json!({"newMode": "review", "reason": "done"})] {
        let msg = mode.convert(&value).unwrap();
        assert_eq!(field(&msg, "new_mode"), Value::String("review".into()));
        assert_eq!(field(&msg, "reason"), Value::String("done".into()));
    }
}

#[test]
fn converts_every_kind_of_field() {
    let (_dir, registry) = user_registry();
    let msg = mode_switch(&registry)
        .convert(&json!({
            "urgency": "URGENCY_HIGH",
            "details": {"note": 1984, "ids": [1, "2", 3.0]},
            "steps": [{"name": "a", "order": 1}, {"name": "b"}],
            "weights": {"x": 2},
            "blob": "aGk=",
            "count": 7,
            "ratio": "0.5",
            "team": "core",
            "at": "2024-01-31T12:00:00Z",
            "confirmed": false,
            "byRank": {"3": {"name": "c"}},
            "reason": null,
        }))
        .unwrap();
    assert_eq!(field(&msg, "urgency"), Value::EnumNumber(2));
    let Value::Message(details) = field(&msg, "details") else { panic!() };
    assert_eq!(field(&details, "note"), Value::String("1984".into()));
    assert_eq!(field(&details, "ids"), Value::List(vec![Value::I64(1), Value::I64(2), Value::I64(3)]));
    let Value::List(steps) = field(&msg, "steps") else { panic!() };
    assert_eq!(steps.len(), 2);
    let Value::Map(weights) = field(&msg, "weights") else { panic!() };
    assert_eq!(weights[&MapKey::String("x".into())], Value::I32(2));
    assert_eq!(field(&msg, "blob"), Value::Bytes(b"hi".to_vec().into()));
    assert_eq!(field(&msg, "count"), Value::U32(7));
    assert_eq!(field(&msg, "ratio"), Value::F32(0.5));
    assert_eq!(field(&msg, "team"), Value::String("core".into()));
    assert!(msg.has_field_by_name("confirmed"), "an explicit false on an optional field is kept");
    let Value::Message(at) = field(&msg, "at") else { panic!() };
    assert_eq!(field(&at, "seconds"), Value::I64(1_706_702_400));
    let Value::Map(by_rank) = field(&msg, "by_rank") else { panic!() };
    assert!(by_rank.contains_key(&MapKey::I32(3)));
    assert!(!msg.has_field_by_name("reason"), "null leaves a field unset");

    let by_number = mode_switch(&registry).convert(&json!({"urgency": 1})).unwrap();
    assert_eq!(field(&by_number, "urgency"), Value::EnumNumber(1));
}

#[test]
fn an_unknown_field_is_named() {
    let (_dir, registry) = user_registry();
    let err = mode_switch(&registry).convert(&json!({"details": {"note": "n", "nope": 1}})).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::UnknownField);
    assert_eq!(err.to_string(), r#"details: unknown field "nope" (expected one of: note, ids)"#);

    let err = mode_switch(&registry).convert(&json!({"mode": "x"})).unwrap_err();
    assert!(
        err.to_string().starts_with(r#"payload: unknown field "mode" (expected one of: new_mode, reason,"#),
        "{err}"
    );
}

#[test]
fn a_wrong_type_names_the_nested_path() {
    let citations = SchemaRegistry::builtin().block_type(builtin::CITATIONS_TAG).unwrap().clone();
    let value = json!({"citations": [{"title": "A", "year": 2020}, {"title": "B", "year": "x"}]});
    let err = citations.convert(&value).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::WrongType);
    assert_eq!(err.path(), "citations[1].year");
    assert_eq!(err.to_string(), r#"citations[1].year: expected an integer, got string "x""#);

    let err = citations.convert(&json!({"citations": {"title": "A"}})).unwrap_err();
    assert_eq!(err.to_string(), "citations: expected a list, got a mapping");
    let err = citations.convert(&json!({"citations": [{"authors": ["a", null]}]})).unwrap_err();
    assert_eq!(err.to_string(), "citations[0].authors[1]: expected a string, got null");
    let err = citations.convert(&json!(["not", "a", "mapping"])).unwrap_err();
    assert_eq!(err.to_string(), "payload: expected a mapping (Citations), got a list of 3 items");
}

#[test]
fn map_and_list_paths_show_keys_and_indexes() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let err = mode.convert(&json!({"steps": [{"name": "a"}, {"order": 1.5}]})).unwrap_err();
    assert_eq!(err.to_string(), "steps[1].order: expected an integer, got number 1.5");
    let err = mode.convert(&json!({"weights": {"w": true}})).unwrap_err();
    assert_eq!(err.to_string(), r#"weights["w"]: expected an integer, got boolean true"#);
    let err = mode.convert(&json!({"by_rank": {"first": {}}})).unwrap_err();
    assert_eq!(err.to_string(), r#"by_rank["first"]: expected an integer, got string "first""#);
}

#[test]
fn numbers_outside_the_field_range_are_rejected() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let err = mode.convert(&json!({"count": -1})).unwrap_err();
    assert_eq!(
        (err.kind(), err.to_string().as_str()),
        (ConversionErrorKind::OutOfRange, "count: number -1 is out of range for uint32")
    );
    let err = mode.convert(&json!({"steps": [{"order": 3_000_000_000_u64}]})).unwrap_err();
    assert_eq!(err.to_string(), "steps[0].order: number 3000000000 is out of range for int32");
    let err = mode.convert(&json!({"ratio": 1e300})).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::OutOfRange);
}

#[test]
fn a_bad_enum_value_lists_the_declared_names() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let err = mode.convert(&json!({"urgency": "urgency_high"})).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::BadEnumValue);
    assert_eq!(
        err.to_string(),
        r#"urgency: string "urgency_high" is not a value of enum Urgency (expected one of: URGENCY_UNSPECIFIED, URGENCY_LOW, URGENCY_HIGH)"#
    );
    let err = mode.convert(&json!({"urgency": 9})).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::BadEnumValue);
}

#[test]
fn conflicting_names_and_oneof_members_are_rejected() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let err = mode.convert(&json!({"new_mode": "a", "newMode": "b"})).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::Conflict);
    assert_eq!(err.to_string(), r#"new_mode: given twice, as "newMode" and "new_mode""#);
    let err = mode.convert(&json!({"user": "u", "team": "t"})).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::Conflict);
    assert!(err.to_string().contains("oneof `target`"), "{err}");
}

#[test]
fn well_known_types_and_bytes_report_their_form() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let err = mode.convert(&json!({"at": "yesterday"})).unwrap_err();
    assert!(err.to_string().starts_with("at: expected an RFC 3339 timestamp string"), "{err}");
    let err = mode.convert(&json!({"blob": "not base64!"})).unwrap_err();
    assert_eq!(err.to_string(), "blob: expected base64 bytes, got a string that is not base64");
}

#[test]
fn null_is_a_null_value_but_leaves_lists_and_maps_of_values_unset() {
    let proto = r#"syntax = "proto3";
package loose.v1;
import "structuredsink/v1/options.proto";
import "google/protobuf/struct.proto";
message Loose {
  option (structuredsink.v1.block) = { tag: "loose:Loose:v1" };
  google.protobuf.Value one = 1;
  repeated google.protobuf.Value items = 2;
  map<string, google.protobuf.Value> named = 3;
}
"#;
    let (_dir, registry) = registry_of("loose/v1/loose.proto", proto);
    let loose = registry.block_type("loose:Loose:v1").unwrap();
    let msg = loose.convert(&json!({"one": null, "items": null, "named": null})).unwrap();
    assert!(msg.has_field_by_name("one"), "a null google.protobuf.Value is a value");
    assert!(!msg.has_field_by_name("items") && !msg.has_field_by_name("named"));
    let msg = loose.convert(&json!({"items": [null, 1]})).unwrap();
    let Value::List(items) = field(&msg, "items") else { panic!() };
    assert_eq!(items.len(), 2);
}

#[test]
fn errors_quote_at_most_a_short_part_of_the_payload() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let long = "secret ".repeat(1000);
    for value in [json!({"count": long}), json!({"urgency": long}), json!({ long.clone(): 1 })] {
        let err = mode.convert(&value).unwrap_err().to_string();
        assert!(err.len() < 400, "{} bytes: {err}", err.len());
        assert!(err.matches("secret").count() <= 5, "{err}");
    }
}

#[test]
fn partial_conversion_drops_what_does_not_convert() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let value = json!({
        "new_mode": "review",
        "urgency": "URGENT",
        "unknown": 1,
        "steps": [{"name": "a", "order": "x"}, 5, {"name": "c"}],
        "weights": {"ok": 1, "bad": "x"},
        "user": "u",
        "team": "t",
    });
    assert!(mode.convert(&value).is_err());
    let msg = mode.convert_partial(&value).unwrap();
    assert_eq!(field(&msg, "new_mode"), Value::String("review".into()));
    assert!(!msg.has_field_by_name("urgency"));
    let Value::List(steps) = field(&msg, "steps") else { panic!() };
    assert_eq!(steps.len(), 2, "the element that is not a mapping is dropped");
    let Value::Message(first) = &steps[0] else { panic!() };
    assert_eq!(field(first, "name"), Value::String("a".into()));
    assert!(!first.has_field_by_name("order"));
    let Value::Map(weights) = field(&msg, "weights") else { panic!() };
    assert_eq!(weights.len(), 1);
    // One member of the oneof is kept (the first in the mapping's key order).
    assert!(msg.has_field_by_name("team") != msg.has_field_by_name("user"));

    assert!(mode.convert_partial(&serde_json::Value::Null).is_none());
    assert!(mode.convert_partial(&json!("text")).is_none());
    assert_eq!(mode.convert_partial(&json!({})).unwrap(), DynamicMessage::new(mode.descriptor().clone()));
}

/// `{"name": "n", "child": {... depth levels in all}}`.
fn nested_nodes(depth: usize) -> serde_json::Value {
    let mut value = json!({"name": "leaf"});
    for _ in 1..depth {
        value = json!({"name": "n", "child": value});
    }
    value
}

#[test]
fn nesting_is_limited() {
    let (_dir, registry) = user_registry();
    let node = registry.block_type("myapp:node:v1").unwrap();
    assert!(node.convert(&nested_nodes(MAX_NESTING_DEPTH)).is_ok());

    let err = node.convert(&nested_nodes(MAX_NESTING_DEPTH + 1)).unwrap_err();
    assert_eq!(err.kind(), ConversionErrorKind::TooDeep);
    assert!(err.to_string().contains(&format!("deeper than {MAX_NESTING_DEPTH} levels")), "{err}");
    assert_eq!(err.path().matches("child").count(), MAX_NESTING_DEPTH);

    let mut current = node.convert_partial(&nested_nodes(1000)).unwrap();
    let mut depth = 1;
    while current.has_field_by_name("child") {
        let Value::Message(child) = field(&current, "child") else { panic!() };
        current = child;
        depth += 1;
    }
    assert_eq!(depth, MAX_NESTING_DEPTH);
}

// ---- Any ---------------------------------------------------------------------------------

#[test]
fn any_carries_the_declared_type_url() {
    let (_dir, registry) = user_registry();
    let mode = mode_switch(&registry);
    let msg = mode.convert(&json!({"new_mode": "review"})).unwrap();
    let any = mode.to_any(&msg);
    assert_eq!(any.type_url, "type.googleapis.com/myapp.v1.ModeSwitch");
    assert_eq!(mode.type_url(), any.type_url);
    assert_eq!(DynamicMessage::decode(mode.descriptor().clone(), any.value.as_slice()).unwrap(), msg);
}

#[test]
fn builtin_any_decodes_into_the_generated_rust_types() {
    let registry = SchemaRegistry::builtin();
    let switch = registry.block_type(builtin::AGENT_MODE_SWITCH_TAG).unwrap();
    let value = json!({"mode_switch": {"analysis": "needs code", "newMode": "coding"}});
    let any = switch.to_any(&switch.convert(&value).unwrap());
    assert_eq!(any.type_url, "type.googleapis.com/pinocchio.v1.AgentModeSwitch");
    let decoded = pinocchio::AgentModeSwitch::decode(any.value.as_slice()).unwrap();
    assert_eq!(
        decoded.mode_switch,
        Some(pinocchio::ModeSwitch { analysis: "needs code".into(), new_mode: "coding".into() })
    );

    let citations = registry.block_type(builtin::CITATIONS_TAG).unwrap();
    let value = json!({"citations": [{"title": "T", "authors": ["A", "B"], "year": 2001, "url": "https://x"}]});
    let any = citations.to_any(&citations.convert(&value).unwrap());
    let decoded = geppetto::Citations::decode(any.value.as_slice()).unwrap();
    assert_eq!(decoded.citations[0].authors, ["A", "B"]);
    assert_eq!(decoded.citations[0].year, 2001);
}

// ---- prompts -----------------------------------------------------------------------------

#[test]
fn builtin_prompt_snapshot() {
    let text = render_prompt(&SchemaRegistry::builtin(), &[]).unwrap();
    insta::assert_snapshot!("builtin_prompt", text);
}

#[test]
fn user_type_example_snapshot() {
    let (_dir, registry) = user_registry();
    insta::assert_snapshot!("mode_switch_block", prompt::render_block(mode_switch(&registry)));
}

/// The raw payload of the example block of `tag` in `prompt`: what the pipeline would capture
/// between the tags, fence included.
fn example_payload<'a>(prompt: &'a str, tag: &str) -> &'a str {
    let open = format!("\n<{tag}>\n");
    let start = prompt.find(&open).unwrap_or_else(|| panic!("no example block for {tag}")) + open.len();
    let end = start + prompt[start..].find(&format!("\n</{tag}>")).unwrap();
    &prompt[start..end]
}

#[test]
fn every_example_converts_with_its_type() {
    let (_dir, registry) = user_registry();
    let text = render_prompt(&registry, &[]).unwrap();
    assert_eq!(registry.tags().count(), 4);
    for block in registry.block_types() {
        let raw = example_payload(&text, block.tag());
        assert!(raw.starts_with("```yaml\n") && raw.ends_with("```"), "{raw}");
        let value = payload::decode(PayloadFormat::Yaml, raw).unwrap_or_else(|e| panic!("{}: {e}\n{raw}", block.tag()));
        let msg = block.convert(&value).unwrap_or_else(|e| panic!("{}: {e}\n{raw}", block.tag()));
        assert_ne!(msg, DynamicMessage::new(block.descriptor().clone()), "{}: the example sets fields", block.tag());
    }
}

#[test]
fn an_example_leaves_out_any_messages_in_every_shape_and_converts() {
    let proto = r#"syntax = "proto3";
package anys.v1;
import "structuredsink/v1/options.proto";
import "google/protobuf/any.proto";
message Holder {
  option (structuredsink.v1.block) = { tag: "anys:Holder:v1" };
  string name = 1;
  google.protobuf.Any one = 2;
  repeated google.protobuf.Any many = 3;
  map<string, google.protobuf.Any> named = 4;
}
"#;
    let (_dir, registry) = registry_of("anys/v1/anys.proto", proto);
    let text = render_prompt(&registry, &["anys:Holder:v1".to_owned()]).unwrap();
    let raw = example_payload(&text, "anys:Holder:v1");
    for name in ["one", "many", "named"] {
        assert!(raw.contains(&format!("# `{name}` (any message")), "{name} left out: {raw}");
    }
    let value = payload::decode(PayloadFormat::Yaml, raw).unwrap();
    let holder = registry.block_type("anys:Holder:v1").unwrap();
    holder.convert(&value).unwrap_or_else(|e| panic!("{e}\n{raw}"));
}

#[test]
fn prompt_for_chosen_tags_keeps_their_order() {
    let registry = SchemaRegistry::builtin();
    let tags = [
        builtin::AGENT_MODE_SWITCH_TAG.to_owned(),
        builtin::CITATIONS_TAG.to_owned(),
        builtin::AGENT_MODE_SWITCH_TAG.to_owned(),
    ];
    let text = render_prompt(&registry, &tags).unwrap();
    let switch = text.find("## Block `pinocchio:agent_mode_switch:v1`").unwrap();
    let citations = text.find("## Block `geppetto:citations:v1`").unwrap();
    assert!(switch < citations);
    assert_eq!(text.matches("## Block").count(), 2);
    assert!(text.contains("such as `</pinocchio:agent_mode_switch:v1>`"));
}

#[test]
fn prompt_for_an_unknown_tag_is_an_error() {
    let err = render_prompt(&SchemaRegistry::builtin(), &["myapp:nope:v1".to_owned()]).unwrap_err();
    assert!(matches!(err, SchemaError::UnknownTag { ref tag, .. } if tag == "myapp:nope:v1"), "{err:?}");
    assert!(err.to_string().contains("registered: geppetto:citations:v1, pinocchio:agent_mode_switch:v1"), "{err}");
}
