//! The router: one policy plus the prefix index it consults, behind one call per request.

use crate::blocks::{block_hashes, covered_bytes};
use crate::config::Config;
use crate::index::PrefixIndex;
use crate::policy::{CacheAware, Candidate, PolicyKind, PowerOfTwo, Random, RoundRobin};
use crate::worker::WorkerId;
use rand::RngCore;

pub use crate::policy::Reason;

/// What the router decided for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Position in the candidate slice.
    pub pos: usize,
    pub worker: WorkerId,
    /// Why (cache-aware only).
    pub reason: Option<Reason>,
    /// Bytes of the routing text found in the chosen worker's index.
    pub matched_bytes: usize,
    /// The blocks newly indexed for the chosen worker (empty for text-blind policies):
    /// what other threads and gateways must apply to their copies of the index.
    pub inserted: Vec<u64>,
}

pub struct Router {
    kind: PolicyKind,
    /// Index prefixes even under a text-blind policy (the PD prefix decider needs it).
    track: bool,
    round_robin: RoundRobin,
    cache_aware: CacheAware,
    index: PrefixIndex,
    block_size: usize,
    max_blocks: u64,
}

impl Router {
    pub fn new(config: &Config) -> Self {
        Self::with_policy(config, config.policy)
    }

    /// A router with `config`'s parameters and another policy (one leg of PD mode).
    pub fn with_policy(config: &Config, kind: PolicyKind) -> Self {
        Self {
            kind,
            track: false,
            round_robin: RoundRobin::default(),
            cache_aware: CacheAware::new(config.cache_aware),
            index: PrefixIndex::new(),
            block_size: config.block_size,
            max_blocks: config.max_blocks_per_worker(),
        }
    }

    pub fn policy(&self) -> PolicyKind {
        self.kind
    }

    /// Keeps the prefix index (and reports matches) whatever the policy.
    pub fn track_prefixes(&mut self, on: bool) {
        self.track = on;
    }

    /// Whether routing looks at (and indexes) the text.
    pub fn uses_text(&self) -> bool {
        self.track || self.kind.uses_text()
    }

    /// Chooses a candidate for a request whose routing text is `text`, and records the
    /// choice in the index when the policy is cache-aware.
    pub fn route(&mut self, text: &[u8], cands: &[Candidate], rng: &mut dyn RngCore) -> Option<Decision> {
        let (pos, reason, matched_bytes, hashes) = match self.kind {
            PolicyKind::CacheAware => {
                let hashes = block_hashes(text, self.block_size);
                let c = self.cache_aware.pick(text.len(), &hashes, self.block_size, cands, &self.index, rng)?;
                (c.pos, Some(c.reason), c.matched_bytes, hashes)
            }
            kind => {
                let pos = self.pick_blind(kind, cands, rng)?;
                if !self.track {
                    (pos, None, 0, Vec::new())
                } else {
                    let hashes = block_hashes(text, self.block_size);
                    let id = cands[pos].id;
                    let blocks =
                        self.index.match_prefix(&hashes).iter().find(|m| m.worker == id).map_or(0, |m| m.blocks);
                    (pos, None, covered_bytes(blocks, self.block_size, text.len()), hashes)
                }
            }
        };
        let worker = cands[pos].id;
        if !hashes.is_empty() {
            self.index.insert(worker, &hashes);
        }
        Some(Decision { pos, worker, reason, matched_bytes, inserted: hashes })
    }

    /// Chooses a candidate for a request that carries no routing text (other paths).
    pub fn route_any(&mut self, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        match self.kind {
            PolicyKind::RoundRobin => self.round_robin.pick(cands),
            _ => PowerOfTwo.pick(cands, rng),
        }
    }

    fn pick_blind(&mut self, kind: PolicyKind, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        match kind {
            PolicyKind::RoundRobin => self.round_robin.pick(cands),
            PolicyKind::PowerOfTwo => PowerOfTwo.pick(cands, rng),
            _ => Random.pick(cands, rng),
        }
    }

    /// Applies an insert decided elsewhere (another thread or gateway).
    pub fn apply_insert(&mut self, worker: WorkerId, hashes: &[u64]) {
        self.index.insert(worker, hashes);
    }

    /// LRU-evicts every worker's index down to `max_tree_size`.
    pub fn evict(&mut self) -> Vec<(u64, WorkerId)> {
        self.index.evict_to(self.max_blocks)
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
    use crate::rng::seeded;

    fn cands(n: u32) -> Vec<Candidate> {
        (0..n).map(|id| Candidate { id, load: 0 }).collect()
    }

    #[test]
    fn cache_aware_sticks_to_a_shared_prefix_and_spreads_others() {
        let mut r = Router::new(&Config::default());
        let mut rng = seeded(11);
        let prefix = "You are a meticulous assistant. ".repeat(20);
        let first = r.route(format!("{prefix}question 0").as_bytes(), &cands(4), &mut rng).unwrap();
        for i in 1..20 {
            let d = r.route(format!("{prefix}question {i}").as_bytes(), &cands(4), &mut rng).unwrap();
            assert_eq!(d.worker, first.worker);
            assert_eq!(d.reason, Some(Reason::CacheHit));
        }
        let mut used = std::collections::HashSet::new();
        for i in 0..8 {
            let text = format!("{i} completely different conversation {}", "x".repeat(200));
            used.insert(r.route(text.as_bytes(), &cands(4), &mut rng).unwrap().worker);
        }
        // Distinct prefixes go to the smallest indexes: the three workers without the prefix.
        assert_eq!(used.len(), 3);
        assert!(!used.contains(&first.worker));
    }

    #[test]
    fn blind_policies_insert_nothing() {
        let cfg = Config::from_json(br#"{"policy":"round_robin"}"#).unwrap();
        let mut r = Router::new(&cfg);
        let mut rng = seeded(1);
        let d = r.route(b"text", &cands(3), &mut rng).unwrap();
        assert!(d.inserted.is_empty() && r.index().is_empty());
        assert_eq!(r.route(b"text", &cands(3), &mut rng).unwrap().pos, 1);
        assert!(r.route(b"text", &[], &mut rng).is_none());
    }

    #[test]
    fn eviction_uses_max_tree_size() {
        let cfg = Config::from_json(br#"{"max_tree_size":64,"block_size":16}"#).unwrap();
        let mut r = Router::new(&cfg);
        let mut rng = seeded(1);
        r.route(&[b'a'; 200], &cands(1), &mut rng);
        assert_eq!(r.index().size_of(0), 13);
        assert_eq!(r.evict().len(), 9);
        assert_eq!(r.index().size_of(0), 4);
    }
}
