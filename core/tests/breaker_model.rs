//! The circuit breaker against a reference model written from its documentation (events kept
//! one by one instead of in window steps), over random sequences of outcomes, probes and
//! clock steps; and the shared-data encoding against any bytes.

use kvmesh_core::breaker::{Breaker, BreakerParams, BreakerState, BreakerTable, BUCKETS, ENTRY_BYTES, MAX_ENTRIES};
use proptest::prelude::*;

/// The documented behaviour, kept as simply as possible.
struct Model {
    p: BreakerParams,
    opened: Option<u64>,
    probe: Option<u64>,
    half_open_successes: u32,
    /// Closed: (window step, failed) of every outcome counted.
    events: Vec<(u64, bool)>,
}

impl Model {
    fn new(p: BreakerParams) -> Self {
        Self { p, opened: None, probe: None, half_open_successes: 0, events: Vec::new() }
    }

    fn state(&self, now: u64) -> BreakerState {
        match self.opened {
            _ if self.p.disabled => BreakerState::Closed,
            None => BreakerState::Closed,
            Some(at) if now < at + self.p.timeout_ms => BreakerState::Open,
            Some(_) => BreakerState::HalfOpen,
        }
    }

    fn open(&mut self, now: u64) {
        self.opened = Some(now);
        self.probe = None;
        self.half_open_successes = 0;
        self.events.clear();
    }

    fn record(&mut self, ok: bool, now: u64) {
        match self.state(now) {
            _ if self.p.disabled => {}
            BreakerState::Closed => {
                let width = self.p.window_ms.div_ceil(BUCKETS as u64).max(1);
                let step = now / width;
                self.events.retain(|&(s, _)| s + BUCKETS as u64 > step);
                let failures = |e: &[(u64, bool)]| e.iter().filter(|(_, f)| *f).count() as u64;
                if ok && failures(&self.events) == 0 {
                    return;
                }
                self.events.push((step, !ok));
                let f = failures(&self.events);
                let s = self.events.len() as u64 - f;
                if !ok && f >= u64::from(self.p.failure_threshold) && f >= s {
                    self.open(now);
                }
            }
            BreakerState::Open => {}
            BreakerState::HalfOpen if ok => {
                self.probe = None;
                self.half_open_successes += 1;
                if self.half_open_successes >= self.p.success_threshold {
                    *self = Self::new(self.p);
                }
            }
            BreakerState::HalfOpen => self.open(now),
        }
    }

    fn probe_out(&self, now: u64) -> bool {
        self.probe.is_some_and(|at| now < at + self.p.timeout_ms)
    }

    fn admits(&self, now: u64) -> bool {
        match self.state(now) {
            BreakerState::Closed => true,
            BreakerState::Open => false,
            BreakerState::HalfOpen => !self.probe_out(now),
        }
    }

    fn take_probe(&mut self, now: u64) -> bool {
        if self.state(now) != BreakerState::HalfOpen || self.probe_out(now) {
            return false;
        }
        self.probe = Some(now);
        true
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Ok,
    Fail,
    Probe,
}

fn params() -> impl Strategy<Value = BreakerParams> {
    (1u32..6, 1u32..4, 1u64..5_000, 1u64..20_000, prop::bool::weighted(0.1)).prop_map(
        |(failure_threshold, success_threshold, timeout_ms, window_ms, disabled)| BreakerParams {
            failure_threshold,
            success_threshold,
            timeout_ms,
            window_ms,
            disabled,
        },
    )
}

fn ops() -> impl Strategy<Value = Vec<(u64, Op)>> {
    let op = prop_oneof![3 => Just(Op::Fail), 3 => Just(Op::Ok), 2 => Just(Op::Probe)];
    // Clock steps: often none, sometimes small, sometimes past a window or a timeout.
    let dt = prop_oneof![4 => Just(0u64), 4 => 0u64..500, 1 => 0u64..30_000];
    prop::collection::vec((dt, op), 0..80)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn the_breaker_behaves_as_documented(p in params(), ops in ops(), start in 0u64..1u64 << 40) {
        let mut model = Model::new(p);
        let mut b = Breaker::default();
        let mut now = start;
        for (i, (dt, op)) in ops.into_iter().enumerate() {
            now += dt;
            match op {
                Op::Ok => { model.record(true, now); b.record(&p, true, now); }
                Op::Fail => { model.record(false, now); b.record(&p, false, now); }
                Op::Probe => prop_assert_eq!(b.take_probe(&p, now), model.take_probe(now), "step {}", i),
            }
            prop_assert_eq!(b.state(&p, now), model.state(now), "step {} {:?}", i, op);
            prop_assert_eq!(b.admits(&p, now), model.admits(now), "step {}", i);
            if p.disabled {
                prop_assert!(b.admits(&p, now));
            }
            // What is shared between threads is exactly what one thread holds.
            let mut t = BreakerTable::default();
            *t.entry(7) = b;
            prop_assert_eq!(BreakerTable::decode(&t.encode()).get(7).copied(), Some(b));
        }
    }

    #[test]
    fn any_bytes_decode_and_any_use_is_safe(
        bytes in prop::collection::vec(any::<u8>(), 0..(ENTRY_BYTES * 4 + 7)),
        p in params(),
        times in prop::collection::vec(any::<u64>(), 1..12),
    ) {
        let mut t = BreakerTable::decode(&bytes);
        prop_assert!(t.len() <= bytes.len() / ENTRY_BYTES);
        let workers: Vec<u32> = t.iter().map(|(w, _)| w).collect();
        for (i, &now) in times.iter().enumerate() {
            for &w in &workers {
                let b = t.entry(w);
                let _ = (b.state(&p, now), b.admits(&p, now), b.window_totals(now));
                b.take_probe(&p, now);
                b.record(&p, i % 2 == 0, now);
                b.count_failover();
            }
            t.prune(now);
        }
        let again = BreakerTable::decode(&t.encode());
        prop_assert_eq!(again, t.clone());
        prop_assert!(t.len() <= MAX_ENTRIES);
    }

    #[test]
    fn an_open_breaker_never_keeps_a_worker_out_for_more_than_twice_the_timeout(
        p in params(), opened in any::<u64>(), now in any::<u64>(),
    ) {
        let mut b = Breaker::default();
        for _ in 0..p.failure_threshold {
            b.record(&p, false, opened);
        }
        if !p.disabled {
            prop_assert_eq!(b.state(&p, opened), BreakerState::Open);
        }
        // Whatever the clock says later (or earlier), the worker is out only within one
        // timeout of the opening on either side.
        if !b.admits(&p, now) {
            prop_assert!(now.abs_diff(opened) <= p.timeout_ms, "out at {} after opening at {}", now, opened);
        }
    }
}
