//! The concurrency limit and its queue, per Envoy (sglang-router's `--max-concurrent-requests`,
//! `--rate-limit-tokens-per-second`, `--queue-size`, `--queue-timeout-secs`; the bucket's
//! arithmetic is [`kvmesh_core::admission`]).
//!
//! - [`SharedBucket`]: one value in shared data (`crate::shared::admission`), changed by
//!   compare-and-swap: the bucket, and how many requests each VM holds admitted and in its
//!   queue. A request is admitted only while fewer than the limit are held Envoy-wide.
//! - [`WaitRoom`]: one VM's FIFO of paused requests. Its tick (the root context's) answers the
//!   ones that waited too long (408) and admits the oldest while slots are free; the request
//!   is then routed and resumed from the tick. It also keeps the VM's heartbeat in the shared
//!   value while the VM holds requests.
//!
//! The slots a VM that died held stop counting once its heartbeat is stale; its tokens come
//! back through the refill.

use std::collections::VecDeque;

use kvmesh_core::admission::AdmissionParams;

pub use crate::shared::admission::Entry;
use crate::shared::admission::{SharedBucket, BEAT_MS};
use crate::shared::SharedStore;

/// What the tick does with a waiting request.
#[derive(Debug, PartialEq, Eq)]
pub enum Wake<T> {
    /// It holds a token now: route it and let it go on.
    Admit(u32, T),
    /// It waited past the queue timeout: 408.
    Expire(u32, T),
}

struct Waiting<T> {
    ctx: u32,
    since_ms: u64,
    waiter: T,
}

/// One VM's queue of paused requests (`T`: how to reach one; the context id names it).
pub struct WaitRoom<T> {
    queue: VecDeque<Waiting<T>>,
    /// The count this VM last published in the shared value.
    published: u32,
    /// This VM's requests holding a slot (its own count: whether it must keep beating).
    held: u32,
    /// When this VM's line in the shared value last beat (ms).
    beat_ms: u64,
}

impl<T> Default for WaitRoom<T> {
    fn default() -> Self {
        Self { queue: VecDeque::new(), published: 0, held: 0, beat_ms: 0 }
    }
}

impl<T> WaitRoom<T> {
    pub fn len(&self) -> u32 {
        u32::try_from(self.queue.len()).unwrap_or(u32::MAX)
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// A request that [`SharedBucket::enter`] queued (its count already published).
    pub fn push(&mut self, ctx: u32, now_ms: u64, waiter: T) {
        self.queue.push_back(Waiting { ctx, since_ms: now_ms, waiter });
        self.published = self.len();
    }

    /// A request of this VM took a slot when it came ([`SharedBucket::enter`]).
    pub fn took(&mut self, now_ms: u64) {
        self.held = self.held.saturating_add(1);
        self.beat_ms = self.beat_ms.max(now_ms);
    }

    /// A request of this VM that held a slot gave it back ([`SharedBucket::give_back`]).
    pub fn gave_back(&mut self) {
        self.held = self.held.saturating_sub(1);
    }

    /// This VM's requests holding a slot.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// A request that went away while waiting (the next tick publishes the new count).
    pub fn remove(&mut self, ctx: u32) {
        self.queue.retain(|w| w.ctx != ctx);
    }

    /// The tick: the ones past the timeout expire, then the oldest are admitted while slots
    /// are free (each counted as held: one that cannot be resumed must be given back). With
    /// nothing waiting, the VM's heartbeat once a [`BEAT_MS`] while it holds requests. With no
    /// limit configured any more, everyone is admitted.
    pub fn tick(&mut self, store: &dyn SharedStore, p: Option<&AdmissionParams>, vm: u32, now_ms: u64) -> Vec<Wake<T>> {
        let mut out = Vec::new();
        let Some(p) = p else {
            out.extend(self.queue.drain(..).map(|w| Wake::Admit(w.ctx, w.waiter)));
            self.published = 0;
            return out;
        };
        while let Some(w) = self.queue.front() {
            if now_ms.saturating_sub(w.since_ms) < p.queue_timeout_ms {
                break;
            }
            if let Some(w) = self.queue.pop_front() {
                out.push(Wake::Expire(w.ctx, w.waiter));
            }
        }
        let beat = self.held > 0 && now_ms.saturating_sub(self.beat_ms) >= BEAT_MS;
        if self.queue.is_empty() && self.published == 0 && !beat {
            return out;
        }
        let taken = SharedBucket::admit(store, p, vm, self.len(), now_ms);
        self.beat_ms = now_ms;
        for _ in 0..taken {
            if let Some(w) = self.queue.pop_front() {
                self.held = self.held.saturating_add(1);
                out.push(Wake::Admit(w.ctx, w.waiter));
            }
        }
        self.published = self.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::admission::{HELD_STALE_MS, QUEUE_STALE_MS};
    use crate::shared::fake::{FakeStore, Racing};

    const P: AdmissionParams =
        AdmissionParams { capacity: 1, refill_per_sec: 1.0, queue_size: 2, queue_timeout_ms: 500 };

    fn enter(store: &dyn SharedStore, p: &AdmissionParams, vm: u32, queued_here: u32, now: u64) -> Entry {
        SharedBucket::enter(store, p, vm, queued_here, now).unwrap()
    }

    #[test]
    fn past_the_limit_requests_queue_then_get_429() {
        let store = FakeStore::default();
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Admitted);
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Queued);
        assert_eq!(enter(&store, &P, 2, 0, 0), Entry::Queued, "queues count across VMs");
        assert_eq!(SharedBucket::queued(&store, 0), 2);
        assert_eq!(enter(&store, &P, 2, 1, 0), Entry::Full);
    }

