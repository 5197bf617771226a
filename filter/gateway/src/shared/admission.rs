//! `kvmesh.admission`: the Envoy-wide concurrency limit — the token bucket (its arithmetic is
//! [`kvmesh_core::admission`]) and, per VM, how many requests it holds admitted and how many
//! wait in its queue (the queue itself is [`crate::admission::WaitRoom`]).
//!
//! The limit is exact: a request is admitted only while fewer than the capacity are held
//! across every VM, whatever the bucket's refill says (sglang-router's refill admits past its
//! limit while requests run). The held counts carry each VM's heartbeat, so those of a VM that
//! died stop counting; every change is one compare-and-swap of the whole value, and the value
//! exists before the first request (see [`SharedBucket::create`]).
//!
//! Counts are kept per priority class ([`kvmesh_core::priority`]): a class's reserved slots
//! and its place ahead of lower classes' queues are Envoy-wide too.

use kvmesh_core::admission::{AdmissionParams, Bucket};
use kvmesh_core::priority::{Class, CLASSES};

use super::{u32_at, u64_at, SetError, SharedStore, CAS_RETRIES};

/// A VM's queue count no longer counts when its heartbeat is older than this.
pub const QUEUE_STALE_MS: u64 = 2_000;
/// A VM's held requests no longer count when its heartbeat is older than this (a VM that
/// died: Envoy replaced it and its streams' `on_log` never runs). As the VM ledger's: far
/// above any single callback.
pub const HELD_STALE_MS: u64 = super::VmLedger::STALE_MS;
/// How often a VM that holds requests but has none waiting refreshes its heartbeat.
pub const BEAT_MS: u64 = 1_000;
/// One VM's entry: `vm u32, heartbeat u64`, then per class `queued u32, held u32`.
const ENTRY: usize = 12 + 8 * CLASSES;

/// Per-class counts.
pub type PerClass = [u32; CLASSES];

/// What a request that wants in is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// It took a slot: on it goes (and gives it back when it ends).
    Admitted,
    /// It waits in this VM's queue (counted in the shared value).
    Queued,
    /// No slot and the queue is full: 429.
    Full,
    /// No slot for a sheddable request (it never queues): 503.
    Shed,
}

/// One VM's line in the shared value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Line {
    vm: u32,
    at_ms: u64,
    queued: PerClass,
    held: PerClass,
}

impl Line {
    fn decode(c: &[u8]) -> Option<Self> {
        let (mut queued, mut held) = ([0; CLASSES], [0; CLASSES]);
        for i in 0..CLASSES {
            *queued.get_mut(i)? = u32_at(c, 12 + 8 * i)?;
            *held.get_mut(i)? = u32_at(c, 16 + 8 * i)?;
        }
        Some(Line { vm: u32_at(c, 0)?, at_ms: u64_at(c, 4)?, queued, held })
    }

    fn busy(&self) -> bool {
        self.queued.iter().chain(&self.held).any(|n| *n > 0)
    }

    fn holds(&self) -> bool {
        self.held.iter().any(|n| *n > 0)
    }
}

/// Changes class `c`'s count in `counts`.
fn bump(counts: &mut PerClass, c: Class, f: impl FnOnce(u32) -> u32) {
    if let Some(n) = counts.get_mut(c.index()) {
        *n = f(*n);
    }
}

/// The shared value: the bucket (16 bytes), then one [`Line`] per VM that holds or queues.
struct State {
    bucket: Bucket,
    lines: Vec<Line>,
}

