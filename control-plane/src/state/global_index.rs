//! The global prefix index's owner: the blocks each worker holds, merged from every
//! gateway's reports. Only this file touches the [`PrefixIndex`]; what changes in it is
//! returned, for the publication to send.

use kvmesh_core::index::{PrefixIndex, PrefixMatch};

/// The global prefix index (read through `&GlobalIndex`, written through `&mut`).
pub(super) struct GlobalIndex(PrefixIndex);

impl Default for GlobalIndex {
    fn default() -> Self {
        // Each report bounds the workers it names to their capacity: by recency, not scans.
        Self(PrefixIndex::with_recency())
    }
}

impl GlobalIndex {
    // ---- reads

    /// Blocks worker `id` holds.
    pub(super) fn size_of(&self, id: u32) -> u64 {
        self.0.size_of(id)
    }

    /// Its blocks.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    /// Its (worker, block) entries.
    pub(super) fn entries(&self) -> u64 {
        self.0.entries()
    }

    /// The workers holding a run of `hashes`' leading blocks.
    pub(super) fn match_prefix(&self, hashes: &[u64]) -> Vec<PrefixMatch> {
        self.0.match_prefix(hashes)
    }

    /// Every worker's blocks.
    pub(super) fn export(&self) -> Vec<(u32, Vec<u64>)> {
        self.0.export()
    }

    /// The workers it holds blocks of.
    pub(super) fn workers(&self) -> Vec<u32> {
        self.0.sizes().map(|(w, _)| w).collect()
    }

    // ---- writes

    /// `worker` holds `hashes` (used now); `added` gets the blocks that are new for it.
    pub(super) fn insert(&mut self, worker: u32, hashes: &[u64], added: impl FnMut(u64)) {
        self.0.insert_reporting(worker, hashes, added);
    }

    /// Evicts `worker`'s least recently used blocks down to `bound`; returns them.
    pub(super) fn evict_worker_to(&mut self, worker: u32, bound: u64) -> Vec<u64> {
        self.0.evict_worker_to(worker, bound)
    }

    /// Evicts the least recently used entries down to `max` in all; returns them as `(hash, worker)`.
    pub(super) fn evict_total_to(&mut self, max: u64) -> Vec<(u64, u32)> {
        self.0.evict_total_to(max)
    }

    /// `worker` no longer holds `hashes`; returns how many blocks it held of them.
    pub(super) fn remove(&mut self, worker: u32, hashes: &[u64]) -> u64 {
        let before = self.0.size_of(worker);
        for &h in hashes {
            self.0.remove(h, worker);
        }
        before.saturating_sub(self.0.size_of(worker))
    }

    /// Forgets every block of `worker` (it is no longer registered: no eviction is sent).
    pub(super) fn remove_worker(&mut self, worker: u32) {
        self.0.remove_worker(worker);
    }
}
