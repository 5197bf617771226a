//! Data-parallel ranks (`--dp-aware`, as sglang-router and SMG): a regular worker whose
//! `/get_server_info` says `dp_size` N (2 to [`MAX_DP_SIZE`]) is registered as N entries,
//! `URL@0` .. `URL@N-1` — one per rank, same URL, each with an id of its own (never reused), so
//! that its load, in-flight counts, breaker and prefix index are the rank's. The filters write
//! the rank into the body they send (`data_parallel_rank`). What is probed is the worker (one
//! health check and one load poll for all its ranks, [`State::ranks_of`]); a new `dp_size`
//! registers the worker again with the new ranks.

use kvmesh_core::dp::MAX_DP_SIZE;
use kvmesh_proto::v1::Role;

use super::registry::Registry;
use super::store::State;
use super::worker::Pressure;

/// One rank's entry of SGLang's `/get_load` list, with its KV usage from `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankLoad {
    pub rank: u32,
    /// Running and waiting requests (`num_reqs`).
    pub load: Option<u64>,
    /// Waiting requests (`num_waiting_reqs`).
    pub waiting: Option<u64>,
    /// `sglang:token_usage{dp_rank="N"}`: the rank's own KV cache use (0..1).
    pub kv_usage: Option<f64>,
}

/// The ids registered for the worker at `url` (all its ranks, or its one entry).
fn entries_at(registry: &Registry, url: &str) -> Vec<u32> {
    registry.entries().filter(|w| w.url == url).map(|w| w.id).collect()
}

impl State {
    /// The entries worker `id` stands for when probed: all the ranks of its worker (itself
    /// alone when it has none), with their ranks.
    pub fn ranks_of(&self, id: u32) -> Vec<(u32, Option<u32>)> {
        let inner = self.lock();
        let Some(w) = inner.registry().get(id) else { return Vec::new() };
        if w.dp_rank.is_none() {
            return vec![(id, None)];
        }
        inner
            .registry()
            .entries()
            .filter(|o| o.url == w.url && o.dp_rank.is_some())
            .map(|o| (o.id, o.dp_rank))
            .collect()
    }

    /// What worker `id`'s `/get_server_info` says of its `dp_size` (none: nothing). With
    /// `--dp-aware`, a regular worker is registered again as that many ranks when it has
    /// another number of them (1: one target again); a `dp_size` above [`MAX_DP_SIZE`] is
    /// ignored with a warning. Whether the worker was registered again.
    pub fn dp_size_result(&self, id: u32, dp_size: Option<u64>) -> bool {
        let Some(n) = dp_size.filter(|_| self.settings.dp_aware) else { return false };
        let mut inner = self.lock();
        let Some(template) = inner.registry().get(id).filter(|w| w.role == Role::Regular).cloned() else {
            return false;
        };
        if n == 0 || n > u64::from(MAX_DP_SIZE) {
            tracing::warn!(url = %template.url, dp_size = n, max = MAX_DP_SIZE, "worker's dp_size ignored");
            return false;
        }
        let wanted: Vec<Option<u32>> = if n == 1 { vec![None] } else { (0..n as u32).map(Some).collect() };
        let old = entries_at(inner.registry(), &template.url);
        let mut have: Vec<Option<u32>> =
            old.iter().filter_map(|&i| inner.registry().get(i)).map(|w| w.dp_rank).collect();
        have.sort_unstable();
        if have == wanted {
            return false;
        }
        let (registry, index, publication, _) = inner.parts();
        for &old_id in &old {
            registry.remove(old_id);
            index.remove_worker(old_id);
        }
        let mut ids = Vec::with_capacity(wanted.len());
        for rank in wanted {
            // Its id: the one the state file kept for `URL@rank`, else a new one.
            let name = match rank {
                Some(r) => format!("{}@{r}", template.url),
                None => template.url.clone(),
            };
            let entry = template.rank_of(registry.new_id(&name), rank);
            ids.push(entry.id);
            registry.insert(entry);
        }
        publication.workers_changed();
        drop(inner);
        tracing::info!(url = %template.url, dp_size = n, ?ids, "worker's data-parallel ranks registered");
        self.persist();
        true
    }

