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
    fn server_info() {
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
        let s = crate::args::Args::parse_from(["kvmesh-cp", "--max-tree-size", "65536"]).unwrap().load().unwrap();
        // 32-byte blocks, 4 bytes a token: 8 tokens a block.
        assert_eq!(bound_blocks(&s, Some(2048)), 256);
        assert_eq!(bound_blocks(&s, None), 2048, "no capacity known: --max-tree-size");
        assert_eq!(bound_blocks(&s, Some(1 << 40)), 2048, "--max-tree-size stays the upper bound");
        assert_eq!(bound_blocks(&s, Some(1)), 1);
        assert_eq!(tokens_of_blocks(&s, 256), 2048);
        assert_eq!(capacity_blocks(&s, 1 << 40), 1 << 37, "the immediate bound ignores --max-tree-size");
    }
}
