//! The engines' KV-event wire formats, decoded with serde over `rmp-serde`.
//!
//! Read from the publishers' sources (`vllm/distributed/kv_events.py` at vLLM 0181ea31,
//! `python/sglang/srt/disaggregation/kv_events.py` at SGLang 006d053f; vLLM up to 0.11 wrote
//! the older positional form): a ZMQ PUB message is `[topic, seq, payload]`, `seq` an 8-byte
//! big-endian counter from 0, `payload` msgpack of an event batch (msgspec structs):
//!
//! - positional (`array_like`): a batch is `[ts, events, data_parallel_rank?]`, an event
//!   `[tag, field...]` (SGLang, vLLM ≤ 0.11);
//! - tagged maps (vLLM now): a batch is `{ts, events, data_parallel_rank?}`, an event a map
//!   with `"type"` naming it.
//!
//! Events: `BlockStored` (block hashes, the parent of the first, the token ids of all of
//! them, tokens per block, LoRA and medium), `BlockRemoved` (hashes), `AllBlocksCleared`.
//! A block hash is an integer or bytes (vLLM's sha256 digests): bytes are folded to 64 bits.
//! Every frame is hostile input: the payload, the events of a batch, the hashes and the token
//! ids of an event are bounded while decoding (nothing over a bound is allocated).

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64;

/// The largest payload decoded (bytes).
pub const MAX_PAYLOAD_BYTES: usize = 16 << 20;
/// The most events in one batch.
pub const MAX_EVENTS_PER_BATCH: usize = 65_536;
/// The most block hashes in one event.
pub const MAX_BLOCKS_PER_EVENT: usize = 16_384;
/// The most token ids in one event.
pub const MAX_TOKENS_PER_EVENT: usize = 1 << 20;
/// The most tokens per engine block.
pub const MAX_BLOCK_TOKENS: u32 = 4096;

/// One decoded batch.
#[derive(Debug, Default, PartialEq)]
pub struct Batch {
    /// The publisher's clock (seconds since the epoch) when it made the batch.
    pub ts: f64,
    pub events: Vec<Event>,
    /// vLLM's data-parallel rank (also given by the port it publishes on).
    pub dp_rank: Option<u32>,
}

/// One event.
#[derive(Debug, PartialEq)]
pub enum Event {
    Stored(Stored),
    Removed {
        hashes: Vec<u64>,
        gpu: bool,
    },
    Cleared,
    /// A tag this decoder does not know (a newer engine): skipped.
    Unknown,
}

/// `BlockStored`.
#[derive(Debug, Default, PartialEq)]
pub struct Stored {
    pub hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub tokens: Vec<u32>,
    pub block_size: u32,
    /// A LoRA adapter's blocks (keyed apart by the engine).
    pub lora: bool,
    /// The GPU tier (no `medium` means the GPU).
    pub gpu: bool,
}

/// Why a frame was refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("payload of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("bad msgpack: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    #[error("message of {0} frames (want topic, seq, payload)")]
    Frames(usize),
    #[error("sequence number of {0} bytes (want 8)")]
    Seq(usize),
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, WireError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(WireError::TooLarge(payload.len()));
    }
    Ok(rmp_serde::from_slice::<BatchDe>(payload)?.0)
}

/// An 8-byte big-endian sequence number (−1 is the replay's end marker).
pub fn decode_seq(frame: &[u8]) -> Result<i64, WireError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| WireError::Seq(frame.len()))?;
    Ok(i64::from_be_bytes(bytes))
}

// ---- serde

struct BatchDe(Batch);

impl<'de> de::Deserialize<'de> for BatchDe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BatchVisitor).map(BatchDe)
    }
}

struct BatchVisitor;

impl<'de> Visitor<'de> for BatchVisitor {
    type Value = Batch;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an event batch (array or map)")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Batch, A::Error> {
        let ts = seq.next_element::<f64>()?.ok_or_else(|| de::Error::custom("batch without ts"))?;
        let events = seq.next_element_seed(Events)?.ok_or_else(|| de::Error::custom("batch without events"))?;
        let dp_rank = seq.next_element::<Option<u32>>()?.flatten();
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Batch { ts, events, dp_rank })
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Batch, A::Error> {
        let mut batch = Batch::default();
        let mut seen_events = false;
        while let Some(key) = map.next_key::<Key>()? {
            match key.0.as_str() {
                "ts" => batch.ts = map.next_value()?,
                "events" => {
                    batch.events = map.next_value_seed(Events)?;
                    seen_events = true;
                }
                "data_parallel_rank" => batch.dp_rank = map.next_value::<Option<u32>>()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !seen_events {
            return Err(de::Error::custom("batch without events"));
        }
        Ok(batch)
    }
}

/// A map key, at most 64 bytes kept.
struct Key(String);

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key(v.get(..v.len().min(64)).unwrap_or_default().to_string()))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Key, E> {
                Ok(Key(String::from_utf8_lossy(v.get(..v.len().min(64)).unwrap_or_default()).into_owned()))
            }
        }
        d.deserialize_str(V)
    }
}

/// A bounded list, each element decoded by `T`.
struct Bounded<T> {
    max: usize,
    what: &'static str,
    _t: std::marker::PhantomData<T>,
}

