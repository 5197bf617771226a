//! What the engines' own KV events say a worker holds (`crate::kv_events` re-keys them onto
//! the gateways' block chain): those blocks enter the global index for that worker, and
//! leave it when the engine removes them, and go out to every gateway in the next delta as
//! any report's inserts and evictions do. Entries from events and from routed reports are
//! the same entries: the engine removing a block removes it whatever put it there.

use std::collections::HashMap;

use kvmesh_core::blocks::model_seed;
use kvmesh_core::models::{ModelRules, Pools, ServedModel};

use super::store::State;

/// The origin the inserts from engine events carry in deltas.
pub const ENGINE_ORIGIN: &str = "kv-events";

impl State {
    /// Worker `worker` holds gateway blocks `hashes` (from its engine's events); returns
    /// false when it is not registered (the blocks are dropped).
    pub fn engine_stored(&self, worker: u32, hashes: &[u64]) -> bool {
        let mut inner = self.lock();
        let (registry, index, publication, _) = inner.parts();
        if !registry.contains(worker) {
            return false;
        }
        let mut added = Vec::new();
        index.insert(worker, hashes, |h| added.push(h));
        publication.inserted(worker, added, ENGINE_ORIGIN);
        let max = self.settings.limits.max_index_entries;
        if index.entries() > max.saturating_add(max / 8) {
            let out = index.evict_total_to(max);
            self.counters.evicted_blocks.inc_by(out.len() as u64);
            publication.evicted_entries(out);
        }
        true
    }

    /// Worker `worker`'s engine no longer holds gateway blocks `hashes`.
    pub fn engine_removed(&self, worker: u32, hashes: Vec<u64>) {
        if hashes.is_empty() {
            return;
        }
        let mut inner = self.lock();
        let (registry, index, publication, _) = inner.parts();
        if !registry.contains(worker) {
            return;
        }
        let gone = index.remove(worker, &hashes);
        self.counters.evicted_blocks.inc_by(gone);
        publication.evicted(worker, hashes);
    }

    /// The first block's seed of every registered worker's pool, as a gateway keys a request
    /// for the model it serves (a worker whose pool does not resolve is left out). The pools
    /// are built once for all workers: O(workers), as it runs every 200 ms under the lock.
    pub fn engine_seeds(&self) -> HashMap<u32, u64> {
        let inner = self.lock();
        let rules = ModelRules::from_settings(&self.settings.routing).unwrap_or_default();
        let served: Vec<(u32, Vec<ServedModel>)> = inner.registry().entries().map(|w| (w.id, w.served())).collect();
        let pools = Pools::new(served.iter().map(|(_, m)| &m[..]), &rules);
        served
            .iter()
            .filter_map(|(id, own)| {
                let name = own.first().map(|m| m.id.as_str());
                Some((*id, model_seed(pools.resolve(name).ok()?.key)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::state::reports::tests::held;
    use crate::state::workers::tests::state;

    #[test]
    fn engine_blocks_enter_and_leave_the_index_and_go_out_in_deltas() {
        let s = state(&["--worker-urls", "http://127.0.0.1:2"]);
        let id = s.workers()[0].id;
        assert!(s.engine_stored(id, &[1, 2, 3]));
        assert_eq!(held(&s, id, &[1, 2, 3]), vec![1, 2, 3]);
        s.engine_removed(id, vec![3]);
        assert_eq!(held(&s, id, &[1, 2, 3]), vec![1, 2]);
        assert!(!s.engine_stored(999, &[4]), "unknown workers are refused");
        let seeds = s.engine_seeds();
        assert!(seeds.contains_key(&id));
        assert_eq!(seeds.len(), 1, "only registered workers have a seed");
    }
}
