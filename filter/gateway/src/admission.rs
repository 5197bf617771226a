//! The concurrency limit and its queue, per Envoy (sglang-router's `--max-concurrent-requests`,
//! `--rate-limit-tokens-per-second`, `--queue-size`, `--queue-timeout-secs`; the bucket's
//! arithmetic is [`kvmesh_core::admission`]).
//!
//! - [`SharedBucket`]: one value in shared data (`crate::shared::admission`), changed by
//!   compare-and-swap: the bucket, and how many requests each VM holds admitted and in its
//!   queue. A request is admitted only while fewer than the limit are held Envoy-wide.
//! - [`WaitRoom`]: one VM's queues of paused requests, a FIFO per priority class
//!   ([`kvmesh_core::priority`]). Its tick (the root context's) answers the ones that waited
//!   too long for their class (408) and admits the oldest of the highest class while slots are
//!   free (with tenant weights, the one whose tenant used the fewest tokens per unit of
//!   weight, [`kvmesh_core::fair`]); the request is then routed and resumed from the tick. It also keeps the VM's heartbeat in the shared
//!   value while the VM holds requests. A tenant's usage is the fleet's: the VM's charges
//!   since its last tick, its Envoy's and the rest of the fleet's as kvmesh-cp shipped them
//!   (`crate::shared::tenant_usage`, to which each tick adds the VM's charges).
//!
//! The slots a VM that died held stop counting once its heartbeat is stale; its tokens come
//! back through the refill.

use std::collections::VecDeque;

use kvmesh_core::admission::AdmissionParams;
use kvmesh_core::fair::{pick_by, Shares};
use kvmesh_core::fleet::Usage;
use kvmesh_core::priority::{Class, CLASSES};

pub use crate::shared::admission::{Entry, PerClass};
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
    /// Its tenant and weight, where tenant weights are configured.
    tenant: Option<(Box<str>, u32)>,
    waiter: T,
}

/// Of a class's queue, the one to admit next: the oldest, or with tenants the fair pick by
/// each tenant's `usage`.
fn next<T>(q: &mut VecDeque<Waiting<T>>, usage: &dyn Fn(&str) -> f64) -> Option<Waiting<T>> {
    if q.iter().all(|w| w.tenant.is_none()) {
        return q.pop_front();
    }
    let waiting = q.iter().map(|w| w.tenant.as_ref().map_or((None, 1), |(t, weight)| (Some(&**t), *weight)));
    let i = pick_by(usage, waiting)?;
    q.remove(i)
}

/// One VM's queues of paused requests, one per class (`T`: how to reach one; the context id
/// names it).
pub struct WaitRoom<T> {
    queues: [VecDeque<Waiting<T>>; CLASSES],
    /// The count this VM last published in the shared value.
    published: u32,
    /// This VM's requests holding a slot (its own count: whether it must keep beating).
    held: u32,
    /// When this VM's line in the shared value last beat (ms).
    beat_ms: u64,
    /// Each tenant's token usage charged on this VM since its last tick (fair shares; empty
    /// without tenant weights), and the bound on tenants it was charged under.
    shares: Shares,
    max_tenants: usize,
}

impl<T> Default for WaitRoom<T> {
    fn default() -> Self {
        Self {
            queues: Default::default(),
            published: 0,
            held: 0,
            beat_ms: 0,
            shares: Shares::default(),
            max_tenants: 64,
        }
    }
}

impl<T> WaitRoom<T> {
    pub fn len(&self) -> u32 {
        self.counts().iter().fold(0u32, |a, n| a.saturating_add(*n))
    }

    /// Requests waiting, per class.
    pub fn counts(&self) -> PerClass {
        self.queues.each_ref().map(|q| u32::try_from(q.len()).unwrap_or(u32::MAX))
    }

    pub fn is_empty(&self) -> bool {
        self.queues.iter().all(VecDeque::is_empty)
    }

    /// A request of `class` that [`SharedBucket::enter`] queued (its count already published).
    pub fn push(&mut self, ctx: u32, class: Class, now_ms: u64, waiter: T) {
        self.push_for(ctx, class, None, now_ms, waiter);
    }

    /// As [`Self::push`], for a request of `tenant` (its id and weight) under tenant weights.
    pub fn push_for(&mut self, ctx: u32, class: Class, tenant: Option<(&str, u32)>, now_ms: u64, waiter: T) {
        let tenant = tenant.map(|(t, w)| (Box::from(t), w));
        if let Some(q) = self.queues.get_mut(class.index()) {
            q.push_back(Waiting { ctx, since_ms: now_ms, tenant, waiter });
        }
        self.published = self.len();
    }