impl<T> Bounded<T> {
    fn new(max: usize, what: &'static str) -> Self {
        Self { max, what, _t: std::marker::PhantomData }
    }
}

impl<'de, T: de::Deserialize<'de>> DeserializeSeed<'de> for Bounded<T> {
    type Value = Vec<T>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, T: de::Deserialize<'de>> Visitor<'de> for Bounded<T> {
    type Value = Vec<T>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of at most {} {}", self.max, self.what)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        if seq.size_hint().unwrap_or(0) > self.max {
            return Err(de::Error::custom(format!("more than {} {}", self.max, self.what)));
        }
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(v) = seq.next_element()? {
            if out.len() == self.max {
                return Err(de::Error::custom(format!("more than {} {}", self.max, self.what)));
            }
            out.push(v);
        }
        Ok(out)
    }
}

/// A block hash: an integer (two's complement for a negative one) or bytes, folded.
struct Hash(u64);

impl<'de> de::Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Hash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Hash, E> {
                Ok(Hash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Hash, E> {
                Ok(Hash(v as u64))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Hash, E> {
                Ok(Hash(xxh3_64(v)))
            }
        }
        d.deserialize_any(V)
    }
}

/// An optional block hash.
struct MaybeHash(Option<u64>);

impl<'de> de::Deserialize<'de> for MaybeHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(MaybeHash(Option::<Hash>::deserialize(d)?.map(|h| h.0)))
    }
}

fn hashes<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<Option<Vec<u64>>, A::Error> {
    Ok(seq
        .next_element_seed(Bounded::<Hash>::new(MAX_BLOCKS_PER_EVENT, "block hashes"))?
        .map(|v| v.into_iter().map(|h| h.0).collect()))
}

/// `medium` names the GPU tier (none does too).
fn is_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU"))
}

struct Events;

impl<'de> DeserializeSeed<'de> for Events {
    type Value = Vec<Event>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Event>, D::Error> {
        Ok(Bounded::<EventDe>::new(MAX_EVENTS_PER_BATCH, "events").deserialize(d)?.into_iter().map(|e| e.0).collect())
    }
}

struct EventDe(Event);

impl<'de> de::Deserialize<'de> for EventDe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EventVisitor).map(EventDe)
    }
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = Event;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a KV event (tagged array or tagged map)")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Event, A::Error> {
        let tag = seq.next_element::<Key>()?.ok_or_else(|| de::Error::custom("event without tag"))?;
        let event = match tag.0.as_str() {
            "BlockStored" => {
                let hashes = hashes(&mut seq)?.unwrap_or_default();
                let parent = seq.next_element::<MaybeHash>()?.and_then(|p| p.0);
                let tokens =
                    seq.next_element_seed(Bounded::<u32>::new(MAX_TOKENS_PER_EVENT, "token ids"))?.unwrap_or_default();
                let block_size = seq.next_element::<u32>()?.unwrap_or(0);
                let lora_id = seq.next_element::<Option<i64>>()?.flatten();
                let medium = seq.next_element::<Option<Key>>()?.flatten();
                let lora_name = seq.next_element::<Option<Key>>()?.flatten();
                let gpu = is_gpu(medium.as_ref().map(|m| m.0.as_str()));
                let lora = lora_id.is_some() || lora_name.is_some();
                Event::Stored(Stored { hashes, parent, tokens, block_size, lora, gpu })
            }
            "BlockRemoved" => {
                let hashes = hashes(&mut seq)?.unwrap_or_default();
                let medium = seq.next_element::<Option<Key>>()?.flatten();
                Event::Removed { hashes, gpu: is_gpu(medium.as_ref().map(|m| m.0.as_str())) }
            }
            "AllBlocksCleared" => Event::Cleared,
            _ => Event::Unknown,
        };
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(event)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Event, A::Error> {
        let mut tag = None;
        let mut s = Stored::default();
        let mut medium: Option<Key> = None;
        while let Some(key) = map.next_key::<Key>()? {
            match key.0.as_str() {
                "type" => tag = Some(map.next_value::<Key>()?.0),
                "block_hashes" => {
                    s.hashes = map
                        .next_value_seed(Bounded::<Hash>::new(MAX_BLOCKS_PER_EVENT, "block hashes"))?
                        .into_iter()
                        .map(|h| h.0)
                        .collect()
                }
                "parent_block_hash" => s.parent = map.next_value::<MaybeHash>()?.0,
                "token_ids" => {
                    s.tokens = map.next_value_seed(Bounded::<u32>::new(MAX_TOKENS_PER_EVENT, "token ids"))?
                }
                "block_size" => s.block_size = map.next_value()?,
                "lora_id" => s.lora |= map.next_value::<Option<i64>>()?.is_some(),
                "lora_name" => s.lora |= map.next_value::<Option<Key>>()?.is_some(),
                "medium" => medium = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let gpu = is_gpu(medium.as_ref().map(|m| m.0.as_str()));
        Ok(match tag.as_deref() {
            Some("BlockStored") => Event::Stored(Stored { gpu, ..s }),
            Some("BlockRemoved") => Event::Removed { hashes: s.hashes, gpu },
            Some("AllBlocksCleared") => Event::Cleared,
            _ => Event::Unknown,
        })
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
pub(crate) mod tests;
