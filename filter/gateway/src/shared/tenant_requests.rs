//! `kvmesh.tenant_requests`: the rest of the fleet's admitted requests per tenant, decayed
//! (issue 47's requests-per-second limit across gateways): kvmesh-cp's sum of every gateway's
//! report less this Envoy's own, written by the stream owner when a snapshot carries it, read
//! by a request of a tenant under that limit ([`super::tenants::hit`]'s `elsewhere`).
//!
//! Format: one table as `kvmesh.tenant_usage`'s (`at_ms u64, count u16`, then entries of
//! `len u8, id, usage f64`); what is read is sanitized.

use kvmesh_core::fleet::Usage;

use super::tenant_usage::{decode_table, encode_table};
use super::SharedStore;

pub const KEY: &str = "kvmesh.tenant_requests.v1";

/// The rest of the fleet's requests (empty while none was shipped).
pub fn rest(store: &dyn SharedStore) -> Usage {
    store.get(KEY).0.map(|v| decode_table(&v, &mut 0)).unwrap_or_default()
}

/// Replaces the rest of the fleet's requests; false when shared data refused every write.
pub fn set_rest(store: &dyn SharedStore, rest: &Usage) -> bool {
    super::update(store, KEY, |value| {
        value.clear();
        encode_table(value, rest);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    fn the_rest_is_replaced_and_garbage_reads_as_none() {
        let store = FakeStore::default();
        assert!(rest(&store).entries.is_empty());
        assert!(set_rest(&store, &Usage::sanitized([("a", 10.0), ("b", 2.0)], 8, 5)));
        assert!(set_rest(&store, &Usage::sanitized([("a", 30.0)], 8, 7)));
        let r = rest(&store);
        assert_eq!((r.get("a", 7), r.get("b", 7), r.at_ms), (30.0, 0.0, 7));
        store.set(KEY, &[9, 9, 9], store.get(KEY).1).unwrap();
        assert!(rest(&store).entries.is_empty());
    }
}
