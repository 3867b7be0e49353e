//! A downstream handler of one typed block: subscribes to the agent mode switch events, and for
//! each completed block decodes the typed payload into the generated Rust type.
//!
//! ```text
//! NATS_URL=nats://127.0.0.1:4222 cargo run --example typed_handler
//! ```
//!
//! Block events are `structuredsink.v1.BlockEvent` messages; a `completed` event of a block
//! whose tag has a declared type carries the converted payload as `google.protobuf.Any` in
//! `typed`. Decoding it needs only prost and the generated types, no reflection.

use futures::StreamExt;
use prost::Message;
use structured_sink::codec::proto::{block_event, BlockEvent};
use structured_sink::typed::builtin::pinocchio::AgentModeSwitch;

/// The default subject of `pinocchio:agent_mode_switch:v1` blocks.
const SUBJECT: &str = "chat.structured.pinocchio.agent_mode_switch.v1";

/// The type URL of the `Any` in `completed.typed`.
const TYPE_URL: &str = "type.googleapis.com/pinocchio.v1.AgentModeSwitch";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(url).await?;
    let mut messages = client.subscribe(SUBJECT).await?;
    println!("listening on {SUBJECT}");

    while let Some(message) = messages.next().await {
        let event = match BlockEvent::decode(message.payload) {
            Ok(event) => event,
            Err(err) => {
                eprintln!("not a BlockEvent: {err}");
                continue;
            }
        };
        let Some(block_event::Event::Completed(completed)) = event.event else {
            continue; // started, delta and snapshot events are not needed here
        };
        if !completed.success {
            eprintln!("{}: block failed: {}", event.item_id, completed.error);
            continue;
        }
        let Some(any) = completed.typed.filter(|any| any.type_url == TYPE_URL) else {
            continue;
        };
        match AgentModeSwitch::decode(any.value.as_slice()) {
            Ok(AgentModeSwitch { mode_switch: Some(switch) }) => {
                println!("{}: switch to {:?} because {:?}", event.item_id, switch.new_mode, switch.analysis);
            }
            Ok(_) => println!("{}: mode switch without details", event.item_id),
            Err(err) => eprintln!("{}: bad AgentModeSwitch: {err}", event.item_id),
        }
    }
    Ok(())
}
