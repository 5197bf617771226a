//! Circuit breakers, one per worker (sglang-router's `--cb-*` flags), as a pure state machine:
//! no clock (times come in as milliseconds), no host, no shared memory. The filter keeps a
//! [`BreakerTable`] in Envoy shared data, so that every thread of an Envoy sees the same
//! breakers; this module also defines that value's bounded byte encoding.
//!
//! - **Closed**: requests flow. Failures are counted in a sliding window of
//!   `window_ms` (in [`BUCKETS`] steps). The breaker opens when the failures in the window reach
//!   `failure_threshold` *and* are at least as many as the successes seen in the window since
//!   its first failure: a worker that fails everything opens after exactly `failure_threshold`
//!   failures (as sglang-router's consecutive count does), one with sporadic errors among many
//!   successes stays closed (in sglang-router a success resets the count), and failures
//!   older than the window are forgotten (sglang-router 0.3.2 accepts the window flag but
//!   does not use it).
//! - **Open** for `timeout_ms`: no requests.
//! - **HalfOpen** after that: one probe request at a time (the probe slot is held until that
//!   request's outcome, or for at most `timeout_ms`). `success_threshold` successes close the
//!   breaker; any failure opens it again for `timeout_ms`.
//!
//! What counts as a failure is the caller's business (the filter counts a 5xx from the
//! worker, a refused or reset connection and a timeout; never a 4xx, nor what Envoy or the
//! client did). With `disabled`, every worker is always available and nothing is recorded.
//!
//! Every input is hostile: decoded values of any bytes, times that jump backwards or lie far in
//! the future. A breaker whose opening lies further ahead than a whole timeout (the clock went
//! back, or garbage) counts as timed out, so no value keeps a worker out for more than twice
//! the timeout.

use std::collections::BTreeMap;

use crate::worker::WorkerId;

/// Steps of the sliding window.
pub const BUCKETS: usize = 8;

/// sglang-router 0.3.2's defaults.
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 10;
pub const DEFAULT_SUCCESS_THRESHOLD: u32 = 3;
pub const DEFAULT_TIMEOUT_SECS: u64 = 60;
pub const DEFAULT_WINDOW_SECS: u64 = 120;

/// The breaker settings, validated (every number at least 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerParams {
    pub failure_threshold: u32,
    pub success_threshold: u32,
    pub timeout_ms: u64,
    pub window_ms: u64,
    pub disabled: bool,
}

impl Default for BreakerParams {
    fn default() -> Self {
        Self {
            failure_threshold: DEFAULT_FAILURE_THRESHOLD,
            success_threshold: DEFAULT_SUCCESS_THRESHOLD,
            timeout_ms: DEFAULT_TIMEOUT_SECS * 1000,
            window_ms: DEFAULT_WINDOW_SECS * 1000,
            disabled: false,
        }
    }
}

impl BreakerParams {
    /// The width of one window step, in milliseconds.
    fn bucket_ms(&self) -> u64 {
        self.window_ms.div_ceil(BUCKETS as u64).max(1)
    }

    fn timeout_ms(&self) -> u64 {
        self.timeout_ms.max(1)
    }
}

/// Where a breaker stands at a given time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// The sliding window of outcomes while closed: [`BUCKETS`] steps of `width_ms`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Window {
    /// The step width the buckets were counted with (0: empty window).
    width_ms: u64,
    /// The newest step (time / width).
    newest: u64,
    failures: [u32; BUCKETS],
    successes: [u32; BUCKETS],
}

impl Window {
    fn slot(step: u64) -> usize {
        (step % BUCKETS as u64) as usize
    }

    /// Moves the window to `now_ms`: the steps that fell out are emptied. A time before the
    /// newest step (a clock that went back) counts in the newest step.
    fn advance(&mut self, width_ms: u64, now_ms: u64) {
        let step = now_ms / width_ms;
        if self.width_ms != width_ms {
            *self = Self { width_ms, newest: step, ..Self::default() };
            return;
        }
        if step <= self.newest {
            return;
        }
        let gone = step - self.newest;
        if gone >= BUCKETS as u64 {
            self.failures = [0; BUCKETS];
            self.successes = [0; BUCKETS];
        } else {
            for s in self.newest + 1..=step {
                let i = Self::slot(s);
                if let Some(f) = self.failures.get_mut(i) {
                    *f = 0;
                }
                if let Some(ok) = self.successes.get_mut(i) {
                    *ok = 0;
                }
            }
        }
        self.newest = step;
    }

