//! `kvmesh.breakers`: every worker's circuit breaker and failover count, as the core's
//! [`BreakerTable`] encodes them, changed by compare-and-swap (the logic around it is
//! [`crate::health`]).

use kvmesh_core::breaker::BreakerTable;

use super::{update, SharedStore};

/// The breakers every VM of this Envoy shares.
pub struct SharedBreakers;

impl SharedBreakers {
    pub const KEY: &'static str = "kvmesh.breakers.v1";

    /// The table as stored (empty when there is none).
    pub fn read(store: &dyn SharedStore) -> BreakerTable {
        BreakerTable::decode(&store.get(Self::KEY).0.unwrap_or_default())
    }

    /// Changes the table by compare-and-swap, idle breakers dropped when `prune_at_ms` is
    /// known; returns what `change` returned and the table written, or None when the write did
    /// not go through.
    pub fn update<T>(
        store: &dyn SharedStore,
        prune_at_ms: Option<u64>,
        mut change: impl FnMut(&mut BreakerTable) -> T,
    ) -> Option<(T, BreakerTable)> {
        let mut last = None;
        let written = update(store, Self::KEY, |value| {
            let mut table = BreakerTable::decode(value);
            let out = change(&mut table);
            if let Some(now) = prune_at_ms {
                table.prune(now);
            }
            *value = table.encode();
            last = Some((out, table));
        });
        last.filter(|_| written)
    }
}
