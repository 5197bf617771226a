//! Passive health: one circuit breaker per worker ([`kvmesh_core::breaker`]: sliding failure
//! window, open for a timeout, then one half-open probe at a time), shared by every VM (Envoy
//! worker thread) of the Envoy through one shared-data value, `kvmesh.breakers`
//! ([`SharedBreakers`]), changed by
//! compare-and-swap: a failure seen on any thread counts for all, and the probe slot of a
//! half-open worker is taken by one of them.
//!
//! Each VM routes on its own view of that value: re-read on every tick (20 ms), after each of
//! its own writes, and before a decision whenever the breakers' generation in `kvmesh.state`
//! (read for every decision anyway) moved. Every write that changes what a breaker admits — a
//! state change, a probe slot taken — moves the generation after the breakers are written and
//! before the request that caused it goes on, so once a breaker opens on one thread no thread
//! routes another request by the old state. Successes cost no write unless a failure is in
//! the worker's window or the worker is half-open, so healthy traffic never touches the
//! value. The same value carries each worker's failover count (cumulative), which
//! the stream owner reports with the breaker states.

use kvmesh_core::breaker::{BreakerParams, BreakerState, BreakerTable};
use kvmesh_core::WorkerId;

use crate::now::Now;
use crate::shared::{Inflight, SharedBreakers, SharedStore};

/// A state change of one worker's breaker.
pub type Transition = (BreakerState, BreakerState);

pub struct Health {
    params: BreakerParams,
    /// The shared table as this VM last read or wrote it.
    view: BreakerTable,
    /// The breakers' generation (`kvmesh.state`) this view is at least as new as.
    generation: u64,
}

/// One worker's breaker as reported to the control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerReport {
    pub worker: WorkerId,
    pub state: BreakerState,
    pub failovers: u32,
}

impl Health {
    pub fn new(params: BreakerParams) -> Self {
        Self { params, view: BreakerTable::default(), generation: 0 }
    }

    /// New settings (the control plane's): the breakers keep their state.
    pub fn set_params(&mut self, params: BreakerParams) {
        self.params = params;
    }

    pub fn params(&self) -> &BreakerParams {
        &self.params
    }

    /// Whether `worker` may receive a request at `now`: its breaker is closed, or half-open
    /// with the probe slot free (as this VM last saw the shared value).
    pub fn available(&self, worker: WorkerId, now: Now) -> bool {
        self.view.get(worker).is_none_or(|b| b.admits(&self.params, now.ms()))
    }

    pub fn state(&self, worker: WorkerId, now: Now) -> BreakerState {
        self.view.get(worker).map_or(BreakerState::Closed, |b| b.state(&self.params, now.ms()))
    }

    /// Adopts the shared value (on the tick).
    pub fn sync(&mut self, store: &dyn SharedStore) {
        self.view = read(store);
    }

    /// Before a decision, given the breakers' generation just read from `kvmesh.state`:
    /// re-reads the shared value when it moved since this VM last looked (a breaker opened or
    /// closed, a probe slot taken, on any VM); no read otherwise.
    pub fn sync_if_changed(&mut self, store: &dyn SharedStore, generation: u64) {
        if generation != self.generation {
            self.generation = generation;
            self.sync(store);
        }
    }

    /// After a write that changed what a breaker admits: moves the generation, so that every
    /// VM reads the breakers before its next decision.
    fn announce(store: &dyn SharedStore) {
        if !Inflight::breakers_changed(store) {
            log::warn!("the breakers' generation could not be moved: other threads see the change on their tick");
        }
    }

    /// Takes the probe slot of `worker` when it is half-open (a request to it is being
    /// committed). True when this call took it; false when the worker is not half-open or
    /// another VM took the slot first (the request goes anyway: it was decided on a view a
    /// few microseconds old).
    pub fn take_probe(&mut self, store: &dyn SharedStore, worker: WorkerId, now: Now) -> bool {
        let now_ms = now.ms();
        if self.state(worker, now) != BreakerState::HalfOpen {
            return false;
        }
        let params = self.params;
        let taken = self.modify(store, Some(now_ms), |t| t.entry(worker).take_probe(&params, now_ms)).unwrap_or(false);
        if taken {
            Self::announce(store);
        }
        taken
    }

