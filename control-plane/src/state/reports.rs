//! Merging what the gateways report: index inserts (within each gateway's budget), every
//! worker they name held to its KV capacity at once, stale blocks forgotten, the whole index
//! held to `--max-index-entries`; and every worker's counts as each gateway sees them:
//! requests in flight, circuit breakers, cumulative requests, errors, failovers and engine
//! feedback (added by difference), and the completion metrics that fill marginal_utility's
//! windows and scores.

use kvmesh_core::policy::{utility_scores, UtilityWindow};
use kvmesh_proto::v1::{BreakerState, IndexEvict, IndexInsert, ReportBatch, Role, WorkerCounts};

use super::counts::LastCounts;
use super::registry::Registry;
use super::store::{now_ms, Locked, State};
use super::worker::WorkerEntry;
use crate::capacity;

impl State {
    /// Merges one gateway report. Entries naming unknown workers are dropped and counted;
    /// so are hashes past the per-report limit and the gateway's rate. The global index stays
    /// within `max_index_entries` (evicting the least recently used at once past 1/8 slack).
    pub fn report(&self, batch: ReportBatch) {
        self.report_at(batch, now_ms());
    }

    /// [`report`](Self::report) arriving at `at_ms` (ms since the epoch): its inserts within
    /// the gateway's budget, each worker it named bounded to its KV capacity, its stale blocks
    /// forgotten, the whole index bounded, then its counts; counted once the lock is released.
    fn report_at(&self, batch: ReportBatch, at_ms: u64) {
        let ReportBatch { gateway_id, inserts, counts, stale, tenant_usage, tenant_requests } = batch;
        let gateway = if gateway_id.is_empty() { "unknown".to_string() } else { gateway_id };
        let mut tally = Tally::default();
        {
            let mut inner = self.lock();
            let touched = self.merge_inserts(&mut inner, &gateway, inserts, &mut tally);
            self.bound_to_capacity(&mut inner, touched, &mut tally);
            self.forget_stale(&mut inner, stale, &mut tally);
            self.bound_total(&mut inner, &mut tally);
            self.merge_counts(&mut inner, &gateway, &counts, at_ms, &mut tally);
            if let Some(usage) = tenant_usage {
                let usage = kvmesh_proto::usage_from_wire(&usage, kvmesh_core::fleet::MAX_SHIPPED, at_ms);
                inner.tenants_mut().reported(&gateway, usage);
            }
            if let Some(requests) = tenant_requests {
                let requests = kvmesh_proto::usage_from_wire(&requests, kvmesh_core::fleet::MAX_SHIPPED, at_ms);
                inner.tenant_requests_mut().reported(&gateway, requests);
            }
        }
        if tally.bad > 0 {
            tracing::warn!(bad = tally.bad, "report names unknown workers; entries dropped");
        }
        if tally.dropped > 0 {
            tracing::debug!(dropped = tally.dropped, "report over its limits; hashes dropped");
        }
        self.counters.reports.inc();
        self.counters.bad_reports.inc_by(tally.bad);
        self.counters.dropped_inserts.inc_by(tally.dropped);
        self.counters.evicted_blocks.inc_by(tally.evicted);
    }

    /// Adds the reported blocks within the gateway's allowance (the news go out as inserts
    /// naming the gateway); returns the workers they named.
    fn merge_inserts(
        &self,
        inner: &mut Locked,
        gateway: &str,
        inserts: Vec<IndexInsert>,
        tally: &mut Tally,
    ) -> Vec<u32> {
        let limits = &self.settings.limits;
        let (registry, index, publication, gateways) = inner.parts();
        let mut allowed =
            gateways.allowance(gateway, limits.max_inserts_per_sec as f64, self.burst(), limits.max_inserts_per_report);
        let mut taken = 0usize;
        let mut touched: Vec<u32> = Vec::new();
        for insert in inserts {
            if !registry.contains(insert.worker) {
                tally.bad += 1;
                continue;
            }
            let n = insert.hashes.len().min(allowed);
            tally.dropped += (insert.hashes.len() - n) as u64;
            allowed -= n;
            taken += n;
            let Some(hashes) = insert.hashes.get(..n) else { continue };
            let mut added = Vec::new();
            index.insert(insert.worker, hashes, |h| added.push(h));
            if !touched.contains(&insert.worker) {
                touched.push(insert.worker);
            }
            publication.inserted(insert.worker, added, gateway);
        }
        gateways.spend(gateway, taken);
        touched
    }

