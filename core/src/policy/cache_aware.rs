//! `cache_aware`: SGLang's cache-aware load balancing.
//!
//! - The system is imbalanced when `max_load - min_load > balance_abs_threshold` and
//!   `max_load > balance_rel_threshold * min_load`; then the least-loaded worker wins.
//! - Otherwise the worker with the longest prefix match wins when
//!   `matched / text_len > cache_threshold`; else the prefix is new and is placed on a worker
//!   with the smallest index (most free cache).
//!
//! Placing a new prefix departs from SGLang in one way, so that many gateways agree without
//! talking: every worker whose index is within half a prefix (half this request's blocks)
//! of the smallest counts as equally empty, and among them the prefix's own rendezvous hash chooses
//! (xxh3 of the block at the `cache_threshold` point of the text, seeded with each worker's
//! [`affinity`](super::Candidate::affinity)) instead of load and a random draw. Two gateways
//! that see a new system prompt at the same moment, with index sizes and loads a few
//! milliseconds apart, send it to the same worker; different prefixes still spread over the
//! emptiest workers, and no worker is given a prefix while another is emptier by half of
//! it or more (a whole prefix of slack let a worker holding one prompt more than another
//! take the next one: 1.5x the mean traffic with 8 shared prompts). Requests that share the text up to that point would count as hits on each
//! other, so they share the key. Workers with the same affinity (none configured) fall back
//! to load, then a random draw.
//!
//! The same key breaks a tie between workers that match equally deep (a prompt two gateways
//! placed apart before they heard of each other, or one copied by the imbalance rule) among
//! those whose load is within 2 (or a third) of the least loaded one: while their loads are
//! close every gateway sends it to the same holder, so the other copy ages out of that
//! worker's cache instead of both being kept warm until the caches overflow; a hot prompt
//! whose holder is busier than that still spreads over its copies.
//!
//! The caller inserts the request's prefix for the chosen worker afterwards (see
//! [`crate::router::Router`]), in both cases, as SGLang does.

use super::{least_loaded, Candidate, Decision, Indexed, RouterParams, RoutingPolicy, RoutingText};
use crate::blocks::covered_bytes;
use crate::index::PrefixIndex;
use crate::worker::WorkerId;
use rand::RngCore;
use xxhash_rust::xxh3::xxh3_64_with_seed;

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
    /// Leading blocks the index believes the chosen worker holds, whatever the reason it was
    /// chosen (what engine feedback judges the worker's answer against).
    pub held_blocks: usize,
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
            let held_blocks = held(index, cands, pos, hashes);
            return Some(Choice { pos, reason: Reason::Imbalanced, matched_bytes: 0, held_blocks });
        }

        // The deepest match among the candidates, and who holds it.
        let (best_blocks, holders) = deepest(index, hashes, cands);
        let matched = covered_bytes(best_blocks, block_size, text_len);
        let ratio = if text_len == 0 { 0.0 } else { matched as f64 / text_len as f64 };
        if best_blocks > 0 && ratio > self.params.cache_threshold {
            let deepest = holders.iter().copied();
            // Holders about as loaded as the least loaded one (within 2, or a third more):
            // a hot prompt's copies still share its traffic.
            let least = deepest.clone().filter_map(|p| cands.get(p).map(|c| c.load)).min()?;
            let margin = least.saturating_add((least / 3).max(2));
            let level = deepest.filter(|&p| cands.get(p).is_some_and(|c| c.load <= margin));
            let key = placement_key(hashes, text_len, block_size, self.params.cache_threshold);
            let pos = heaviest(cands, level, key, rng)?;
            return Some(Choice { pos, reason: Reason::CacheHit, matched_bytes: matched, held_blocks: best_blocks });
        }

        let pos = self.place(text_len, hashes, block_size, cands, index, rng)?;
        let held_blocks = held(index, cands, pos, hashes.get(..best_blocks).unwrap_or(hashes));
        Some(Choice { pos, reason: Reason::SmallestIndex, matched_bytes: 0, held_blocks })
    }

    /// Where a new prefix goes: among the workers within half a prefix of the smallest index,
    /// the one its rendezvous hash weighs most (see the module's documentation).
    fn place(
        &self,
        text_len: usize,
        hashes: &[u64],
        block_size: usize,
        cands: &[Candidate],
        index: &PrefixIndex,
        rng: &mut dyn RngCore,
    ) -> Option<usize> {
        let smallest = cands.iter().map(|c| index.size_of(c.id)).min()?;
        let Some(key) = placement_key(hashes, text_len, block_size, self.params.cache_threshold) else {
            // No text: SGLang's rule as it stands.
            let emptiest = (0..cands.len()).filter(|&p| cands.get(p).is_some_and(|c| index.size_of(c.id) == smallest));
            return least_loaded(cands, emptiest, rng);
        };
        let within = smallest.saturating_add((hashes.len() as u64 / 2).max(1));
        let near = (0..cands.len()).filter(|&p| cands.get(p).is_some_and(|c| index.size_of(c.id) < within));
        heaviest(cands, near, Some(key), rng)
    }
}