    fn add(&mut self, failure: bool) {
        let i = Self::slot(self.newest);
        let counts = if failure { &mut self.failures } else { &mut self.successes };
        if let Some(n) = counts.get_mut(i) {
            *n = n.saturating_add(1);
        }
    }

    /// `(failures, successes)` in the window (as last advanced).
    fn totals(&self) -> (u64, u64) {
        let sum = |c: &[u32; BUCKETS]| c.iter().map(|&n| u64::from(n)).sum();
        (sum(&self.failures), sum(&self.successes))
    }

    /// Whether anything counted is still inside the window at `now_ms`.
    fn live(&self, now_ms: u64) -> bool {
        if self.width_ms == 0 {
            return false;
        }
        let mut w = *self;
        w.advance(self.width_ms, now_ms);
        w.totals() != (0, 0)
    }
}

/// One worker's breaker. `Default` is closed with an empty window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Breaker {
    /// When the breaker last opened (ms): open for a timeout from then, half-open after.
    opened_ms: Option<u64>,
    /// Half-open: when the probe in flight was admitted.
    probe_ms: Option<u64>,
    /// Half-open: successes so far.
    half_open_successes: u32,
    window: Window,
    /// Requests moved from this worker to another (cumulative, wrapping at 2^32).
    failovers: u32,
}

/// Whether a period that began at `since_ms` and lasts `len_ms` is still running at `now_ms`. A
/// beginning further ahead than a whole period (a clock that went back, or garbage) is over.
fn running(since_ms: u64, len_ms: u64, now_ms: u64) -> bool {
    now_ms < since_ms.saturating_add(len_ms) && since_ms <= now_ms.saturating_add(len_ms)
}

impl Breaker {
    pub fn state(&self, p: &BreakerParams, now_ms: u64) -> BreakerState {
        match self.opened_ms {
            _ if p.disabled => BreakerState::Closed,
            None => BreakerState::Closed,
            Some(at) if running(at, p.timeout_ms(), now_ms) => BreakerState::Open,
            Some(_) => BreakerState::HalfOpen,
        }
    }

    fn probe_out(&self, p: &BreakerParams, now_ms: u64) -> bool {
        self.probe_ms.is_some_and(|at| running(at, p.timeout_ms(), now_ms))
    }

    /// Whether a request may be sent to the worker now: closed, or half-open with the probe
    /// slot free.
    pub fn admits(&self, p: &BreakerParams, now_ms: u64) -> bool {
        match self.state(p, now_ms) {
            BreakerState::Closed => true,
            BreakerState::Open => false,
            BreakerState::HalfOpen => !self.probe_out(p, now_ms),
        }
    }

    /// Takes the half-open probe slot for a request about to be sent: true when this request
    /// is the probe (false when the breaker is not half-open or the slot is taken).
    pub fn take_probe(&mut self, p: &BreakerParams, now_ms: u64) -> bool {
        if self.state(p, now_ms) != BreakerState::HalfOpen || self.probe_out(p, now_ms) {
            return false;
        }
        self.probe_ms = Some(now_ms);
        true
    }

    fn open(&mut self, now_ms: u64) {
        *self = Self { opened_ms: Some(now_ms), failovers: self.failovers, ..Self::default() };
    }