    /// Each worker with a known KV capacity stays within it: its least recently used blocks
    /// go at once (--max-tree-size waits for the periodic eviction, as in sglang-router,
    /// whether the capacity is known or not).
    fn bound_to_capacity(&self, inner: &mut Locked, touched: Vec<u32>, tally: &mut Tally) {
        let (registry, index, publication, _) = inner.parts();
        for worker in touched {
            let Some(capacity) = registry.get(worker).and_then(|w| self.kv_capacity(w)) else { continue };
            let bound = capacity::capacity_blocks(&self.settings, capacity);
            let out = index.evict_worker_to(worker, bound);
            if !out.is_empty() {
                tally.evicted += out.len() as u64;
                publication.evicted(worker, out);
            }
        }
    }

    /// Blocks a worker's response showed it no longer held: every gateway forgets them.
    fn forget_stale(&self, inner: &mut Locked, stale: Vec<IndexEvict>, tally: &mut Tally) {
        let (registry, index, publication, _) = inner.parts();
        for stale in stale {
            if !registry.contains(stale.worker) {
                tally.bad += 1;
                continue;
            }
            let n = stale.hashes.len().min(self.settings.limits.max_inserts_per_report);
            let Some(hashes) = stale.hashes.get(..n) else { continue };
            let gone = index.remove(stale.worker, hashes);
            self.counters.stale_blocks.inc_by(gone);
            tally.evicted += gone;
            publication.evicted(stale.worker, hashes.to_vec());
        }
    }

    /// The global index stays within `max_index_entries`: past it and 1/8 slack, the least
    /// recently used entries go at once.
    fn bound_total(&self, inner: &mut Locked, tally: &mut Tally) {
        let max = self.settings.limits.max_index_entries;
        let (_, index, publication, _) = inner.parts();
        if index.entries() > max.saturating_add(max / 8) {
            let out = index.evict_total_to(max);
            tally.evicted += out.len() as u64;
            publication.evicted_entries(out);
        }
    }

    /// The gateway's counts: every worker's in-flight and breaker as this gateway sees them,
    /// its cumulative counts by difference, and the utility scores they give. A batch without
    /// counts (a chunk of the full report on connect) leaves them be.
    fn merge_counts(&self, inner: &mut Locked, gateway: &str, counts: &[WorkerCounts], at_ms: u64, tally: &mut Tally) {
        if counts.is_empty() {
            return;
        }
        let window = self.settings.utility.map(|u| u.window_size);
        let mut changed = false;
        let registry = inner.registry_mut();
        for w in registry.entries_mut() {
            changed |= match counts.iter().find(|c| c.worker == w.id) {
                Some(c) => merge_worker_counts(w, gateway, c, window, at_ms),
                None => not_counted(w, gateway),
            };
        }
        tally.bad += counts.iter().filter(|c| !registry.contains(c.worker)).count() as u64;
        changed |= self.score_utility(registry, at_ms);
        if changed {
            inner.publication_mut().workers_changed();
        }
    }

    /// marginal_utility: every worker's score from its window at `now_ms`, z-scored among the
    /// workers of its role (prefill, decode and regular workers are separate pools). Scores
    /// are rounded to 1/1000 so that noise does not republish the table; says whether one
    /// changed.
    fn score_utility(&self, registry: &mut Registry, now_ms: u64) -> bool {
        let Some(params) = self.settings.utility else { return false };
        let mut changed = false;
        for role in [Role::Regular, Role::Prefill, Role::Decode, Role::Both] {
            let ids: Vec<u32> = registry.entries().filter(|w| w.role == role).map(|w| w.id).collect();
            let trends: Vec<_> = ids
                .iter()
                .map(|&id| registry.get(id).and_then(|w| w.window.trend(params.min_history, now_ms)))
                .collect();
            let scores = utility_scores(&trends, params.throughput_weight, params.latency_weight);
            for (&id, score) in ids.iter().zip(scores) {
                let Some(w) = registry.get_mut(id) else { continue };
                let score = score.map(|u| (u * 1000.0).round() / 1000.0);
                changed |= w.utility != score;
                w.utility = score;
            }
        }
        changed
    }

