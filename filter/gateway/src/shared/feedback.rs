//! Engine feedback counts of one Envoy, shared by its VMs (`kvmesh.feedback`): per worker,
//! how the predictions compared with what the worker's responses said, and the completion
//! metrics those responses carried. Cumulative and wrapping (like `kvmesh.state`'s counts);
//! the stream owner reports them and kvmesh-cp adds the differences.
//!
//! Layout: 56-byte entries `(worker u32, predictions u32, accurate u32, over u32, under u32,
//! completions u32, predicted_tokens u64, cached_tokens u64, completion_tokens u64,
//! e2e_latency_ms u64)`, at most [`MAX_WORKERS`] of them.

use kvmesh_core::feedback::{Judged, Verdict};
use kvmesh_core::usage::Usage;
use kvmesh_core::WorkerId;
use kvmesh_proto::v1::Feedback;

use super::{update, SharedStore};

const KEY: &str = "kvmesh.feedback.v1";
const ENTRY: usize = 56;
/// Workers tracked at once (a worker past it is not counted).
pub const MAX_WORKERS: usize = 1024;

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).and_then(|s| s.try_into().ok()).map_or(0, u32::from_le_bytes)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).and_then(|s| s.try_into().ok()).map_or(0, u64::from_le_bytes)
}

fn decode(entry: &[u8]) -> (WorkerId, Feedback) {
    let f = Feedback {
        predictions: u32_at(entry, 4),
        accurate: u32_at(entry, 8),
        over: u32_at(entry, 12),
        under: u32_at(entry, 16),
        completions: u32_at(entry, 20),
        predicted_tokens: u64_at(entry, 24),
        cached_tokens: u64_at(entry, 32),
        completion_tokens: u64_at(entry, 40),
        e2e_latency_ms: u64_at(entry, 48),
    };
    (u32_at(entry, 0), f)
}

fn encode(worker: WorkerId, f: &Feedback, out: &mut [u8]) {
    let fields32 = [worker, f.predictions, f.accurate, f.over, f.under, f.completions];
    let fields64 = [f.predicted_tokens, f.cached_tokens, f.completion_tokens, f.e2e_latency_ms];
    let bytes = fields32.iter().flat_map(|v| v.to_le_bytes()).chain(fields64.iter().flat_map(|v| v.to_le_bytes()));
    for (slot, b) in out.iter_mut().zip(bytes) {
        *slot = b;
    }
}

/// Adds one response's judgement (if a prediction was made) and usage to `f`.
fn add(f: &mut Feedback, judged: Option<&Judged>, usage: &Usage) {
    if let Some(j) = judged {
        f.predictions = f.predictions.wrapping_add(1);
        match j.verdict {
            Verdict::Accurate => f.accurate = f.accurate.wrapping_add(1),
            Verdict::Over => f.over = f.over.wrapping_add(1),
            Verdict::Under => f.under = f.under.wrapping_add(1),
        }
        f.predicted_tokens = f.predicted_tokens.wrapping_add(j.predicted_tokens);
        f.cached_tokens = f.cached_tokens.wrapping_add(j.cached_tokens);
    }
    if let Some(tokens) = usage.completion_tokens {
        f.completions = f.completions.wrapping_add(1);
        f.completion_tokens = f.completion_tokens.wrapping_add(tokens);
        let ms = usage.e2e_latency.map_or(0, |s| (s * 1000.0).min(u32::MAX as f64) as u64);
        f.e2e_latency_ms = f.e2e_latency_ms.wrapping_add(ms);
    }
}

/// `b` added to `a`, field by field (wrapping, like the shared counts).
fn merge(a: &mut Feedback, b: &Feedback) {
    a.predictions = a.predictions.wrapping_add(b.predictions);
    a.accurate = a.accurate.wrapping_add(b.accurate);
    a.over = a.over.wrapping_add(b.over);
    a.under = a.under.wrapping_add(b.under);
    a.completions = a.completions.wrapping_add(b.completions);
    a.predicted_tokens = a.predicted_tokens.wrapping_add(b.predicted_tokens);
    a.cached_tokens = a.cached_tokens.wrapping_add(b.cached_tokens);
    a.completion_tokens = a.completion_tokens.wrapping_add(b.completion_tokens);
    a.e2e_latency_ms = a.e2e_latency_ms.wrapping_add(b.e2e_latency_ms);
}

/// One VM's feedback not yet in shared data. Responses are added here (no host call on the
/// request path); the tick merges them into `kvmesh.feedback` with one compare-and-swap, so
/// the stream owner's report lags a response by at most one tick.
#[derive(Debug, Default)]
pub struct Pending {
    workers: std::collections::BTreeMap<WorkerId, Feedback>,
}

