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

use crate::shared::{update, SharedStore};

const KEY: &str = "kvmesh.feedback";
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

/// Adds one response of `worker`: its judged prediction (if one was made) and its usage.
pub fn record(store: &dyn SharedStore, worker: WorkerId, judged: Option<&Judged>, usage: &Usage) {
    update(store, KEY, |value| {
        value.truncate(value.len() - value.len() % ENTRY);
        let pos = value.chunks_exact(ENTRY).position(|e| u32_at(e, 0) == worker);
        let at = match pos {
            Some(i) => i * ENTRY,
            None if value.len() / ENTRY < MAX_WORKERS => {
                value.resize(value.len() + ENTRY, 0);
                value.len() - ENTRY
            }
            None => return,
        };
        let Some(entry) = value.get_mut(at..at + ENTRY) else { return };
        let (_, mut f) = decode(entry);
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
        encode(worker, &f, entry);
    });
}

/// Every worker's counts.
pub fn read(store: &dyn SharedStore) -> Vec<(WorkerId, Feedback)> {
    store.get(KEY).0.unwrap_or_default().chunks_exact(ENTRY).map(decode).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;
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