    /// Records the outcome of a request to the worker at `now_ms`. Returns whether the breaker
    /// changed (a success while closed with no failure in the window changes nothing, so
    /// healthy traffic costs no write).
    pub fn record(&mut self, p: &BreakerParams, ok: bool, now_ms: u64) -> bool {
        match self.state(p, now_ms) {
            _ if p.disabled => false,
            BreakerState::Closed => {
                let before = *self;
                self.window.advance(p.bucket_ms(), now_ms);
                let (failures, _) = self.window.totals();
                if ok && failures == 0 {
                    // Nothing to weigh a success against.
                    *self = before;
                    return false;
                }
                self.window.add(!ok);
                let (failures, successes) = self.window.totals();
                if !ok && failures >= u64::from(p.failure_threshold) && failures >= successes {
                    self.open(now_ms);
                }
                true
            }
            // The late outcome of a request sent before the breaker opened.
            BreakerState::Open => false,
            BreakerState::HalfOpen if ok => {
                self.probe_ms = None;
                self.half_open_successes = self.half_open_successes.saturating_add(1);
                if self.half_open_successes >= p.success_threshold {
                    *self = Self { failovers: self.failovers, ..Self::default() };
                }
                true
            }
            BreakerState::HalfOpen => {
                self.open(now_ms);
                true
            }
        }
    }

    /// Counts one request moved from this worker to another.
    pub fn count_failover(&mut self) {
        self.failovers = self.failovers.wrapping_add(1);
    }

    pub fn failovers(&self) -> u32 {
        self.failovers
    }

    /// Nothing worth keeping at `now_ms`: closed, nothing in the window, no failovers counted.
    pub fn idle(&self, now_ms: u64) -> bool {
        self.opened_ms.is_none() && self.failovers == 0 && !self.window.live(now_ms)
    }

    /// `(failures, successes)` counted in the window at `now_ms` (a debugging view).
    pub fn window_totals(&self, now_ms: u64) -> (u64, u64) {
        let mut w = self.window;
        if w.width_ms == 0 {
            return (0, 0);
        }
        w.advance(w.width_ms, now_ms);
        w.totals()
    }
}

/// Bytes of one encoded entry (worker id included).
pub const ENTRY_BYTES: usize = 112;
/// Most entries a table holds (112 KiB encoded); see [`BreakerTable::prune`].
pub const MAX_ENTRIES: usize = 1024;

const OPENED: u32 = 1;
const PROBE: u32 = 2;

/// Every worker's breaker, as kept in shared data: entries sorted by worker id, each
/// [`ENTRY_BYTES`] bytes, little-endian:
/// `worker u32, flags u32 (1 opened, 2 probe out), opened_ms u64, probe_ms u64,
/// half_open_successes u32, failovers u32, window width_ms u64, newest step u64,
/// failures [u32; 8], successes [u32; 8]`.
/// Decoding takes any bytes: a short tail is ignored, a repeated worker keeps its first
/// entry, and at most [`MAX_ENTRIES`] are read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BreakerTable {
    entries: BTreeMap<WorkerId, Breaker>,
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

fn decode_entry(bytes: &[u8]) -> Option<(WorkerId, Breaker)> {
    let mut r = Reader(bytes);
    let worker = r.u32()?;
    let flags = r.u32()?;
    let opened_ms = r.u64()?;
    let probe_ms = r.u64()?;
    let half_open_successes = r.u32()?;
    let failovers = r.u32()?;
    let width_ms = r.u64()?;
    let newest = r.u64()?;
    let mut failures = [0u32; BUCKETS];
    for f in &mut failures {
        *f = r.u32()?;
    }
    let mut successes = [0u32; BUCKETS];
    for s in &mut successes {
        *s = r.u32()?;
    }
    let breaker = Breaker {
        opened_ms: (flags & OPENED != 0).then_some(opened_ms),
        probe_ms: (flags & PROBE != 0).then_some(probe_ms),
        half_open_successes,
        window: Window { width_ms, newest, failures, successes },
        failovers,
    };
    Some((worker, breaker))
}

fn encode_entry(worker: WorkerId, b: &Breaker, out: &mut Vec<u8>) {
    let flags = if b.opened_ms.is_some() { OPENED } else { 0 } | if b.probe_ms.is_some() { PROBE } else { 0 };
    out.extend_from_slice(&worker.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&b.opened_ms.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&b.probe_ms.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&b.half_open_successes.to_le_bytes());
    out.extend_from_slice(&b.failovers.to_le_bytes());
    out.extend_from_slice(&b.window.width_ms.to_le_bytes());
    out.extend_from_slice(&b.window.newest.to_le_bytes());
    for n in b.window.failures.iter().chain(&b.window.successes) {
        out.extend_from_slice(&n.to_le_bytes());
    }
}