    #[test]
    fn a_flood_is_bounded_by_the_queue_and_the_shared_value_by_the_vms() {
        let store = FakeStore::default();
        let (mut entries, mut rooms) = ([0u32; 3], [0u32; 4]);
        for i in 0..100_000usize {
            let vm = i % 4;
            match enter(&store, &P, vm as u32, rooms[vm], 0) {
                Entry::Admitted => entries[0] += 1,
                Entry::Queued => {
                    entries[1] += 1;
                    rooms[vm] += 1;
                }
                Entry::Full => entries[2] += 1,
            }
        }
        assert_eq!(entries[0], P.capacity);
        assert_eq!(entries[1], P.queue_size, "{entries:?}");
        assert!(SharedBucket::queued(&store, 0) <= u64::from(P.queue_size));
        let value = store.get(SharedBucket::KEY).0.unwrap();
        assert!(value.len() <= 16 + 4 * 20, "one line per VM at most: {} bytes", value.len());
    }

    #[test]
    fn a_newcomer_never_jumps_the_queue() {
        let store = FakeStore::default();
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Admitted);
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Queued);
        SharedBucket::give_back(&store, &P, 1, 10);
        assert_eq!(enter(&store, &P, 2, 0, 10), Entry::Queued, "a slot is back, but one waits");
    }

    #[test]
    fn the_tick_admits_the_oldest_when_a_slot_comes_back_and_expires_the_late() {
        let store = FakeStore::default();
        let mut room = WaitRoom::default();
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Admitted);
        room.took(0);
        for (ctx, at) in [(10, 0), (11, 300)] {
            assert_eq!(enter(&store, &P, 1, room.len(), at), Entry::Queued);
            room.push(ctx, at, ctx * 100);
        }
        assert_eq!(room.tick(&store, Some(&P), 1, 100), vec![], "no slot yet");
        SharedBucket::give_back(&store, &P, 1, 200);
        room.gave_back();
        assert_eq!(room.tick(&store, Some(&P), 1, 200), vec![Wake::Admit(10, 1000)], "the oldest first");
        assert_eq!((room.held(), SharedBucket::held(&store, 200)), (1, 1));
        assert_eq!(SharedBucket::queued(&store, 200), 1);
        assert_eq!(room.tick(&store, Some(&P), 1, 800), vec![Wake::Expire(11, 1100)], "waited 500 ms");
        assert_eq!(SharedBucket::queued(&store, 800), 0, "the expired one no longer counts");
    }

    /// sglang-router's `test_rate_limit_queue_and_timeout`: a limit of 1 refilled at 1 per
    /// second, a queue of 1, a 1 s timeout, four requests at once (two VMs), the first running
    /// for 2 s. The refill restores the token at 1 s, 5 ms before the waiting one's timeout:
    /// it must not let it run beside the first (it did: `[200, 200, 429, 429]`), whatever the
    /// tick's phase.
    #[test]
    fn the_refill_never_admits_past_the_limit() {
        let p = AdmissionParams { capacity: 1, refill_per_sec: 1.0, queue_size: 1, queue_timeout_ms: 1_000 };
        for phase in 0..20 {
            let store = FakeStore::default();
            let mut rooms = [WaitRoom::default(), WaitRoom::default()];
            assert_eq!(enter(&store, &p, 0, 0, 0), Entry::Admitted);
            rooms[0].took(0);
            assert_eq!(enter(&store, &p, 1, 0, 5), Entry::Queued);
            rooms[1].push(7, 5, ());
            assert_eq!(enter(&store, &p, 0, 0, 6), Entry::Full);
            assert_eq!(enter(&store, &p, 1, 1, 6), Entry::Full);
            let mut wakes = Vec::new();
            for now in (phase..2_000).step_by(20) {
                for (vm, room) in rooms.iter_mut().enumerate() {
                    wakes.extend(room.tick(&store, Some(&p), vm as u32, now).into_iter().map(|w| (now, w)));
                }
            }
            assert_eq!(wakes.len(), 1, "phase {phase}: {wakes:?}");
            assert!(matches!(wakes[0], (1_005.., Wake::Expire(7, ()))), "phase {phase}: {wakes:?}");
            assert_eq!(SharedBucket::held(&store, 1_999), 1);
        }
    }

    /// Two VMs take the last slot at once: the second one's write meets the first one's and
    /// is refused; read again, the slot is gone.
    #[test]
    fn two_vms_racing_for_the_last_slot_get_it_once() {
        let store = FakeStore::default();
        SharedBucket::create(&store, &P, 0).unwrap();
        let racing = Racing::new(&store, |s| assert_eq!(enter(s, &P, 2, 0, 0), Entry::Admitted));
        assert_eq!(enter(&racing, &P, 1, 0, 0), Entry::Queued);
        assert_eq!(racing.writes(), (2, 1), "one conflict, then the write of a queued request");
        assert_eq!(SharedBucket::held(&store, 0), 1);
    }

    /// A value no configuration created yet (the first request finds none): the request
    /// creates it empty and then takes its slot by compare-and-swap, so another VM's request
    /// between the two is not wiped out.
    #[test]
    fn a_missing_value_is_created_before_it_is_changed() {
        let store = FakeStore::default();
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Admitted);
        assert_eq!(enter(&store, &P, 2, 0, 0), Entry::Queued);
        SharedBucket::create(&store, &P, 0).unwrap();
        assert_eq!(SharedBucket::held(&store, 0), 1, "creating an existing value changes nothing");
    }

    #[test]
    fn a_request_that_leaves_stops_counting_at_the_next_tick() {
        let store = FakeStore::default();
        let mut room = WaitRoom::default();
        enter(&store, &P, 1, 0, 0);
        room.took(0);
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Queued);
        room.push(7, 0, ());
        room.remove(7);
        assert!(room.tick(&store, Some(&P), 1, 10).is_empty());
        assert_eq!(SharedBucket::queued(&store, 10), 0);
        assert_eq!(enter(&store, &P, 1, 0, 10), Entry::Queued, "the slot is still held");
    }

    #[test]
    fn a_dead_vms_queue_stops_counting() {
        let store = FakeStore::default();
        enter(&store, &P, 1, 0, 0);
        assert_eq!(enter(&store, &P, 9, 0, 0), Entry::Queued);
        assert_eq!(enter(&store, &P, 9, 1, 0), Entry::Queued);
        assert_eq!(enter(&store, &P, 1, 0, 100), Entry::Full);
        assert_eq!(SharedBucket::queued(&store, QUEUE_STALE_MS + 1), 0, "VM 9 stopped beating");
    }

    /// A VM that holds slots keeps them while it beats (its tick, or the native build's
    /// ticker for every thread); one that died gives them up once its heartbeat is stale, and
    /// the refill brings back its tokens.
    #[test]
    fn a_dead_vms_slots_come_back_and_a_live_ones_stay_held() {
        let p = AdmissionParams { capacity: 2, queue_timeout_ms: 60_000, ..P };
        let store = FakeStore::default();
        let mut live = WaitRoom::<()>::default();
        assert_eq!(enter(&store, &p, 1, 0, 0), Entry::Admitted);
        live.took(0);
        assert_eq!(enter(&store, &p, 9, 0, 0), Entry::Admitted, "VM 9 then dies");
        let mut waiting = WaitRoom::default();
        assert_eq!(enter(&store, &p, 2, 0, 0), Entry::Queued);
        waiting.push(3, 0, ());
        for now in (0..=HELD_STALE_MS).step_by(20) {
            assert!(live.tick(&store, Some(&p), 1, now).is_empty());
            assert!(waiting.tick(&store, Some(&p), 2, now).is_empty(), "at {now}");
        }
        let now = HELD_STALE_MS + 20;
        assert!(live.tick(&store, Some(&p), 1, now).is_empty());
        assert_eq!(waiting.tick(&store, Some(&p), 2, now), vec![Wake::Admit(3, ())], "VM 9's slot");
        assert_eq!(SharedBucket::held(&store, now), 2, "VM 1's still counts");
        // No tick any more (the native build's idle threads): the ticker keeps them alive.
        let half = HELD_STALE_MS / 2;
        SharedBucket::keep_alive(&store, now + half);
        assert_eq!(SharedBucket::held(&store, now + 3 * half), 2, "kept alive");
    }

    #[test]
    fn with_the_limit_turned_off_everyone_waiting_goes() {
        let store = FakeStore::default();
        let mut room = WaitRoom::default();
        room.push(1, 0, ());
        room.push(2, 0, ());
        assert_eq!(room.tick(&store, None, 1, 0), vec![Wake::Admit(1, ()), Wake::Admit(2, ())]);
    }
}
