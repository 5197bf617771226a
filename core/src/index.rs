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

/// Workers matched past which `match_prefix` finds them by a map instead of a scan.
const LINEAR_MATCHES: usize = 8;

/// Blocks past which an index with an expected size grows straight to it.
const EARLY_GROWTH: usize = 1 << 17;

/// A worker id no worker has: a [`Node`] holding it lists its owners in [`Shared`].
const MANY: WorkerId = WorkerId::MAX;

/// The workers holding one block, in 8 bytes (the map holds millions of them: 16 bytes an
/// entry with its key). Almost always a single owner, held inline; a block held by several
/// workers holds `MANY` as its worker and, as its tick, the [`Shared`] slot listing them.
#[derive(Clone, Copy, Debug)]
struct Node(Owner);

/// The owner lists of blocks held by several workers, in slots reused once freed.
#[derive(Debug, Default)]
struct Shared {
    slots: Vec<Vec<Owner>>,
    free: Vec<u32>,
}

impl Shared {
    fn add(&mut self, owners: Vec<Owner>) -> u32 {
        match self.free.pop() {
            Some(slot) => {
                if let Some(s) = self.slots.get_mut(slot as usize) {
                    *s = owners;
                }
                slot
            }
            None => {
                self.slots.push(owners);
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, slot: u32) -> Vec<Owner> {
        let owners = self.slots.get_mut(slot as usize).map(std::mem::take).unwrap_or_default();
        self.free.push(slot);
        owners
    }
}

impl Node {
    fn one(worker: WorkerId, tick: u32) -> Self {
        Self(Owner { worker, tick })
    }

    fn owners<'a>(&'a self, shared: &'a Shared) -> &'a [Owner] {
        if self.0.worker == MANY {
            return shared.slots.get(self.0.tick as usize).map_or(&[], Vec::as_slice);
        }
        std::slice::from_ref(&self.0)
    }

    /// Stamps `worker` with `tick`, adding it when it is new on this block.
    fn touch(&mut self, shared: &mut Shared, worker: WorkerId, tick: u32) {
        let fresh = Owner { worker, tick };
        if self.0.worker == MANY {
            if let Some(v) = shared.slots.get_mut(self.0.tick as usize) {
                match v.iter_mut().find(|o| o.worker == worker) {
                    Some(o) => o.tick = tick,
                    None => v.push(fresh),
                }
            }
        } else if self.0.worker == worker {
            self.0.tick = tick;
        } else {
            let slot = shared.add(vec![self.0, fresh]);
            self.0 = Owner { worker: MANY, tick: slot };
        }
    }

    /// Removes `worker`; returns true when no owner is left.
    fn remove(&mut self, shared: &mut Shared, worker: WorkerId) -> bool {
        if self.0.worker != MANY {
            return self.0.worker == worker;
        }
        let slot = self.0.tick;
        let Some(v) = shared.slots.get_mut(slot as usize) else { return true };
        v.retain(|o| o.worker != worker);
        match v.as_slice() {
            [] => {
                shared.release(slot);
                true
            }
            [only] => {
                self.0 = *only;
                shared.release(slot);
                false
            }
            _ => false,
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
    nodes: HashMap<u64, Node, BuildNoHashHasher<u64>>,
    /// Owner lists of the blocks several workers hold.
    shared: Shared,
    /// How many blocks the index may come to hold (its owner's bound; 0: unknown).
    expected: usize,
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

    /// The index will hold at most about `blocks` blocks: past [`EARLY_GROWTH`] it grows
    /// straight to that size instead of doubling its table step by step (each step holds the
    /// old table and the new at once, and a VM's linear memory never shrinks).
    pub fn expect_blocks(&mut self, blocks: usize) {
        self.expected = blocks;
    }

    fn stamped(&mut self, worker: WorkerId, tick: u32, hash: u64) {
        let Some(recency) = self.recency.as_mut() else { return };
        let log = recency.entry(worker).or_default();
        log.push_back((tick, hash));
        let size = self.sizes.get(&worker).copied().unwrap_or(0);
        // Stale entries (re-stamped or removed blocks) are dropped once they outnumber the
        // live ones: amortised O(1) per stamp.
        if log.len() as u64 > size.saturating_mul(2).saturating_add(64) {
            let (nodes, shared) = (&self.nodes, &self.shared);
            log.retain(|&(t, h)| current(nodes, shared, h, worker, t));
        }
    }

    /// Records that `worker` now holds the prefix whose chained block hashes are `hashes`.
    pub fn insert(&mut self, worker: WorkerId, hashes: &[u64]) {
        self.insert_reporting(worker, hashes, |_| {});
    }

    /// [`insert`](Self::insert), calling `added` with each block that is new for `worker`
    /// (what other copies of the index need to learn).
    pub fn insert_reporting(&mut self, worker: WorkerId, hashes: &[u64], mut added_block: impl FnMut(u64)) {
        if worker == MANY {
            return; // Not a worker id (and the marker of a shared node): nothing to record.
        }
        let n = hashes.len() as u32;
        let base = self.clock;
        self.clock = self.clock.wrapping_add(n);
        for (i, &hash) in hashes.iter().enumerate() {
            // Deeper blocks get older stamps, so eviction takes leaves first.
            let tick = base.wrapping_add(n - 1 - i as u32);
            let added = match self.nodes.get_mut(&hash) {
                Some(node) => {
                    let had = node.owners(&self.shared).iter().any(|o| o.worker == worker);
                    node.touch(&mut self.shared, worker, tick);
                    !had
                }
                None => {
                    let len = self.nodes.len();
                    if len >= EARLY_GROWTH && len == self.nodes.capacity() && self.expected > len {
                        self.nodes.reserve(self.expected - len);
                    }
                    self.nodes.insert(hash, Node::one(worker, tick));
                    true
                }
            };
            if added {
                *self.sizes.entry(worker).or_default() += 1;
                added_block(hash);
            }
        }
        if self.recency.is_some() {
            // In stamping order: the deepest block first (the oldest stamp). After the blocks
            // carry their new stamps: a compaction of the log within this loop keeps them.
            for (i, &hash) in hashes.iter().enumerate().rev() {
                self.stamped(worker, base.wrapping_add(n - 1 - i as u32), hash);
            }
        }
    }

    /// For every worker holding some leading blocks of `hashes`, the deepest such block.
    /// The walk stops at the first block nobody holds.
    pub fn match_prefix(&self, hashes: &[u64]) -> Vec<PrefixMatch> {
        let mut found: Vec<PrefixMatch> = Vec::new();
        // Where each worker is in `found`, once a few are (a prompt shared by a whole fleet
        // has dozens of owners on every block: no scan of `found` per owner then).
        let mut at: Option<HashMap<WorkerId, usize, BuildNoHashHasher<WorkerId>>> = None;
        for (i, hash) in hashes.iter().enumerate() {
            let Some(node) = self.nodes.get(hash) else {
                break;
            };
            for o in node.owners(&self.shared) {
                let pos = match &at {
                    Some(map) => map.get(&o.worker).copied(),
                    None => found.iter().position(|m| m.worker == o.worker),
                };
                match pos.and_then(|p| found.get_mut(p)) {
                    Some(m) => m.blocks = i + 1,
                    None => {
                        if let Some(map) = at.as_mut() {
                            map.insert(o.worker, found.len());
                        }
                        found.push(PrefixMatch { worker: o.worker, blocks: i + 1 });
                        if at.is_none() && found.len() >= LINEAR_MATCHES {
                            at = Some(found.iter().enumerate().map(|(p, m)| (m.worker, p)).collect());
                        }
                    }
                }
            }
        }
        found
    }

    /// How many leading blocks of `hashes` the index holds for some worker, found by binary
    /// search in about log2(len) look-ups instead of one per block: an entry stands for its
    /// whole prefix (the hashes are chained, and eviction takes a prefix's leaves first), so
    /// the blocks held form a run from the first. Returns that depth with the workers that
    /// hold the deepest block (empty at depth 0).
    pub fn deepest(&self, hashes: &[u64]) -> (usize, impl Iterator<Item = WorkerId> + '_) {
        let depth = leading_run(hashes.len(), |i| hashes.get(i).is_some_and(|h| self.nodes.contains_key(h)));
        let node = depth.checked_sub(1).and_then(|i| hashes.get(i)).and_then(|h| self.nodes.get(h));
        let owners = node.map_or(&[][..], |n| n.owners(&self.shared));
        (depth, owners.iter().map(|o| o.worker))
    }

    /// How many leading blocks of `hashes` `worker` holds, by binary search (see
    /// [`deepest`](Self::deepest)).
    pub fn depth_of(&self, worker: WorkerId, hashes: &[u64]) -> usize {
        leading_run(hashes.len(), |i| {
            let node = hashes.get(i).and_then(|h| self.nodes.get(h));
            node.is_some_and(|n| n.owners(&self.shared).iter().any(|o| o.worker == worker))
        })
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

    /// Every `(worker, hashes)` the index holds, each worker's blocks oldest first. To send
    /// them as inserts, cut each list into pieces in this order and turn each piece with
    /// [`as_insert`]: inserted one after the other into an empty index, they reproduce the
    /// recency order.
    pub fn export(&self) -> Vec<(WorkerId, Vec<u64>)> {
        let mut workers: Vec<WorkerId> = self.sizes.keys().copied().collect();
        workers.sort_unstable();
        self.export_workers(&workers)
    }

    /// [`export`](Self::export) for `workers` only (sorted): one pass over the index, and
    /// memory for what those workers hold, not for the whole index.
    pub fn export_workers(&self, workers: &[WorkerId]) -> Vec<(WorkerId, Vec<u64>)> {
        let mut per_worker: HashMap<WorkerId, Vec<(u32, u64)>, BuildNoHashHasher<WorkerId>> = HashMap::default();
        for (&hash, node) in &self.nodes {
            for o in node.owners(&self.shared).iter().filter(|o| workers.binary_search(&o.worker).is_ok()) {
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
        let shared = &mut self.shared;
        self.nodes.retain(|_, node| !node.remove(shared, worker));
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
            if current(&self.nodes, &self.shared, hash, worker, tick) {
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
            .filter_map(|(&h, node)| {
                node.owners(&self.shared).iter().find(|o| o.worker == worker).map(|o| (self.age(o.tick), h))
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
        let Some(node) = self.nodes.get_mut(&hash) else {
            return;
        };
        if !node.owners(&self.shared).iter().any(|o| o.worker == worker) {
            return;
        }
        if node.remove(&mut self.shared, worker) {
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
        // The oldest `excess` entries without a list of every entry (the bound exists for
        // memory): the age from which they start is found in two counting passes, on its
        // high then its low 16 bits, and a third pass takes them.
        let ages = || self.nodes.values().flat_map(|node| node.owners(&self.shared).iter().map(|o| self.age(o.tick)));
        let mut counts = vec![0u64; 1 << 16];
        for age in ages() {
            if let Some(c) = counts.get_mut((age >> 16) as usize) {
                *c += 1;
            }
        }
        let (high, before_high) = oldest_bucket(&counts, excess);
        counts.iter_mut().for_each(|c| *c = 0);
        for age in ages().filter(|a| a >> 16 == high) {
            if let Some(c) = counts.get_mut((age & 0xffff) as usize) {
                *c += 1;
            }
        }
        let (low, before_low) = oldest_bucket(&counts, excess - before_high);
        let threshold = (high << 16) | low;
        // Entries older than the threshold all go; of those exactly at it, as many as needed.
        let mut at_threshold = excess - before_high - before_low;
        let mut evicted: Vec<(u64, WorkerId)> = Vec::new();
        for (&hash, node) in &self.nodes {
            for o in node.owners(&self.shared) {
                let age = self.age(o.tick);
                if age > threshold {
                    evicted.push((hash, o.worker));
                } else if age == threshold && at_threshold > 0 {
                    at_threshold -= 1;
                    evicted.push((hash, o.worker));
                }
            }
        }
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

/// A piece of an oldest-first list of a worker's blocks ([`PrefixIndex::export`]) as the
/// hashes of one insert: newest first, since an insert stamps its first hash as the most
/// recently used (a request's prefix is root first, and the root is used whenever any of it
/// is). Pieces inserted in list order then keep the whole list's order.
pub fn as_insert(oldest_first: &[u64]) -> Vec<u64> {
    oldest_first.iter().rev().copied().collect()
}

/// The length of the run of `held` blocks from block 0, out of `len`, for a `held` that is
/// true up to some block and false after it (binary search: about log2(len) calls).
fn leading_run(len: usize, held: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, len);
    // Invariant: the first `lo` blocks are held; none from `hi` on.
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if held(mid - 1) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Over `counts` per age bucket (oldest last), the bucket holding the `need`-th oldest entry
/// and how many entries are older than that bucket.
fn oldest_bucket(counts: &[u64], need: u64) -> (u32, u64) {
    let mut older = 0u64;
    for (bucket, &n) in counts.iter().enumerate().rev() {
        if older + n >= need {
            return (bucket as u32, older);
        }
        older += n;
    }
    (0, older)
}

/// Whether `worker` still holds `hash` with the stamp `tick` (a recency entry is current).
fn current(
    nodes: &HashMap<u64, Node, BuildNoHashHasher<u64>>,
    shared: &Shared,
    hash: u64,
    worker: WorkerId,
    tick: u32,
) -> bool {
    nodes.get(&hash).is_some_and(|node| node.owners(shared).iter().any(|o| o.worker == worker && o.tick == tick))
}

#[cfg(test)]
mod tests;
