//! One worker's subscriber: a ZMQ SUB socket on its publisher and, when it has one, a DEALER
//! on its replay socket. Sequence numbers say what was missed:
//!
//! - on connect, everything the replay buffer holds is asked for (from 0), then the live
//!   stream follows;
//! - a batch past the next expected one is a gap: the missing ones are asked for again; what
//!   the replay buffer no longer holds is lost, so the worker's entries are dropped (a lost
//!   removal would leave an entry the engine no longer holds) and it starts again from there;
//! - a batch before the next expected one that no replay explains is a restarted engine (its
//!   counter started again): the worker's entries are dropped at once;
//! - `AllBlocksCleared` drops them too.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::rekey::Rekeyer;
use super::wire::{self, Batch, Event};
use super::{EventLabels, KvEvents};
use crate::settings::KvEventEndpoints;
use crate::state::State;

/// How long one replay may take before it is given up.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// The most batches, and bytes, one replay may bring.
const MAX_REPLAY_BATCHES: usize = 100_000;
const MAX_REPLAY_BYTES: usize = 256 << 20;

pub(super) struct Subscriber {
    pub state: Arc<State>,
    pub events: Arc<KvEvents>,
    pub worker: u32,
    pub labels: EventLabels,
    pub endpoints: KvEventEndpoints,
    pub topic: String,
    pub rekeyer: Arc<Mutex<Rekeyer>>,
}

/// Where the sequence stands.
#[derive(Default)]
struct Cursor {
    /// The next sequence number expected (none before the first batch).
    next: Option<u64>,
    /// Numbers below `next` from here on came twice (a replay and the live stream).
    replayed_from: Option<u64>,
}

impl Subscriber {
    /// Subscribes until aborted; a failed connection is tried again after a second.
    pub async fn run(self) {
        loop {
            if let Err(e) = self.session().await {
                tracing::warn!(worker = self.worker, publisher = %self.endpoints.publisher, "KV events: {e}");
            }
            self.drop_all();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    async fn session(&self) -> Result<(), zeromq::ZmqError> {
        let mut sub = SubSocket::new();
        sub.subscribe(&self.topic).await?;
        sub.connect(&self.endpoints.publisher).await?;
        tracing::info!(worker = self.worker, publisher = %self.endpoints.publisher, "KV events connected");
        let mut cursor = Cursor::default();
        if self.endpoints.replay.is_some() {
            self.replay(&mut cursor, 0).await;
        }
        loop {
            let msg = sub.recv().await?;
            let Some((seq, batch)) = self.decode_live(msg) else { continue };
            self.on_live(&mut cursor, seq, batch).await;
        }
    }

    fn decode_live(&self, msg: ZmqMessage) -> Option<(u64, Batch)> {
        let frames = msg.into_vecdeque();
        let decoded = decode_frames(frames);
        if let Err(e) = &decoded {
            self.events.metrics.refused.get_or_create(&self.labels).inc();
            tracing::debug!(worker = self.worker, "KV events: frame refused: {e}");
        }
        decoded.ok()
    }

    async fn on_live(&self, cursor: &mut Cursor, seq: u64, batch: Batch) {
        match cursor.next {
            None => {
                cursor.replayed_from = None;
                self.apply(cursor, seq, batch)
            }
            Some(next) if seq == next => {
                cursor.replayed_from = None;
                self.apply(cursor, seq, batch)
            }
            Some(next) if seq > next => {
                cursor.replayed_from = None;
                self.events.metrics.gaps.get_or_create(&self.labels).inc();
                if self.endpoints.replay.is_some() {
                    self.replay(cursor, next).await;
                }
                match cursor.next {
                    Some(n) if seq < n => {}
                    Some(n) if seq == n => self.apply(cursor, seq, batch),
                    _ => {
                        tracing::warn!(worker = self.worker, from = next, to = seq, "KV events lost: entries dropped");
                        self.drop_all();
                        self.apply(cursor, seq, batch);
                    }
                }
            }
            Some(_) if cursor.replayed_from.is_some_and(|from| seq >= from) => {}
            Some(_) => {
                self.events.metrics.restarts.get_or_create(&self.labels).inc();
                tracing::info!(worker = self.worker, seq, "engine restarted (sequence started again): entries dropped");
                self.drop_all();
                cursor.replayed_from = None;
                self.apply(cursor, seq, batch);
            }
        }
    }

    /// Asks the replay socket for every batch from `from`, applying those that are next.
    async fn replay(&self, cursor: &mut Cursor, from: u64) {
        let Some(endpoint) = self.endpoints.replay.as_deref() else { return };
        self.events.metrics.replays.get_or_create(&self.labels).inc();
        let got = tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(endpoint, from)).await;
        let batches = match got {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                tracing::warn!(worker = self.worker, %endpoint, "KV-event replay failed: {e}");
                return;
            }
            Err(_) => {
                tracing::warn!(worker = self.worker, %endpoint, "KV-event replay timed out");
                return;
            }
        };
        cursor.replayed_from = Some(from);
        for (seq, payload) in batches {
            if cursor.next.is_some_and(|n| seq < n) {
                continue;
            }
            if cursor.next.is_some_and(|n| seq > n) {
                // The replay buffer no longer held what comes before: lost.
                self.drop_all();
            }
            match wire::decode_batch(&payload) {
                Ok(batch) => self.apply(cursor, seq, batch),
                Err(e) => {
                    self.events.metrics.refused.get_or_create(&self.labels).inc();
                    tracing::debug!(worker = self.worker, "KV events: replayed frame refused: {e}");
                    cursor.next = Some(seq + 1);
                }
            }
        }
    }

