//! The router: one policy plus the prefix index it consults, behind one call per request.
//! The policy ([`Policy`]) carries its own state; the router keeps the index and its bounds.

use crate::index::PrefixIndex;
use crate::policy::{Candidate, Indexed, Policy, PolicyKind};
// The vocabulary lives below the policies, which name it too; re-exported here where it was.
pub use crate::policy::{Decision, RouterParams, RoutingText};
use crate::worker::WorkerId;
use rand::RngCore;

/// The `(worker, block)` entries one router's index is kept to (about 40 MiB): past it, by one
/// eighth, the VM's tick evicts the least recently used ([`Router::bound`]); past it by a
/// quarter, inserts are dropped until then. No eviction runs while a request is routed.
pub const MAX_INDEX_ENTRIES: u64 = 1 << 20;

/// Routing text one request may add to its worker's index beyond what the index holds for
/// that worker already: a client sending ever new long prompts fills the shared index with
/// 64 KiB of text a request, not the whole 256 KiB it may route by (a prompt seen again
/// extends its worker's entry by as much each time). Under `cache_aware`, at least the share of
/// the text a repeat needs to count as a hit (`cache_threshold` + 0.1), so that no prompt loses
/// its worker to the cap.
pub const MAX_NEW_BYTES_PER_REQUEST: usize = 64 << 10;

/// The most blocks an index reserves room for in one step (its bound, past which it doubles).
const MAX_EXPECTED_BLOCKS: usize = 1 << 21;

pub struct Router {
    policy: Policy,
    /// Index prefixes even under a text-blind policy (the PD prefix decider needs it).
    track: bool,
    index: PrefixIndex,
    block_size: usize,
    max_blocks: u64,
    max_entries: u64,
}

impl Router {
    /// A router running `kind` with `params` (PD mode has one per leg).
    pub fn new(params: RouterParams, kind: PolicyKind) -> Self {
        let mut index = PrefixIndex::new();
        // What inserts between two ticks let the index reach: it may grow there in one step.
        let most = params.max_entries.saturating_add(params.max_entries / 4);
        index.expect_blocks(usize::try_from(most).unwrap_or(usize::MAX).min(MAX_EXPECTED_BLOCKS));
        let policy = Policy::new(kind, &params);
        Self {
            max_blocks: policy.max_blocks(params.max_blocks),
            policy,
            track: false,
            index,
            block_size: params.block_size,
            max_entries: params.max_entries,
        }
    }

    /// Keeps the prefix index (and reports matches) whatever the policy.
    pub fn track_prefixes(&mut self, on: bool) {
        self.track = on;
    }

    /// Whether routing looks at (and indexes) the text.
    pub fn uses_text(&self) -> bool {
        self.track || self.policy.kind().uses_text()
    }

    /// Chooses a candidate for a request whose routing text is `text`. Changes nothing. The
    /// blocks it would index stop [`MAX_NEW_BYTES_PER_REQUEST`] past what the chosen worker holds.
    pub fn decide(&self, text: RoutingText<'_>, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<Decision> {
        let at = Indexed { index: &self.index, block_size: self.block_size, track: self.track };
        let mut d = self.policy.decide(at, text, cands, rng)?;
        let share = self.policy.indexed_share();
        let bytes = MAX_NEW_BYTES_PER_REQUEST.max((text.len as f64 * share).ceil() as usize);
        d.blocks.truncate(d.held_blocks.saturating_add(bytes.div_ceil(self.block_size.max(1))));
        Some(d)
    }

    /// Records a decision that went through: the chosen worker now holds the prefix (and
    /// round robin moves on).
    pub fn commit(&mut self, decision: &Decision) {
        self.policy.commit();
        self.insert(decision.worker, &decision.blocks);
    }

    /// Inserts as much of `hashes` (shallowest first) as keeps the index within its bound by a
    /// quarter: the tick evicts before that, unless inserts arrive faster than ticks.
    fn insert(&mut self, worker: WorkerId, hashes: &[u64]) {
        let room = self.max_entries.saturating_add(self.max_entries / 4).saturating_sub(self.index.entries());
        let fits = hashes.get(..usize::try_from(room).unwrap_or(usize::MAX).min(hashes.len())).unwrap_or_default();
        if !fits.is_empty() {
            self.index.insert(worker, fits);
        }
    }