    /// Records the outcome of a request to `worker` at `now`; returns the breaker's
    /// transition when it changed state.
    pub fn record(&mut self, store: &dyn SharedStore, worker: WorkerId, ok: bool, now: Now) -> Option<Transition> {
        let now_ms = now.ms();
        if self.params.disabled {
            return None;
        }
        if ok {
            // A success that would change nothing in this VM's view is not written.
            let mut b = self.view.get(worker).copied().unwrap_or_default();
            if !b.record(&self.params, true, now_ms) {
                return None;
            }
        }
        let params = self.params;
        let transition = self
            .modify(store, Some(now_ms), |t| {
                let b = t.entry(worker);
                let before = b.state(&params, now_ms);
                b.record(&params, ok, now_ms);
                let after = b.state(&params, now_ms);
                (before != after).then_some((before, after))
            })
            .flatten();
        if transition.is_some() {
            Self::announce(store);
        }
        transition
    }

    /// Counts one request moved from `worker` to another.
    pub fn count_failover(&mut self, store: &dyn SharedStore, worker: WorkerId) {
        self.modify(store, None, |t| t.entry(worker).count_failover());
    }

    /// Every worker's breaker state at `now` and its failover count, from the shared value.
    pub fn report(&self, store: &dyn SharedStore, now: Now) -> Vec<BreakerReport> {
        let now_ms = now.ms();
        read(store)
            .iter()
            .map(|(worker, b)| BreakerReport { worker, state: b.state(&self.params, now_ms), failovers: b.failovers() })
            .collect()
    }

    /// Changes the shared value by compare-and-swap (idle breakers are dropped when `now_ms` is
    /// known) and adopts what was written. None when the write did not go through.
    fn modify<T>(
        &mut self,
        store: &dyn SharedStore,
        now_ms: Option<u64>,
        change: impl FnMut(&mut BreakerTable) -> T,
    ) -> Option<T> {
        let (out, table) = SharedBreakers::update(store, now_ms, change)?;
        self.view = table;
        Some(out)
    }
}