/// How deep the candidates' deepest match goes, and the positions of the candidates that
/// hold it. The index finds its deepest block by binary search; only when no candidate holds
/// it (its holders are unhealthy or unknown here) are the blocks walked one by one.
fn deepest(index: &PrefixIndex, hashes: &[u64], cands: &[Candidate]) -> (usize, Vec<usize>) {
    let (depth, owners) = index.deepest(hashes);
    let at = |w: WorkerId| cands.iter().position(|c| c.id == w);
    let holders: Vec<usize> = owners.filter_map(at).collect();
    if depth == 0 || !holders.is_empty() {
        return (depth, holders);
    }
    let mut depths = vec![0usize; cands.len()];
    for m in index.match_prefix(hashes) {
        if let Some(slot) = at(m.worker).and_then(|p| depths.get_mut(p)) {
            *slot = m.blocks;
        }
    }
    let best = depths.iter().copied().max().unwrap_or(0);
    let holders = if best == 0 {
        Vec::new()
    } else {
        depths.iter().enumerate().filter(|&(_, &d)| d == best).map(|(p, _)| p).collect()
    };
    (best, holders)
}

/// How many leading blocks of `hashes` the candidate at `pos` holds.
fn held(index: &PrefixIndex, cands: &[Candidate], pos: usize, hashes: &[u64]) -> usize {
    cands.get(pos).map_or(0, |c| index.depth_of(c.id, hashes))
}

/// Among `positions`, the candidate `key`'s rendezvous hash weighs most; equal weights (the
/// same affinity), or no key, go to the least loaded, then a random draw.
fn heaviest(
    cands: &[Candidate],
    positions: impl Iterator<Item = usize> + Clone,
    key: Option<u64>,
    rng: &mut dyn RngCore,
) -> Option<usize> {
    let Some(key) = key else { return least_loaded(cands, positions, rng) };
    let weight = |p: usize| cands.get(p).map_or(0, |c| xxh3_64_with_seed(&key.to_le_bytes(), c.affinity));
    let most = positions.clone().map(weight).max()?;
    least_loaded(cands, positions.filter(|&p| weight(p) == most), rng)
}

/// The block a new prefix is placed by: the one that covers the `threshold` share of the
/// text (requests sharing the text that far would match each other above the threshold), or
/// the last block hashed when the text runs longer than its hashed head. None without blocks.
pub fn placement_key(hashes: &[u64], text_len: usize, block_size: usize, threshold: f64) -> Option<u64> {
    let last = hashes.len().checked_sub(1)?;
    let at = (threshold.clamp(0.0, 1.0) * text_len as f64) as usize / block_size.max(1);
    hashes.get(at.min(last)).copied()
}

impl RoutingPolicy for CacheAware {
    const USES_TEXT: bool = true;

    fn new(params: &RouterParams) -> Self {
        Self::new(params.cache_aware)
    }