impl Pending {
    /// Adds one response of `worker`: its judged prediction (if one was made) and its usage.
    pub fn add(&mut self, worker: WorkerId, judged: Option<&Judged>, usage: &Usage) {
        if !self.workers.contains_key(&worker) && self.workers.len() >= MAX_WORKERS {
            return;
        }
        add(self.workers.entry(worker).or_default(), judged, usage);
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Merges what was added into the shared counts (nothing to do: no host call). What did
    /// not fit (the table full, or the store refusing every try) is dropped, not retried.
    pub fn flush(&mut self, store: &dyn SharedStore) {
        if self.workers.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.workers);
        update(store, KEY, |value| {
            value.truncate(value.len() - value.len() % ENTRY);
            for (&worker, more) in &pending {
                let pos = value.chunks_exact(ENTRY).position(|e| u32_at(e, 0) == worker);
                let at = match pos {
                    Some(i) => i * ENTRY,
                    None if value.len() / ENTRY < MAX_WORKERS => {
                        value.resize(value.len() + ENTRY, 0);
                        value.len() - ENTRY
                    }
                    None => continue,
                };
                let Some(entry) = value.get_mut(at..at + ENTRY) else { continue };
                let (_, mut f) = decode(entry);
                merge(&mut f, more);
                encode(worker, &f, entry);
            }
        });
    }
}

/// Adds one response of `worker` to the shared counts at once (the request path goes
/// through [`Pending`]).
#[cfg(test)]
pub fn record(store: &dyn SharedStore, worker: WorkerId, judged: Option<&Judged>, usage: &Usage) {
    let mut one = Pending::default();
    one.add(worker, judged, usage);
    one.flush(store);
}

/// Every worker's counts.
pub fn read(store: &dyn SharedStore) -> Vec<(WorkerId, Feedback)> {
    store.get(KEY).0.unwrap_or_default().chunks_exact(ENTRY).map(decode).collect()
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeStore;
    use super::*;
    use kvmesh_core::feedback::judge;

    #[test]
    fn responses_add_up_per_worker() {
        let store = FakeStore::default();
        let usage = Usage { cached_tokens: Some(0), completion_tokens: Some(4), e2e_latency: Some(0.25) };
        record(&store, 3, Some(&judge(320, 10, 0, 32, 4)), &usage);
        record(&store, 3, Some(&judge(320, 10, 80, 32, 4)), &Usage::default());
        record(&store, 5, None, &usage);
        let all = read(&store);
        assert_eq!(all.len(), 2);
        let (w, f) = all[0];
        assert_eq!((w, f.predictions, f.accurate, f.over, f.under), (3, 2, 1, 1, 0));
        assert_eq!((f.predicted_tokens, f.cached_tokens), (160, 80));
        assert_eq!((f.completions, f.completion_tokens, f.e2e_latency_ms), (1, 4, 250));
        assert_eq!((all[1].0, all[1].1.predictions, all[1].1.completions), (5, 0, 1));
    }

    #[test]
    fn pending_responses_reach_shared_data_in_one_write_on_flush() {
        let store = FakeStore::default();
        let mut pending = Pending::default();
        let usage = Usage { cached_tokens: Some(0), completion_tokens: Some(2), e2e_latency: Some(0.5) };
        for i in 0..100u32 {
            pending.add(i % 2, Some(&judge(320, 10, 0, 32, 4)), &usage);
        }
        assert!(read(&store).is_empty(), "nothing written per response");
        pending.flush(&store);
        assert!(pending.is_empty());
        pending.flush(&store); // nothing pending: nothing changes
        let all = read(&store);
        assert_eq!(all.len(), 2);
        for (_, f) in &all {
            assert_eq!((f.predictions, f.over, f.completions, f.completion_tokens), (50, 50, 50, 100));
            assert_eq!((f.e2e_latency_ms, f.predicted_tokens, f.cached_tokens), (25_000, 4_000, 0));
        }
        // A second batch adds to what the first left.
        pending.add(1, None, &usage);
        pending.flush(&store);
        assert_eq!(read(&store)[1].1.completions, 51);
    }

    #[test]
    fn the_table_is_bounded() {
        let store = FakeStore::default();
        for w in 0..(MAX_WORKERS as u32 + 10) {
            record(&store, w, None, &Usage { completion_tokens: Some(1), ..Default::default() });
        }
        assert_eq!(read(&store).len(), MAX_WORKERS);
        store.set(KEY, &[1, 2, 3], None).unwrap();
        record(&store, 1, None, &Usage { completion_tokens: Some(1), ..Default::default() });
        assert_eq!(read(&store).len(), 1, "garbage is dropped, not trusted");
    }
}