    /// Counts `tokens` used by `tenant` (at most `max_tenants` tracked, then `other`).
    pub fn charge(&mut self, tenant: &str, tokens: u64, max_tenants: usize, now_ms: u64) {
        if self.shares.is_empty() {
            self.shares = Shares::new(max_tenants);
            self.max_tenants = max_tenants;
        }
        self.shares.charge(tenant, tokens, now_ms);
    }

    /// Whether tenants were charged since the last tick (the tick shares them).
    pub fn has_charges(&self) -> bool {
        !self.shares.is_empty()
    }

    /// The VM's charges go into its Envoy's usage (kept here while shared data refuses them).
    pub fn share_charges(&mut self, store: &dyn SharedStore, now_ms: u64) {
        if self.shares.is_empty() {
            return;
        }
        let charges = Usage::sanitized(self.shares.each(now_ms), self.max_tenants, now_ms);
        if crate::shared::tenant_usage::add(store, &charges, self.max_tenants, now_ms) {
            self.shares.clear();
        }
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
        for q in &mut self.queues {
            q.retain(|w| w.ctx != ctx);
        }
    }

    /// The tick: the ones past their class's timeout expire, then the oldest of the highest
    /// class are admitted while slots are free (each counted as held: one that cannot be
    /// resumed must be given back). With nothing waiting, the VM's heartbeat once a
    /// [`BEAT_MS`] while it holds requests. With no limit configured any more, everyone is
    /// admitted.
    pub fn tick(&mut self, store: &dyn SharedStore, p: Option<&AdmissionParams>, vm: u32, now_ms: u64) -> Vec<Wake<T>> {
        let mut out = Vec::new();
        self.share_charges(store, now_ms);
        let Some(p) = p else {
            for q in self.queues.iter_mut().rev() {
                out.extend(q.drain(..).map(|w| Wake::Admit(w.ctx, w.waiter)));
            }
            self.published = 0;
            return out;
        };
        for (q, class) in self.queues.iter_mut().zip(Class::ALL) {
            let timeout = p.timeout_ms(class);
            while q.front().is_some_and(|w| now_ms.saturating_sub(w.since_ms) >= timeout) {
                if let Some(w) = q.pop_front() {
                    out.push(Wake::Expire(w.ctx, w.waiter));
                }
            }
        }
        let beat = self.held > 0 && now_ms.saturating_sub(self.beat_ms) >= BEAT_MS;
        if self.is_empty() && self.published == 0 && !beat {
            return out;
        }
        let taken = SharedBucket::admit(store, p, vm, self.counts(), now_ms);
        self.beat_ms = now_ms;
        // The fleet's usage, read once and only when a tenant's request may be admitted.
        let fair = taken.iter().any(|n| *n > 0) && self.queues.iter().flatten().any(|w| w.tenant.is_some());
        let (envoy, rest) = fair.then(|| crate::shared::tenant_usage::read(store)).flatten().unwrap_or_default();
        let shares = &self.shares;
        let usage = |t: &str| shares.usage(t, now_ms) + envoy.get(t, now_ms) + rest.get(t, now_ms);
        for (q, n) in self.queues.iter_mut().zip(taken).rev() {
            for _ in 0..n {
                if let Some(w) = next(q, &usage) {
                    self.held = self.held.saturating_add(1);
                    out.push(Wake::Admit(w.ctx, w.waiter));
                }
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
    use kvmesh_core::priority::ClassLimits;

    const NO_CLASSES: ClassLimits =
        ClassLimits { reserved: [0; 4], queue_size: [None; 4], queue_timeout_ms: [None; 4] };
    const P: AdmissionParams =
        AdmissionParams { capacity: 1, refill_per_sec: 1.0, queue_size: 2, queue_timeout_ms: 500, classes: NO_CLASSES };

    fn enter(store: &dyn SharedStore, p: &AdmissionParams, vm: u32, queued_here: u32, now: u64) -> Entry {
        SharedBucket::enter(store, p, vm, Class::Default, [0, queued_here, 0, 0], now).unwrap()
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
                Entry::Full | Entry::Shed => entries[2] += 1,
            }
        }
        assert_eq!(entries[0], P.capacity);
        assert_eq!(entries[1], P.queue_size, "{entries:?}");
        assert!(SharedBucket::queued(&store, 0) <= u64::from(P.queue_size));
        let value = store.get(SharedBucket::KEY).0.unwrap();
        assert!(value.len() <= 16 + 4 * (12 + 8 * CLASSES), "one line per VM at most: {} bytes", value.len());
    }

    #[test]
    fn a_newcomer_never_jumps_the_queue() {
        let store = FakeStore::default();
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Admitted);
        assert_eq!(enter(&store, &P, 1, 0, 0), Entry::Queued);
        SharedBucket::give_back(&store, &P, 1, Class::Default, 10);
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
            room.push(ctx, Class::Default, at, ctx * 100);
        }
        assert_eq!(room.tick(&store, Some(&P), 1, 100), vec![], "no slot yet");
        SharedBucket::give_back(&store, &P, 1, Class::Default, 200);
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
        let p = AdmissionParams {
            capacity: 1,
            refill_per_sec: 1.0,
            queue_size: 1,
            queue_timeout_ms: 1_000,
            classes: NO_CLASSES,
        };
        for phase in 0..20 {
            let store = FakeStore::default();
            let mut rooms = [WaitRoom::default(), WaitRoom::default()];
            assert_eq!(enter(&store, &p, 0, 0, 0), Entry::Admitted);
            rooms[0].took(0);
            assert_eq!(enter(&store, &p, 1, 0, 5), Entry::Queued);
            rooms[1].push(7, Class::Default, 5, ());
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
        room.push(7, Class::Default, 0, ());
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
        waiting.push(3, Class::Default, 0, ());
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
        room.push(1, Class::Default, 0, ());
        room.push(2, Class::Default, 0, ());
        assert_eq!(room.tick(&store, None, 1, 0), vec![Wake::Admit(1, ()), Wake::Admit(2, ())]);
    }
}

