//! `marginal_utility` (seed 002): route to the worker whose performance trend improves most.
//!
//! Two halves, split between the control plane and the filter:
//!
//! - kvmesh-cp keeps a [`UtilityWindow`] per worker: the last `window_size` completed requests
//!   (completion tokens, the worker's own `e2e_latency`, when it finished), from the completion
//!   metrics every gateway reports. With at least `min_history` of them, the window is split in
//!   two halves; each half's throughput (completion tokens per second over its span) and mean
//!   latency give the gradients `∇T = (T2 − T1) / Δt` and `∇L = (L2 − L1) / Δt`, Δt the whole
//!   window's span. [`utility_scores`] z-scores the gradients across the workers that have a
//!   trend and scores each `throughput_weight · z(∇T) − latency_weight · z(∇L)`; the scores go
//!   to every filter in the snapshot ([`Candidate::utility`]).
//! - The filter ([`MarginalUtility::pick`]) adds its local view of load: score =
//!   `utility − load_weight · load` (load = the control plane's load plus this gateway's
//!   in-flight requests). A worker without a trend counts as average (utility 0), so when
//!   none has one the policy is "fewest outstanding requests", the seed's fallback.
//!
//! Degenerate windows have no trend (the worker falls back to its load): fewer than
//! `min_history` samples, a window whose samples all share one timestamp (Δt = 0), a half
//! whose samples do (no throughput), a window whose newest sample is older than
//! [`STALE_MS`] (a worker that gets no traffic keeps no trend: it would otherwise never
//! recover from a bad one). Zero variance across workers divides by 1; one worker with a
//! trend scores 0.

use std::collections::VecDeque;

use super::{best_scored, Candidate, Decision, Indexed, RouterParams, RoutingPolicy, RoutingText};
use rand::RngCore;

/// A window whose newest sample is older than this has no trend.
pub const STALE_MS: u64 = 10_000;
/// The largest window accepted (validated in the configuration).
pub const MAX_WINDOW: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UtilityParams {
    /// Completed requests kept per worker (N).
    pub window_size: usize,
    /// Completed requests needed for a trend (M ≤ N).
    pub min_history: usize,
    pub throughput_weight: f64,
    pub latency_weight: f64,
    /// Weight of a request in flight against one unit of utility (the filter's part).
    pub load_weight: f64,
}

/// One completed request as the window keeps it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// When it finished, in milliseconds (any fixed origin).
    pub at_ms: u64,
    pub tokens: f64,
    /// The worker's `e2e_latency`, in seconds.
    pub latency_s: f64,
}

/// The throughput and latency gradients of one worker's window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Trend {
    /// Completion tokens per second, per second.
    pub throughput: f64,
    /// Seconds of latency, per second.
    pub latency: f64,
}

/// One worker's sliding window of completed requests.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UtilityWindow {
    samples: VecDeque<Sample>,
    cap: usize,
}

impl UtilityWindow {
    /// A window of the last `cap` samples (between 1 and [`MAX_WINDOW`]).
    pub fn new(cap: usize) -> Self {
        let cap = cap.clamp(1, MAX_WINDOW);
        Self { samples: VecDeque::with_capacity(cap), cap }
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The most samples kept.
    pub fn capacity(&self) -> usize {
        self.cap.max(1)
    }

    pub fn push(&mut self, s: Sample) {
        while self.samples.len() >= self.capacity() {
            self.samples.pop_front();
        }
        self.samples.push_back(s);
    }

    /// `count` requests reported together (a gateway's counts grew by them between two
    /// reports, at `from_ms` and `to_ms`), with their token and latency sums: each gets the
    /// mean, and they are spread evenly over `(from_ms, to_ms]` (the report says no more).
    pub fn push_batch(&mut self, from_ms: u64, to_ms: u64, count: u64, tokens: u64, latency_ms: u64) {
        if count == 0 {
            return;
        }
        let tokens = tokens as f64 / count as f64;
        let latency_s = latency_ms as f64 / count as f64 / 1000.0;
        let span = to_ms.saturating_sub(from_ms);
        // Only the last `cap` can stay in the window.
        let first = count.saturating_sub(self.capacity() as u64);
        for k in first..count {
            let at_ms = to_ms - span.saturating_mul(count - 1 - k) / count;
            self.push(Sample { at_ms, tokens, latency_s });
        }
    }

    /// The window's trend at `now_ms`, if it has one (see the module documentation).
    pub fn trend(&self, min_history: usize, now_ms: u64) -> Option<Trend> {
        let n = self.samples.len();
        if n < min_history.max(2) {
            return None;
        }
        let (first, last) = (self.samples.front()?, self.samples.back()?);
        if now_ms.saturating_sub(last.at_ms) > STALE_MS || last.at_ms <= first.at_ms {
            return None;
        }
        let dt = (last.at_ms - first.at_ms) as f64 / 1000.0;
        let mid = n / 2;
        let (t1, l1) = half(self.samples.range(..mid))?;
        let (t2, l2) = half(self.samples.range(mid..))?;
        Some(Trend { throughput: (t2 - t1) / dt, latency: (l2 - l1) / dt })
    }
}

/// A half window's throughput (tokens per second over its span) and mean latency; none when
/// its samples share one timestamp.
fn half<'a>(samples: impl Iterator<Item = &'a Sample> + Clone) -> Option<(f64, f64)> {
    let (mut n, mut tokens, mut latency) = (0usize, 0.0, 0.0);
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for s in samples {
        n += 1;
        tokens += s.tokens;
        latency += s.latency_s;
        lo = lo.min(s.at_ms);
        hi = hi.max(s.at_ms);
    }
    if n == 0 || hi <= lo {
        return None;
    }
    Some((tokens / ((hi - lo) as f64 / 1000.0), latency / n as f64))
}