    /// Keeps the index to [`MAX_INDEX_ENTRIES`], evicting the least recently used once it is
    /// an eighth over (so that the cost of the scan is amortised over many inserts). Runs on
    /// the VM's tick, never while a request is routed. Returns the entries evicted.
    pub fn bound(&mut self) -> usize {
        if self.index.entries() > self.max_entries.saturating_add(self.max_entries / 8) {
            return self.index.evict_total_to(self.max_entries).len();
        }
        0
    }

    /// Chooses a candidate for a request that carries no routing text (other paths); round
    /// robin moves on at once (nothing is recorded for these).
    pub fn route_any(&mut self, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        self.policy.route_any(cands, rng)
    }

    /// The policy this router runs.
    pub fn kind(&self) -> PolicyKind {
        self.policy.kind()
    }

    /// Applies an insert decided elsewhere (another thread or gateway).
    pub fn apply_insert(&mut self, worker: WorkerId, hashes: &[u64]) {
        self.insert(worker, hashes);
    }

    /// LRU-evicts every worker's index down to `max_tree_size`.
    pub fn evict(&mut self) -> Vec<(u64, WorkerId)> {
        self.evict_to_multiple(1)
    }

    /// LRU-evicts every worker's index down to `factor` times `max_tree_size` (a safety cap
    /// for a filter whose evictions normally come from the control plane).
    pub fn evict_to_multiple(&mut self, factor: u64) -> Vec<(u64, WorkerId)> {
        self.index.evict_to(self.max_blocks.saturating_mul(factor))
    }

    /// Applies evictions decided elsewhere (the control plane's global LRU).
    pub fn apply_evictions(&mut self, worker: WorkerId, hashes: &[u64]) {
        for &h in hashes {
            self.index.remove(h, worker);
        }
    }

    pub fn forget_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::CacheAwareParams;
    use crate::rng::{seeded, FastRng};

    fn params(block_size: usize, max_blocks: u64) -> RouterParams {
        let cache_aware =
            CacheAwareParams { cache_threshold: 0.3, balance_abs_threshold: 64, balance_rel_threshold: 1.5 };
        let prefix_hash = crate::Config::default().prefix_hash;
        RouterParams {
            cache_aware,
            prefix_hash,
            utility_load_weight: 1.0,
            block_size,
            max_blocks,
            max_entries: MAX_INDEX_ENTRIES,
        }
    }

    fn cands(n: u32) -> Vec<Candidate> {
        (0..n).map(|id| Candidate { id, affinity: u64::from(id) * 7919, ..Default::default() }).collect()
    }

    /// Decides and commits, as the filter does when nothing failed in between.
    fn route(r: &mut Router, text: &[u8], cands: &[Candidate], rng: &mut FastRng) -> Option<Decision> {
        let d = r.decide(text.into(), cands, rng)?;
        r.commit(&d);
        Some(d)
    }

    #[test]
    fn cache_aware_sticks_to_a_shared_prefix_and_spreads_others() {
        let mut r = Router::new(params(32, 1 << 20), PolicyKind::CacheAware);
        let mut rng = seeded(11);
        let prefix = "You are a meticulous assistant. ".repeat(20);
        let first = route(&mut r, format!("{prefix}question 0").as_bytes(), &cands(4), &mut rng).unwrap();
        for i in 1..20 {
            let d = route(&mut r, format!("{prefix}question {i}").as_bytes(), &cands(4), &mut rng).unwrap();
            assert_eq!(d.worker, first.worker);
            assert!(d.matched_bytes >= prefix.len() - 32, "a cache hit: {}", d.matched_bytes);
        }
        let mut used = std::collections::HashSet::new();
        for i in 0..8 {
            let text = format!("{i} completely different conversation {}", "x".repeat(200));
            used.insert(route(&mut r, text.as_bytes(), &cands(4), &mut rng).unwrap().worker);
        }
        // Distinct prefixes go to the smallest indexes: the three workers without the prefix.
        assert_eq!(used.len(), 3);
        assert!(!used.contains(&first.worker));
    }

