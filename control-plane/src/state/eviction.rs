//! Evictions from the global index: every worker to its bound (the periodic eviction), one
//! worker to a KV capacity it newly reported (at once), all of one worker's (its cache was
//! emptied by worker administration). They go out in the next delta, so that every filter
//! forgets them too.

use super::global_index::GlobalIndex;
use super::store::State;

impl State {
    /// LRU-evicts every worker's index to its bound (its KV capacity within
    /// `max_tree_size`); the evictions go out in the next delta.
    pub fn evict(&self) -> usize {
        let bounds: Vec<(u32, u64)> = {
            let inner = self.lock();
            inner.index().workers().into_iter().map(|w| (w, self.bound_of(&inner, w))).collect()
        };
        self.evict_with(|index| {
            bounds
                .iter()
                .flat_map(|&(w, bound)| index.evict_worker_to(w, bound).into_iter().map(move |h| (h, w)))
                .collect()
        })
    }

    /// What worker `id` reported as its KV capacity (None: it does not say). A smaller
    /// capacity than before evicts its least recently used blocks at once.
    pub fn capacity_result(&self, id: u32, tokens: Option<u64>) {
        let bound = {
            let mut inner = self.lock();
            let Some(w) = inner.registry_mut().get_mut(id) else { return };
            if w.kv_capacity_reported == tokens {
                return;
            }
            tracing::info!(url = %w.url, ?tokens, "worker KV capacity");
            w.kv_capacity_reported = tokens;
            self.bound_of(&inner, id)
        };
        self.evict_with(|index| index.evict_worker_to(id, bound).into_iter().map(|h| (h, id)).collect());
    }

    /// Forgets one worker's part of the global index (its cache was emptied); the evictions
    /// go out in the next delta, so every filter forgets it too.
    pub fn forget_worker_index(&self, id: u32) -> usize {
        self.evict_with(|index| index.evict_worker_to(id, 0).into_iter().map(|h| (h, id)).collect())
    }

    /// Runs `evict` on the index; its evictions are counted and go out in the next delta.
    fn evict_with(&self, evict: impl FnOnce(&mut GlobalIndex) -> Vec<(u64, u32)>) -> usize {
        let mut inner = self.lock();
        let (_, index, publication, _) = inner.parts();
        let evicted = evict(index);
        let n = evicted.len();
        publication.evicted_entries(evicted);
        drop(inner);
        self.counters.evicted_blocks.inc_by(n as u64);
        n
    }
}

#[cfg(test)]
mod tests {
    use crate::state::reports::tests::{held, insert};
    use crate::state::workers::tests::state;
    use kvmesh_proto::v1::{IndexInsert, ReportBatch};

    #[test]
    fn eviction_bounds_the_index_and_is_published() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "--max-tree-size", "64", "--block-size", "16"]);
        s.publish();
        let mut rx = s.subscribe();
        s.report(ReportBatch {
            gateway_id: "a".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: (0..10).collect(), ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.evict(), 6);
        s.publish();
        let d = rx.try_recv().unwrap();
        assert_eq!(d.evictions[0].hashes.len(), 6);
        assert_eq!(s.index_stats().0, 4);
    }

    #[test]
    fn forgetting_a_workers_index_evicts_its_entries_only_and_tells_the_filters() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        s.publish();
        let mut rx = s.subscribe();
        for worker in [0, 1] {
            s.report(ReportBatch {
                gateway_id: "a".into(),
                inserts: vec![IndexInsert { worker, hashes: (0..5).collect(), ..Default::default() }],
                ..Default::default()
            });
        }
        s.publish();
        let _ = rx.try_recv();
        assert_eq!(s.forget_worker_index(1), 5);
        assert_eq!(s.index_stats().0, 5, "worker 0's entries stay");
        s.publish();
        let d = rx.try_recv().unwrap();
        assert_eq!(d.evictions.iter().map(|e| (e.worker, e.hashes.len())).collect::<Vec<_>>(), [(1, 5)]);
    }

    #[test]
    fn prefix_hash_workers_are_evicted_to_the_lru_capacity_per_server() {
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--policy",
            "prefix_hash",
            "--lru-capacity-per-server",
            "3",
        ]);
        let hashes: Vec<u64> = (1..=10).collect();
        s.report(ReportBatch {
            gateway_id: "g".into(),
            inserts: vec![IndexInsert { worker: 0, hashes, ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.index_size_of(0), 10);
        assert_eq!(s.evict(), 7);
        assert_eq!(s.index_size_of(0), 3);
    }

    #[test]
    fn each_worker_is_bounded_to_its_capacity_evicting_by_last_use() {
        // Worker 0: 64 tokens = 256 bytes = 8 blocks of 32 bytes. Worker 1: no capacity known.
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            "--worker-kv-capacity",
            "http://127.0.0.1:1=64",
        ]);
        let mut rx = s.subscribe();
        s.publish();
        let _ = rx.try_recv();
        insert(&s, 0, &[1, 2, 3, 4, 5, 6]); // prefix A
        insert(&s, 0, &[11, 12, 13, 14]); // prefix B: 10 blocks, A's two deepest go
        assert_eq!(s.index_size_of(0), 8);
        assert_eq!(held(&s, 0, &[1, 2, 3, 4, 5, 6]), vec![1, 2, 3, 4]);
        insert(&s, 0, &[1, 2, 3]); // a request on A's first blocks: used again
        insert(&s, 0, &[21, 22, 23]); // prefix C: the three least recently used go
        assert_eq!(held(&s, 0, &[1, 2, 3, 4, 11, 12, 13, 14, 21, 22, 23]), vec![1, 2, 3, 11, 12, 21, 22, 23]);
        assert_eq!(s.index_tokens_of(0), 64, "within the capacity");
        for i in 0..100u64 {
            insert(&s, 1, &[1000 + i]);
        }
        assert_eq!(s.index_size_of(1), 100, "unbounded but for --max-tree-size");
        // The filters are told.
        s.publish();
        let d = rx.try_recv().unwrap();
        let mut evicted: Vec<u64> =
            d.evictions.iter().filter(|e| e.worker == 0).flat_map(|e| e.hashes.clone()).collect();
        evicted.sort_unstable();
        assert_eq!(evicted, vec![4, 5, 6, 13, 14]);
        // A capacity reported later (16 tokens: 2 blocks) applies at once.
        s.capacity_result(1, Some(16));
        assert_eq!(s.index_size_of(1), 2);
        assert_eq!(held(&s, 1, &[1098, 1099]), vec![1098, 1099], "the most recent stay");
        // The override wins over what the worker says.
        s.capacity_result(0, Some(1 << 20));
        insert(&s, 0, &[31, 32]);
        assert_eq!(s.index_size_of(0), 8);
    }
}