/// Mean and population standard deviation of the values.
fn stats(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Each worker's utility from its trend (none without one): the gradients z-scored across
/// the workers that have a trend (a zero deviation divides by 1), then
/// `throughput_weight · z(∇T) − latency_weight · z(∇L)`.
pub fn utility_scores(trends: &[Option<Trend>], throughput_weight: f64, latency_weight: f64) -> Vec<Option<f64>> {
    let ts: Vec<f64> = trends.iter().flatten().map(|t| t.throughput).collect();
    let ls: Vec<f64> = trends.iter().flatten().map(|t| t.latency).collect();
    let (mt, st) = stats(&ts);
    let (ml, sl) = stats(&ls);
    let z = |x: f64, mean: f64, sd: f64| (x - mean) / if sd > 0.0 { sd } else { 1.0 };
    trends
        .iter()
        .map(|t| {
            let t = t.as_ref()?;
            let u = throughput_weight * z(t.throughput, mt, st) - latency_weight * z(t.latency, ml, sl);
            u.is_finite().then_some(u)
        })
        .collect()
}

/// The filter's half: utility from the control plane against local load.
#[derive(Clone, Copy, Debug)]
pub struct MarginalUtility {
    pub load_weight: f64,
}

impl MarginalUtility {
    pub fn score(&self, c: &Candidate) -> f64 {
        c.utility.filter(|u| u.is_finite()).unwrap_or(0.0) - self.load_weight * c.load as f64
    }

    pub fn pick(&self, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        best_scored(0..cands.len(), |p| cands.get(p).map_or(f64::NAN, |c| self.score(c)), rng)
    }
}

impl RoutingPolicy for MarginalUtility {
    fn new(params: &RouterParams) -> Self {
        Self { load_weight: params.utility_load_weight }
    }

    fn decide(
        &self,
        at: Indexed<'_>,
        text: RoutingText<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        at.blind(self.pick(cands, rng), text, cands)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::seeded;

    /// A window of `n` requests, one every 100 ms from `start_ms`, the i-th with `tokens(i)`
    /// tokens and `latency(i)` seconds.
    fn window(n: usize, tokens: impl Fn(usize) -> f64, latency: impl Fn(usize) -> f64) -> UtilityWindow {
        let mut w = UtilityWindow::new(20);
        for i in 0..n {
            w.push(Sample { at_ms: 1_000 + 100 * i as u64, tokens: tokens(i), latency_s: latency(i) });
        }
        w
    }

    #[test]
    fn gradients_between_the_halves() {
        // 20 samples over 1.9 s; first half: 10 tokens each over 0.9 s, second: 20 each.
        let w = window(20, |i| if i < 10 { 10.0 } else { 20.0 }, |i| if i < 10 { 1.0 } else { 2.0 });
        let t = w.trend(10, 3_000).unwrap();
        let (t1, t2) = (100.0 / 0.9, 200.0 / 0.9);
        assert!((t.throughput - (t2 - t1) / 1.9).abs() < 1e-9, "{t:?}");
        assert!((t.latency - 1.0 / 1.9).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn degenerate_windows_have_no_trend() {
        assert_eq!(window(9, |_| 1.0, |_| 1.0).trend(10, 2_000), None, "below min_history");
        assert_eq!(UtilityWindow::new(20).trend(0, 0), None, "empty");
        let mut same = UtilityWindow::new(20);
        for _ in 0..12 {
            same.push(Sample { at_ms: 5_000, tokens: 3.0, latency_s: 0.1 });
        }
        assert_eq!(same.trend(10, 5_000), None, "equal timestamps");
        // The first half all at one instant: no throughput for it.
        let mut half_same = UtilityWindow::new(20);
        for i in 0..12u64 {
            half_same.push(Sample { at_ms: if i < 6 { 5_000 } else { 5_000 + i * 10 }, tokens: 1.0, latency_s: 0.1 });
        }
        assert_eq!(half_same.trend(10, 5_200), None, "a half without a span");
        let w = window(12, |_| 1.0, |_| 1.0);
        assert!(w.trend(10, 2_100).is_some());
        assert_eq!(w.trend(10, 2_100 + STALE_MS + 1), None, "stale");
    }

    #[test]
    fn the_window_slides_and_batches_are_spread_over_their_interval() {
        let mut w = UtilityWindow::new(4);
        w.push_batch(0, 1_000, 10, 100, 5_000);
        assert_eq!(w.len(), 4, "only the last cap of a batch stay");
        let at: Vec<u64> = w.samples.iter().map(|s| s.at_ms).collect();
        assert_eq!(at, vec![700, 800, 900, 1_000]);
        assert!(w.samples.iter().all(|s| s.tokens == 10.0 && s.latency_s == 0.5));
        w.push_batch(1_000, 1_000, 1, 7, 0);
        assert_eq!(w.samples.back().map(|s| (s.at_ms, s.tokens)), Some((1_000, 7.0)));
        w.push_batch(1_000, 2_000, 0, 0, 0);
        assert_eq!(w.len(), 4, "an empty batch adds nothing");
        let mut d = UtilityWindow::default();
        d.push_batch(0, 10, 5, 5, 5);
        assert_eq!((d.len(), d.capacity()), (1, 1), "a default window keeps one");
    }

    #[test]
    fn scores_are_z_scored_across_workers() {
        let up = Trend { throughput: 10.0, latency: -1.0 };
        let down = Trend { throughput: -10.0, latency: 1.0 };
        let s = utility_scores(&[Some(up), None, Some(down)], 0.6, 0.4);
        // z(∇T) = ±1, z(∇L) = ∓1: 0.6 + 0.4 and its opposite.
        assert_eq!(s, vec![Some(1.0), None, Some(-1.0)]);
        // Zero variance (and one worker): everyone scores 0.
        assert_eq!(utility_scores(&[Some(up), Some(up)], 0.6, 0.4), vec![Some(0.0), Some(0.0)]);
        assert_eq!(utility_scores(&[Some(down)], 0.6, 0.4), vec![Some(0.0)]);
        assert_eq!(utility_scores(&[None, None], 0.6, 0.4), vec![None, None]);
        assert!(utility_scores(&[], 0.6, 0.4).is_empty());
    }

    #[test]
    fn the_filter_weighs_utility_against_load_and_falls_back_to_fewest_outstanding() {
        let mu = MarginalUtility { load_weight: 1.0 };
        let c = |load, utility| Candidate { load, utility, ..Default::default() };
        let mut rng = seeded(5);
        // No history anywhere: fewest outstanding wins.
        assert_eq!(mu.pick(&[c(3, None), c(1, None), c(2, None)], &mut rng), Some(1));
        // An improving worker wins over one request more in flight, not over three.
        assert_eq!(mu.pick(&[c(2, Some(1.5)), c(1, Some(-0.5))], &mut rng), Some(0));
        assert_eq!(mu.pick(&[c(4, Some(1.5)), c(1, Some(-0.5))], &mut rng), Some(1));
        assert_eq!(mu.pick(&[c(0, Some(f64::NAN))], &mut rng), Some(0), "not finite: counts as 0");
        assert_eq!(mu.pick(&[], &mut rng), None);
        // Ties at random.
        let mut seen = [false; 3];
        for _ in 0..48 {
            seen[mu.pick(&[c(0, None), c(0, None), c(0, None)], &mut rng).unwrap()] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