    /// Every block is indexed for the chosen worker (within the router's cap).
    fn decide(
        &self,
        at: Indexed<'_>,
        text: RoutingText<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let blocks = text.blocks(at.block_size);
        let c = self.pick(text.len, &blocks, at.block_size, cands, at.index, rng)?;
        let worker = cands.get(c.pos)?.id;
        Some(Decision { worker, matched_bytes: c.matched_bytes, held_blocks: c.held_blocks, blocks })
    }

    /// At least the share of the text a repeat needs to count as a hit, so that no prompt
    /// loses its worker to the router's per-request cap.
    fn indexed_share(&self) -> f64 {
        (self.params.cache_threshold + 0.1).min(1.0)
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
        // "abcd" matches worker 11 for 4 of 30 bytes: below the threshold. Workers 11 and 12
        // are within one prefix of each other (and have no affinity): the less loaded.
        let c = pick(&p, "abcd-something-else-entirely!!", &cands(&[0, 1, 0]), &idx, &mut rng);
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

    fn fleet(loads: &[u64]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Candidate {
                id: i as u32 + 10,
                load,
                affinity: crate::policy::affinity_of(&format!("http://10.0.0.{i}:30000")),
                ..Default::default()
            })
            .collect()
    }

    /// An index where worker `10 + i` holds `sizes[i]` blocks of filler.
    fn sized(sizes: &[usize]) -> PrefixIndex {
        let mut idx = PrefixIndex::new();
        for (i, &n) in sizes.iter().enumerate() {
            let filler: Vec<u64> = (0..n as u64).map(|b| (i as u64 + 1) << 32 | b).collect();
            idx.insert(i as u32 + 10, &filler);
        }
        idx
    }

    #[test]
    fn gateways_with_different_views_place_a_new_prefix_on_the_same_worker() {
        let p = policy();
        // Two gateways a few inserts and requests apart: sizes and loads differ a little.
        let (a, b) = (sized(&[40, 42, 41, 40]), sized(&[41, 40, 44, 42]));
        let (loads_a, loads_b) = (fleet(&[1, 0, 3, 2]), fleet(&[0, 2, 1, 0]));
        let mut rng = seeded(3);
        let mut spread = [0usize; 4];
        for i in 0..200 {
            let text = format!("system prompt number {i}: a long shared instruction for every user. Q?");
            let on_a = pick(&p, &text, &loads_a, &a, &mut rng);
            let on_b = pick(&p, &text, &loads_b, &b, &mut rng);
            assert_eq!((on_a.reason, on_b.reason), (Reason::SmallestIndex, Reason::SmallestIndex));
            assert_eq!(on_a.pos, on_b.pos, "{text}");
            spread[on_a.pos] += 1;
        }
        assert!(spread.iter().all(|&n| n > 25), "new prefixes still spread: {spread:?}");
    }

    #[test]
    fn a_worker_half_a_prefix_fuller_than_the_emptiest_gets_no_new_prefix() {
        let p = policy();
        let text = "a new prefix of exactly forty bytes!!!!!"; // 10 blocks of 4
        let idx = sized(&[25, 19, 30, 24]);
        let mut rng = seeded(4);
        for i in 0..50 {
            let t = format!("{i:02}{text}");
            assert_eq!(pick(&p, &t, &fleet(&[0, 3, 0, 0]), &idx, &mut rng).pos, 1, "the only one within half a prefix");
        }
        // Requests sharing the text up to the threshold point share their key.
        let idx = sized(&[0, 0, 0, 0]);
        let first = pick(&p, "shared-system-prompt-long-enough/question one", &fleet(&[0; 4]), &idx, &mut rng).pos;
        let again =
            pick(&p, "shared-system-prompt-long-enough/another question", &fleet(&[4, 0, 2, 1]), &idx, &mut rng);
        assert_eq!(again.pos, first);
    }