    /// What one load poll of worker `id` found, for each entry it stands for: `(id, load,
    /// waiting)`, a rank's own `/get_load` entry where there is one, else the worker's totals.
    pub fn rank_loads(
        &self,
        id: u32,
        load: Option<u64>,
        pressure: Pressure,
        ranks: &[RankLoad],
    ) -> Vec<(u32, Option<u64>, Pressure)> {
        self.ranks_of(id)
            .into_iter()
            .map(|(entry, rank)| match rank.and_then(|r| ranks.iter().find(|l| l.rank == r)) {
                Some(own) => {
                    let waiting = own.waiting.or(pressure.waiting);
                    (entry, own.load.or(load), Pressure { waiting, kv_usage: own.kv_usage.or(pressure.kv_usage) })
                }
                None => (entry, load, pressure),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::workers::tests::state;

    fn names(s: &State) -> Vec<(String, u32, Option<u32>)> {
        s.workers().into_iter().map(|w| (w.name(), w.id, w.dp_rank)).collect()
    }

    #[test]
    fn with_dp_aware_a_worker_becomes_its_ranks_with_ids_of_their_own() {
        let s = state(&["--dp-aware", "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        s.publish();
        s.dp_size_result(0, Some(2));
        let url = |r: u32| format!("http://127.0.0.1:1@{r}");
        assert_eq!(
            names(&s),
            [("http://127.0.0.1:2".into(), 1, None), (url(0), 2, Some(0)), (url(1), 3, Some(1))],
            "two ranks with new ids (the old one's index entries named the whole worker)"
        );
        assert!(s.publish().is_some(), "the filters hear of it");
        assert_eq!(s.ranks_of(3), [(2, Some(0)), (3, Some(1))], "probed as one worker");
        assert_eq!(s.ranks_of(1), [(1, None)]);
        // The same dp_size again changes nothing; another one registers the ranks again.
        s.dp_size_result(2, Some(2));
        assert_eq!(names(&s).len(), 3);
        s.dp_size_result(2, Some(3));
        assert_eq!(
            names(&s).iter().filter(|(_, _, r)| r.is_some()).map(|(_, id, _)| *id).collect::<Vec<_>>(),
            [4, 5, 6]
        );
        // Hostile or broken answers are ignored.
        for bad in [0, 65, u64::MAX] {
            s.dp_size_result(4, Some(bad));
            assert_eq!(names(&s).len(), 4, "dp_size {bad}");
        }
        // dp_size 1: one target again; removing the URL removes every rank.
        s.dp_size_result(4, Some(1));
        assert_eq!(names(&s).last().unwrap().2, None);
        s.dp_size_result(1, Some(4));
        assert!(s.remove_worker("http://127.0.0.1:2"));
        assert_eq!(names(&s), [("http://127.0.0.1:1".into(), 7, None)]);
    }

    #[test]
    fn without_dp_aware_or_for_pd_workers_nothing_changes() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        s.dp_size_result(0, Some(2));
        assert_eq!(names(&s), [("http://127.0.0.1:1".into(), 0, None)]);
        let s = state(&["--dp-aware", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]);
        s.dp_size_result(0, Some(2));
        s.dp_size_result(1, Some(2));
        assert_eq!(names(&s).len(), 2);
        assert!(s.settings.warnings.iter().any(|w| w.starts_with("--dp-aware: no effect on PD")));
    }

    #[test]
    fn each_rank_gets_its_own_load_from_get_load() {
        let s = state(&["--dp-aware", "--worker-urls", "http://127.0.0.1:1"]);
        s.dp_size_result(0, Some(3));
        let ranks = [
            RankLoad { rank: 0, load: Some(5), waiting: Some(1), kv_usage: Some(0.9) },
            RankLoad { rank: 1, load: Some(0), waiting: None, kv_usage: Some(0.1) },
        ];
        let total = Pressure { waiting: Some(1), kv_usage: Some(0.9) };
        let got = s.rank_loads(1, Some(5), total, &ranks);
        let p = |waiting, kv_usage| Pressure { waiting, kv_usage };
        let want = [
            (1, Some(5), p(Some(1), Some(0.9))),
            (2, Some(0), p(Some(1), Some(0.1))),
            (3, Some(5), p(Some(1), Some(0.9))),
        ];
        assert_eq!(got, want, "rank 2 is not listed: the worker's totals");
    }
}
