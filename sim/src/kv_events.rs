//! KV-cache events as an engine publishes them: the prompt tokenized (`bpe.rs`), its full
//! pages kept as engine blocks (chained hashes of token ids, LRU over the KV capacity), and
//! every change published on a ZMQ PUB socket as `[topic, seq, msgpack batch]` — vLLM's
//! positional form (≤ 0.11), vLLM's tagged maps (now, sha256-sized bytes hashes) or SGLang's
//! (one `BlockStored` per page) — with the last batches kept for a ROUTER replay socket
//! (request: the first sequence number, answered batch by batch, then −1).
//!
//! With events on, this block cache is the engine's truth: `cached_tokens` is what it held of
//! a prompt when the request arrived (its leading full pages, their bytes counted as the
//! simulator counts tokens, 4 a token), its capacity is `--kv-capacity-tokens` × 4 bytes, and
//! a finished request's output pages are cached after its prompt (decode takes cache space).
//!
//! `/flush_cache` publishes `AllBlocksCleared`; `POST /sim/restart` is an engine restarted
//! in place (blocks gone, sequence from 0, replay buffer empty, no event);
//! `POST /sim/kv_events/drop_next` loses the next batch on the PUB socket only (a gap).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use bytes::Bytes;
use lru::LruCache;
use rmp::encode::{write_array_len, write_bin, write_f64, write_map_len, write_nil, write_str, write_uint};
use tokio::sync::mpsc;
use xxhash_rust::xxh3::xxh3_64_with_seed;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::bpe::Bpe;
use crate::cli::KvEventsEncoding;

/// Batches kept for replay (vLLM's `buffer_steps` default is 10 000).
const REPLAY_BATCHES: usize = 10_000;

enum Ev {
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32> },
    Removed(Vec<u64>),
    Cleared,
}

struct Inner {
    blocks: Blocks,
    seq: u64,
    replay: VecDeque<(u64, Bytes)>,
}

/// The engine's block cache: full pages by chained hash, each with the bytes of text its
/// tokens stand for, least recently used first out once they pass the capacity in bytes (the
/// simulator's tokens are 4 bytes: `--kv-capacity-tokens` × 4). A request touches its pages
/// deepest first, so a parent is always used more recently than its children and a leaf goes
/// before its parent (SGLang's radix tree evicts leaves; vLLM frees a request's blocks tail
/// first): what is held of a prompt is a run of its leading pages.
struct Blocks {
    lru: LruCache<u64, u64>,
    bytes: u64,
    capacity_bytes: u64,
}

impl Blocks {
    fn new(capacity_bytes: u64) -> Self {
        Self { lru: LruCache::unbounded(), bytes: 0, capacity_bytes: capacity_bytes.max(1) }
    }

    fn clear(&mut self) {
        self.lru.clear();
        self.bytes = 0;
    }

    /// A sequence's full pages (`(hash, bytes)`, chained, with their tokens in `tokens`, `page`
    /// a page) are used: returns the bytes of its leading pages held before, and the events
    /// (one `BlockStored` per run of new pages, the evictions).
    fn run(&mut self, pages: &[(u64, u64)], tokens: &[u32], page: usize) -> (u64, Vec<Ev>) {
        let held: u64 = pages.iter().take_while(|(h, _)| self.lru.contains(h)).map(|(_, b)| b).sum();
        let mut events = Vec::new();
        let mut run: Option<Ev> = None;
        for (i, &(hash, _)) in pages.iter().enumerate() {
            if self.lru.contains(&hash) {
                events.extend(run.take());
                continue;
            }
            let page_tokens = tokens.get(i * page..(i + 1) * page).unwrap_or_default();
            match &mut run {
                Some(Ev::Stored { hashes, tokens, .. }) => {
                    hashes.push(hash);
                    tokens.extend_from_slice(page_tokens);
                }
                _ => {
                    let parent = i.checked_sub(1).and_then(|p| pages.get(p)).map(|(h, _)| *h);
                    run = Some(Ev::Stored { hashes: vec![hash], parent, tokens: page_tokens.to_vec() })
                }
            }
        }
        events.extend(run);
        for &(hash, bytes) in pages.iter().rev() {
            if self.lru.put(hash, bytes).is_none() {
                self.bytes += bytes;
            }
        }
        let mut removed = Vec::new();
        while self.bytes > self.capacity_bytes {
            let Some((hash, bytes)) = self.lru.pop_lru() else { break };
            self.bytes -= bytes;
            removed.push(hash);
        }
        if !removed.is_empty() {
            events.push(Ev::Removed(removed));
        }
        (held, events)
    }
}

