//! The global prefix index as read: how much of it each worker holds (in blocks and in
//! tokens), which workers hold a text's leading blocks, and the bound each worker is held to
//! there (its KV capacity within `--max-tree-size`; prefix_hash's LRU capacity per server).

use kvmesh_core::blocks::{block_hashes_from, model_seed};
use kvmesh_core::models::{ModelError, ModelRules, Pools, ServedModel};

use super::store::{Locked, State};
use super::worker::WorkerEntry;
use crate::capacity;

impl State {
    /// Blocks worker `id` holds in the index.
    pub fn index_size_of(&self, id: u32) -> u64 {
        self.lock().index().size_of(id)
    }

    /// Tokens' worth of the blocks worker `id` holds in the index.
    pub fn index_tokens_of(&self, id: u32) -> u64 {
        capacity::tokens_of_blocks(&self.settings, self.index_size_of(id))
    }

    /// The index's blocks, and its (worker, block) entries.
    pub fn index_stats(&self) -> (usize, u64) {
        let inner = self.lock();
        (inner.index().len(), inner.index().entries())
    }

    /// Which workers hold leading blocks of `text` (the routing text) for a request naming
    /// `model` (resolved to its pool as the filters do), deepest first: `(worker id, its name,
    /// blocks, the deepest block's hash)`.
    pub fn match_text(&self, text: &[u8], model: Option<&str>) -> Result<Vec<(u32, String, usize, u64)>, ModelError> {
        let inner = self.lock();
        let rules = ModelRules::from_settings(&self.settings.routing).unwrap_or_default();
        let served: Vec<Vec<ServedModel>> = inner.registry().entries().map(|w| w.served()).collect();
        let pools = Pools::new(served.iter().map(|m| &m[..]), &rules);
        let seed = model_seed(pools.resolve(model)?.key);
        let hashes = block_hashes_from(text, self.settings.block_size, seed);
        let mut out: Vec<(u32, String, usize, u64)> = inner
            .index()
            .match_prefix(&hashes)
            .into_iter()
            .filter_map(|m| {
                let deepest = *hashes.get(m.blocks.checked_sub(1)?)?;
                Some((m.worker, inner.registry().get(m.worker)?.name(), m.blocks, deepest))
            })
            .collect();
        out.sort_by_key(|m| std::cmp::Reverse(m.2));
        Ok(out)
    }

    /// A worker's KV capacity in tokens: `--worker-kv-capacity`, else what it reported.
    pub fn kv_capacity(&self, w: &WorkerEntry) -> Option<u64> {
        self.settings.kv_capacity.get(&w.url).copied().or(w.kv_capacity_reported)
    }

    /// The most blocks `worker`'s part of the index may hold.
    pub(super) fn bound_of(&self, inner: &Locked, worker: u32) -> u64 {
        let entry = inner.registry().get(worker);
        let bound = capacity::bound_blocks(&self.settings, entry.and_then(|w| self.kv_capacity(w)));
        match entry {
            // prefix_hash keeps llm-d's per-server LRU capacity.
            Some(w) if self.settings.prefix_hash_roles.contains(&w.role) => {
                bound.min(self.settings.lru_capacity_per_server.max(1))
            }
            _ => bound,
        }
    }
}
