//! The capacity model: how much of the prefix index each worker may hold.
//!
//! A worker's KV cache holds `max_total_num_tokens` tokens (SGLang's `/get_server_info`), or
//! what `--worker-kv-capacity URL=TOKENS` says for engines that do not report it. Its part of
//! the global index is kept within that many tokens' worth of blocks (`--bytes-per-token`
//! bytes of routing text a token, `--block-size` bytes a block), evicting its least recently
//! used blocks first — the order the engine's own LRU evicts in — so that the index claims no
//! more than the worker can hold. `--max-tree-size` stays an upper bound on top, as in
//! sglang-router.

use crate::settings::Settings;

/// Parses one `--worker-kv-capacity` entry: `URL=TOKENS`.
pub fn parse_override(entry: &str) -> Result<(String, u64), String> {
    let (url, tokens) = entry.rsplit_once('=').ok_or_else(|| format!("`{entry}` is not URL=TOKENS"))?;
    let tokens: u64 = tokens.trim().parse().map_err(|_| format!("`{tokens}` is not a number of tokens"))?;
    if tokens == 0 {
        return Err(format!("`{entry}`: the capacity must be at least 1 token"));
    }
    Ok((url.trim().trim_end_matches('/').to_string(), tokens))
}

/// `max_total_num_tokens` from SGLang's `/get_server_info` (top level, or under
/// `internal_states`, one per data-parallel rank, summed).
pub fn parse_server_info(body: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    if let Some(n) = v.get("max_total_num_tokens").and_then(serde_json::Value::as_u64) {
        return Some(n).filter(|&n| n > 0);
    }
    let ranks = v.get("internal_states")?.as_array()?;
    let total = ranks
        .iter()
        .filter_map(|r| r.get("max_total_num_tokens").and_then(serde_json::Value::as_u64))
        .fold(0u64, u64::saturating_add);
    (total > 0).then_some(total)
}

/// The most blocks a worker's part of the index may hold: its KV capacity in blocks, within
/// `--max-tree-size`.
pub fn bound_blocks(settings: &Settings, capacity_tokens: Option<u64>) -> u64 {
    let block = (settings.block_size as u64).max(1);
    let tree = (settings.max_tree_size / block).max(1);
    match capacity_tokens {
        Some(tokens) => capacity_blocks(settings, tokens).min(tree),
        None => tree,
    }
}

/// A KV capacity of `tokens` in index blocks (at least 1): the bound a report is held to at
/// once; `--max-tree-size` is the periodic eviction's, as in sglang-router.
pub fn capacity_blocks(settings: &Settings, tokens: u64) -> u64 {
    (tokens.saturating_mul(settings.bytes_per_token) / (settings.block_size as u64).max(1)).max(1)
}

