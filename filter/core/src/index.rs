//! The prefix index: which worker has (approximately) cached which prefix.
//!
//! Keys are chained block hashes ([`crate::blocks`]), so the index is a flat map rather than a
//! tree, and the same request yields the same keys in every filter and in the control plane:
//! an insert is `(worker, hashes)`, an eviction `(hash, worker)`, both small enough to ship
//! in snapshot deltas.
//!
//! Recency is a logical clock. An insert stamps its blocks so that deeper blocks are older
//! than shallower ones; LRU eviction therefore removes the leaves of a prefix before its
//! root, as a radix tree's leaf eviction does, and never strands a reachable suffix.

use std::collections::{HashMap, VecDeque};

use nohash_hasher::BuildNoHashHasher;

use crate::worker::WorkerId;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owner {
    worker: WorkerId,
    tick: u32,
}

/// The workers holding one block; almost always a single one, so that case stays inline.
#[derive(Debug)]
enum Owners {
    One(Owner),
    // Boxed so that `Owners` stays 16 bytes: the map holds millions of them.
    #[allow(clippy::box_collection)]
    Many(Box<Vec<Owner>>),
}

impl Owners {
    fn as_slice(&self) -> &[Owner] {
        match self {
            Owners::One(o) => std::slice::from_ref(o),
            Owners::Many(v) => v,
        }
    }

    /// Stamps `worker` with `tick`, adding it when it is new on this block.
    fn touch(&mut self, worker: WorkerId, tick: u32) {
        let fresh = Owner { worker, tick };
        match self {
            Owners::One(o) if o.worker == worker => o.tick = tick,
            Owners::One(o) => *self = Owners::Many(Box::new(vec![*o, fresh])),
            Owners::Many(v) => match v.iter_mut().find(|o| o.worker == worker) {
                Some(o) => o.tick = tick,
                None => v.push(fresh),
            },
        }
    }

