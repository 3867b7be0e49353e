//! The index of one shard's open segments (streams with an id of their own) by message and
//! provider call: how an event that ends a message or a provider call without naming a segment
//! finds the segments it ends.
//!
//! It holds only keys, shared with the stream table that owns the streams, and knows nothing of
//! stream state, events or IO. A segment is named by its stream key,
//! `<escaped message id>/<stream id>` (see
//! [`StreamIdentity::key`](crate::codec::inbound::StreamIdentity::key)); its message is the part
//! of the key before the first `/`, so the index keeps no copy of message ids. Most messages have
//! one provider call and a few segments: each level is a short vector, until a producer opens
//! many, when it becomes a linked hash map (so no operation costs more than the segments it
//! touches, however many are open).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashlink::linked_hash_map::RawEntryMut;
use hashlink::LinkedHashMap;

/// The message part of stream key `key`: its escaped message id (the whole key of a stream that
/// is its message).
pub fn message_part(key: &str) -> &str {
    key.split_once('/').map_or(key, |(message, _)| message)
}

/// The open segments, by message, then provider call, each in the order they opened (calls in the
/// order they were first seen). Every segment listed is open; an emptied list goes with its last
/// segment, so this holds no more than the table does.
#[derive(Default)]
pub struct Segments(HashMap<MessageKey, Listing<Listing<()>>>);

impl Segments {
    /// Lists open segment `key` under provider call `call` (empty when it named none). Returns
    /// the call's id as listed, shared by its segments: [`Segments::remove`] takes it back.
    pub fn add(&mut self, key: &Arc<str>, call: &str) -> Arc<str> {
        let calls = self.0.entry(MessageKey(key.clone())).or_default();
        let (call, segments) = calls.entry(call, Listing::default);
        segments.push(key.clone(), ());
        call.clone()
    }

    /// Takes segment `key`, listed under provider call `call`, off the index.
    pub fn remove(&mut self, key: &str, call: &str) {
        let message = message_part(key);
        let Some(calls) = self.0.get_mut(message) else { return };
        if let Some(segments) = calls.get_mut(call) {
            segments.remove(key);
            if segments.is_empty() {
                calls.remove(call);
            }
        }
        if calls.is_empty() {
            self.0.remove(message);
        }
    }

    /// Whether message `message` (a [`message_part`]) has open segments.
    pub fn has_message(&self, message: &str) -> bool {
        self.0.contains_key(message)
    }

    /// The segments of `message` (a [`message_part`]): of provider call `call` and of none, or of
    /// every call when `call` is `None`; call by call, oldest first.
    pub fn of(&self, message: &str, call: Option<&str>) -> Vec<Arc<str>> {
        let Some(calls) = self.0.get(message) else { return Vec::new() };
        let listed = |call: &str| calls.get(call).into_iter().flat_map(Listing::keys).cloned();
        match call {
            Some(call) if !call.is_empty() => listed(call).chain(listed("")).collect(),
            _ => calls.iter().flat_map(|(_, segments)| segments.keys()).cloned().collect(),
        }
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A message named by the key of one of its segments, hashed and compared by its message part
/// (so it borrows as that `&str`). It may outlive that segment's stream while the message has
/// others: it only keeps the key's bytes.
struct MessageKey(Arc<str>);

impl MessageKey {
    fn message(&self) -> &str {
        message_part(&self.0)
    }
}

impl Hash for MessageKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes, which `Borrow<str>` requires.
        self.message().hash(state);
    }
}

impl PartialEq for MessageKey {
    fn eq(&self, other: &Self) -> bool {
        self.message() == other.message()
    }
}

impl Eq for MessageKey {}

impl Borrow<str> for MessageKey {
    fn borrow(&self) -> &str {
        self.message()
    }
}

/// Above this many entries a listing is hashed: a linear search of a few keys is cheaper than a
/// hash, and a vector of one entry far smaller than a linked hash map (which allocates its table,
/// a guard node and a node per entry).
const FEW: usize = 8;

/// Entries with distinct keys, in the order they were added.
enum Listing<V> {
    Few(Vec<(Arc<str>, V)>),
    Many(Box<LinkedHashMap<Arc<str>, V>>),
}

impl<V> Default for Listing<V> {
    fn default() -> Self {
        Listing::Few(Vec::new())
    }
}

impl<V> Listing<V> {
    /// Appends `key`, which must not be listed.
    fn push(&mut self, key: Arc<str>, value: V) {
        match self {
            Listing::Few(few) if few.len() < FEW => {
                if few.capacity() == 0 {
                    // Most listings keep one entry for their whole life.
                    few.reserve_exact(1);
                }
                few.push((key, value));
            }
            Listing::Few(few) => {
                let mut many = LinkedHashMap::with_capacity(FEW * 2);
                many.extend(few.drain(..));
                many.insert(key, value);
                *self = Listing::Many(Box::new(many));
            }
            Listing::Many(many) => {
                many.insert(key, value);
            }
        }
    }

