//! `cache_aware`: SGLang's cache-aware load balancing.
//!
//! - The system is imbalanced when `max_load - min_load > balance_abs_threshold` and
//!   `max_load > balance_rel_threshold * min_load`; then the least-loaded worker wins.
//! - Otherwise the worker with the longest prefix match wins when
//!   `matched / text_len > cache_threshold`; else the worker with the smallest index (most
//!   free cache). Ties are broken by load, then at random.
//!
//! The caller inserts the request's prefix for the chosen worker afterwards (see
//! [`crate::router::Router`]), in both cases, as SGLang does.

use super::{least_loaded, Candidate};
use crate::blocks::covered_bytes;
use crate::index::PrefixIndex;
use rand::RngCore;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheAwareParams {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
}

/// Why the policy chose what it chose (reported in stats and debug logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Imbalanced,
    CacheHit,
    SmallestIndex,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub pos: usize,
    pub reason: Reason,
    /// Bytes of the routing text the chosen worker already holds (0 unless a cache hit).
    pub matched_bytes: usize,
}

#[derive(Clone, Debug)]
pub struct CacheAware {
    pub params: CacheAwareParams,
}

impl CacheAware {
    pub fn new(params: CacheAwareParams) -> Self {
        Self { params }
    }

    /// Whether the candidates' loads count as imbalanced.
    pub fn imbalanced(&self, cands: &[Candidate]) -> bool {
        let (Some(max), Some(min)) = (cands.iter().map(|c| c.load).max(), cands.iter().map(|c| c.load).min()) else {
            return false;
        };
        max - min > self.params.balance_abs_threshold && max as f64 > self.params.balance_rel_threshold * min as f64
    }

    pub fn pick(
        &self,
        text_len: usize,
        hashes: &[u64],
        block_size: usize,
        cands: &[Candidate],
        index: &PrefixIndex,
        rng: &mut dyn RngCore,
    ) -> Option<Choice> {
        if cands.is_empty() {
            return None;
        }
        if self.imbalanced(cands) {
            let pos = least_loaded(cands, 0..cands.len(), rng)?;
            return Some(Choice { pos, reason: Reason::Imbalanced, matched_bytes: 0 });
        }

        // Deepest match per candidate (workers not among the candidates are ignored).
        let mut best_blocks = 0usize;
        let mut depth = vec![0usize; cands.len()];
        for m in index.match_prefix(hashes) {
            if let Some(slot) = cands.iter().position(|c| c.id == m.worker).and_then(|pos| depth.get_mut(pos)) {
                *slot = m.blocks;
                best_blocks = best_blocks.max(m.blocks);
            }
        }
        let matched = covered_bytes(best_blocks, block_size, text_len);
        let ratio = if text_len == 0 { 0.0 } else { matched as f64 / text_len as f64 };
        if best_blocks > 0 && ratio > self.params.cache_threshold {
            let deepest = depth.iter().enumerate().filter(|&(_, &d)| d == best_blocks).map(|(p, _)| p);
            let pos = least_loaded(cands, deepest, rng)?;
            return Some(Choice { pos, reason: Reason::CacheHit, matched_bytes: matched });
        }

        let smallest = cands.iter().map(|c| index.size_of(c.id)).min()?;
        let emptiest = cands.iter().enumerate().filter(|(_, c)| index.size_of(c.id) == smallest).map(|(p, _)| p);
        let pos = least_loaded(cands, emptiest, rng)?;
        Some(Choice { pos, reason: Reason::SmallestIndex, matched_bytes: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::block_hashes;
    use crate::rng::{seeded, FastRng};

    const BS: usize = 4;

    fn policy() -> CacheAware {
        CacheAware::new(CacheAwareParams { cache_threshold: 0.5, balance_abs_threshold: 4, balance_rel_threshold: 1.5 })
    }

    fn cands(loads: &[u64]) -> Vec<Candidate> {
        loads.iter().enumerate().map(|(i, &load)| Candidate { id: i as u32 + 10, load, ..Default::default() }).collect()
    }

    fn pick(p: &CacheAware, text: &str, cands: &[Candidate], idx: &PrefixIndex, rng: &mut FastRng) -> Choice {
        p.pick(text.len(), &block_hashes(text.as_bytes(), BS), BS, cands, idx, rng).unwrap()
    }

    #[test]
    fn imbalance_needs_both_thresholds() {
        let p = policy();
        assert!(p.imbalanced(&cands(&[0, 5])));
        assert!(!p.imbalanced(&cands(&[0, 4])), "abs difference not exceeded");
        assert!(!p.imbalanced(&cands(&[20, 26])), "26 <= 1.5 * 20");
        assert!(p.imbalanced(&cands(&[20, 31])));
        assert!(!p.imbalanced(&[]));
    }

    #[test]
    fn long_match_wins_when_balanced() {
        let p = policy();
        let mut idx = PrefixIndex::new();
        idx.insert(11, &block_hashes(b"system prompt: you are helpful", BS));
        let mut rng = seeded(1);
        let c = pick(&p, "system prompt: you are helpful. Q1", &cands(&[0, 3, 0]), &idx, &mut rng);
        assert_eq!((c.pos, c.reason), (1, Reason::CacheHit));
        assert_eq!(c.matched_bytes, 28);
    }

    #[test]
    fn short_match_goes_to_the_smallest_index() {
        let p = policy();
        let mut idx = PrefixIndex::new();
        idx.insert(10, &block_hashes(b"abcdefgh-worker-ten-has-a-lot", BS));
        idx.insert(11, &block_hashes(b"abcd", BS));
        let mut rng = seeded(1);
        // "abcd" matches worker 11 for 4 of 30 bytes: below the threshold.
        let c = pick(&p, "abcd-something-else-entirely!!", &cands(&[0, 0, 1]), &idx, &mut rng);
        assert_eq!((c.pos, c.reason), (2, Reason::SmallestIndex));
    }

    #[test]
    fn imbalance_overrides_the_cache() {
        let p = policy();
        let mut idx = PrefixIndex::new();
        let text = "shared prefix that is long enough";
        idx.insert(10, &block_hashes(text.as_bytes(), BS));
        let mut rng = seeded(1);
        let c = pick(&p, text, &cands(&[9, 2, 3]), &idx, &mut rng);
        assert_eq!((c.pos, c.reason), (1, Reason::Imbalanced));
        let c = pick(&p, text, &cands(&[4, 2, 3]), &idx, &mut rng);
        assert_eq!((c.pos, c.reason), (0, Reason::CacheHit));
    }

    #[test]
    fn ties_are_not_always_the_same_worker() {
        let p = policy();
        let idx = PrefixIndex::new();
        let mut rng = seeded(2);
        let cs = cands(&[0, 0, 0, 0]);
        let mut seen = [false; 4];
        for _ in 0..64 {
            seen[pick(&p, "fresh text", &cs, &idx, &mut rng).pos] = true;
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
    }

    #[test]
    fn matches_of_unavailable_workers_are_ignored() {
        let p = policy();
        let mut idx = PrefixIndex::new();
        let text = "prefix held by a worker that is gone now";
        idx.insert(99, &block_hashes(text.as_bytes(), BS));
        let mut rng = seeded(1);
        let c = pick(&p, text, &cands(&[0, 0]), &idx, &mut rng);
        assert_eq!(c.reason, Reason::SmallestIndex);
    }
}
