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
//! - `AllBlocksCleared` drops them too;
//! - a live batch past the per-worker rate bound (`MAX_LIVE_BYTES_PER_SEC`) is dropped
//!   undecoded and counted, and the worker's entries with it.
//!
//! The sockets are kvmesh's own (`zmtp.rs`: every frame bounded before it is read). When the
//! publisher closes its end (an engine restarted as a new process), or after `IDLE_RECONNECT`
//! without a batch, the subscriber connects anew (keeping its place, asking the replay socket for what follows it), so a restarted
//! engine's first batches show its sequence started again, and what it published before the
//! new connection is asked for from 0.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::zmtp::{Peer, ZmtpError};
use xxhash_rust::xxh3::xxh3_64;

use super::rekey::Rekeyer;
use super::wire::{self, Batch, Event};
use super::{EventLabels, KvEvents};
use crate::settings::KvEventEndpoints;
use crate::state::State;

/// A connection without a batch for this long is made again (a restart in place shows in
/// the next batch; an engine restarted as a new process closes the connection, seen at once,
/// or, where nothing closes it, within this).
const IDLE_RECONNECT: Duration = Duration::from_millis(500);
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

/// Bytes of live batches a worker's publisher may send a second (and in one burst): a
/// hundred times what an engine decoding 100k tokens a second publishes. Beyond it a batch is
/// dropped undecoded and counted, and the worker's entries go (it may have been a removal).
const MAX_LIVE_BYTES_PER_SEC: f64 = (32 << 20) as f64;

/// A token bucket over the bytes of live batches.
struct Gate {
    tokens: f64,
    last: Option<Instant>,
}

impl Default for Gate {
    fn default() -> Self {
        Self { tokens: MAX_LIVE_BYTES_PER_SEC, last: None }
    }
}

impl Gate {
    /// Whether a batch of `bytes` arriving at `now` is within the rate.
    fn admit(&mut self, now: Instant, bytes: usize) -> bool {
        let elapsed = self.last.map_or(0.0, |l| now.saturating_duration_since(l).as_secs_f64());
        self.last = Some(now);
        self.tokens = (self.tokens + elapsed * MAX_LIVE_BYTES_PER_SEC).min(MAX_LIVE_BYTES_PER_SEC);
        if self.tokens >= bytes as f64 {
            self.tokens -= bytes as f64;
            true
        } else {
            false
        }
    }
}

/// Where the sequence stands.
#[derive(Default)]
struct Cursor {
    /// The live stream's rate bound.
    gate: Gate,
    /// The next sequence number expected (none before the first batch).
    next: Option<u64>,
    /// Numbers below `next` from here on came twice (a replay and the live stream).
    replayed_from: Option<u64>,
    /// The last batch applied: its sequence number and payload's hash (a new connection
    /// checks that the publisher still holds it, else the engine restarted).
    last: Option<(u64, u64)>,
}