/// Tokens' worth of `blocks` index blocks.
pub fn tokens_of_blocks(settings: &Settings, blocks: u64) -> u64 {
    blocks.saturating_mul(settings.block_size as u64) / settings.bytes_per_token.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_and_server_info() {
        assert_eq!(parse_override("http://10.0.0.1:8000/=4096"), Ok(("http://10.0.0.1:8000".into(), 4096)));
        assert!(parse_override("http://10.0.0.1:8000").is_err());
        assert!(parse_override("http://10.0.0.1:8000=0").is_err());
        assert!(parse_override("http://10.0.0.1:8000=lots").is_err());
        assert_eq!(parse_server_info(r#"{"model_path":"m","max_total_num_tokens":2048}"#), Some(2048));
        assert_eq!(
            parse_server_info(r#"{"internal_states":[{"max_total_num_tokens":100},{"max_total_num_tokens":50}]}"#),
            Some(150)
        );
        assert_eq!(parse_server_info(r#"{"model_path":"m"}"#), None);
        assert_eq!(parse_server_info(r#"{"max_total_num_tokens":-3}"#), None);
        assert_eq!(parse_server_info("<html>"), None);
    }

    #[test]
    fn the_bound_is_the_capacity_within_max_tree_size() {
        let s = crate::state::tests::state(&["--max-tree-size", "65536"]).settings.clone();
        // 32-byte blocks, 4 bytes a token: 8 tokens a block.
        assert_eq!(bound_blocks(&s, Some(2048)), 256);
        assert_eq!(bound_blocks(&s, None), 2048, "no capacity known: --max-tree-size");
        assert_eq!(bound_blocks(&s, Some(1 << 40)), 2048, "--max-tree-size stays the upper bound");
        assert_eq!(bound_blocks(&s, Some(1)), 1);
        assert_eq!(tokens_of_blocks(&s, 256), 2048);
        assert_eq!(capacity_blocks(&s, 1 << 40), 1 << 37, "the immediate bound ignores --max-tree-size");
    }

    use kvmesh_proto::v1::{Feedback, IndexEvict, IndexInsert, ReportBatch, WorkerCounts};

    fn insert(s: &crate::state::State, worker: u32, hashes: &[u64]) {
        let inserts = vec![IndexInsert { worker, hashes: hashes.to_vec(), ..Default::default() }];
        s.report(ReportBatch { gateway_id: "g".into(), inserts, ..Default::default() });
    }

    fn held(s: &crate::state::State, worker: u32, hashes: &[u64]) -> Vec<u64> {
        let snap = s.full_snapshot();
        let all: Vec<u64> = snap.inserts.iter().filter(|i| i.worker == worker).flat_map(|i| i.hashes.clone()).collect();
        hashes.iter().copied().filter(|h| all.contains(h)).collect()
    }

    #[test]
    fn each_worker_is_bounded_to_its_capacity_evicting_by_last_use() {
        // Worker 0: 64 tokens = 256 bytes = 8 blocks of 32 bytes. Worker 1: no capacity known.
        let s = crate::state::tests::state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            "--worker-kv-capacity",
            "http://127.0.0.1:1=64",
        ]);
        let mut rx = s.subscribe();
        s.publish();
        let _ = rx.try_recv();
        insert(&s, 0, &[1, 2, 3, 4, 5, 6]); // prefix A
        insert(&s, 0, &[11, 12, 13, 14]); // prefix B: 10 blocks, A's two deepest go
        assert_eq!(s.index_size_of(0), 8);
        assert_eq!(held(&s, 0, &[1, 2, 3, 4, 5, 6]), vec![1, 2, 3, 4]);
        insert(&s, 0, &[1, 2, 3]); // a request on A's first blocks: used again
        insert(&s, 0, &[21, 22, 23]); // prefix C: the three least recently used go
        assert_eq!(held(&s, 0, &[1, 2, 3, 4, 11, 12, 13, 14, 21, 22, 23]), vec![1, 2, 3, 11, 12, 21, 22, 23]);
        assert_eq!(s.index_tokens_of(0), 64, "within the capacity");
        for i in 0..100u64 {
            insert(&s, 1, &[1000 + i]);
        }
        assert_eq!(s.index_size_of(1), 100, "unbounded but for --max-tree-size");
        // The filters are told.
        s.publish();
        let d = rx.try_recv().unwrap();
        let mut evicted: Vec<u64> =
            d.evictions.iter().filter(|e| e.worker == 0).flat_map(|e| e.hashes.clone()).collect();
        evicted.sort_unstable();
        assert_eq!(evicted, vec![4, 5, 6, 13, 14]);
        // A capacity reported later (16 tokens: 2 blocks) applies at once.
        s.capacity_result(1, Some(16));
        assert_eq!(s.index_size_of(1), 2);
        assert_eq!(held(&s, 1, &[1098, 1099]), vec![1098, 1099], "the most recent stay");
        // The override wins over what the worker says.
        s.capacity_result(0, Some(1 << 20));
        insert(&s, 0, &[31, 32]);
        assert_eq!(s.index_size_of(0), 8);
    }

    #[test]
    fn stale_blocks_and_feedback_from_reports() {
        let s = crate::state::tests::state(&["--worker-urls", "http://127.0.0.1:1"]);
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
}