pub struct KvEvents {
    bpe: Bpe,
    encoding: KvEventsEncoding,
    page: usize,
    topic: String,
    inner: Mutex<Inner>,
    drop_next: AtomicBool,
    out: mpsc::UnboundedSender<(u64, Bytes)>,
}

impl KvEvents {
    /// Binds the PUB socket on `port` and the replay ROUTER on `replay_port`.
    pub async fn start(
        tokenizer: &str,
        encoding: KvEventsEncoding,
        page: usize,
        capacity_tokens: u64,
        host: &str,
        port: u16,
        replay_port: Option<u16>,
    ) -> anyhow::Result<Arc<Self>> {
        let bpe = Bpe::load(tokenizer)?;
        let mut publisher = PubSocket::new();
        publisher.bind(&format!("tcp://{host}:{port}")).await.context("KV-event PUB socket")?;
        let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Bytes)>();
        let events = Arc::new(Self {
            bpe,
            encoding,
            page: page.max(1),
            topic: String::new(),
            inner: Mutex::new(Inner {
                blocks: Blocks::new(capacity_tokens.saturating_mul(crate::cache::BYTES_PER_TOKEN)),
                seq: 0,
                replay: VecDeque::new(),
            }),
            drop_next: AtomicBool::new(false),
            out: tx,
        });
        let topic = events.topic.clone();
        tokio::spawn(async move {
            while let Some((seq, payload)) = rx.recv().await {
                let mut msg = ZmqMessage::from(Bytes::from(topic.clone()));
                msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                msg.push_back(payload);
                let _ = publisher.send(msg).await;
            }
        });
        if let Some(rp) = replay_port {
            let mut router = RouterSocket::new();
            router.bind(&format!("tcp://{host}:{rp}")).await.context("KV-event replay socket")?;
            let ev = events.clone();
            tokio::spawn(async move { ev.serve_replay(router).await });
        }
        eprintln!("kvmesh-sim: KV events ({encoding:?}) on tcp://{host}:{port}");
        Ok(events)
    }

    async fn serve_replay(&self, mut router: RouterSocket) {
        while let Ok(req) = router.recv().await {
            let frames = req.into_vec();
            let Some(id) = frames.first().cloned() else { continue };
            let Some(Ok(start)) = frames.last().map(|f| <[u8; 8]>::try_from(&f[..])) else { continue };
            let start = u64::from_be_bytes(start);
            let batches: Vec<(u64, Bytes)> = match self.inner.lock() {
                Ok(inner) => inner.replay.iter().filter(|(s, _)| *s >= start).cloned().collect(),
                Err(_) => Vec::new(),
            };
            for (seq, payload) in batches.into_iter().map(|(s, p)| (s.to_be_bytes().to_vec(), p)) {
                let mut m = ZmqMessage::from(id.clone());
                m.push_back(Bytes::new());
                m.push_back(Bytes::from(seq));
                m.push_back(payload);
                let _ = router.send(m).await;
            }
            let mut end = ZmqMessage::from(id);
            end.push_back(Bytes::new());
            end.push_back(Bytes::copy_from_slice(&(-1i64).to_be_bytes()));
            end.push_back(Bytes::new());
            let _ = router.send(end).await;
        }
    }

    /// A prompt arrived: returns the bytes of its leading full pages the cache held; its full
    /// pages are stored (those not yet held), the least recently used beyond the capacity
    /// removed; the changes are published as one batch.
    pub fn on_prompt(&self, prompt: &[u8]) -> u64 {
        self.run(&self.bpe.encode(prompt))
    }

    /// A request finished: the pages its output completed (the prompt's tokens, then the
    /// output's) are cached after its prompt, as an engine keeps a finished sequence's KV —
    /// decode tokens take cache space.
    pub fn on_finished(&self, prompt: &[u8], output: &[u8]) {
        let mut tokens = self.bpe.encode(prompt);
        tokens.extend(self.bpe.encode(output));
        self.run(&tokens);
    }

    fn run(&self, tokens: &[u32]) -> u64 {
        let mut parent: Option<u64> = None;
        let pages: Vec<(u64, u64)> = tokens
            .chunks_exact(self.page)
            .map(|page| {
                let bytes: Vec<u8> = page.iter().flat_map(|t| t.to_le_bytes()).collect();
                let hash = xxh3_64_with_seed(&bytes, parent.unwrap_or(0x5eed));
                parent = Some(hash);
                (hash, page.iter().map(|&t| self.bpe.byte_len(t)).sum())
            })
            .collect();
        let Ok(mut inner) = self.inner.lock() else { return 0 };
        let (held, events) = inner.blocks.run(&pages, tokens, self.page);
        self.publish(&mut inner, events);
        held
    }

    /// The cache was emptied (`/flush_cache`, a weight update): `AllBlocksCleared`.
    pub fn cleared(&self) {
        let Ok(mut inner) = self.inner.lock() else { return };
        inner.blocks.clear();
        self.publish(&mut inner, vec![Ev::Cleared]);
    }

    /// The engine restarted: nothing held, the sequence from 0, no replay, no event.
    pub fn restarted(&self) {
        let Ok(mut inner) = self.inner.lock() else { return };
        inner.blocks.clear();
        inner.seq = 0;
        inner.replay.clear();
    }

    /// The next batch is lost on the PUB socket (kept for replay).
    pub fn drop_next(&self) {
        self.drop_next.store(true, Relaxed);
    }

    fn publish(&self, inner: &mut Inner, events: Vec<Ev>) {
        if events.is_empty() {
            return;
        }
        let payload = Bytes::from(self.encode(events));
        let seq = inner.seq;
        inner.seq += 1;
        inner.replay.push_back((seq, payload.clone()));
        if inner.replay.len() > REPLAY_BATCHES {
            inner.replay.pop_front();
        }
        if !self.drop_next.swap(false, Relaxed) {
            let _ = self.out.send((seq, payload));
        }
    }

    fn encode(&self, events: Vec<Ev>) -> Vec<u8> {
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut b = Vec::new();
        // Per page for SGLang: one BlockStored each.
        let events: Vec<Ev> = match self.encoding {
            KvEventsEncoding::Sglang => events
                .into_iter()
                .flat_map(|e| match e {
                    Ev::Stored { hashes, parent, tokens } => {
                        let mut parents = std::iter::once(parent).chain(hashes.iter().copied().map(Some));
                        hashes
                            .iter()
                            .zip(tokens.chunks(self.page))
                            .map(|(h, t)| Ev::Stored {
                                hashes: vec![*h],
                                parent: parents.next().flatten(),
                                tokens: t.to_vec(),
                            })
                            .collect::<Vec<_>>()
                    }
                    other => vec![other],
                })
                .collect(),
            _ => events,
        };
        let tagged = self.encoding == KvEventsEncoding::VllmTagged;
        if tagged {
            let _ = write_map_len(&mut b, 3);
            let _ = write_str(&mut b, "ts");
            let _ = write_f64(&mut b, ts);
            let _ = write_str(&mut b, "events");
        } else {
            let _ = write_array_len(&mut b, if self.encoding == KvEventsEncoding::Sglang { 2 } else { 3 });
            let _ = write_f64(&mut b, ts);
        }
        let _ = write_array_len(&mut b, events.len() as u32);
        for e in &events {
            if tagged {
                self.tagged_event(&mut b, e);
            } else {
                self.positional_event(&mut b, e);
            }
        }
        if tagged {
            let _ = write_str(&mut b, "data_parallel_rank");
        }
        if self.encoding != KvEventsEncoding::Sglang {
            let _ = write_uint(&mut b, 0);
        }
        b
    }

    fn hash(&self, b: &mut Vec<u8>, h: u64) {
        if self.encoding == KvEventsEncoding::VllmTagged {
            // vLLM's sha256 digests: 32 bytes.
            let mut digest = [0u8; 32];
            digest[..8].copy_from_slice(&h.to_be_bytes());
            let _ = write_bin(b, &digest);
        } else {
            let _ = write_uint(b, h);
        }
    }

    fn hashes(&self, b: &mut Vec<u8>, hs: &[u64]) {
        let _ = write_array_len(b, hs.len() as u32);
        for &h in hs {
            self.hash(b, h);
        }
    }

    fn tokens(b: &mut Vec<u8>, ts: &[u32]) {
        let _ = write_array_len(b, ts.len() as u32);
        for &t in ts {
            let _ = write_uint(b, u64::from(t));
        }
    }

    fn positional_event(&self, b: &mut Vec<u8>, e: &Ev) {
        let vllm = self.encoding == KvEventsEncoding::VllmArray;
        match e {
            Ev::Stored { hashes, parent, tokens } => {
                let _ = write_array_len(b, if vllm { 7 } else { 6 });
                let _ = write_str(b, "BlockStored");
                self.hashes(b, hashes);
                match parent {
                    Some(p) => self.hash(b, *p),
                    None => {
                        let _ = write_nil(b);
                    }
                }
                Self::tokens(b, tokens);
                let _ = write_uint(b, self.page as u64);
                let _ = write_nil(b);
                if vllm {
                    let _ = write_str(b, "GPU");
                }
            }
            Ev::Removed(hs) => {
                let _ = write_array_len(b, if vllm { 3 } else { 2 });
                let _ = write_str(b, "BlockRemoved");
                self.hashes(b, hs);
                if vllm {
                    let _ = write_str(b, "GPU");
                }
            }
            Ev::Cleared => {
                let _ = write_array_len(b, 1);
                let _ = write_str(b, "AllBlocksCleared");
            }
        }
    }

    fn tagged_event(&self, b: &mut Vec<u8>, e: &Ev) {
        match e {
            Ev::Stored { hashes, parent, tokens } => {
                let _ = write_map_len(b, 8);
                let _ = write_str(b, "type");
                let _ = write_str(b, "BlockStored");
                let _ = write_str(b, "block_hashes");
                self.hashes(b, hashes);
                let _ = write_str(b, "parent_block_hash");
                match parent {
                    Some(p) => self.hash(b, *p),
                    None => {
                        let _ = write_nil(b);
                    }
                }
                let _ = write_str(b, "token_ids");
                Self::tokens(b, tokens);
                let _ = write_str(b, "block_size");
                let _ = write_uint(b, self.page as u64);
                let _ = write_str(b, "lora_id");
                let _ = write_nil(b);
                let _ = write_str(b, "medium");
                let _ = write_str(b, "GPU");
                let _ = write_str(b, "lora_name");
                let _ = write_nil(b);
            }
            Ev::Removed(hs) => {
                let _ = write_map_len(b, 3);
                let _ = write_str(b, "type");
                let _ = write_str(b, "BlockRemoved");
                let _ = write_str(b, "block_hashes");
                self.hashes(b, hs);
                let _ = write_str(b, "medium");
                let _ = write_str(b, "GPU");
            }
            Ev::Cleared => {
                let _ = write_map_len(b, 1);
                let _ = write_str(b, "type");
                let _ = write_str(b, "AllBlocksCleared");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of `n` pages of 10 bytes, one token each, hashes `base + i`.
    fn chain(base: u64, n: u64) -> Vec<(u64, u64)> {
        (0..n).map(|i| (base + i, 10)).collect()
    }

    fn stored(events: &[Ev]) -> Vec<(Vec<u64>, Option<u64>)> {
        events
            .iter()
            .filter_map(|e| match e {
                Ev::Stored { hashes, parent, .. } => Some((hashes.clone(), *parent)),
                _ => None,
            })
            .collect()
    }

    fn removed(events: &[Ev]) -> Vec<u64> {
        events.iter().flat_map(|e| if let Ev::Removed(h) = e { h.clone() } else { Vec::new() }).collect()
    }

    #[test]
    fn the_answer_is_the_leading_pages_held_when_the_request_arrived() {
        let mut b = Blocks::new(1000);
        let tokens: Vec<u32> = (0..8).collect();
        let (held, ev) = b.run(&chain(100, 4), &tokens, 1);
        assert_eq!((held, stored(&ev)), (0, vec![(vec![100, 101, 102, 103], None)]));
        let (held, ev) = b.run(&chain(100, 6), &tokens, 1);
        assert_eq!(held, 40, "4 pages of 10 bytes");
        assert_eq!(stored(&ev), vec![(vec![104, 105], Some(103))], "the new run, from its parent");
    }

    #[test]
    fn eviction_keeps_the_bytes_within_capacity_and_takes_leaves_first() {
        let mut b = Blocks::new(60);
        let tokens: Vec<u32> = (0..8).collect();
        b.run(&chain(100, 4), &tokens, 1);
        // Another prompt of 3 pages: 70 bytes > 60, the oldest leaf (103) goes, not the root.
        let (_, ev) = b.run(&chain(200, 3), &tokens, 1);
        assert_eq!(removed(&ev), vec![103]);
        assert_eq!(b.bytes, 60);
        let (held, _) = b.run(&chain(100, 4), &tokens, 1);
        assert_eq!(held, 30, "what is held of a prompt is a run of its leading pages");
        b.clear();
        assert_eq!((b.bytes, b.run(&chain(100, 1), &tokens, 1).0), (0, 0));
    }
}
