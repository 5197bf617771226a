//! `kvmesh.admission`: the Envoy-wide token bucket of the concurrency limit and how many
//! requests each VM holds in its queue (the bucket's arithmetic is
//! [`kvmesh_core::admission`]; the queue itself is [`crate::admission::WaitRoom`]).

use kvmesh_core::admission::{AdmissionParams, Bucket};

use super::{update, SharedStore};

/// A VM's queue count no longer counts when its heartbeat is older than this.
pub const QUEUE_STALE_MS: u64 = 2_000;

/// What a request that wants in is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// It took a token: on it goes (and gives the token back when it ends).
    Admitted,
    /// It waits in this VM's queue (counted in the shared value).
    Queued,
    /// No token and the queue is full: 429.
    Full,
}

/// The shared value: the bucket (16 bytes), then `(vm u32, queued u32, heartbeat u64)`.
struct State {
    bucket: Bucket,
    queues: Vec<(u32, u32, u64)>,
}

impl State {
    /// The value in `bytes`; a missing or garbled bucket reads as `fresh`.
    fn decode(bytes: &[u8], fresh: Bucket, now_ms: u64) -> Self {
        let bucket = Bucket::decode(bytes).unwrap_or(fresh);
        let queues = bytes
            .get(16..)
            .unwrap_or_default()
            .chunks_exact(16)
            .filter_map(|c| {
                let vm = u32::from_le_bytes(c.get(..4)?.try_into().ok()?);
                let n = u32::from_le_bytes(c.get(4..8)?.try_into().ok()?);
                let at = u64::from_le_bytes(c.get(8..16)?.try_into().ok()?);
                Some((vm, n, at))
            })
            // Stale (a VM that died) or empty entries go.
            .filter(|&(_, n, at)| n > 0 && now_ms.saturating_sub(at) <= QUEUE_STALE_MS)
            .collect();
        Self { bucket, queues }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = self.bucket.encode().to_vec();
        for &(vm, n, at) in &self.queues {
            out.extend_from_slice(&vm.to_le_bytes());
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(&at.to_le_bytes());
        }
        out
    }

    fn queued(&self) -> u64 {
        self.queues.iter().map(|&(_, n, _)| u64::from(n)).sum()
    }

    fn set_queued(&mut self, vm: u32, n: u32, now_ms: u64) {
        self.queues.retain(|&(v, _, _)| v != vm);
        if n > 0 {
            self.queues.push((vm, n, now_ms));
        }
    }
}

/// The Envoy-wide bucket and queue counts, in shared data.
pub struct SharedBucket;

impl SharedBucket {
    pub const KEY: &'static str = "kvmesh.admission.v1";

    /// A request of VM `vm` wants in. It takes a token only when nobody waits (the queue is
    /// first come, first served); else it queues if there is room. `queued_here` is what this
    /// VM's queue holds before this request.
    pub fn enter(store: &dyn SharedStore, p: &AdmissionParams, vm: u32, queued_here: u32, now_ms: u64) -> Entry {
        let mut entry = Entry::Full;
        let written = update(store, Self::KEY, |value| {
            let mut s = State::decode(value, Bucket::full(p, now_ms), now_ms);
            entry = if s.queued() == 0 && s.bucket.take(p, now_ms) {
                Entry::Admitted
            } else if s.queued() < u64::from(p.queue_size) {
                s.set_queued(vm, queued_here.saturating_add(1), now_ms);
                Entry::Queued
            } else {
                Entry::Full
            };
            *value = s.encode();
        });
        // Shared data refusing writes: let the request through rather than fail it.
        if written {
            entry
        } else {
            Entry::Admitted
        }
    }

    /// A request ended: its token goes back.
    pub fn give_back(store: &dyn SharedStore, p: &AdmissionParams, now_ms: u64) {
        update(store, Self::KEY, |value| {
            let mut s = State::decode(value, Bucket::full(p, now_ms), now_ms);
            s.bucket.give_back(p, now_ms);
            *value = s.encode();
        });
    }

    /// Takes up to `waiting` tokens for this VM's queue; publishes what is left waiting (with a
    /// heartbeat). Returns how many were taken.
    pub fn admit(store: &dyn SharedStore, p: &AdmissionParams, vm: u32, waiting: u32, now_ms: u64) -> u32 {
        let mut taken = 0;
        update(store, Self::KEY, |value| {
            let mut s = State::decode(value, Bucket::full(p, now_ms), now_ms);
            taken = 0;
            while taken < waiting && s.bucket.take(p, now_ms) {
                taken += 1;
            }
            s.set_queued(vm, waiting - taken, now_ms);
            *value = s.encode();
        });
        taken
    }

    /// Requests waiting in every live VM's queue.
    pub fn queued(store: &dyn SharedStore, now_ms: u64) -> u64 {
        let Some(value) = store.get(Self::KEY).0 else { return 0 };
        State::decode(&value, Bucket { tokens: 0.0, at_ms: now_ms }, now_ms).queued()
    }
}
