//! The stall window: a worker that holds this VM's requests and has answered none of them
//! (nor any other) for `worker_stall_secs` is passed over by new requests while other workers
//! can take them — a frozen worker (accepting connections, never answering) leaves rotation
//! within seconds instead of holding every request routed to it until the request timeout.
//! kvmesh-cp's active health checks take it out for every gateway later.
//!
//! Each VM keeps its own view (its own requests are what it can see); a worker that answers
//! anything is back at once. Once every request it held has ended unanswered (timed out), one
//! request per window may go to it as a probe, so that a worker that recovers comes back.

use std::collections::BTreeMap;

use kvmesh_core::WorkerId;

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Requests sent and not ended yet.
    waiting: u32,
    /// Start of the silence: the first request sent since the worker last answered.
    since: u64,
    /// With nothing waiting: when the next probe may go.
    probe_after: u64,
}

#[derive(Default)]
pub struct Stalls {
    /// Workers that were sent requests they have not all answered.
    entries: BTreeMap<WorkerId, Entry>,
    window_ms: u64,
}

impl Stalls {
    /// `window_ms` 0 turns the stall window off.
    pub fn new(window_ms: u64) -> Self {
        Self { entries: BTreeMap::new(), window_ms }
    }

    pub fn set_window(&mut self, window_ms: u64) {
        self.window_ms = window_ms;
    }

    /// A request went to `worker` at `now_ms`.
    pub fn sent(&mut self, worker: WorkerId, now_ms: u64) {
        let e = self.entries.entry(worker).or_insert(Entry { waiting: 0, since: now_ms, probe_after: 0 });
        e.waiting = e.waiting.saturating_add(1);
    }

    /// A request to `worker` ended: `answered` when the worker itself answered (it is back),
    /// not when Envoy gave up on it (a timeout, a reset, the client left).
    pub fn ended(&mut self, worker: WorkerId, answered: bool, now_ms: u64) {
        let Some(e) = self.entries.get_mut(&worker) else { return };
        e.waiting = e.waiting.saturating_sub(1);
        if answered {
            if e.waiting == 0 {
                self.entries.remove(&worker);
            } else {
                e.since = now_ms;
            }
        } else if e.waiting == 0 {
            e.probe_after = now_ms.saturating_add(self.window_ms);
        }
    }

    /// Whether `worker` has been silent for the whole window with requests sent to it (and,
    /// when nothing is waiting any more, no probe is due).
    pub fn stalled(&self, worker: WorkerId, now_ms: u64) -> bool {
        self.window_ms > 0
            && self.entries.get(&worker).is_some_and(|e| {
                now_ms.saturating_sub(e.since) > self.window_ms && (e.waiting > 0 || now_ms < e.probe_after)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_that_answers_nothing_for_the_window_is_stalled_until_it_answers() {
        let mut s = Stalls::new(2_000);
        s.sent(1, 0);
        s.sent(1, 500);
        assert!(!s.stalled(1, 2_000));
        assert!(s.stalled(1, 2_001), "two requests, no answer for 2 s");
        assert!(!s.stalled(2, 2_001), "another worker");
        s.ended(1, true, 2_100);
        assert!(!s.stalled(1, 2_200), "an answer restarts the clock");
        assert!(s.stalled(1, 4_101));
    }

    #[test]
    fn timeouts_do_not_bring_a_worker_back_but_a_probe_per_window_may_go() {
        let mut s = Stalls::new(1_000);
        s.sent(3, 0);
        s.sent(3, 0);
        s.ended(3, false, 1_500); // Envoy timed one out
        assert!(s.stalled(3, 1_500));
        s.ended(3, false, 1_600); // and the other
        assert!(s.stalled(3, 2_000), "timed out, not answered: still stalled");
        assert!(!s.stalled(3, 2_600), "a window later one probe may go");
        s.sent(3, 2_600);
        assert!(s.stalled(3, 2_601), "only one");
        s.ended(3, true, 2_700);
        assert!(!s.stalled(3, 2_701), "the probe was answered: back");
        s.sent(4, 20_000);
        assert!(!s.stalled(4, 20_500), "the clock starts with the first request held");
        s.ended(9, true, 0); // unknown worker: nothing happens
    }

    #[test]
    fn a_zero_window_is_off() {
        let mut s = Stalls::new(0);
        s.sent(1, 0);
        assert!(!s.stalled(1, u64::MAX));
    }
}