impl Subscriber {
    /// Subscribes until aborted; a failed connection drops the worker's entries and is tried
    /// again after a second, an idle one is made again at once.
    pub async fn run(self) {
        let mut cursor = Cursor::default();
        loop {
            match self.session(&mut cursor).await {
                Ok(()) => continue,
                Err(e) => tracing::warn!(worker = self.worker, publisher = %self.endpoints.publisher, "KV events: {e}"),
            }
            self.drop_all();
            cursor = Cursor::default();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// One connection: what the replay socket holds past the cursor, then the live stream
    /// until it stays idle for [`IDLE_RECONNECT`] (`Ok`) or fails.
    async fn session(&self, cursor: &mut Cursor) -> Result<(), ZmtpError> {
        let mut sub = Peer::connect(&self.endpoints.publisher, "SUB").await?;
        sub.subscribe(&self.topic).await?;
        tracing::debug!(worker = self.worker, publisher = %self.endpoints.publisher, "KV events connected");
        if self.endpoints.replay.is_some() {
            self.resume(cursor).await;
        }
        loop {
            let frames = match tokio::time::timeout(IDLE_RECONNECT, sub.recv()).await {
                Err(_) => return Ok(()),
                Ok(Ok(frames)) => frames,
                // The publisher closed its end (an engine restarted as a new process).
                Ok(Err(ZmtpError::Io(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Ok(Err(e)) => {
                    self.events.metrics.refused.get_or_create(&self.labels).inc();
                    return Err(e);
                }
            };
            let bytes = frames.iter().map(bytes::Bytes::len).sum();
            if !cursor.gate.admit(Instant::now(), bytes) {
                self.flooded(cursor, &frames);
                continue;
            }
            let Some((seq, batch, hash)) = self.decode_live(frames) else { continue };
            self.on_live(cursor, seq, batch, hash).await;
        }
    }

    /// A live batch over the rate bound: dropped undecoded, with the worker's entries; the
    /// sequence moves past it (no replay brings the flood back).
    fn flooded(&self, cursor: &mut Cursor, frames: &[bytes::Bytes]) {
        self.events.metrics.dropped.get_or_create(&self.labels).inc();
        self.drop_all();
        if let Some(seq) = frames.get(1).and_then(|f| wire::decode_seq(f).ok()) {
            cursor.next = Some((seq.max(0) as u64).saturating_add(1));
            cursor.last = None;
            cursor.replayed_from = None;
        }
    }

    fn decode_live(&self, frames: Vec<bytes::Bytes>) -> Option<(u64, Batch, u64)> {
        let decoded = decode_frames(VecDeque::from(frames));
        if let Err(e) = &decoded {
            self.events.metrics.refused.get_or_create(&self.labels).inc();
            tracing::debug!(worker = self.worker, "KV events: frame refused: {e}");
        }
        decoded.ok()
    }

    async fn on_live(&self, cursor: &mut Cursor, seq: u64, batch: Batch, hash: u64) {
        match cursor.next {
            None => {
                cursor.replayed_from = None;
                self.apply(cursor, seq, batch, hash)
            }
            Some(next) if seq == next => {
                cursor.replayed_from = None;
                self.apply(cursor, seq, batch, hash)
            }
            Some(next) if seq > next => {
                cursor.replayed_from = None;
                self.events.metrics.gaps.get_or_create(&self.labels).inc();
                if self.endpoints.replay.is_some() {
                    self.replay(cursor, next).await;
                }
                match cursor.next {
                    Some(n) if seq < n => {}
                    Some(n) if seq == n => self.apply(cursor, seq, batch, hash),
                    _ => {
                        tracing::warn!(worker = self.worker, from = next, to = seq, "KV events lost: entries dropped");
                        self.drop_all();
                        self.apply(cursor, seq, batch, hash);
                    }
                }
            }
            Some(_) if cursor.replayed_from.is_some_and(|from| seq >= from) => {}
            Some(_) => {
                self.events.metrics.restarts.get_or_create(&self.labels).inc();
                tracing::info!(worker = self.worker, seq, "engine restarted (sequence started again): entries dropped");
                self.drop_all();
                cursor.replayed_from = None;
                cursor.next = None;
                // What the new engine published before this batch, from its replay socket.
                if seq > 0 && self.endpoints.replay.is_some() {
                    self.replay(cursor, 0).await;
                }
                if cursor.next.is_none_or(|n| seq >= n) {
                    self.apply(cursor, seq, batch, hash);
                }
            }
        }
    }

    /// A new connection after an idle one: the publisher still holding the last batch applied
    /// is the same engine (what follows is applied); otherwise it restarted, and everything
    /// it holds is applied from 0 over nothing.
    async fn resume(&self, cursor: &mut Cursor) {
        let Some((seq, hash)) = cursor.last else {
            let from = cursor.next.unwrap_or(0);
            return self.replay(cursor, from).await;
        };
        let Some(batches) = self.fetch(seq).await else { return };
        let same = batches.first().is_some_and(|(s, p)| *s == seq && xxh3_64(p) == hash);
        if same {
            self.apply_replayed(cursor, seq, batches);
        } else {
            self.events.metrics.restarts.get_or_create(&self.labels).inc();
            tracing::info!(
                worker = self.worker,
                "engine restarted (its publisher no longer holds the last batch): entries dropped"
            );
            self.drop_all();
            *cursor = Cursor::default();
            self.replay(cursor, 0).await;
        }
    }

    /// The replay socket's batches from `from` (none: no socket, or it failed).
    async fn fetch(&self, from: u64) -> Option<Vec<(u64, bytes::Bytes)>> {
        let endpoint = self.endpoints.replay.as_deref()?;
        self.events.metrics.replays.get_or_create(&self.labels).inc();
        match tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(endpoint, from)).await {
            Ok(Ok(b)) => Some(b),
            Ok(Err(e)) => {
                tracing::warn!(worker = self.worker, %endpoint, "KV-event replay failed: {e}");
                None
            }
            Err(_) => {
                tracing::warn!(worker = self.worker, %endpoint, "KV-event replay timed out");
                None
            }
        }
    }

    /// Asks the replay socket for every batch from `from`, applying those that are next.
    async fn replay(&self, cursor: &mut Cursor, from: u64) {
        let Some(batches) = self.fetch(from).await else { return };
        self.apply_replayed(cursor, from, batches);
    }

    /// Applies replayed batches that come next (those before the cursor came already).
    fn apply_replayed(&self, cursor: &mut Cursor, from: u64, batches: Vec<(u64, bytes::Bytes)>) {
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
                Ok(batch) => self.apply(cursor, seq, batch, xxh3_64(&payload)),
                Err(e) => {
                    self.events.metrics.refused.get_or_create(&self.labels).inc();
                    tracing::debug!(worker = self.worker, "KV events: replayed frame refused: {e}");
                    cursor.next = Some(seq + 1);
                }
            }
        }
    }

    /// Applies one batch in order; the sequence moves past it.
    fn apply(&self, cursor: &mut Cursor, seq: u64, batch: Batch, hash: u64) {
        cursor.next = Some(seq.saturating_add(1));
        cursor.last = Some((seq, hash));
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
fn decode_frames(mut frames: VecDeque<bytes::Bytes>) -> Result<(u64, Batch, u64), wire::WireError> {
    if frames.len() != 3 {
        return Err(wire::WireError::Frames(frames.len()));
    }
    let payload = frames.pop_back().unwrap_or_default();
    let seq = frames.pop_back().unwrap_or_default();
    let seq = wire::decode_seq(&seq)?;
    Ok((seq.max(0) as u64, wire::decode_batch(&payload)?, xxh3_64(&payload)))
}

/// Asks `endpoint` (a ROUTER) for the batches from `from`: `[empty, seq]` out, then
/// `[empty, seq, payload]` back until the sequence number −1.
async fn fetch_replay(endpoint: &str, from: u64) -> Result<Vec<(u64, bytes::Bytes)>, ZmtpError> {
    let mut dealer = Peer::connect(endpoint, "DEALER").await?;
    dealer.send(&[b"", &from.to_be_bytes()]).await?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    loop {
        let mut frames = VecDeque::from(dealer.recv().await?);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_passes_a_burst_of_its_rate_then_refills_with_time() {
        let mut g = Gate::default();
        let t0 = Instant::now();
        let rate = MAX_LIVE_BYTES_PER_SEC as usize;
        assert!(g.admit(t0, rate / 2) && g.admit(t0, rate / 2), "a second's worth at once");
        assert!(!g.admit(t0, 1), "then nothing");
        assert!(!g.admit(t0 + Duration::from_millis(100), rate / 5), "a tenth of a second refills a tenth");
        assert!(g.admit(t0 + Duration::from_millis(300), rate / 5));
        assert!(
            g.admit(t0 + Duration::from_secs(100), rate) && !g.admit(t0 + Duration::from_secs(100), 1),
            "capped at one second's worth"
        );
    }
}
