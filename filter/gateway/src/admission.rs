//! The concurrency limit and its queue, per Envoy (sglang-router's `--max-concurrent-requests`,
//! `--rate-limit-tokens-per-second`, `--queue-size`, `--queue-timeout-secs`; the bucket's
//! arithmetic is [`kvmesh_core::admission`]).
//!
//! - [`SharedBucket`]: one value in shared data (`crate::shared::admission`), changed by
//!   compare-and-swap: the bucket, and how many requests each VM holds in its queue.
//! - [`WaitRoom`]: one VM's FIFO of paused requests. Its tick (the root context's) answers the
//!   ones that waited too long (408) and admits the oldest while tokens are left; the request
//!   is then routed and resumed from the tick.
//!
//! A token lost with a VM that died comes back through the refill; nothing else keeps count.

use std::collections::VecDeque;

use kvmesh_core::admission::AdmissionParams;

pub use crate::shared::admission::Entry;
use crate::shared::admission::SharedBucket;
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
}

impl<T> Default for WaitRoom<T> {
    fn default() -> Self {
        Self { queue: VecDeque::new(), published: 0 }
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

    /// A request that went away while waiting (the next tick publishes the new count).
    pub fn remove(&mut self, ctx: u32) {
        self.queue.retain(|w| w.ctx != ctx);
    }

    /// The tick: the ones past the timeout expire, then the oldest are admitted while tokens
    /// are left. With no limit configured any more, everyone is admitted.
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
        if self.queue.is_empty() && self.published == 0 {
            return out;
        }
        let taken = SharedBucket::admit(store, p, vm, self.len(), now_ms);
        for _ in 0..taken {
            if let Some(w) = self.queue.pop_front() {
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
    use crate::shared::admission::QUEUE_STALE_MS;
    use crate::shared::fake::FakeStore;

    const P: AdmissionParams =
        AdmissionParams { capacity: 1, refill_per_sec: 1.0, queue_size: 2, queue_timeout_ms: 500 };

    #[test]
    fn past_the_limit_requests_queue_then_get_429() {
        let store = FakeStore::default();
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 0), Entry::Admitted);
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 0), Entry::Queued);
        assert_eq!(SharedBucket::enter(&store, &P, 2, 0, 0), Entry::Queued, "queues count across VMs");
        assert_eq!(SharedBucket::queued(&store, 0), 2);
        assert_eq!(SharedBucket::enter(&store, &P, 2, 1, 0), Entry::Full);
    }

    #[test]
    fn a_flood_is_bounded_by_the_queue_and_the_shared_value_by_the_vms() {
        let store = FakeStore::default();
        let (mut entries, mut rooms) = ([0u32; 3], [0u32; 4]);
        for i in 0..100_000usize {
            let vm = i % 4;
            match SharedBucket::enter(&store, &P, vm as u32, rooms[vm], 0) {
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
        assert!(value.len() <= 16 + 4 * 16, "one entry per VM at most: {} bytes", value.len());
    }

    #[test]
    fn a_newcomer_never_jumps_the_queue() {
        let store = FakeStore::default();
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 0), Entry::Admitted);
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 0), Entry::Queued);
        SharedBucket::give_back(&store, &P, 10);
        assert_eq!(SharedBucket::enter(&store, &P, 2, 0, 10), Entry::Queued, "a token is back, but one waits");
    }

    #[test]
    fn the_tick_admits_the_oldest_when_a_token_comes_back_and_expires_the_late() {
        let store = FakeStore::default();
        let mut room = WaitRoom::default();
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 0), Entry::Admitted);
        for (ctx, at) in [(10, 0), (11, 300)] {
            assert_eq!(SharedBucket::enter(&store, &P, 1, room.len(), at), Entry::Queued);
            room.push(ctx, at, ctx * 100);
        }
        assert_eq!(room.tick(&store, Some(&P), 1, 100), vec![], "no token yet");
        SharedBucket::give_back(&store, &P, 200);
        assert_eq!(room.tick(&store, Some(&P), 1, 200), vec![Wake::Admit(10, 1000)], "the oldest first");
        assert_eq!(SharedBucket::queued(&store, 200), 1);
        assert_eq!(room.tick(&store, Some(&P), 1, 800), vec![Wake::Expire(11, 1100)], "waited 500 ms");
        assert_eq!(SharedBucket::queued(&store, 800), 0, "the expired one no longer counts");
    }

    #[test]
    fn a_request_that_leaves_stops_counting_at_the_next_tick() {
        let store = FakeStore::default();
        let mut room = WaitRoom::default();
        SharedBucket::enter(&store, &P, 1, 0, 0);
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 0), Entry::Queued);
        room.push(7, 0, ());
        room.remove(7);
        assert!(room.tick(&store, Some(&P), 1, 10).is_empty());
        assert_eq!(SharedBucket::queued(&store, 10), 0);
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 10), Entry::Queued, "the bucket is still empty");
    }

    #[test]
    fn a_dead_vms_queue_stops_counting() {
        let store = FakeStore::default();
        SharedBucket::enter(&store, &P, 1, 0, 0);
        assert_eq!(SharedBucket::enter(&store, &P, 9, 0, 0), Entry::Queued);
        assert_eq!(SharedBucket::enter(&store, &P, 9, 1, 0), Entry::Queued);
        assert_eq!(SharedBucket::enter(&store, &P, 1, 0, 100), Entry::Full);
        assert_eq!(SharedBucket::queued(&store, QUEUE_STALE_MS + 1), 0, "VM 9 stopped beating");
    }

    #[test]
    fn the_refill_admits_without_any_request_ending() {
        let store = FakeStore::default();
        let mut room = WaitRoom::default();
        SharedBucket::enter(&store, &P, 1, 0, 0);
        SharedBucket::enter(&store, &P, 1, 0, 0);
        room.push(3, 0, ());
        let p = AdmissionParams { queue_timeout_ms: 60_000, ..P };
        assert_eq!(room.tick(&store, Some(&p), 1, 999), vec![]);
        assert_eq!(room.tick(&store, Some(&p), 1, 1_000), vec![Wake::Admit(3, ())], "1 token per second");
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