#[cfg(test)]
mod class_tests {
    use super::*;
    use crate::shared::fake::FakeStore;
    use kvmesh_core::priority::ClassLimits;

    fn params(capacity: u32, reserved: [u32; CLASSES]) -> AdmissionParams {
        let classes = ClassLimits { reserved, ..ClassLimits::default() };
        AdmissionParams { capacity, refill_per_sec: 1_000.0, queue_size: 10, queue_timeout_ms: 60_000, classes }
    }

    fn enter(store: &FakeStore, p: &AdmissionParams, vm: u32, class: Class, room: &WaitRoom<u32>) -> Entry {
        SharedBucket::enter(store, p, vm, class, room.counts(), 0).unwrap()
    }

    /// One slot, held; a default and then an interactive request queue; when the slot comes
    /// back the interactive one goes first. A sheddable one is refused at once, never queued.
    #[test]
    fn a_higher_class_goes_ahead_and_sheddable_requests_never_wait() {
        let (store, p) = (FakeStore::default(), params(1, [0; CLASSES]));
        let mut room = WaitRoom::default();
        assert_eq!(enter(&store, &p, 1, Class::Default, &room), Entry::Admitted);
        room.took(0);
        assert_eq!(enter(&store, &p, 1, Class::Default, &room), Entry::Queued);
        room.push(10, Class::Default, 0, 10);
        assert_eq!(enter(&store, &p, 1, Class::Interactive, &room), Entry::Queued);
        room.push(11, Class::Interactive, 0, 11);
        assert_eq!(enter(&store, &p, 1, Class::Sheddable, &room), Entry::Shed);
        assert_eq!(SharedBucket::queued(&store, 0), 2, "the shed one was never counted");
        SharedBucket::give_back(&store, &p, 1, Class::Default, 5);
        room.gave_back();
        assert_eq!(room.tick(&store, Some(&p), 1, 5), vec![Wake::Admit(11, 11)], "interactive first");
        SharedBucket::give_back(&store, &p, 1, Class::Interactive, 6);
        room.gave_back();
        assert_eq!(room.tick(&store, Some(&p), 1, 6), vec![Wake::Admit(10, 10)]);
        assert_eq!(enter(&store, &p, 1, Class::Sheddable, &room), Entry::Shed, "the slot is held");
    }