fn read(store: &dyn SharedStore) -> BreakerTable {
    SharedBreakers::read(store)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::{FakeStore, Racing};
    use BreakerState::{Closed, HalfOpen, Open};
    const KEY: &str = SharedBreakers::KEY;

    fn ms(t: u64) -> Now {
        Now::from_ms(t)
    }

    fn params() -> BreakerParams {
        BreakerParams {
            failure_threshold: 3,
            success_threshold: 2,
            timeout_ms: 1_000,
            window_ms: 8_000,
            disabled: false,
        }
    }

    #[test]
    fn a_failure_on_one_vm_counts_for_all() {
        let store = FakeStore::default();
        let (mut a, mut b) = (Health::new(params()), Health::new(params()));
        a.record(&store, 7, false, ms(0));
        b.sync(&store);
        b.record(&store, 7, false, ms(10));
        assert_eq!(a.record(&store, 7, false, ms(20)), Some((Closed, Open)), "the third failure, on any VM, opens it");
        assert!(!a.available(7, ms(20)));
        assert!(b.available(7, ms(20)), "b has not looked yet");
        b.sync(&store);
        assert!(!b.available(7, ms(20)) && b.available(8, ms(20)));
    }

    #[test]
    fn only_one_vm_takes_the_probe_slot() {
        let store = FakeStore::default();
        let (mut a, mut b) = (Health::new(params()), Health::new(params()));
        for t in 0..3 {
            a.record(&store, 1, false, ms(t));
        }
        b.sync(&store);
        assert!(a.available(1, ms(1_500)) && b.available(1, ms(1_500)), "half-open: both may decide to probe");
        assert!(a.take_probe(&store, 1, ms(1_500)));
        assert!(!b.take_probe(&store, 1, ms(1_501)), "the slot is a's");
        assert!(!a.available(1, ms(1_501)) && !b.available(1, ms(1_501)));
        // A VM that has not ticked since sees the slot taken before its next decision.
        let mut c = Health::new(params());
        c.sync(&store);
        let mut d = Health::new(params());
        for t in 0..3 {
            d.record(&store, 2, false, ms(t));
        }
        c.sync(&store);
        c.sync_if_changed(&store, Inflight::load(&store).breakers());
        assert!(d.take_probe(&store, 2, ms(1_500)));
        assert!(c.available(2, ms(1_500)), "stale view");
        c.sync_if_changed(&store, Inflight::load(&store).breakers());
        assert!(!c.available(2, ms(1_500)));
    }

    #[test]
    fn a_breaker_opened_on_one_vm_is_obeyed_by_the_next_decision_on_every_vm() {
        let store = FakeStore::default();
        let (mut a, mut b) = (Health::new(params()), Health::new(params()));
        let generation = |store: &FakeStore| Inflight::load(store).breakers();
        b.sync_if_changed(&store, generation(&store));
        a.record(&store, 7, false, ms(0));
        a.record(&store, 7, false, ms(1));
        let before = generation(&store);
        b.sync_if_changed(&store, before);
        assert!(b.available(7, ms(2)), "closed, two failures of three: nothing to read");
        let gets = store.gets();
        b.sync_if_changed(&store, before);
        assert_eq!(store.gets(), gets, "an unchanged generation costs no read");
        assert_eq!(a.record(&store, 7, false, ms(2)), Some((Closed, Open)));
        assert_ne!(generation(&store), before, "the opening moved the generation");
        // b has not ticked: the generation it reads before deciding tells it to look.
        b.sync_if_changed(&store, generation(&store));
        assert!(!b.available(7, ms(3)), "no thread sends it another request");
    }

    #[test]
    fn probes_close_it_and_every_vm_sees_it() {
        let store = FakeStore::default();
        let (mut a, mut b) = (Health::new(params()), Health::new(params()));
        for t in 0..3 {
            a.record(&store, 1, false, ms(t));
        }
        assert!(a.take_probe(&store, 1, ms(1_100)));
        assert_eq!(a.record(&store, 1, true, ms(1_200)), None, "one success of two");
        b.sync(&store);
        assert_eq!(b.state(1, ms(1_200)), HalfOpen);
        assert!(b.take_probe(&store, 1, ms(1_300)));
        assert_eq!(b.record(&store, 1, true, ms(1_400)), Some((HalfOpen, Closed)));
        a.sync(&store);
        assert_eq!(a.state(1, ms(1_400)), Closed);
        assert!(store.get(KEY).0.unwrap().is_empty(), "a closed, idle breaker is dropped from the value");
    }

    #[test]
    fn healthy_traffic_writes_nothing() {
        let store = FakeStore::default();
        let mut h = Health::new(params());
        let racing = Racing::new(&store, |_| {});
        for t in 0..100 {
            assert_eq!(h.record(&racing, 3, true, ms(t)), None);
        }
        assert_eq!(racing.writes(), (0, 0));
        h.record(&racing, 3, false, ms(100));
        h.record(&racing, 3, true, ms(101));
        assert_eq!(racing.writes().0, 2, "with a failure in the window, successes count");
    }

    #[test]
    fn a_conflicting_write_is_retried_and_nothing_is_lost() {
        let store = FakeStore::default();
        let mut a = Health::new(params());
        a.record(&store, 5, false, ms(0));
        // Another VM records a failure between a's read and its write.
        let racing = Racing::new(&store, |other| {
            Health::new(params()).record(other, 5, false, ms(1));
        });
        assert_eq!(a.record(&racing, 5, false, ms(2)), Some((Closed, Open)));
        assert_eq!(racing.writes(), (3, 1), "the breakers twice (one conflict), then the generation");
    }

    #[test]
    fn disabled_breakers_record_nothing() {
        let store = FakeStore::default();
        let mut h = Health::new(BreakerParams { disabled: true, ..params() });
        for t in 0..10 {
            assert_eq!(h.record(&store, 1, false, ms(t)), None);
        }
        assert!(h.available(1, ms(10)));
        assert_eq!(store.get(KEY).0, None);
    }

    #[test]
    fn failovers_and_states_are_reported() {
        let store = FakeStore::default();
        let mut h = Health::new(params());
        h.count_failover(&store, 4);
        h.count_failover(&store, 4);
        for t in 0..3 {
            h.record(&store, 6, false, ms(t));
        }
        let report = h.report(&store, ms(10));
        assert_eq!(
            report,
            vec![
                BreakerReport { worker: 4, state: Closed, failovers: 2 },
                BreakerReport { worker: 6, state: Open, failovers: 0 },
            ]
        );
        assert_eq!(h.report(&store, ms(2_000))[1].state, HalfOpen);
    }

    #[test]
    fn a_garbage_value_is_survived_and_replaced() {
        let store = FakeStore::default();
        store.set(KEY, &[0xa5; 1000], None).unwrap();
        let mut h = Health::new(params());
        h.sync(&store);
        h.sync_if_changed(&store, 9);
        let _ = h.available(0xa5a5_a5a5, ms(5));
        h.record(&store, 1, false, ms(5));
        h.count_failover(&store, 1);
        let _ = h.report(&store, ms(5));
        assert_eq!(BreakerTable::decode(&store.get(KEY).0.unwrap()).get(1).map(|b| b.failovers()), Some(1));
    }
}