    #[test]
    fn prefix_hash_sticks_to_a_shared_prefix_spreads_others_and_indexes_only_what_counts() {
        let mut r = Router::new(params(32, 1 << 20), PolicyKind::PrefixHash);
        let mut rng = seeded(12);
        let prefix = "You are a meticulous assistant. ".repeat(40); // 1280 bytes: 40 blocks
        let first = route(&mut r, format!("{prefix}question 0").as_bytes(), &cands(4), &mut rng).unwrap();
        assert_eq!(first.blocks.len(), 32, "the first 256 tokens only (32 blocks)");
        for i in 1..10 {
            let d = route(&mut r, format!("{prefix}question {i}").as_bytes(), &cands(4), &mut rng).unwrap();
            assert_eq!(d.worker, first.worker);
            assert_eq!(d.matched_bytes, 32 * 32);
        }
        // Distinct prompts: nothing matches, equal loads: spread at random.
        let mut used = std::collections::HashSet::new();
        for i in 0..24 {
            let text = format!("{i} completely different conversation {}", "x".repeat(200));
            used.insert(route(&mut r, text.as_bytes(), &cands(4), &mut rng).unwrap().worker);
        }
        assert_eq!(used.len(), 4);
        // With the prefix worker loaded well past the mean, the prefix goes elsewhere.
        let mut loaded = cands(4);
        loaded[first.worker as usize].load = 20;
        let d = r.decide(format!("{prefix}question x").as_bytes().into(), &loaded, &mut rng).unwrap();
        assert_ne!(d.worker, first.worker);
    }

    #[test]
    fn prefix_hash_evicts_to_its_lru_capacity() {
        let mut p = params(16, 1 << 20);
        p.prefix_hash.lru_capacity = 5;
        let mut r = Router::new(p, PolicyKind::PrefixHash);
        let mut rng = seeded(1);
        route(&mut r, &[b'a'; 160], &cands(1), &mut rng);
        assert_eq!(r.index().size_of(0), 10);
        assert_eq!(r.evict().len(), 5);
        assert_eq!(r.index().size_of(0), 5);
    }

    #[test]
    fn consistent_hashing_follows_the_key_and_marginal_utility_the_scores() {
        let r = Router::new(params(32, 1 << 20), PolicyKind::ConsistentHashing);
        let mut rng = seeded(3);
        let keyed = |k: &'static str| RoutingText::from(b"same text".as_slice()).with_key(Some(k.as_bytes()));
        let owners: std::collections::HashSet<u32> =
            (0..10).map(|_| r.decide(keyed("alice"), &cands(5), &mut rng).unwrap().worker).collect();
        assert_eq!(owners.len(), 1);
        let keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9", "k10", "k11"];
        let spread: std::collections::HashSet<u32> =
            keys.iter().map(|k| r.decide(keyed(k), &cands(5), &mut rng).unwrap().worker).collect();
        assert!(spread.len() >= 3, "{spread:?}");
        assert!(r.decide(keyed("alice"), &cands(5), &mut rng).unwrap().blocks.is_empty(), "text-blind");
        let r = Router::new(params(32, 1 << 20), PolicyKind::MarginalUtility);
        let mut cs = cands(3);
        cs[0].utility = Some(-1.0);
        cs[1].utility = Some(1.2);
        cs[2].load = 1;
        assert!((0..20).all(|_| r.decide(b"t".as_slice().into(), &cs, &mut rng).unwrap().worker == 1));
    }

    #[test]
    fn blind_policies_insert_nothing() {
        let mut r = Router::new(params(32, 1 << 20), PolicyKind::RoundRobin);
        let mut rng = seeded(1);
        let d = route(&mut r, b"text", &cands(3), &mut rng).unwrap();
        assert!(d.blocks.is_empty() && r.index().is_empty());
        assert_eq!(route(&mut r, b"text", &cands(3), &mut rng).unwrap().worker, 1);
        assert!(route(&mut r, b"text", &[], &mut rng).is_none());
    }