impl BreakerTable {
    pub fn decode(bytes: &[u8]) -> Self {
        let mut entries = BTreeMap::new();
        for (worker, b) in bytes.chunks_exact(ENTRY_BYTES).take(MAX_ENTRIES).filter_map(decode_entry) {
            entries.entry(worker).or_insert(b);
        }
        Self { entries }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.entries.len() * ENTRY_BYTES);
        for (worker, b) in &self.entries {
            encode_entry(*worker, b, &mut out);
        }
        out
    }

    pub fn get(&self, worker: WorkerId) -> Option<&Breaker> {
        self.entries.get(&worker)
    }

    /// `worker`'s breaker, added (closed) when it has none.
    pub fn entry(&mut self, worker: WorkerId) -> &mut Breaker {
        self.entries.entry(worker).or_default()
    }

    /// Every breaker, by worker id.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, &Breaker)> {
        self.entries.iter().map(|(w, b)| (*w, b))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops the breakers with nothing worth keeping at `now_ms`, then, past [`MAX_ENTRIES`],
    /// closed ones before open ones, the oldest worker ids first.
    pub fn prune(&mut self, now_ms: u64) {
        self.entries.retain(|_, b| !b.idle(now_ms));
        let excess = self.entries.len().saturating_sub(MAX_ENTRIES);
        if excess > 0 {
            let mut order: Vec<(bool, WorkerId)> =
                self.entries.iter().map(|(w, b)| (b.opened_ms.is_none(), *w)).collect();
            order.sort_unstable_by_key(|&(closed, w)| (std::cmp::Reverse(closed), w));
            for (_, w) in order.into_iter().take(excess) {
                self.entries.remove(&w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(failures: u32, successes: u32, timeout_ms: u64, window_ms: u64) -> BreakerParams {
        BreakerParams {
            failure_threshold: failures,
            success_threshold: successes,
            timeout_ms,
            window_ms,
            disabled: false,
        }
    }

    use BreakerState::{Closed, HalfOpen, Open};

    #[test]
    fn defaults_are_sglang_routers() {
        let p = BreakerParams::default();
        assert_eq!((p.failure_threshold, p.success_threshold, p.timeout_ms, p.window_ms), (10, 3, 60_000, 120_000));
        assert!(!p.disabled);
    }

    #[test]
    fn failures_open_then_half_open_probe_closes() {
        let p = params(3, 2, 1_000, 10_000);
        let mut b = Breaker::default();
        assert!(b.record(&p, false, 0));
        assert!(b.record(&p, false, 100));
        assert_eq!(b.state(&p, 100), Closed);
        assert!(b.record(&p, false, 200));
        assert_eq!(b.state(&p, 200), Open);
        assert!(!b.admits(&p, 1_199));
        assert!(!b.record(&p, false, 500), "a late failure while open changes nothing");
        assert_eq!(b.state(&p, 1_200), HalfOpen);
        assert!(b.admits(&p, 1_200));
        assert!(b.take_probe(&p, 1_200));
        assert!(!b.admits(&p, 1_201), "one probe at a time");
        assert!(!b.take_probe(&p, 1_201));
        assert!(b.record(&p, true, 1_300));
        assert_eq!(b.state(&p, 1_300), HalfOpen, "one success of two");
        assert!(b.admits(&p, 1_300), "the slot is free again");
        assert!(b.take_probe(&p, 1_300));
        assert!(b.record(&p, true, 1_400));
        assert_eq!(b.state(&p, 1_400), Closed);
        assert_eq!(b.window_totals(1_400), (0, 0), "closing starts a fresh window");
    }

    #[test]
    fn a_failed_probe_opens_again_for_a_whole_timeout() {
        let p = params(1, 3, 1_000, 10_000);
        let mut b = Breaker::default();
        b.record(&p, false, 0);
        assert!(b.take_probe(&p, 1_000));
        b.record(&p, true, 1_010);
        assert!(b.take_probe(&p, 1_020));
        b.record(&p, false, 1_500);
        assert_eq!(b.state(&p, 2_499), Open, "reopened at 1500");
        assert_eq!(b.state(&p, 2_500), HalfOpen);
        assert!(b.take_probe(&p, 2_500));
        for t in [2_600, 2_700] {
            b.record(&p, true, t);
            assert_eq!(b.state(&p, t), HalfOpen, "the successes before the failure do not count");
            assert!(b.take_probe(&p, t));
        }
        b.record(&p, true, 2_800);
        assert_eq!(b.state(&p, 2_800), Closed);
    }

    #[test]
    fn a_probe_that_never_answers_frees_its_slot_after_a_timeout() {
        let p = params(1, 1, 1_000, 10_000);
        let mut b = Breaker::default();
        b.record(&p, false, 0);
        assert!(b.take_probe(&p, 1_000));
        assert!(!b.admits(&p, 1_999));
        assert!(b.admits(&p, 2_000));
        assert!(b.take_probe(&p, 2_000));
    }

    #[test]
    fn failures_leave_the_window() {
        // Window 8 s in steps of 1 s.
        let p = params(3, 1, 1_000, 8_000);
        let mut b = Breaker::default();
        b.record(&p, false, 0);
        b.record(&p, false, 1_000);
        assert_eq!(b.window_totals(7_999), (2, 0));
        assert_eq!(b.window_totals(8_000), (1, 0), "the step of t=0 fell out");
        b.record(&p, false, 8_000);
        assert_eq!(b.state(&p, 8_000), Closed, "only two failures in the window");
        b.record(&p, false, 8_500);
        assert_eq!(b.state(&p, 8_500), Open);
        // Long silence: everything falls out at once.
        let mut c = Breaker::default();
        c.record(&p, false, 0);
        c.record(&p, false, 0);
        assert_eq!(c.window_totals(1_000_000), (0, 0));
        assert!(c.idle(1_000_000));
        c.record(&p, false, 1_000_000);
        assert_eq!(c.state(&p, 1_000_000), Closed);
    }

    #[test]
    fn sporadic_failures_among_successes_do_not_open() {
        let p = params(3, 1, 1_000, 100_000);
        let mut b = Breaker::default();
        // A busy worker: one failure in ten requests.
        for i in 0..1_000u64 {
            b.record(&p, i % 10 != 0, i * 10);
            assert_eq!(b.state(&p, i * 10), Closed, "request {i}");
        }
        // A worker that fails most requests opens.
        let mut c = Breaker::default();
        for (i, ok) in [true, false, false, true, false].into_iter().enumerate() {
            c.record(&p, ok, i as u64);
        }
        assert_eq!(c.state(&p, 5), Open, "3 failures, 2 successes");
    }

    #[test]
    fn successes_before_any_failure_are_not_recorded() {
        let p = params(3, 1, 1_000, 10_000);
        let mut b = Breaker::default();
        assert!(!b.record(&p, true, 0), "nothing to write for healthy traffic");
        assert_eq!(b, Breaker::default());
        b.record(&p, false, 1);
        assert!(b.record(&p, true, 2));
        assert_eq!(b.window_totals(2), (1, 1));
    }

    #[test]
    fn disabled_breakers_never_open() {
        let p = BreakerParams { disabled: true, ..params(1, 1, 1_000, 1_000) };
        let mut b = Breaker::default();
        for t in 0..100 {
            assert!(!b.record(&p, false, t));
            assert!(b.admits(&p, t));
        }
        // A breaker opened before it was disabled no longer counts either.
        let on = params(1, 1, 1_000, 1_000);
        let mut c = Breaker::default();
        c.record(&on, false, 0);
        assert!(!c.admits(&on, 10) && c.admits(&p, 10));
        assert_eq!(c.state(&p, 10), Closed);
    }

    #[test]
    fn a_clock_that_goes_back_keeps_a_worker_out_at_most_twice_the_timeout() {
        let p = params(1, 1, 1_000, 10_000);
        let mut b = Breaker::default();
        b.record(&p, false, 50_000);
        assert_eq!(b.state(&p, 49_500), Open, "a little skew between threads: still open");
        assert_eq!(b.state(&p, 49_000), Open);
        assert_eq!(b.state(&p, 48_999), HalfOpen, "opened further ahead than a timeout: over");
        // Failures at earlier times count in the newest step.
        let mut c = Breaker::default();
        let q = params(2, 1, 1_000, 8_000);
        c.record(&q, false, 10_000);
        c.record(&q, false, 5);
        assert_eq!(c.state(&q, 5), Open);
    }

    #[test]
    fn changing_the_window_starts_it_afresh() {
        let mut b = Breaker::default();
        b.record(&params(3, 1, 1_000, 8_000), false, 0);
        b.record(&params(3, 1, 1_000, 8_000), false, 0);
        b.record(&params(3, 1, 1_000, 16_000), false, 0);
        assert_eq!(b.state(&params(3, 1, 1_000, 16_000), 0), Closed);
        assert_eq!(b.window_totals(0), (1, 0));
    }

    #[test]
    fn failovers_are_cumulative_and_survive_transitions() {
        let p = params(1, 1, 1_000, 1_000);
        let mut b = Breaker::default();
        b.count_failover();
        b.record(&p, false, 0);
        b.count_failover();
        b.take_probe(&p, 1_000);
        b.record(&p, true, 1_000);
        assert_eq!((b.state(&p, 1_000), b.failovers()), (Closed, 2));
        assert!(!b.idle(1_000_000), "a counted failover is kept for the reports");
        let mut w = Breaker { failovers: u32::MAX, ..Breaker::default() };
        w.count_failover();
        assert_eq!(w.failovers(), 0, "wraps");
    }

    /// One row: the outcomes at given times and the state expected after each.
    #[test]
    fn table_of_sequences() {
        // (threshold, successes, timeout, window) and steps of (time, event, expected state).
        // Events: 'F' failure, 'S' success, 'P' probe taken, 'p' probe refused.
        type Row = ((u32, u32, u64, u64), &'static [(u64, char, BreakerState)]);
        let rows: &[Row] = &[
            ((2, 1, 100, 1_000), &[(0, 'F', Closed), (1, 'F', Open), (101, 'P', HalfOpen), (102, 'S', Closed)]),
            ((2, 1, 100, 1_000), &[(0, 'F', Closed), (1, 'S', Closed), (2, 'F', Open)]),
            (
                (2, 1, 100, 1_000),
                &[(0, 'F', Closed), (1, 'S', Closed), (2, 'S', Closed), (3, 'S', Closed), (4, 'F', Closed)],
            ),
            ((2, 1, 100, 1_000), &[(0, 'F', Closed), (1, 'S', Closed), (2, 'S', Closed), (3, 'F', Open)]),
            ((2, 1, 100, 1_000), &[(0, 'F', Closed), (1_000, 'F', Closed), (1_001, 'F', Open)]),
            ((1, 2, 100, 1_000), &[(0, 'F', Open), (50, 'p', Open), (100, 'P', HalfOpen), (100, 'p', HalfOpen)]),
            ((1, 2, 100, 1_000), &[(0, 'F', Open), (100, 'P', HalfOpen), (150, 'F', Open), (249, 'p', Open)]),
            ((1, 2, 100, 1_000), &[(0, 'F', Open), (100, 'S', HalfOpen), (101, 'S', Closed), (102, 'F', Open)]),
            (
                (3, 3, 100, 800),
                &[(0, 'S', Closed), (1, 'S', Closed), (2, 'F', Closed), (3, 'F', Closed), (4, 'F', Open)],
            ),
        ];
        for (n, ((f, s, t, w), steps)) in rows.iter().enumerate() {
            let p = params(*f, *s, *t, *w);
            let mut b = Breaker::default();
            for (i, &(now, event, want)) in steps.iter().enumerate() {
                match event {
                    'F' => {
                        b.record(&p, false, now);
                    }
                    'S' => {
                        b.record(&p, true, now);
                    }
                    'P' => assert!(b.take_probe(&p, now), "row {n} step {i}: probe refused"),
                    _ => assert!(!b.take_probe(&p, now), "row {n} step {i}: probe admitted"),
                }
                assert_eq!(b.state(&p, now), want, "row {n} step {i}");
            }
        }
    }

    #[test]
    fn the_table_round_trips_and_stays_sorted() {
        let p = params(1, 1, 1_000, 8_000);
        let mut t = BreakerTable::default();
        t.entry(9).record(&p, false, 5);
        t.entry(2).record(&p, false, 5);
        t.entry(2).take_probe(&p, 2_000);
        t.entry(4).count_failover();
        t.entry(7).record(&params(3, 1, 1_000, 8_000), false, 5);
        let bytes = t.encode();
        assert_eq!(bytes.len(), 4 * ENTRY_BYTES);
        let back = BreakerTable::decode(&bytes);
        assert_eq!(back, t);
        assert_eq!(back.iter().map(|(w, _)| w).collect::<Vec<_>>(), vec![2, 4, 7, 9]);
        assert!(!back.get(2).unwrap().admits(&p, 2_001), "the probe is out");
        assert_eq!(back.get(4).unwrap().failovers(), 1);
    }

    #[test]
    fn decoding_tolerates_garbage() {
        let p = params(1, 1, 1_000, 8_000);
        assert!(BreakerTable::decode(&[]).is_empty());
        assert!(BreakerTable::decode(&[0xff; ENTRY_BYTES - 1]).is_empty());
        // All ones: opened at u64::MAX (further ahead than a timeout: half-open), probe likewise.
        let t = BreakerTable::decode(&[0xff; ENTRY_BYTES * 3 + 5]);
        assert_eq!(t.len(), 1, "one worker id repeated: the first entry");
        let mut b = *t.get(u32::MAX).unwrap();
        assert_eq!(b.state(&p, 1_000), HalfOpen);
        assert!(b.admits(&p, 1_000));
        b.record(&p, false, 1_000);
        b.record(&p, true, 2_000);
        // Huge counts and steps do not overflow.
        let mut c = Breaker {
            window: Window {
                width_ms: 1_000,
                newest: u64::MAX,
                failures: [u32::MAX; BUCKETS],
                successes: [0; BUCKETS],
            },
            ..Breaker::default()
        };
        assert_eq!(c.window_totals(u64::MAX).0, u64::from(u32::MAX) * BUCKETS as u64);
        let late = u64::MAX - 10_000;
        c.record(&params(1, 1, 1_000, 8_000), false, late);
        assert_eq!(c.state(&params(1, 1, 1_000, 8_000), late), Open);
        assert_eq!(c.state(&params(1, 1, 1_000, 8_000), u64::MAX), HalfOpen, "no overflow at the end of time");
        let many: Vec<u8> = (0..(MAX_ENTRIES as u32 + 10))
            .flat_map(|w| {
                let mut e = vec![0u8; ENTRY_BYTES];
                e[..4].copy_from_slice(&w.to_le_bytes());
                e
            })
            .collect();
        assert_eq!(BreakerTable::decode(&many).len(), MAX_ENTRIES);
    }

    #[test]
    fn pruning_drops_idle_breakers_and_bounds_the_table() {
        let p = params(1, 1, 1_000, 8_000);
        let mut t = BreakerTable::default();
        t.entry(1);
        t.entry(2).record(&params(5, 1, 1_000, 8_000), false, 0);
        t.entry(3).record(&p, false, 0);
        t.prune(1);
        assert_eq!(t.iter().map(|(w, _)| w).collect::<Vec<_>>(), vec![2, 3]);
        t.prune(100_000);
        assert_eq!(t.iter().map(|(w, _)| w).collect::<Vec<_>>(), vec![3], "an opened breaker is kept");
        for w in 10..(MAX_ENTRIES as u32 + 20) {
            t.entry(w).count_failover();
        }
        t.prune(100_000);
        assert_eq!(t.len(), MAX_ENTRIES);
        assert!(t.get(3).is_some(), "open breakers go last");
    }
}