    pub fn bad_report(&self) {
        self.counters.bad_reports.inc();
    }
}

/// What merging one report found: entries naming unknown workers, hashes over the limits,
/// blocks evicted from the global index.
#[derive(Default)]
struct Tally {
    bad: u64,
    dropped: u64,
    evicted: u64,
}

/// The most requests one gateway's report may say it has in flight on one worker.
pub const MAX_IN_FLIGHT: u32 = 1 << 16;

/// One worker's counts from `gateway`: its breaker there, its in-flight requests, the
/// cumulative counts added by difference, the completions pushed into its utility window
/// (`window`: its size, when marginal_utility is in force). Says whether the load filters
/// see changed.
fn merge_worker_counts(
    w: &mut WorkerEntry,
    gateway: &str,
    c: &WorkerCounts,
    window: Option<usize>,
    at_ms: u64,
) -> bool {
    // An unknown state number (a newer gateway) reads as closed.
    match c.breaker() {
        BreakerState::Closed => w.breakers.remove(gateway),
        state => w.breakers.insert(gateway.to_string(), state),
    };
    // No Envoy holds more than MAX_IN_FLIGHT requests on one worker: a forged count is capped.
    let in_flight = c.in_flight.min(MAX_IN_FLIGHT);
    let old = w.inflight.insert(gateway.to_string(), in_flight).unwrap_or(0);
    let changed = old != in_flight && w.polled_load.is_none();
    // The first report of a gateway counts from zero; the same gateway (one id per Envoy,
    // whichever VM holds its stream) is counted by differences.
    let now = LastCounts::of(c, at_ms);
    let last = w.last_counts(gateway);
    // Counts that went backwards, grew implausibly, or claim more errors than requests are not
    // added: the next report counts from them (a forged report cannot drive a total backwards,
    // wrap it, or add more than the bound a report).
    if now.follows(&last) {
        if let Some(size) = window {
            if w.window.capacity() != size {
                w.window = UtilityWindow::new(size);
            }
            now.push_completions_since(&last, &mut w.window);
        }
        let step = now.step_since(&last, &mut w.feedback);
        w.requests = w.requests.saturating_add(step.requests);
        w.errors = w.errors.saturating_add(step.errors);
        w.failovers = w.failovers.saturating_add(step.failovers);
    } else {
        tracing::warn!(gateway, worker = w.id, "implausible cumulative counts in a report: not added");
    }
    w.set_last_counts(gateway, now);
    changed
}