    /// Removes `worker`; returns true when no owner is left.
    fn remove(&mut self, worker: WorkerId) -> bool {
        match self {
            Owners::One(o) => o.worker == worker,
            Owners::Many(v) => {
                v.retain(|o| o.worker != worker);
                match v.as_slice() {
                    [] => true,
                    [only] => {
                        *self = Owners::One(*only);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

/// The deepest block of a request that a worker holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    pub worker: WorkerId,
    /// Number of leading blocks matched.
    pub blocks: usize,
}

/// Per worker, `(tick, hash)` stamps in the order they were made.
type Recency = HashMap<WorkerId, VecDeque<(u32, u64)>, BuildNoHashHasher<WorkerId>>;

/// Block hashes per worker, with LRU eviction to a per-worker size.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    nodes: HashMap<u64, Owners, BuildNoHashHasher<u64>>,
    sizes: HashMap<WorkerId, u64, BuildNoHashHasher<WorkerId>>,
    clock: u32,
    /// With [`PrefixIndex::with_recency`]: per worker, its stamps in the order they were
    /// made (`(tick, hash)`, oldest first). An entry is current while the block's owner still
    /// carries that tick; the others are skipped (and compacted away), so evicting one
    /// worker's least recently used blocks costs what it evicts, not a scan of the index.
    recency: Option<Recency>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index that also keeps each worker's recency order, for
    /// [`evict_worker_to`](Self::evict_worker_to) (the control plane's, which bounds each
    /// worker to its KV capacity on every report; about 16 more bytes per entry).
    pub fn with_recency() -> Self {
        Self { recency: Some(HashMap::default()), ..Self::default() }
    }

    fn stamped(&mut self, worker: WorkerId, tick: u32, hash: u64) {
        let Some(recency) = self.recency.as_mut() else { return };
        let log = recency.entry(worker).or_default();
        log.push_back((tick, hash));
        let size = self.sizes.get(&worker).copied().unwrap_or(0);
        // Stale entries (re-stamped or removed blocks) are dropped once they outnumber the
        // live ones: amortised O(1) per stamp.
        if log.len() as u64 > size.saturating_mul(2).saturating_add(64) {
            let nodes = &self.nodes;
            log.retain(|&(t, h)| current(nodes, h, worker, t));
        }
    }

    /// Records that `worker` now holds the prefix whose chained block hashes are `hashes`.
    pub fn insert(&mut self, worker: WorkerId, hashes: &[u64]) {
        self.insert_reporting(worker, hashes, |_| {});
    }

    /// [`insert`](Self::insert), calling `added` with each block that is new for `worker`
    /// (what other copies of the index need to learn).
    pub fn insert_reporting(&mut self, worker: WorkerId, hashes: &[u64], mut added_block: impl FnMut(u64)) {
        let n = hashes.len() as u32;
        let base = self.clock;
        self.clock = self.clock.wrapping_add(n);
        if self.recency.is_some() {
            // In stamping order: the deepest block first (the oldest stamp).
            for (i, &hash) in hashes.iter().enumerate().rev() {
                self.stamped(worker, base.wrapping_add(n - 1 - i as u32), hash);
            }
        }
        for (i, &hash) in hashes.iter().enumerate() {
            // Deeper blocks get older stamps, so eviction takes leaves first.
            let tick = base.wrapping_add(n - 1 - i as u32);
            let added = match self.nodes.get_mut(&hash) {
                Some(owners) => {
                    let had = owners.as_slice().iter().any(|o| o.worker == worker);
                    owners.touch(worker, tick);
                    !had
                }
                None => {
                    self.nodes.insert(hash, Owners::One(Owner { worker, tick }));
                    true
                }
            };
            if added {
                *self.sizes.entry(worker).or_default() += 1;
                added_block(hash);
            }
        }
    }

    /// For every worker holding some leading blocks of `hashes`, the deepest such block.
    /// The walk stops at the first block nobody holds.
    pub fn match_prefix(&self, hashes: &[u64]) -> Vec<PrefixMatch> {
        let mut found: Vec<PrefixMatch> = Vec::new();
        for (i, hash) in hashes.iter().enumerate() {
            let Some(owners) = self.nodes.get(hash) else {
                break;
            };
            for o in owners.as_slice() {
                match found.iter_mut().find(|m| m.worker == o.worker) {
                    Some(m) => m.blocks = i + 1,
                    None => found.push(PrefixMatch { worker: o.worker, blocks: i + 1 }),
                }
            }
        }
        found
    }

    /// Number of blocks `worker` holds (its "tree size").
    pub fn size_of(&self, worker: WorkerId) -> u64 {
        self.sizes.get(&worker).copied().unwrap_or(0)
    }

    /// Number of distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Sum over workers of the blocks each holds.
    pub fn entries(&self) -> u64 {
        self.sizes.values().sum()
    }

    /// Every `(worker, hashes)` the index holds, each worker's blocks oldest first, so that
    /// inserting them in this order into an empty index reproduces the recency order.
    pub fn export(&self) -> Vec<(WorkerId, Vec<u64>)> {
        let mut per_worker: HashMap<WorkerId, Vec<(u32, u64)>, BuildNoHashHasher<WorkerId>> = HashMap::default();
        for (&hash, owners) in &self.nodes {
            for o in owners.as_slice() {
                per_worker.entry(o.worker).or_default().push((self.age(o.tick), hash));
            }
        }
        let mut out: Vec<(WorkerId, Vec<u64>)> = per_worker
            .into_iter()
            .map(|(w, mut blocks)| {
                blocks.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
                (w, blocks.into_iter().map(|(_, h)| h).collect())
            })
            .collect();
        out.sort_unstable_by_key(|(w, _)| *w);
        out
    }

    /// Forgets everything `worker` holds.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.nodes.retain(|_, owners| !owners.remove(worker));
        self.sizes.remove(&worker);
        if let Some(recency) = self.recency.as_mut() {
            recency.remove(&worker);
        }
    }

    /// Evicts `worker`'s least recently used blocks (by last use: an insert or a match that
    /// was routed there) until it holds at most `max_blocks`; deeper blocks of one prefix go
    /// before shallower ones. Returns the evicted hashes. Without
    /// [`with_recency`](Self::with_recency), scans the index.
    pub fn evict_worker_to(&mut self, worker: WorkerId, max_blocks: u64) -> Vec<u64> {
        let size = self.size_of(worker);
        if size <= max_blocks {
            return Vec::new();
        }
        let Some(log) = self.recency.as_mut().and_then(|r| r.remove(&worker)) else {
            return self.evict_scan(worker, size - max_blocks);
        };
        let mut log = log;
        let mut evicted = Vec::new();
        while self.size_of(worker) > max_blocks {
            let Some((tick, hash)) = log.pop_front() else { break };
            if current(&self.nodes, hash, worker, tick) {
                self.remove(hash, worker);
                evicted.push(hash);
            }
        }
        if let Some(recency) = self.recency.as_mut() {
            recency.insert(worker, log);
        }
        evicted
    }

    /// `worker`'s `excess` least recently used blocks, found by a scan of the whole index.
    fn evict_scan(&mut self, worker: WorkerId, excess: u64) -> Vec<u64> {
        let mut stamps: Vec<(u32, u64)> = self
            .nodes
            .iter()
            .filter_map(|(&h, owners)| {
                owners.as_slice().iter().find(|o| o.worker == worker).map(|o| (self.age(o.tick), h))
            })
            .collect();
        // Oldest first: the largest age.
        let k = usize::try_from(excess).unwrap_or(usize::MAX).min(stamps.len());
        if k < stamps.len() {
            stamps.select_nth_unstable_by(k, |a, b| b.0.cmp(&a.0));
        }
        let evicted: Vec<u64> = stamps.iter().take(k).map(|&(_, h)| h).collect();
        for &hash in &evicted {
            self.remove(hash, worker);
        }
        evicted
    }

    /// Removes `worker` from one block (an eviction decided elsewhere, e.g. by the control
    /// plane).
    pub fn remove(&mut self, hash: u64, worker: WorkerId) {
        let Some(owners) = self.nodes.get_mut(&hash) else {
            return;
        };
        if !owners.as_slice().iter().any(|o| o.worker == worker) {
            return;
        }
        if owners.remove(worker) {
            self.nodes.remove(&hash);
        }
        if let Some(size) = self.sizes.get_mut(&worker) {
            *size = size.saturating_sub(1);
        }
    }

    /// Evicts the least recently used blocks of every worker holding more than `max_blocks`,
    /// down to `max_blocks`. Returns the evicted `(hash, worker)` pairs.
    pub fn evict_to(&mut self, max_blocks: u64) -> Vec<(u64, WorkerId)> {
        let over: Vec<(WorkerId, u64)> = self
            .sizes
            .iter()
            .filter(|(_, &size)| size > max_blocks)
            .map(|(&w, &size)| (w, size - max_blocks))
            .collect();
        let mut evicted = Vec::new();
        for (worker, excess) in over {
            let size = self.size_of(worker);
            let gone = self.evict_worker_to(worker, size.saturating_sub(excess));
            evicted.extend(gone.into_iter().map(|h| (h, worker)));
        }
        evicted
    }

    /// Evicts the least recently used entries of all workers together until at most
    /// `max_entries` `(worker, block)` entries are left: the hard bound on the index's memory,
    /// whatever the traffic between two periodic evictions. Returns the evicted pairs.
    pub fn evict_total_to(&mut self, max_entries: u64) -> Vec<(u64, WorkerId)> {
        let excess = self.entries().saturating_sub(max_entries);
        if excess == 0 {
            return Vec::new();
        }
        let mut stamps: Vec<(u32, u64, WorkerId)> = self
            .nodes
            .iter()
            .flat_map(|(&h, owners)| owners.as_slice().iter().map(move |o| (o.tick, h, o.worker)))
            .map(|(tick, h, w)| (self.age(tick), h, w))
            .collect();
        let k = usize::try_from(excess).unwrap_or(usize::MAX).min(stamps.len());
        if k < stamps.len() {
            stamps.select_nth_unstable_by(k, |a, b| b.0.cmp(&a.0));
        }
        let evicted: Vec<(u64, WorkerId)> = stamps.iter().take(k).map(|&(_, h, w)| (h, w)).collect();
        for &(hash, worker) in &evicted {
            self.remove(hash, worker);
        }
        evicted
    }

    /// The workers the index holds blocks for, with how many each holds.
    pub fn sizes(&self) -> impl Iterator<Item = (WorkerId, u64)> + '_ {
        self.sizes.iter().map(|(&w, &n)| (w, n))
    }

    /// How many ticks ago `tick` was stamped (the clock wraps; ages stay right while fewer
    /// than 2^32 blocks are inserted between two evictions).
    fn age(&self, tick: u32) -> u32 {
        self.clock.wrapping_sub(tick)
    }
}

/// Whether `worker` still holds `hash` with the stamp `tick` (a recency entry is current).
fn current(nodes: &HashMap<u64, Owners, BuildNoHashHasher<u64>>, hash: u64, worker: WorkerId, tick: u32) -> bool {
    nodes.get(&hash).is_some_and(|owners| owners.as_slice().iter().any(|o| o.worker == worker && o.tick == tick))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_total_bound_evicts_the_oldest_entries_of_any_worker() {
        let mut idx = super::PrefixIndex::new();
        idx.insert(1, &[10, 11, 12]);
        idx.insert(2, &[20, 21]);
        idx.insert(1, &[10]); // fresh again
        assert!(idx.evict_total_to(10).is_empty());
        let mut gone = idx.evict_total_to(3);
        gone.sort_unstable();
        // Oldest: worker 1's deeper blocks 12 and 11 (stamped first, deepest oldest).
        assert_eq!(gone, vec![(11, 1), (12, 1)]);
        assert_eq!(idx.entries(), 3);
        assert_eq!(idx.size_of(1), 1);
    }

    use super::*;
    use crate::blocks::block_hashes;

    fn h(text: &str) -> Vec<u64> {
        block_hashes(text.as_bytes(), 4)
    }

    #[test]
    fn longest_prefix_per_worker() {
        let mut idx = PrefixIndex::new();
        idx.insert(1, &h("aaaabbbbcccc"));
        idx.insert(2, &h("aaaabbbbzzzz"));
        idx.insert(3, &h("qqqq"));
        let mut m = idx.match_prefix(&h("aaaabbbbccccdddd"));
        m.sort_by_key(|m| m.worker);
        assert_eq!(m, vec![PrefixMatch { worker: 1, blocks: 3 }, PrefixMatch { worker: 2, blocks: 2 }]);
        assert!(idx.match_prefix(&h("xxxx")).is_empty());
        assert_eq!(idx.size_of(1), 3);
        assert_eq!(idx.size_of(2), 3);
        assert_eq!(idx.len(), 5, "the two shared blocks are stored once");
        assert_eq!(idx.entries(), 7);
    }

    #[test]
    fn reinserting_does_not_grow() {
        let mut idx = PrefixIndex::new();
        idx.insert(1, &h("aaaabbbb"));
        let mut new = Vec::new();
        idx.insert_reporting(1, &h("aaaabbbbcccc"), |b| new.push(b));
        assert_eq!(new, h("aaaabbbbcccc")[2..]);
        idx.insert(1, &h("aaaabbbb"));
        assert_eq!(idx.size_of(1), 3);
        assert_eq!(idx.len(), 3);
    }

    #[test]
    fn eviction_takes_least_recent_leaves_first() {
        let mut idx = PrefixIndex::new();
        idx.insert(1, &h("aaaabbbbcccc")); // old
        idx.insert(1, &h("xxxxyyyy")); // newer
        let evicted = idx.evict_to(3);
        assert_eq!(evicted.len(), 2);
        assert_eq!(idx.size_of(1), 3);
        // The old prefix lost its two deepest blocks, its root stays reachable.
        assert_eq!(idx.match_prefix(&h("aaaabbbbcccc")), vec![PrefixMatch { worker: 1, blocks: 1 }]);
        assert_eq!(idx.match_prefix(&h("xxxxyyyy")), vec![PrefixMatch { worker: 1, blocks: 2 }]);
    }

    #[test]
    fn eviction_only_touches_workers_over_the_limit() {
        let mut idx = PrefixIndex::new();
        idx.insert(1, &h("aaaabbbbcccc"));
        idx.insert(2, &h("aaaabbbbcccc"));
        idx.insert(2, &h("zzzz"));
        idx.evict_to(3);
        assert_eq!(idx.size_of(1), 3);
        assert_eq!(idx.size_of(2), 3);
        assert_eq!(idx.match_prefix(&h("aaaabbbbcccc")).len(), 2);
        assert_eq!(idx.match_prefix(&h("zzzz")), vec![PrefixMatch { worker: 2, blocks: 1 }]);
    }

    #[test]
    fn touching_a_prefix_protects_it() {
        let mut idx = PrefixIndex::new();
        idx.insert(1, &h("aaaabbbb"));
        idx.insert(1, &h("cccc"));
        idx.insert(1, &h("aaaabbbb")); // used again: now the most recent
        idx.evict_to(2);
        assert_eq!(idx.match_prefix(&h("aaaabbbb")), vec![PrefixMatch { worker: 1, blocks: 2 }]);
        assert!(idx.match_prefix(&h("cccc")).is_empty());
    }

    #[test]
    fn one_workers_bound_evicts_its_least_recently_used_blocks_leaves_first() {
        for mut idx in [PrefixIndex::new(), PrefixIndex::with_recency()] {
            idx.insert(1, &h("aaaabbbbcccc")); // used first
            idx.insert(1, &h("xxxxyyyy"));
            idx.insert(2, &h("qqqqrrrrssss")); // another worker: untouched
            idx.insert(1, &h("aaaabbbb")); // a match routed here: the shared blocks are fresh again
            let gone = idx.evict_worker_to(1, 3);
            // Oldest by last use: "cccc" (stamped with the first insert), then "yyyy" (the
            // deeper block of the second), leaving "aaaa", "bbbb", "xxxx".
            assert_eq!(gone, vec![h("aaaabbbbcccc")[2], h("xxxxyyyy")[1]]);
            assert_eq!(idx.size_of(1), 3);
            assert_eq!(idx.size_of(2), 3);
            assert_eq!(idx.match_prefix(&h("aaaabbbbcccc")), vec![PrefixMatch { worker: 1, blocks: 2 }]);
            assert_eq!(idx.match_prefix(&h("xxxxyyyy")), vec![PrefixMatch { worker: 1, blocks: 1 }]);
            assert!(idx.evict_worker_to(1, 3).is_empty(), "within its bound: nothing");
            assert_eq!(idx.evict_worker_to(2, 0).len(), 3);
        }
    }

    #[test]
    fn the_recency_order_survives_removals_restamps_and_compaction() {
        // A worker whose blocks are touched over and over (stale recency entries pile up and
        // are compacted) evicts exactly what a scan of the whole index evicts.
        let mut fast = PrefixIndex::with_recency();
        let mut slow = PrefixIndex::new();
        let mut x = 7u64;
        for round in 0..2_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let prompt = format!("{:04}{}", x % 50, "z".repeat((x >> 20) as usize % 12));
            for idx in [&mut fast, &mut slow] {
                idx.insert(1, &h(&prompt));
                if round % 7 == 0 {
                    idx.remove(h(&prompt)[0], 1);
                }
            }
            if round % 100 == 99 {
                let mut a = fast.evict_worker_to(1, 40);
                let mut b = slow.evict_worker_to(1, 40);
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b, "round {round}");
            }
        }
        let log = fast.recency.as_ref().and_then(|r| r.get(&1)).map_or(0, |l| l.len()) as u64;
        assert!(log <= fast.size_of(1) * 2 + 64 + 16, "the log stays within twice the live entries: {log}");
    }

    #[test]
    fn export_lists_every_block_oldest_first() {
        let mut idx = PrefixIndex::new();
        idx.insert(1, &h("aaaabbbb"));
        idx.insert(2, &h("cccc"));
        idx.insert(1, &h("dddd"));
        let out = idx.export();
        assert_eq!(out.len(), 2);
        let (w, blocks) = &out[0];
        assert_eq!(*w, 1);
        // "bbbb" (deepest, oldest), "aaaa", then "dddd".
        let ab = h("aaaabbbb");
        assert_eq!(blocks, &vec![ab[1], ab[0], h("dddd")[0]]);
        assert_eq!(out[1], (2, h("cccc")));
    }

    #[test]
    fn remove_worker_and_single_block() {
        let mut idx = PrefixIndex::new();
        idx.insert(1, &h("aaaa"));
        idx.insert(2, &h("aaaabbbb"));
        idx.remove_worker(2);
        assert_eq!(idx.size_of(2), 0);
        assert_eq!(idx.len(), 1);
        let hashes = h("aaaa");
        idx.remove(hashes[0], 1);
        assert!(idx.is_empty());
        assert_eq!(idx.entries(), 0);
    }
}
