//! Passive health: workers whose requests fail are taken out of rotation for a while
//! (sglang-router's circuit breaker: `cb_failure_threshold` consecutive failures open it for
//! `cb_timeout_duration_secs`). Each VM keeps its own view and shares opened breakers with
//! the other VMs through one shared-data value, merged on the tick.

use std::collections::HashMap;

use kvmesh_core::WorkerId;

use crate::shared::{update, SharedStore};

const KEY: &str = "kvmesh.breakers";

#[derive(Default)]
pub struct Health {
    failures: HashMap<WorkerId, u32>,
    /// Worker → second until which it is out of rotation.
    open_until: HashMap<WorkerId, u64>,
    threshold: u32,
    open_secs: u64,
}

impl Health {
    pub fn new(threshold: u32, open_secs: u64) -> Self {
        Self { threshold: threshold.max(1), open_secs, ..Self::default() }
    }

    /// Whether `worker` may receive requests at `now` (seconds).
    pub fn available(&self, worker: WorkerId, now: u64) -> bool {
        self.open_until.get(&worker).is_none_or(|&until| now >= until)
    }

    /// Records a failed request; returns true when this opened the breaker.
    pub fn failure(&mut self, store: &dyn SharedStore, worker: WorkerId, now: u64) -> bool {
        let n = self.failures.entry(worker).or_default();
        *n += 1;
        if *n < self.threshold {
            return false;
        }
        *n = 0;
        let until = now + self.open_secs;
        self.open_until.insert(worker, until);
        update(store, KEY, |value| {
            let mut entries = decode(value);
            entries.retain(|(w, u)| *w != worker && *u > now);
            entries.push((worker, until));
            *value = encode(&entries);
        });
        true
    }

    pub fn success(&mut self, worker: WorkerId) {
        self.failures.remove(&worker);
    }

    /// Adopts the breakers other VMs opened.
    pub fn sync(&mut self, store: &dyn SharedStore) {
        for (worker, until) in decode(&store.get(KEY).0.unwrap_or_default()) {
            let mine = self.open_until.entry(worker).or_default();
            *mine = (*mine).max(until);
        }
    }
}

fn decode(value: &[u8]) -> Vec<(WorkerId, u64)> {
    value
        .chunks_exact(12)
        .filter_map(|c| {
            let (worker, until) = c.split_at_checked(4)?;
            Some((u32::from_le_bytes(worker.try_into().ok()?), u64::from_le_bytes(until.try_into().ok()?)))
        })
        .collect()
}

fn encode(entries: &[(WorkerId, u64)]) -> Vec<u8> {
    entries.iter().flat_map(|(w, u)| w.to_le_bytes().into_iter().chain(u.to_le_bytes())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    fn threshold_opens_for_a_while_and_other_vms_learn_it() {
        let store = FakeStore::default();
        let mut a = Health::new(2, 30);
        let mut b = Health::new(2, 30);
        assert!(!a.failure(&store, 7, 100));
        assert!(a.available(7, 100));
        assert!(a.failure(&store, 7, 101));
        assert!(!a.available(7, 120) && a.available(7, 131));
        assert!(b.available(7, 120));
        b.sync(&store);
        assert!(!b.available(7, 120));
    }

    #[test]
    fn success_resets_the_count() {
        let store = FakeStore::default();
        let mut h = Health::new(2, 30);
        h.failure(&store, 1, 0);
        h.success(1);
        assert!(!h.failure(&store, 1, 0));
        assert!(h.available(1, 0));
    }
}