    /// Applies one batch in order; the sequence moves past it.
    fn apply(&self, cursor: &mut Cursor, seq: u64, batch: Batch) {
        cursor.next = Some(seq.saturating_add(1));
        let m = &self.events.metrics;
        m.received.get_or_create(&self.labels).inc_by(batch.events.len() as u64);
        let mut applied = 0u64;
        let mut refused = 0u64;
        {
            let Ok(mut k) = self.rekeyer.lock() else { return };
            for event in &batch.events {
                match event {
                    Event::Stored(s) => {
                        let out = k.stored(s);
                        refused += out.refused;
                        if !out.added.is_empty() {
                            self.state.engine_stored(self.worker, &out.added);
                        }
                        applied += 1;
                    }
                    Event::Removed { hashes, gpu: true } => {
                        self.state.engine_removed(self.worker, k.removed(hashes));
                        applied += 1;
                    }
                    Event::Removed { .. } | Event::Unknown => {}
                    Event::Cleared => {
                        let gone = k.clear();
                        self.state.forget_worker_index(self.worker);
                        drop(gone);
                        applied += 1;
                    }
                }
            }
            m.blocks.get_or_create(&self.labels).set(k.len() as i64);
        }
        m.applied.get_or_create(&self.labels).inc_by(applied);
        m.refused.get_or_create(&self.labels).inc_by(refused);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        if batch.ts > 0.0 {
            m.lag_ms.get_or_create(&self.labels).set(((now - batch.ts) * 1000.0).clamp(0.0, 1e12) as i64);
        }
    }

    /// Every entry of the worker goes (a restart, a clear, events lost).
    fn drop_all(&self) {
        if let Ok(mut k) = self.rekeyer.lock() {
            k.clear();
        }
        self.state.forget_worker_index(self.worker);
    }
}

/// `[topic, seq, payload]` → the sequence number and the batch.
fn decode_frames(mut frames: VecDeque<bytes::Bytes>) -> Result<(u64, Batch), wire::WireError> {
    if frames.len() != 3 {
        return Err(wire::WireError::Frames(frames.len()));
    }
    let payload = frames.pop_back().unwrap_or_default();
    let seq = frames.pop_back().unwrap_or_default();
    let seq = wire::decode_seq(&seq)?;
    Ok((seq.max(0) as u64, wire::decode_batch(&payload)?))
}

/// Asks `endpoint` (a ROUTER) for the batches from `from`: `[empty, seq]` out, then
/// `[empty, seq, payload]` back until the sequence number −1.
async fn fetch_replay(endpoint: &str, from: u64) -> Result<Vec<(u64, bytes::Bytes)>, zeromq::ZmqError> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await?;
    let mut request = ZmqMessage::from(bytes::Bytes::new());
    request.push_back(bytes::Bytes::copy_from_slice(&from.to_be_bytes()));
    dealer.send(request).await?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    loop {
        let msg = dealer.recv().await?;
        let mut frames = msg.into_vecdeque();
        // The empty delimiter, if the ROUTER kept it.
        if frames.front().is_some_and(|f| f.is_empty()) {
            frames.pop_front();
        }
        let Some(seq) = frames.pop_front() else { continue };
        let Ok(seq) = wire::decode_seq(&seq) else { continue };
        if seq < 0 {
            return Ok(out);
        }
        let payload = frames.pop_front().unwrap_or_default();
        bytes += payload.len();
        out.push((seq as u64, payload));
        if out.len() >= MAX_REPLAY_BATCHES || bytes >= MAX_REPLAY_BYTES {
            return Ok(out);
        }
    }
}
