//! `prefix_hash`: llm-d's prefix-cache scorer, combined with a load score.
//!
//! - The routing text is cut into blocks of `block_size` bytes, each block's hash chained to
//!   the previous one (the prefix index's keys, [`crate::blocks`]); only the first
//!   `max_blocks` blocks count (llm-d's `max_prefix_blocks_to_match`, or SMG's
//!   `--prefix-token-count` in blocks, whichever is smaller).
//! - A worker's prefix score is the longest run of leading blocks it holds, over the blocks
//!   considered (0..1). Its load score is min-max normalised over the candidates: 1 for the
//!   least loaded, 0 for the most (1 for all when the loads are equal), as llm-d's queue
//!   scorer.
//! - Score = `cache_weight` · prefix + `load_weight` · load; the best wins, ties at random.
//! - Bounded load (SMG's `--prefix-hash-load-factor`): a worker whose load is above
//!   `load_factor` times the mean load is passed over (the least loaded never is), so a hot
//!   prefix cannot pile everything onto one worker.
//!
//! The chosen worker's blocks are inserted afterwards (see [`crate::router::Router`]); each
//! worker's part of the index is LRU-evicted to `lru_capacity_per_server` blocks.

use super::{best_scored, Candidate, Decision, Indexed, RouterParams, RoutingPolicy, RoutingText};
use crate::blocks::covered_bytes;
use crate::index::PrefixIndex;
use rand::RngCore;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefixHashParams {
    /// Leading blocks considered (at least 1).
    pub max_blocks: usize,
    pub cache_weight: f64,
    pub load_weight: f64,
    /// At least 1 (validated); a worker above `load_factor` × the mean load is passed over.
    pub load_factor: f64,
    /// Blocks each worker's part of the index is evicted to (llm-d's `lru_capacity_per_server`).
    pub lru_capacity: u64,
}

/// What the policy chose: the candidate's position and the leading blocks it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixChoice {
    pub pos: usize,
    pub blocks: usize,
}

#[derive(Clone, Debug)]
pub struct PrefixHash {
    pub params: PrefixHashParams,
}

impl PrefixHash {
    pub fn new(params: PrefixHashParams) -> Self {
        Self { params }
    }

    /// The blocks of a request that count.
    pub fn considered<'h>(&self, hashes: &'h [u64]) -> &'h [u64] {
        hashes.get(..self.params.max_blocks.max(1)).unwrap_or(hashes)
    }

    /// Each candidate's leading blocks held in `index`, among the considered ones.
    pub fn depths(&self, hashes: &[u64], cands: &[Candidate], index: &PrefixIndex) -> Vec<usize> {
        let mut depth = vec![0usize; cands.len()];
        if hashes.is_empty() {
            return depth;
        }
        for m in index.match_prefix(self.considered(hashes)) {
            if let Some(slot) = cands.iter().position(|c| c.id == m.worker).and_then(|p| depth.get_mut(p)) {
                *slot = m.blocks;
            }
        }
        depth
    }

    /// Every candidate's score (prefix and load together), or none when it is passed over for
    /// its load.
    pub fn scores(&self, hashes: &[u64], cands: &[Candidate], index: &PrefixIndex) -> Vec<Option<f64>> {
        self.scores_of(self.considered(hashes).len(), &self.depths(hashes, cands, index), cands)
    }

    fn scores_of(&self, considered: usize, depth: &[usize], cands: &[Candidate]) -> Vec<Option<f64>> {
        let (Some(min), Some(max)) = (cands.iter().map(|c| c.load).min(), cands.iter().map(|c| c.load).max()) else {
            return Vec::new();
        };
        let mean = cands.iter().map(|c| c.load as f64).sum::<f64>() / cands.len() as f64;
        let p = &self.params;
        cands
            .iter()
            .zip(depth)
            .map(|(c, &d)| {
                if c.load > min && c.load as f64 > p.load_factor * mean {
                    return None;
                }
                let prefix = if considered == 0 { 0.0 } else { d as f64 / considered as f64 };
                let load = if max == min { 1.0 } else { (max - c.load) as f64 / (max - min) as f64 };
                Some(p.cache_weight * prefix + p.load_weight * load)
            })
            .collect()
    }

    pub fn pick(
        &self,
        hashes: &[u64],
        cands: &[Candidate],
        index: &PrefixIndex,
        rng: &mut dyn RngCore,
    ) -> Option<PrefixChoice> {
        let depth = self.depths(hashes, cands, index);
        let scores = self.scores_of(self.considered(hashes).len(), &depth, cands);
        let pos = best_scored(0..cands.len(), |p| scores.get(p).copied().flatten().unwrap_or(f64::NAN), rng)?;
        Some(PrefixChoice { pos, blocks: depth.get(pos).copied().unwrap_or(0) })
    }
}

impl RoutingPolicy for PrefixHash {
    const USES_TEXT: bool = true;

    fn new(params: &RouterParams) -> Self {
        Self::new(params.prefix_hash)
    }