    /// A sheddable request takes a free slot when nothing waits, and is refused while anything
    /// waits even if a slot is free (before the tick hands it to the waiting one).
    #[test]
    fn sheddable_requests_run_only_when_nobody_waits() {
        let (store, p) = (FakeStore::default(), params(2, [0; CLASSES]));
        let mut room = WaitRoom::<u32>::default();
        assert_eq!(enter(&store, &p, 1, Class::Sheddable, &room), Entry::Admitted);
        assert_eq!(enter(&store, &p, 1, Class::Default, &room), Entry::Admitted);
        assert_eq!(enter(&store, &p, 1, Class::Default, &room), Entry::Queued);
        room.push(3, Class::Default, 0, 3);
        SharedBucket::give_back(&store, &p, 1, Class::Sheddable, 1);
        assert_eq!(enter(&store, &p, 1, Class::Sheddable, &room), Entry::Shed);
    }

    /// Reserved slots: with 3 slots and 2 reserved for interactive requests, default requests
    /// get one; interactive ones get the rest, and a newcomer goes ahead of the waiting
    /// default ones.
    #[test]
    fn reserved_slots_are_kept_for_their_class() {
        let (store, p) = (FakeStore::default(), params(3, [0, 0, 2, 0]));
        let mut room = WaitRoom::<u32>::default();
        assert_eq!(enter(&store, &p, 1, Class::Default, &room), Entry::Admitted);
        assert_eq!(enter(&store, &p, 1, Class::Default, &room), Entry::Queued, "two slots reserved");
        room.push(1, Class::Default, 0, 1);
        assert_eq!(enter(&store, &p, 1, Class::Interactive, &room), Entry::Admitted);
        assert_eq!(enter(&store, &p, 1, Class::Interactive, &room), Entry::Admitted);
        assert_eq!(enter(&store, &p, 1, Class::Interactive, &room), Entry::Queued, "all three held");
        room.push(2, Class::Interactive, 0, 2);
        assert!(room.tick(&store, Some(&p), 1, 1).is_empty());
        SharedBucket::give_back(&store, &p, 1, Class::Default, 2);
        assert_eq!(room.tick(&store, Some(&p), 1, 2), vec![Wake::Admit(2, 2)]);
        SharedBucket::give_back(&store, &p, 1, Class::Interactive, 3);
        assert_eq!(room.tick(&store, Some(&p), 1, 3), vec![Wake::Admit(1, 1)], "interactive uses its reserve");
        assert_eq!(SharedBucket::held(&store, 3), 3);
    }

    /// Two VMs: one holds a waiting default request, the other an interactive one. A free slot
    /// goes to the interactive one, whichever VM ticks first.
    #[test]
    fn across_vms_the_higher_class_gets_the_slot() {
        let (store, p) = (FakeStore::default(), params(1, [0; CLASSES]));
        let (mut low, mut high) = (WaitRoom::<u32>::default(), WaitRoom::<u32>::default());
        assert_eq!(enter(&store, &p, 1, Class::Default, &low), Entry::Admitted);
        low.took(0);
        assert_eq!(enter(&store, &p, 1, Class::Default, &low), Entry::Queued);
        low.push(1, Class::Default, 0, 1);
        assert_eq!(enter(&store, &p, 2, Class::System, &high), Entry::Queued);
        high.push(2, Class::System, 0, 2);
        SharedBucket::give_back(&store, &p, 1, Class::Default, 1);
        low.gave_back();
        assert!(low.tick(&store, Some(&p), 1, 1).is_empty(), "VM 2's system request is ahead");
        assert_eq!(high.tick(&store, Some(&p), 2, 1), vec![Wake::Admit(2, 2)]);
    }

    #[test]
    fn each_class_waits_its_own_timeout() {
        let store = FakeStore::default();
        let mut p = params(1, [0; CLASSES]);
        p.classes.queue_timeout_ms[Class::Interactive.index()] = Some(100);
        let mut room = WaitRoom::<u32>::default();
        assert_eq!(enter(&store, &p, 1, Class::Default, &room), Entry::Admitted);
        room.took(0);
        for (ctx, class) in [(1, Class::Default), (2, Class::Interactive)] {
            assert_eq!(enter(&store, &p, 1, class, &room), Entry::Queued);
            room.push(ctx, class, 0, ctx);
        }
        assert_eq!(room.tick(&store, Some(&p), 1, 100), vec![Wake::Expire(2, 2)]);
        assert_eq!(room.counts(), [0, 1, 0, 0]);
    }
}

#[cfg(test)]
mod fair_tests {
    use super::*;
    use crate::shared::fake::FakeStore;
    use kvmesh_core::priority::ClassLimits;