    #[test]
    fn equally_deep_holders_about_as_loaded_are_chosen_by_the_prompt() {
        let p = policy();
        let mut idx = PrefixIndex::new();
        let prompts: Vec<String> = (0..40).map(|i| format!("prompt {i:02}: shared by two workers")).collect();
        for t in &prompts {
            // Placed apart by two gateways that had not heard of each other: workers 11, 13.
            idx.insert(11, &block_hashes(t.as_bytes(), BS));
            idx.insert(13, &block_hashes(t.as_bytes(), BS));
        }
        let mut rng = seeded(5);
        let mut to = [0usize; 4];
        for t in &prompts {
            // Loads within 2 of each other: every gateway picks by the prompt.
            let here = pick(&p, t, &fleet(&[0, 2, 0, 0]), &idx, &mut rng);
            let there = pick(&p, t, &fleet(&[0, 0, 0, 2]), &idx, &mut rng);
            assert_eq!((here.reason, there.reason), (Reason::CacheHit, Reason::CacheHit));
            assert_eq!(here.pos, there.pos, "{t}: every gateway picks the same holder");
            to[here.pos] += 1;
        }
        assert_eq!(to[0] + to[2], 0, "only holders: {to:?}");
        assert!(to[1] > 8 && to[3] > 8, "different prompts, different holders: {to:?}");
        // A holder busier than that gives way to the other copy.
        for t in &prompts {
            assert_eq!(pick(&p, t, &fleet(&[0, 4, 0, 1]), &idx, &mut rng).pos, 3, "{t}");
        }
    }

    #[test]
    fn the_placement_key_is_the_block_at_the_threshold_within_the_hashed_head() {
        let hashes = [1, 2, 3, 4, 5];
        assert_eq!(placement_key(&hashes, 20, 4, 0.3), Some(2), "0.3 * 20 bytes = byte 6: block 1 of 0..5");
        assert_eq!(placement_key(&hashes, 20, 4, 0.0), Some(1));
        assert_eq!(placement_key(&hashes, 1 << 30, 4, 0.3), Some(5), "a text longer than its head: the last block");
        assert_eq!(placement_key(&[], 20, 4, 0.3), None);
        assert_eq!(placement_key(&hashes, 20, 0, f64::NAN), Some(1), "hostile parameters stay in range");
    }

    #[test]
    fn a_deeper_match_on_an_unavailable_worker_leaves_the_candidates_own_match() {
        let p = policy();
        let mut idx = PrefixIndex::new();
        let text = "a prompt whose whole text one gone worker holds";
        idx.insert(99, &block_hashes(text.as_bytes(), BS));
        idx.insert(11, &block_hashes(&text.as_bytes()[..40], BS));
        let mut rng = seeded(1);
        let c = pick(&p, text, &cands(&[0, 0, 0]), &idx, &mut rng);
        assert_eq!((c.pos, c.reason, c.matched_bytes, c.held_blocks), (1, Reason::CacheHit, 40, 10));
    }

    #[test]
    fn the_chosen_workers_own_match_is_reported_whatever_chose_it() {
        let p = policy();
        let mut idx = PrefixIndex::new();
        let text = "shared prefix that is long enough";
        idx.insert(10, &block_hashes(text.as_bytes(), BS));
        idx.insert(11, &block_hashes(&text.as_bytes()[..12], BS));
        let mut rng = seeded(1);
        // Imbalanced: the least loaded (worker 11) holds 3 blocks of it.
        let c = pick(&p, text, &cands(&[9, 2, 3]), &idx, &mut rng);
        assert_eq!((c.pos, c.reason, c.held_blocks), (1, Reason::Imbalanced, 3));
        // Below the threshold (8 of 33 bytes held anywhere): placed as new, its 2 blocks reported.
        idx.remove_worker(10);
        let c = pick(&p, &format!("{}{}", &text[..8], "-then something else"), &cands(&[0, 0, 0]), &idx, &mut rng);
        assert_eq!(c.reason, Reason::SmallestIndex);
        assert_eq!(c.held_blocks, if c.pos == 1 { 2 } else { 0 });
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