/// A worker missing from the gateway's counts: nothing in flight there, breaker closed. Says
/// whether the load filters see changed.
fn not_counted(w: &mut WorkerEntry, gateway: &str) -> bool {
    let changed = w.inflight.insert(gateway.to_string(), 0).is_some_and(|old| old != 0) && w.polled_load.is_none();
    w.breakers.remove(gateway);
    changed
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::state::counts::MAX_COUNT_STEP;
    use crate::state::gateways::{GATEWAY_TTL, INFLIGHT_TTL};
    use crate::state::worker::Source;
    use crate::state::workers::tests::state;
    use kvmesh_proto::v1::Feedback;
    use std::time::Instant;

    pub(crate) fn insert(s: &State, worker: u32, hashes: &[u64]) {
        let inserts = vec![IndexInsert { worker, hashes: hashes.to_vec(), ..Default::default() }];
        s.report(ReportBatch { gateway_id: "g".into(), inserts, ..Default::default() });
    }

    pub(crate) fn held(s: &State, worker: u32, hashes: &[u64]) -> Vec<u64> {
        let snap = s.full_snapshot();
        let all: Vec<u64> = snap.inserts.iter().filter(|i| i.worker == worker).flat_map(|i| i.hashes.clone()).collect();
        hashes.iter().copied().filter(|h| all.contains(h)).collect()
    }

    #[test]
    fn reports_merge_into_one_index_and_deltas_carry_only_news() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        let mut rx = s.subscribe();
        assert_eq!(s.publish(), Some(1), "the initial worker set");
        assert!(rx.try_recv().unwrap().workers_changed);
        s.report(ReportBatch {
            gateway_id: "a".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: vec![1, 2], ..Default::default() }],
            ..Default::default()
        });
        s.report(ReportBatch {
            gateway_id: "b".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: vec![1, 2, 3], ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.publish(), Some(2));
        let d = rx.try_recv().unwrap();
        assert_eq!(d.inserts.iter().map(|i| i.hashes.len()).sum::<usize>(), 3, "{d:?}");
        let origins: Vec<&str> = d.inserts.iter().map(|i| i.origin.as_str()).collect();
        assert_eq!(origins, ["a", "b"], "each insert names the gateway that reported it");
        assert!(!d.workers_changed);
        assert_eq!(s.publish(), None, "nothing new");
        let full = s.full_snapshot();
        assert_eq!((full.version, full.workers.len(), full.inserts[0].hashes.len()), (2, 2, 3));
    }

    #[test]
    fn unknown_workers_in_reports_are_dropped_and_counted() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        s.report(ReportBatch {
            gateway_id: "a".into(),
            inserts: vec![IndexInsert { worker: 42, hashes: vec![1], ..Default::default() }],
            counts: vec![WorkerCounts { worker: 43, in_flight: 1, ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.counters.bad_reports.get(), 2);
        assert_eq!(s.index_stats(), (0, 0));
    }

    #[test]
    fn reports_are_limited_per_message_and_per_gateway_rate_and_drops_are_counted() {
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--max-inserts-per-report",
            "100",
            "--max-inserts-per-sec",
            "50",
        ]);
        s.report_stream_opened("gw").unwrap();
        let batch = |from: u64, n: u64| ReportBatch {
            gateway_id: "gw".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: (from..from + n).collect(), ..Default::default() }],
            ..Default::default()
        };
        // Per message: 100 of 150.
        s.report(batch(0, 150));
        assert_eq!((s.index_stats().1, s.counters.dropped_inserts.get()), (100, 50));
        // The bucket held 4 s x 50 = 200: 100 are left, then it is empty.
        s.report(batch(1000, 100));
        s.report(batch(2000, 100));
        let (_, entries) = s.index_stats();
        assert!((200..=205).contains(&entries), "{entries}");
        assert!(s.counters.dropped_inserts.get() >= 145);
    }

    #[test]
    fn the_global_index_is_bounded_on_insert_and_the_evictions_are_published() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--max-index-entries", "80"]);
        s.publish();
        let mut rx = s.subscribe();
        for round in 0..20u64 {
            s.report(ReportBatch {
                gateway_id: "gw".into(),
                inserts: vec![IndexInsert {
                    worker: (round % 2) as u32,
                    hashes: (round * 10..round * 10 + 10).collect(),
                    ..Default::default()
                }],
                ..Default::default()
            });
            assert!(s.index_stats().1 <= 90, "within the bound and its 1/8 slack: {:?}", s.index_stats());
        }
        assert!(s.counters.evicted_blocks.get() >= 110);
        s.publish();
        let d = rx.try_recv().unwrap();
        assert!(d.evictions.iter().map(|e| e.hashes.len()).sum::<usize>() >= 110, "the filters forget them too");
        // The newest survive: the last round is still there.
        assert!(s.index_size_of(1) > 0);
    }

    #[test]
    fn every_eviction_of_a_report_is_counted() {
        // Worker 0 holds at most 8 blocks (64 tokens); the index at most 16 entries (and 2 slack).
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            "--worker-kv-capacity",
            "http://127.0.0.1:1=64",
            "--max-index-entries",
            "16",
        ]);
        s.publish();
        let mut rx = s.subscribe();
        // One report: 4 blocks over worker 0's capacity, 2 stale, then 21 entries bounded to 16.
        s.report(ReportBatch {
            gateway_id: "gw".into(),
            inserts: vec![
                IndexInsert { worker: 0, hashes: (0..12).collect(), ..Default::default() },
                IndexInsert { worker: 1, hashes: (100..115).collect(), ..Default::default() },
            ],
            stale: vec![IndexEvict { worker: 1, hashes: vec![100, 101] }],
            ..Default::default()
        });
        assert_eq!(s.index_stats().1, 16);
        s.publish();
        let told: usize = rx.try_recv().unwrap().evictions.iter().map(|e| e.hashes.len()).sum();
        assert_eq!(told, 4 + 2 + 5);
        assert_eq!(s.counters.evicted_blocks.get(), 4 + 2 + 5, "capacity, stale and total evictions all count");
        assert_eq!(s.counters.stale_blocks.get(), 2);
    }

    #[test]
    fn stale_blocks_and_feedback_from_reports() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        insert(&s, 0, &[1, 2, 3, 4]);
        let mut rx = s.subscribe();
        let feedback = Feedback {
            predictions: 3,
            accurate: 2,
            over: 1,
            predicted_tokens: 40,
            cached_tokens: 8,
            ..Default::default()
        };
        s.report(ReportBatch {
            gateway_id: "g".into(),
            stale: vec![IndexEvict { worker: 0, hashes: vec![3, 4] }, IndexEvict { worker: 9, hashes: vec![1] }],
            counts: vec![WorkerCounts { worker: 0, feedback: Some(feedback), ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(held(&s, 0, &[1, 2, 3, 4]), vec![1, 2]);
        assert_eq!((s.counters.stale_blocks.get(), s.counters.bad_reports.get()), (2, 1));
        s.publish();
        let d = rx.try_recv().unwrap();
        assert_eq!(d.evictions, vec![IndexEvict { worker: 0, hashes: vec![3, 4] }], "every gateway forgets them");
        let w = s.workers().into_iter().next().unwrap();
        assert_eq!((w.feedback.predictions, w.feedback.over, w.feedback.accuracy()), (3, 1, Some(2.0 / 3.0)));
    }

    #[test]
    fn a_gateways_inflight_goes_when_its_last_stream_ends_and_counts_are_not_doubled() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        let counts = |in_flight, requests| ReportBatch {
            gateway_id: "envoy/1".into(),
            counts: vec![WorkerCounts { worker: 0, in_flight, requests, ..Default::default() }],
            ..Default::default()
        };
        // VM a holds the stream.
        s.report_stream_opened("envoy/1").unwrap();
        s.report(counts(4, 10));
        assert_eq!((s.workers()[0].load(), s.workers()[0].requests), (4, 10));
        // The lease moves: VM b opens its stream (same Envoy, same id) before a's ends.
        s.report_stream_opened("envoy/1").unwrap();
        s.report(counts(2, 12));
        s.report_stream_closed("envoy/1");
        assert_eq!((s.workers()[0].load(), s.workers()[0].requests), (2, 12), "b's counts stay; nothing doubled");
        // A full-report chunk carries no counts and changes none.
        s.report(ReportBatch { gateway_id: "envoy/1".into(), ..Default::default() });
        assert_eq!(s.workers()[0].load(), 2);
        s.report_stream_closed("envoy/1");
        assert_eq!(s.workers()[0].load(), 0, "no stream left: its in-flight is gone");
        // It comes back (a control-plane hiccup): cumulative counts continue, never re-added.
        s.report_stream_opened("envoy/1").unwrap();
        s.report(counts(0, 15));
        assert_eq!(s.workers()[0].requests, 15);
        // A gateway silent past the TTL loses its in-flight even with a stream open.
        s.report(counts(3, 15));
        s.prune_gateways(Instant::now() + INFLIGHT_TTL);
        assert_eq!(s.workers()[0].load(), 0);
        // Gone past the gateway TTL: forgotten.
        s.report_stream_closed("envoy/1");
        assert_eq!(s.prune_gateways(Instant::now() + GATEWAY_TTL), 0);
    }

    #[test]
    fn forged_counts_cannot_drive_totals_backwards_or_past_the_bound() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        let report = |requests: u32, errors: u32, feedback: Feedback| {
            s.report(ReportBatch {
                gateway_id: "g".into(),
                counts: vec![WorkerCounts {
                    worker: 0,
                    requests,
                    errors,
                    feedback: Some(feedback),
                    ..Default::default()
                }],
                ..Default::default()
            })
        };
        let totals = || {
            let w = &s.workers()[0];
            (w.requests, w.errors, w.feedback.completions, w.feedback.e2e_latency_ms)
        };
        let fb = |completions: u32, e2e_latency_ms: u64| Feedback { completions, e2e_latency_ms, ..Default::default() };
        report(100, 1, fb(10, 5_000));
        assert_eq!(totals(), (100, 1, 10, 5_000));
        // Backwards (a wrapping difference of nearly 2^32 used to be added): not added, and
        // the next honest report counts from it.
        report(50, 1, fb(10, 5_000));
        assert_eq!(totals(), (100, 1, 10, 5_000));
        report(60, 2, fb(12, 6_000));
        assert_eq!(totals(), (110, 2, 12, 6_000));
        // More errors than requests, a leap past the bound, a latency sum no responses explain.
        report(61, 9, fb(12, 6_000));
        report(61 + MAX_COUNT_STEP + 1, 9, fb(12, 6_000));
        report(62 + MAX_COUNT_STEP + 1, 9, fb(13, u64::MAX));
        assert_eq!(totals(), (110, 2, 12, 6_000));
        // The 64-bit sums could be wrapped (or overflow, in a debug build) the same way.
        report(63 + MAX_COUNT_STEP + 1, 9, fb(14, u64::MAX - 1));
        report(64 + MAX_COUNT_STEP + 1, 9, fb(15, 0));
        assert_eq!(totals(), (110, 2, 12, 6_000), "backwards: nothing added");
        report(65 + MAX_COUNT_STEP + 1, 9, fb(16, 10));
        assert_eq!(totals(), (111, 2, 13, 6_010), "the next honest step counts from the last report");
        // Wrapping at 2^32 is honest.
        report(u32::MAX, 9, fb(16, 10)); // a leap: the starting point
        report(4, 10, fb(17, 20));
        assert_eq!(totals(), (116, 3, 14, 6_020));
    }

    #[test]
    fn breakers_are_merged_over_the_live_gateways_and_failovers_summed() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        let report = |gateway: &str, breaker: BreakerState, failovers: u32| {
            let mut c = WorkerCounts { worker: 0, failovers, ..Default::default() };
            c.set_breaker(breaker);
            s.report(ReportBatch { gateway_id: gateway.into(), counts: vec![c], ..Default::default() });
        };
        let w = |s: &State| s.workers().into_iter().next().unwrap();
        for g in ["a", "b"] {
            s.report_stream_opened(g).unwrap();
        }
        report("a", BreakerState::Closed, 0);
        assert_eq!((w(&s).circuit_breaker(), w(&s).breakers_open()), ("closed", 0));
        report("a", BreakerState::HalfOpen, 1);
        assert_eq!(w(&s).circuit_breaker(), "half_open");
        report("b", BreakerState::Open, 2);
        assert_eq!((w(&s).circuit_breaker(), w(&s).breakers_open(), w(&s).failovers), ("open", 1, 3));
        report("a", BreakerState::Open, 4);
        assert_eq!((w(&s).breakers_open(), w(&s).failovers), (2, 6), "cumulative: a's 1 then 4");
        assert_eq!(s.workers()[1].circuit_breaker(), "closed", "another worker");
        // A report without this worker: closed there. A gateway whose stream ended: forgotten.
        s.report(ReportBatch {
            gateway_id: "a".into(),
            counts: vec![WorkerCounts { worker: 1, ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(w(&s).breakers_open(), 1);
        s.report_stream_closed("b");
        assert_eq!((w(&s).circuit_breaker(), w(&s).failovers), ("closed", 6));
        // A state number from a newer gateway reads as closed.
        let c = WorkerCounts { worker: 0, breaker: 77, ..Default::default() };
        s.report(ReportBatch { gateway_id: "a".into(), counts: vec![c], ..Default::default() });
        assert_eq!(w(&s).circuit_breaker(), "closed");
    }

    #[test]
    fn completion_metrics_fill_windows_and_a_worker_slowing_down_scores_below_a_steady_one() {
        let urls = ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--policy", "marginal_utility"];
        let s = state(&urls);
        s.report_stream_opened("g").unwrap();
        // Every second, each worker finishes 2 requests of 10 tokens; worker 0's latency grows
        // by 100 ms a report, worker 1's stays at 200 ms.
        let (mut lat0, mut lat1, mut done) = (0u64, 0u64, 0u32);
        for i in 1..=12u64 {
            done += 2;
            lat0 += 2 * 100 * i;
            lat1 += 2 * 200;
            let fb = |lat| Feedback {
                completions: done,
                completion_tokens: 10 * u64::from(done),
                e2e_latency_ms: lat,
                ..Default::default()
            };
            let counts = vec![
                WorkerCounts { worker: 0, feedback: Some(fb(lat0)), ..Default::default() },
                WorkerCounts { worker: 1, feedback: Some(fb(lat1)), ..Default::default() },
            ];
            s.report_at(ReportBatch { gateway_id: "g".into(), counts, ..Default::default() }, 1_000_000 + 1000 * i);
            let ws = s.workers();
            if i < 5 {
                assert_eq!((ws[0].utility, ws[1].utility), (None, None), "below min_history after {i} reports");
            }
        }
        let ws = s.workers();
        assert_eq!((ws[0].window.len(), ws[1].window.len()), (20, 20), "the window slides");
        let (u0, u1) = (ws[0].utility.unwrap(), ws[1].utility.unwrap());
        assert!(u0 < 0.0 && u1 > 0.0, "slowing {u0} vs steady {u1}");
        let snap = s.full_snapshot();
        assert_eq!(snap.workers.iter().map(|w| w.utility).collect::<Vec<_>>(), vec![Some(u0), Some(u1)]);
        // Silence: the windows go stale, and the next report (no completions) clears the scores.
        let counts = vec![WorkerCounts {
            worker: 0,
            feedback: Some(Feedback { completions: done, ..Default::default() }),
            ..Default::default()
        }];
        s.report_at(ReportBatch { gateway_id: "g".into(), counts, ..Default::default() }, 1_000_000 + 30_000);
        assert!(s.workers().iter().all(|w| w.utility.is_none()));
        // Without marginal_utility in force, no windows are kept.
        let s = state(&urls[..3]);
        let fb = Feedback { completions: 5, completion_tokens: 50, e2e_latency_ms: 500, ..Default::default() };
        let counts = vec![WorkerCounts { worker: 0, feedback: Some(fb), ..Default::default() }];
        s.report_at(ReportBatch { gateway_id: "g".into(), counts, ..Default::default() }, 5_000);
        assert_eq!((s.workers()[0].window.len(), s.workers()[0].utility), (0, None));
    }

    #[test]
    fn ids_are_never_reused_and_inflight_is_load_without_polling() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        assert!(s.remove_worker("http://127.0.0.1:1"));
        assert_eq!(s.add_worker("http://127.0.0.1:1", Role::Regular, None, Source::Api), Ok(1));
        assert!(s.add_worker("http://127.0.0.1:1", Role::Regular, None, Source::Api).is_err());
        let counts = |in_flight, requests, errors| {
            vec![WorkerCounts { worker: 1, in_flight, requests, errors, ..Default::default() }]
        };
        s.report(ReportBatch { gateway_id: "a".into(), counts: counts(3, 10, 1), ..Default::default() });
        s.report(ReportBatch { gateway_id: "b".into(), counts: counts(2, 5, 0), ..Default::default() });
        s.report(ReportBatch { gateway_id: "a".into(), counts: counts(3, 12, 1), ..Default::default() });
        assert_eq!(s.workers()[0].load(), 5);
        assert_eq!((s.workers()[0].requests, s.workers()[0].errors), (17, 1));
        // Cumulative counts wrap at 2^32 (a leap past MAX_COUNT_STEP is not added: it is where
        // the next report counts from).
        s.report(ReportBatch { gateway_id: "b".into(), counts: counts(2, u32::MAX, 0), ..Default::default() });
        s.report(ReportBatch { gateway_id: "b".into(), counts: counts(2, 1, 0), ..Default::default() });
        assert_eq!(s.workers()[0].requests, 17 + 2);
        // A forged in-flight count is capped.
        s.report(ReportBatch { gateway_id: "b".into(), counts: counts(u32::MAX, 1, 0), ..Default::default() });
        assert_eq!(s.workers()[0].load(), 3 + u64::from(MAX_IN_FLIGHT));
        s.load_result(1, Some(9), None);
        assert_eq!(s.workers()[0].load(), 9);
    }
}