    #[test]
    fn eviction_uses_max_tree_size() {
        let cfg = crate::Config::from_json(br#"{"max_tree_size":64,"block_size":16}"#).unwrap();
        let mut r = Router::new(cfg.router_params(), cfg.policy);
        let mut rng = seeded(1);
        route(&mut r, &[b'a'; 200], &cands(1), &mut rng);
        assert_eq!(r.index().size_of(0), 13);
        assert_eq!(r.evict().len(), 9);
        assert_eq!(r.index().size_of(0), 4);
    }

    #[test]
    fn deciding_changes_nothing_until_committed() {
        let mut r = Router::new(params(32, 1 << 20), PolicyKind::CacheAware);
        let mut rng = seeded(4);
        let text = "a prompt long enough to fill several blocks of the index".repeat(4);
        let d = r.decide(text.as_bytes().into(), &cands(2), &mut rng).unwrap();
        assert!(!d.blocks.is_empty());
        assert!(r.index().is_empty(), "an uncommitted decision leaves no trace");
        r.commit(&d);
        assert_eq!(r.index().size_of(d.worker), d.blocks.len() as u64);
        let mut r = Router::new(params(32, 1 << 20), PolicyKind::RoundRobin);
        let first = r.decide(b"x".as_slice().into(), &cands(3), &mut rng).unwrap();
        assert_eq!(
            r.decide(b"x".as_slice().into(), &cands(3), &mut rng).unwrap(),
            first,
            "round robin waits for the commit"
        );
        r.commit(&first);
        assert_ne!(r.decide(b"x".as_slice().into(), &cands(3), &mut rng).unwrap().worker, first.worker);
    }

    #[test]
    fn the_index_stays_under_its_hard_bound_whatever_arrives_and_routing_never_evicts() {
        let mut p = params(4, 1 << 30);
        p.max_entries = 1_000;
        let mut r = Router::new(p, PolicyKind::CacheAware);
        let mut rng = seeded(2);
        let mut most = 0;
        for i in 0..500 {
            // Unique prompts of 20 blocks each: 10 000 entries offered; a tick every 10.
            let text = format!("{i:08}-unique-prompt-of-80-bytes-{}", "z".repeat(44));
            let before = r.index().entries();
            route(&mut r, text.as_bytes(), &cands(2), &mut rng);
            assert!(r.index().entries() >= before, "routing evicted nothing");
            most = most.max(r.index().entries());
            if i % 10 == 9 {
                r.bound();
                assert!(r.index().entries() <= 1_125);
            }
        }
        assert!((1_126..=1_250).contains(&most), "{most} entries at most between ticks");
        r.apply_insert(0, &(0..5_000).collect::<Vec<u64>>());
        assert_eq!(r.index().entries(), 1_250, "past the hard bound inserts are dropped");
        assert!(r.bound() > 0 && r.index().entries() == 1_000);
    }

    #[test]
    fn a_request_indexes_at_most_64_kib_of_new_text() {
        let mut r = Router::new(params(16, 1 << 30), PolicyKind::CacheAware);
        let mut rng = seeded(3);
        let long: String = (0..20_000).map(|i| format!("{i:07} ")).collect(); // 160 KB
        let most_new = MAX_NEW_BYTES_PER_REQUEST / 16;
        let first = route(&mut r, long.as_bytes(), &cands(1), &mut rng).unwrap();
        assert_eq!((first.held_blocks, first.blocks.len()), (0, most_new));
        let second = route(&mut r, long.as_bytes(), &cands(1), &mut rng).unwrap();
        assert_eq!(second.matched_bytes, MAX_NEW_BYTES_PER_REQUEST, "what the first indexed matches");
        assert_eq!(second.blocks.len(), 2 * most_new, "and the prompt seen again extends it");
    }

    #[test]
    fn a_long_prompt_seen_again_is_still_a_cache_hit_under_the_cap() {
        // 240 KB: 64 KiB would be a 27 % match, under the 0.3 threshold.
        let mut r = Router::new(params(16, 1 << 30), PolicyKind::CacheAware);
        let mut rng = seeded(4);
        let long: String = (0..30_000).map(|i| format!("{i:07} ")).collect();
        let first = route(&mut r, long.as_bytes(), &cands(4), &mut rng).unwrap();
        assert!(first.blocks.len() * 16 < long.len() / 2, "capped: {} blocks", first.blocks.len());
        for _ in 0..3 {
            let again = route(&mut r, long.as_bytes(), &cands(4), &mut rng).unwrap();
            assert_eq!(again.worker, first.worker);
            assert!(again.matched_bytes as f64 > 0.3 * long.len() as f64);
        }
    }
}