    /// One slot; tenant `a` (weight 1) has used 1000 tokens, `b` (weight 1) none and `c`
    /// (weight 4) 2000: of the three waiting (a first), `b` goes first, then `c` (500 per unit
    /// of weight), then `a`. Without tenants, the oldest.
    #[test]
    fn within_a_class_the_least_served_tenant_by_weight_goes_first() {
        let p = AdmissionParams {
            capacity: 1,
            refill_per_sec: 1_000.0,
            queue_size: 10,
            queue_timeout_ms: 60_000,
            classes: ClassLimits::default(),
        };
        let store = FakeStore::default();
        let mut room = WaitRoom::<u32>::default();
        room.charge("a", 1_000, 8, 0);
        room.charge("c", 2_000, 8, 0);
        assert_eq!(SharedBucket::enter(&store, &p, 1, Class::Default, room.counts(), 0), Some(Entry::Admitted));
        room.took(0);
        for (ctx, t, w) in [(1, "a", 1), (2, "b", 1), (3, "c", 4)] {
            let entry = SharedBucket::enter(&store, &p, 1, Class::Default, room.counts(), 0);
            assert_eq!(entry, Some(Entry::Queued));
            room.push_for(ctx, Class::Default, Some((t, w)), 0, ctx);
        }
        let mut order = Vec::new();
        for now in 1..4 {
            SharedBucket::give_back(&store, &p, 1, Class::Default, now);
            room.gave_back();
            order.extend(room.tick(&store, Some(&p), 1, now));
        }
        assert_eq!(order, vec![Wake::Admit(2, 2), Wake::Admit(3, 3), Wake::Admit(1, 1)]);
    }
}

#[cfg(test)]
mod fleet_tests {
    use super::*;
    use crate::shared::fake::FakeStore;
    use kvmesh_core::priority::ClassLimits;

    const P: AdmissionParams = AdmissionParams {
        capacity: 1,
        refill_per_sec: 1_000.0,
        queue_size: 10,
        queue_timeout_ms: 60_000,
        classes: ClassLimits { reserved: [0; 4], queue_size: [None; 4], queue_timeout_ms: [None; 4] },
    };

    /// With one slot held, `a` then `b` wait in `room`; the order they are admitted in.
    fn order(store: &FakeStore, room: &mut WaitRoom<u32>, vm: u32) -> Vec<Wake<u32>> {
        assert_eq!(SharedBucket::enter(store, &P, vm, Class::Default, room.counts(), 1), Some(Entry::Admitted));
        room.took(1);
        for (ctx, t) in [(1, "a"), (2, "b")] {
            assert_eq!(SharedBucket::enter(store, &P, vm, Class::Default, room.counts(), 1), Some(Entry::Queued));
            room.push_for(ctx, Class::Default, Some((t, 1)), 1, ctx);
        }
        let mut out = Vec::new();
        for now in 2..4 {
            SharedBucket::give_back(store, &P, vm, Class::Default, now);
            room.gave_back();
            out.extend(room.tick(store, Some(&P), vm, now));
        }
        out
    }

    /// Another VM of the Envoy charged `a`: its tick shares the charge, and this VM's pick
    /// counts it (`b` first, though it came last).
    #[test]
    fn the_vms_of_one_envoy_pick_by_their_shared_usage() {
        let store = FakeStore::default();
        let mut other = WaitRoom::<u32>::default();
        other.charge("a", 1_000, 8, 0);
        assert!(other.has_charges());
        assert!(other.tick(&store, None, 2, 1).is_empty());
        assert!(!other.has_charges(), "shared on its tick");
        let mut room = WaitRoom::<u32>::default();
        assert_eq!(order(&store, &mut room, 1), vec![Wake::Admit(2, 2), Wake::Admit(1, 1)]);
    }

    /// The rest of the fleet (kvmesh-cp's usage less this Envoy's) used `a`: `b` goes first;
    /// without it, the oldest (`a`).
    #[test]
    fn the_rest_of_the_fleets_usage_counts_in_the_pick() {
        let store = FakeStore::default();
        let mut room = WaitRoom::<u32>::default();
        assert_eq!(order(&store, &mut room, 1), vec![Wake::Admit(1, 1), Wake::Admit(2, 2)], "no usage: oldest first");
        let store = FakeStore::default();
        let rest = Usage::sanitized([("a", 5_000.0)], 8, 0);
        assert!(crate::shared::tenant_usage::set_rest(&store, &rest));
        let mut room = WaitRoom::<u32>::default();
        assert_eq!(order(&store, &mut room, 1), vec![Wake::Admit(2, 2), Wake::Admit(1, 1)]);
    }
}