impl State {
    /// The value in `bytes`; a missing or garbled bucket reads as `fresh`.
    fn decode(bytes: &[u8], fresh: Bucket, now_ms: u64) -> Self {
        let bucket = Bucket::decode(bytes).unwrap_or(fresh);
        let lines = bytes
            .get(16..)
            .unwrap_or_default()
            .chunks_exact(ENTRY)
            .filter_map(Line::decode)
            // Empty lines and those of VMs that stopped beating go.
            .filter(|l| {
                let stale = if l.holds() { HELD_STALE_MS } else { QUEUE_STALE_MS };
                l.busy() && now_ms.saturating_sub(l.at_ms) <= stale
            })
            .collect();
        Self { bucket, lines }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = self.bucket.encode().to_vec();
        for l in &self.lines {
            out.extend_from_slice(&l.vm.to_le_bytes());
            out.extend_from_slice(&l.at_ms.to_le_bytes());
            for (q, h) in l.queued.iter().zip(&l.held) {
                out.extend_from_slice(&q.to_le_bytes());
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        out
    }

    /// Per class, summed over the lines (but `except`'s).
    fn sum(&self, except: Option<u32>, f: impl Fn(&Line) -> &PerClass) -> [u64; CLASSES] {
        let mut out = [0u64; CLASSES];
        for line in self.lines.iter().filter(|l| Some(l.vm) != except) {
            for (o, n) in out.iter_mut().zip(f(line)) {
                *o += u64::from(*n);
            }
        }
        out
    }

    fn queued(&self) -> u64 {
        self.sum(None, |l| &l.queued).iter().sum()
    }

    fn held(&self) -> u64 {
        self.sum(None, |l| &l.held).iter().sum()
    }

    /// A slot for a request of `class`, if one is free: fewer than the capacity held, none
    /// of it reserved for a class above, and a token in the bucket.
    fn take(&mut self, p: &AdmissionParams, class: Class, now_ms: u64) -> bool {
        p.slot_free(&self.sum(None, |l| &l.held), class) && self.bucket.take(p, now_ms)
    }

    /// Changes `vm`'s line, which beats at `now_ms` (a new line if it had none).
    fn with_line(&mut self, vm: u32, now_ms: u64, f: impl FnOnce(&mut Line)) {
        match self.lines.iter_mut().find(|l| l.vm == vm) {
            Some(line) => {
                line.at_ms = line.at_ms.max(now_ms);
                f(line);
            }
            None => {
                let mut line = Line { vm, at_ms: now_ms, queued: [0; CLASSES], held: [0; CLASSES] };
                f(&mut line);
                self.lines.push(line);
            }
        }
        self.lines.retain(Line::busy);
    }
}

/// Reads the value, applies `f` and writes it back by compare-and-swap, retrying on conflicts;
/// returns whether the write went through. A missing value is first written as a full bucket
/// with no lines — unconditionally: Envoy has no create-if-absent, and a write with a version
/// to a missing key is not checked — and then changed by compare-and-swap like any other, so
/// that no change is ever written blind. Two VMs that find it missing both write the same
/// empty value; one that finds it missing while another has already changed it would wipe
/// that change, which is why every VM creates it when it is configured
/// ([`SharedBucket::create`]), before the first request.
fn change(store: &dyn SharedStore, p: &AdmissionParams, now_ms: u64, mut f: impl FnMut(&mut State)) -> bool {
    for _ in 0..CAS_RETRIES {
        let (Some(value), Some(cas)) = store.get(SharedBucket::KEY) else {
            if SharedBucket::create(store, p, now_ms).is_err() {
                return false;
            }
            continue;
        };
        let mut state = State::decode(&value, Bucket::full(p, now_ms), now_ms);
        f(&mut state);
        match store.set(SharedBucket::KEY, &state.encode(), Some(cas)) {
            Ok(()) => return true,
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Other) => return false,
        }
    }
    false
}

/// The Envoy-wide limit: the bucket, and each VM's held and queued counts, in shared data.
pub struct SharedBucket;

impl SharedBucket {
    pub const KEY: &'static str = "kvmesh.admission.v3";

    /// Writes a full bucket with no lines unless the value exists: each VM when it is
    /// configured (Envoy configures the main thread's before any worker thread takes a
    /// request; the native build, its configuration on the main thread), so that requests
    /// only ever change the value by compare-and-swap.
    pub fn create(store: &dyn SharedStore, p: &AdmissionParams, now_ms: u64) -> Result<(), SetError> {
        if store.get(Self::KEY).0.is_some() {
            return Ok(());
        }
        let empty = State { bucket: Bucket::full(p, now_ms), lines: Vec::new() };
        store.set(Self::KEY, &empty.encode(), None)
    }