    /// The entry of `key`, added at the end (with a value from `value`) when it was not listed.
    fn entry(&mut self, key: &str, value: impl FnOnce() -> V) -> (&Arc<str>, &mut V) {
        if self.get(key).is_none() {
            self.push(key.into(), value());
        }
        match self {
            Listing::Few(few) => {
                let (listed, value) = few.iter_mut().find(|(listed, _)| **listed == *key).expect("listed above");
                (&*listed, value)
            }
            Listing::Many(many) => match many.raw_entry_mut().from_key(key) {
                RawEntryMut::Occupied(entry) => {
                    let (listed, value) = entry.into_key_value();
                    (&*listed, value)
                }
                RawEntryMut::Vacant(_) => unreachable!("listed above"),
            },
        }
    }

    fn get(&self, key: &str) -> Option<&V> {
        match self {
            Listing::Few(few) => few.iter().find(|(listed, _)| **listed == *key).map(|(_, value)| value),
            Listing::Many(many) => many.get(key),
        }
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        match self {
            Listing::Few(few) => few.iter_mut().find(|(listed, _)| **listed == *key).map(|(_, value)| value),
            Listing::Many(many) => many.get_mut(key),
        }
    }

    /// Takes `key` off, keeping the others in order.
    fn remove(&mut self, key: &str) {
        match self {
            Listing::Few(few) => {
                if let Some(at) = few.iter().position(|(listed, _)| **listed == *key) {
                    few.remove(at);
                }
            }
            Listing::Many(many) => {
                many.remove(key);
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Listing::Few(few) => few.is_empty(),
            Listing::Many(many) => many.is_empty(),
        }
    }

    /// The entries in order. (Either listing's iterator, without boxing: one side is empty.)
    fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &V)> {
        let (few, many) = match self {
            Listing::Few(few) => (Some(few.iter().map(|(key, value)| (key, value))), None),
            Listing::Many(many) => (None, Some(many.iter())),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }

    fn keys(&self) -> impl Iterator<Item = &Arc<str>> {
        self.iter().map(|(key, _)| key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(listed: Vec<Arc<str>>) -> Vec<String> {
        listed.iter().map(|key| key.to_string()).collect()
    }

    #[test]
    fn a_message_is_its_keys_part_before_the_first_slash() {
        assert_eq!(message_part("m%2F1/seg/0"), "m%2F1");
        assert_eq!(message_part("m1"), "m1");
    }

    #[test]
    fn segments_come_call_by_call_oldest_first_and_an_emptied_call_goes_to_the_back() {
        let mut index = Segments::default();
        let open = |index: &mut Segments, key: &str, call: &str| {
            let key: Arc<str> = key.into();
            (key.clone(), index.add(&key, call))
        };
        let a1 = open(&mut index, "m/a1", "A");
        open(&mut index, "m/b1", "B");
        open(&mut index, "m/n1", "");
        open(&mut index, "m/a2", "A");
        open(&mut index, "other/a1", "A");
        assert_eq!(keys(index.of("m", None)), ["m/a1", "m/a2", "m/b1", "m/n1"]);
        // A call's own segments, then those that named no call.
        assert_eq!(keys(index.of("m", Some("A"))), ["m/a1", "m/a2", "m/n1"]);
        assert_eq!(keys(index.of("m", Some("C"))), ["m/n1"]);
        // Call A keeps its place while one of its segments is open.
        index.remove(&a1.0, &a1.1);
        assert_eq!(keys(index.of("m", None)), ["m/a2", "m/b1", "m/n1"]);
        index.remove("m/a2", "A");
        open(&mut index, "m/a3", "A");
        assert_eq!(keys(index.of("m", None)), ["m/b1", "m/n1", "m/a3"]);
        for (key, call) in [("m/b1", "B"), ("m/n1", ""), ("m/a3", "A")] {
            assert!(index.has_message("m"));
            index.remove(key, call);
        }
        assert!(!index.has_message("m"));
        index.remove("other/a1", "A");
        assert!(index.is_empty());
    }

    #[test]
    fn a_call_shares_one_copy_of_its_id_among_its_segments() {
        let mut index = Segments::default();
        let first = index.add(&"m/1".into(), "call-7");
        let second = index.add(&"m/2".into(), "call-7");
        assert!(Arc::ptr_eq(&first, &second));
    }

    #[test]
    fn many_calls_keep_their_order_once_hashed() {
        let mut index = Segments::default();
        let calls: Vec<String> = (0..2 * FEW).map(|n| format!("call-{n}")).collect();
        // Two segments per call, opened call after call, then one that named no call.
        for (n, call) in calls.iter().enumerate() {
            for s in 0..2 {
                index.add(&format!("m/{n}.{s}").as_str().into(), call);
            }
        }
        index.add(&"m/none".into(), "");
        let mut expected: Vec<String> = (0..2 * FEW).flat_map(|n| [format!("m/{n}.0"), format!("m/{n}.1")]).collect();
        expected.push("m/none".into());
        assert_eq!(keys(index.of("m", None)), expected);
        assert_eq!(keys(index.of("m", Some("call-11"))), ["m/11.0", "m/11.1", "m/none"]);
        // A call emptied leaves; the others keep their order.
        index.remove("m/3.0", "call-3");
        index.remove("m/3.1", "call-3");
        expected.retain(|key| !key.starts_with("m/3."));
        assert_eq!(keys(index.of("m", None)), expected);
        assert!(index.of("m", Some("call-3")).iter().all(|key| &**key == "m/none"));
    }

    #[test]
    fn many_segments_keep_their_order_once_hashed_and_leave_in_any_order() {
        let mut index = Segments::default();
        let names: Vec<String> = (0..3 * FEW).map(|n| format!("m/{n}")).collect();
        for name in &names {
            index.add(&name.as_str().into(), "A");
        }
        assert_eq!(keys(index.of("m", Some("A"))), names);
        // Every other one, then the rest from the newest.
        for name in names.iter().step_by(2) {
            index.remove(name, "A");
        }
        let odd: Vec<String> = names.iter().skip(1).step_by(2).cloned().collect();
        assert_eq!(keys(index.of("m", None)), odd);
        for name in odd.iter().rev() {
            index.remove(name, "A");
        }
        assert!(index.is_empty());
    }

    proptest::proptest! {
        /// Against a model that keeps every list in a vector, whatever the sizes: any mix of
        /// segments opening and closing, over messages with more calls and segments than a short
        /// listing holds, finds the same segments in the same order.
        #[test]
        fn the_index_finds_what_a_list_of_lists_finds(
            ops in proptest::collection::vec((0..3u8, 0..12u8, proptest::bool::ANY, 0..64usize), 1..300),
        ) {
            type Model = Vec<(String, Vec<(String, Vec<String>)>)>;
            fn model_of(model: &Model, message: &str, call: Option<&str>) -> Vec<String> {
                let Some((_, calls)) = model.iter().find(|(m, _)| m == message) else { return Vec::new() };
                let listed = |call: &str| calls.iter().filter(|(c, _)| c == call).flat_map(|(_, s)| s.clone()).collect::<Vec<_>>();
                match call {
                    Some(call) if !call.is_empty() => [listed(call), listed("")].concat(),
                    _ => calls.iter().flat_map(|(_, s)| s.clone()).collect(),
                }
            }
            let mut index = Segments::default();
            let mut model: Model = Vec::new();
            let mut open: Vec<(String, String)> = Vec::new();
            for (n, (message, call, opens, pick)) in ops.into_iter().enumerate() {
                let (message, call) = (format!("m{message}"), if call == 0 { String::new() } else { format!("c{call}") });
                if opens || open.is_empty() {
                    let key = format!("{message}/s{n}");
                    index.add(&key.as_str().into(), &call);
                    let at = model.iter().position(|(m, _)| *m == message).unwrap_or_else(|| {
                        model.push((message.clone(), Vec::new()));
                        model.len() - 1
                    });
                    let calls = &mut model[at].1;
                    match calls.iter_mut().find(|(c, _)| *c == call) {
                        Some((_, segments)) => segments.push(key.clone()),
                        None => calls.push((call.clone(), vec![key.clone()])),
                    }
                    open.push((key, call.clone()));
                } else {
                    let (key, call) = open.remove(pick % open.len());
                    index.remove(&key, &call);
                    let message = message_part(&key);
                    let at = model.iter().position(|(m, _)| m == message).unwrap();
                    let calls = &mut model[at].1;
                    let c = calls.iter().position(|(c, _)| *c == call).unwrap();
                    calls[c].1.retain(|k| *k != key);
                    if calls[c].1.is_empty() {
                        calls.remove(c);
                    }
                    if calls.is_empty() {
                        model.remove(at);
                    }
                }
                for message in ["m0", "m1", "m2"] {
                    proptest::prop_assert_eq!(index.has_message(message), model.iter().any(|(m, _)| m == message));
                    for call in [None, Some(""), Some("c1"), Some(call.as_str())] {
                        proptest::prop_assert_eq!(keys(index.of(message, call)), model_of(&model, message, call));
                    }
                }
            }
        }
    }
}
