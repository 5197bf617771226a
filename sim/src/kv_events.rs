//! KV-cache events as an engine publishes them: the prompt tokenized (`bpe.rs`), its full
//! pages kept as engine blocks (chained hashes of token ids, LRU over the KV capacity), and
//! every change published on a ZMQ PUB socket as `[topic, seq, msgpack batch]` — vLLM's
//! positional form (≤ 0.11), vLLM's tagged maps (now, sha256-sized bytes hashes) or SGLang's
//! (one `BlockStored` per page) — with the last batches kept for a ROUTER replay socket
//! (request: the first sequence number, answered batch by batch, then −1).
//!
//! `/flush_cache` publishes `AllBlocksCleared`; `POST /sim/restart` is an engine restarted
//! in place (blocks gone, sequence from 0, replay buffer empty, no event);
//! `POST /sim/kv_events/drop_next` loses the next batch on the PUB socket only (a gap).

use std::collections::VecDeque;
use std::num::NonZeroUsize;
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
    blocks: LruCache<u64, ()>,
    seq: u64,
    replay: VecDeque<(u64, Bytes)>,
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
        let blocks = (capacity_tokens / page as u64).max(1) as usize;
        let events = Arc::new(Self {
            bpe,
            encoding,
            page: page.max(1),
            topic: String::new(),
            inner: Mutex::new(Inner {
                blocks: LruCache::new(NonZeroUsize::new(blocks).unwrap_or(NonZeroUsize::MIN)),
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

    /// A prompt ran: its full pages are stored (those not yet held), the least recently
    /// used beyond the capacity removed; the changes are published as one batch.
    pub fn on_prompt(&self, prompt: &[u8]) {
        let tokens = self.bpe.encode(prompt);
        let Ok(mut inner) = self.inner.lock() else { return };
        let mut parent: Option<u64> = None;
        let mut new_hashes = Vec::new();
        let mut new_tokens = Vec::new();
        let mut first_parent = None;
        let mut removed = Vec::new();
        for page in tokens.chunks_exact(self.page) {
            let bytes: Vec<u8> = page.iter().flat_map(|t| t.to_le_bytes()).collect();
            let hash = xxh3_64_with_seed(&bytes, parent.unwrap_or(0x5eed));
            if inner.blocks.get(&hash).is_none() {
                if new_hashes.is_empty() {
                    first_parent = parent;
                }
                if let Some((old, ())) = inner.blocks.push(hash, ()) {
                    if old != hash {
                        removed.push(old);
                    }
                }
                new_hashes.push(hash);
                new_tokens.extend_from_slice(page);
            }
            parent = Some(hash);
        }
        let mut events = Vec::new();
        if !new_hashes.is_empty() {
            events.push(Ev::Stored { hashes: new_hashes, parent: first_parent, tokens: new_tokens });
        }
        if !removed.is_empty() {
            events.push(Ev::Removed(removed));
        }
        self.publish(&mut inner, events);
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