    /// A request of class `class` from VM `vm` wants in. It takes a slot only when nobody of
    /// its class or above waits (each class is first come, first served, and goes ahead of the
    /// classes below) and a slot is free for its class; else it queues if its class has room
    /// (a sheddable request is refused instead). `queued_here` is what this VM's queue holds
    /// before this request. `None`: shared data refused the write (the request goes on,
    /// holding nothing).
    pub fn enter(
        store: &dyn SharedStore,
        p: &AdmissionParams,
        vm: u32,
        class: Class,
        queued_here: PerClass,
        now_ms: u64,
    ) -> Option<Entry> {
        let mut entry = Entry::Full;
        let written = change(store, p, now_ms, |s| {
            let queued = s.sum(None, |l| &l.queued);
            let ahead: u64 = queued.iter().skip(class.index()).sum();
            entry = if ahead == 0 && s.take(p, class, now_ms) {
                s.with_line(vm, now_ms, |l| {
                    bump(&mut l.held, class, |n| n.saturating_add(1));
                    l.queued = queued_here;
                });
                Entry::Admitted
            } else if class == Class::Sheddable {
                Entry::Shed
            } else if p.queue_room(&queued, class) {
                s.with_line(vm, now_ms, |l| {
                    l.queued = queued_here;
                    bump(&mut l.queued, class, |n| n.saturating_add(1));
                });
                Entry::Queued
            } else {
                Entry::Full
            };
        });
        written.then_some(entry)
    }

    /// A request of class `class` from VM `vm` that held a slot ended: the slot and its token
    /// go back.
    pub fn give_back(store: &dyn SharedStore, p: &AdmissionParams, vm: u32, class: Class, now_ms: u64) {
        change(store, p, now_ms, |s| {
            s.bucket.give_back(p, now_ms);
            s.with_line(vm, now_ms, |l| bump(&mut l.held, class, |n| n.saturating_sub(1)));
        });
    }

    /// Takes slots for VM `vm`'s queue (`waiting` per class), highest class first, none for a
    /// class while another VM has requests of a higher class waiting; publishes what is left
    /// waiting, with a heartbeat (also of what `vm` holds: with nothing waiting, this is the
    /// heartbeat). Returns how many were taken per class.
    pub fn admit(store: &dyn SharedStore, p: &AdmissionParams, vm: u32, waiting: PerClass, now_ms: u64) -> PerClass {
        let mut taken = [0; CLASSES];
        change(store, p, now_ms, |s| {
            taken = [0; CLASSES];
            let others = s.sum(Some(vm), |l| &l.queued);
            'classes: for class in Class::ALL.into_iter().rev() {
                let i = class.index();
                if others.iter().skip(i + 1).any(|n| *n > 0) {
                    break;
                }
                let (Some(want), Some(t)) = (waiting.get(i).copied(), taken.get_mut(i)) else { continue };
                while *t < want {
                    if !s.take(p, class, now_ms) {
                        break 'classes;
                    }
                    *t += 1;
                    s.with_line(vm, now_ms, |l| bump(&mut l.held, class, |n| n.saturating_add(1)));
                }
            }
            s.with_line(vm, now_ms, |l| {
                for ((q, w), t) in l.queued.iter_mut().zip(waiting).zip(taken) {
                    *q = w.saturating_sub(t);
                }
            });
        });
        taken
    }

    /// Refreshes the heartbeat of every VM's line (by CAS): for a host whose plugins cannot
    /// die apart from their process and whose idle threads do not tick (the native build), so
    /// that a thread idle under long requests keeps its held count. Once a second.
    pub fn keep_alive(store: &dyn SharedStore, now_ms: u64) {
        let (Some(value), Some(cas)) = store.get(Self::KEY) else { return };
        let mut s = State::decode(&value, Bucket { tokens: 0.0, at_ms: now_ms }, now_ms);
        if s.lines.is_empty() {
            return;
        }
        for line in &mut s.lines {
            line.at_ms = line.at_ms.max(now_ms);
        }
        // A conflict: whoever wrote is alive and beat anyway; the next second tries again.
        let _ = store.set(Self::KEY, &s.encode(), Some(cas));
    }

    /// Requests waiting in every live VM's queue.
    pub fn queued(store: &dyn SharedStore, now_ms: u64) -> u64 {
        let Some(value) = store.get(Self::KEY).0 else { return 0 };
        State::decode(&value, Bucket { tokens: 0.0, at_ms: now_ms }, now_ms).queued()
    }

    /// Requests holding a slot in every live VM.
    pub fn held(store: &dyn SharedStore, now_ms: u64) -> u64 {
        let Some(value) = store.get(Self::KEY).0 else { return 0 };
        State::decode(&value, Bucket { tokens: 0.0, at_ms: now_ms }, now_ms).held()
    }
}