    fn decide(
        &self,
        at: Indexed<'_>,
        text: RoutingText<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let mut blocks = text.blocks(at.block_size);
        let c = self.pick(&blocks, cands, at.index, rng)?;
        let worker = cands.get(c.pos)?.id;
        if at.track {
            // The PD decider needs the whole match, and the whole prefix indexed.
            return Some(at.tracked(worker, text, blocks));
        }
        // Only the blocks that count are indexed (llm-d's scorer does the same).
        blocks.truncate(self.considered(&blocks).len());
        let matched_bytes = covered_bytes(c.blocks, at.block_size, text.len);
        let held_blocks = at.index.depth_of(worker, &blocks);
        Some(Decision { worker, matched_bytes, held_blocks, blocks })
    }

    /// llm-d's per-server LRU capacity bounds the index (within `max_tree_size`).
    fn max_blocks(&self, budget: u64) -> u64 {
        budget.min(self.params.lru_capacity.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::block_hashes;
    use crate::rng::seeded;

    const BS: usize = 4;

    fn policy(max_blocks: usize, load_factor: f64) -> PrefixHash {
        PrefixHash::new(PrefixHashParams {
            max_blocks,
            cache_weight: 2.0,
            load_weight: 1.0,
            load_factor,
            lru_capacity: 1000,
        })
    }

    fn cands(loads: &[u64]) -> Vec<Candidate> {
        loads.iter().enumerate().map(|(i, &load)| Candidate { id: i as u32, load, ..Default::default() }).collect()
    }

    #[test]
    fn the_longest_leading_run_scores_and_wins_over_a_small_load_difference() {
        let p = policy(256, 10.0);
        let mut idx = PrefixIndex::new();
        let text = b"shared system prompt, then the question";
        idx.insert(1, &block_hashes(&text[..20], BS)); // 5 of 10 blocks
        idx.insert(2, &block_hashes(&text[..8], BS)); // 2 of 10
        let h = block_hashes(text, BS);
        let s = p.scores(&h, &cands(&[0, 2, 0]), &idx);
        // Worker 1: 2·0.5 + 1·0 = 1.0; worker 0: 0 + 1 = 1.0; worker 2: 2·0.2 + 1 = 1.4.
        assert_eq!(s, vec![Some(1.0), Some(1.0), Some(1.4)]);
        let mut rng = seeded(1);
        assert_eq!(p.pick(&h, &cands(&[0, 2, 0]), &idx, &mut rng), Some(PrefixChoice { pos: 2, blocks: 2 }));
        assert_eq!(p.pick(&h, &cands(&[0, 0, 0]), &idx, &mut rng), Some(PrefixChoice { pos: 1, blocks: 5 }));
    }

    #[test]
    fn only_the_first_max_blocks_count() {
        let p = policy(2, 10.0);
        let mut idx = PrefixIndex::new();
        let text = b"aaaabbbbccccdddd";
        idx.insert(0, &block_hashes(text, BS));
        idx.insert(1, &block_hashes(&text[..8], BS));
        let h = block_hashes(text, BS);
        // Both hold the 2 blocks considered: a full score each, equal loads: a tie.
        let s = p.scores(&h, &cands(&[0, 0]), &idx);
        assert_eq!(s, vec![Some(3.0), Some(3.0)]);
        assert_eq!(p.considered(&h).len(), 2);
    }

    #[test]
    fn a_worker_over_the_load_factor_is_passed_over_but_never_the_least_loaded() {
        let p = policy(256, 1.25);
        let mut idx = PrefixIndex::new();
        let text = b"the hot prefix everyone shares";
        idx.insert(0, &block_hashes(text, BS));
        let h = block_hashes(text, BS);
        // Mean 4: worker 0 at 10 > 5 is passed over despite its full match.
        let s = p.scores(&h, &cands(&[10, 1, 1]), &idx);
        assert_eq!(s[0], None);
        let mut rng = seeded(3);
        assert_ne!(p.pick(&h, &cands(&[10, 1, 1]), &idx, &mut rng).unwrap().pos, 0);
        // All loads equal (even high): nobody is over the mean.
        assert!(p.scores(&h, &cands(&[7, 7, 7]), &idx).iter().all(Option::is_some));
        // One worker: always chosen.
        assert_eq!(p.pick(&h, &cands(&[99]), &idx, &mut rng).map(|c| c.pos), Some(0));
    }

    #[test]
    fn degenerate_inputs() {
        let p = policy(256, 1.25);
        let idx = PrefixIndex::new();
        let mut rng = seeded(4);
        assert_eq!(p.pick(&[], &[], &idx, &mut rng), None);
        // No text: load alone decides.
        assert_eq!(p.pick(&[], &cands(&[3, 1, 2]), &idx, &mut rng).map(|c| c.pos), Some(1));
        // Nothing cached, equal loads: spread at random over every worker.
        let h = block_hashes(b"fresh", BS);
        let mut seen = [false; 4];
        for _ in 0..64 {
            seen[p.pick(&h, &cands(&[0, 0, 0, 0]), &idx, &mut rng).unwrap().pos] = true;
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
    }
}
