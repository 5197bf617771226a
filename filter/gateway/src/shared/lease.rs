//! `kvmesh.cp.lease`: which VM of this Envoy holds the control-plane streams.

use super::{u32_at, u64_at, SharedStore};

/// The control-plane stream ownership: one VM per Envoy holds a lease in shared data, renews
/// it on every tick, and another takes over when it lapses.
pub struct Lease;

impl Lease {
    const KEY: &'static str = "kvmesh.cp.lease.v1";

    /// Takes or renews the lease for `vm` until `now_ms + ttl_ms` when it is free, lapsed or
    /// already `vm`'s. True when `vm` holds it afterwards.
    pub fn hold(store: &dyn SharedStore, vm: u32, now_ms: u64, ttl_ms: u64) -> bool {
        let (value, cas) = store.get(Self::KEY);
        if let Some(v) = value {
            let (owner, until) = (u32_at(&v, 0), u64_at(&v, 4).unwrap_or(0));
            if owner != Some(vm) && until > now_ms {
                return false;
            }
        }
        let mut lease = vm.to_le_bytes().to_vec();
        lease.extend_from_slice(&(now_ms + ttl_ms).to_le_bytes());
        if store.set(Self::KEY, &lease, cas).is_err() {
            return false;
        }
        // Two VMs may both have found the key missing: the last writer wins.
        store.get(Self::KEY).0.and_then(|v| u32_at(&v, 0)) == Some(vm)
    }

    /// The VM named in the lease (lapsed or not): for the `test-crash` build's hook that stops
    /// the owner, and for tests.
    #[cfg(any(test, feature = "test-crash"))]
    pub fn owner(store: &dyn SharedStore) -> Option<u32> {
        store.get(Self::KEY).0.and_then(|v| u32_at(&v, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeStore;
    use super::*;

    #[test]
    fn one_vm_holds_the_lease_until_it_lapses() {
        let store = FakeStore::default();
        assert!(Lease::hold(&store, 1, 1000, 3000));
        assert!(!Lease::hold(&store, 2, 2000, 3000), "held by 1 until 4000");
        assert!(Lease::hold(&store, 1, 3000, 3000), "renewed until 6000");
        assert!(!Lease::hold(&store, 2, 5999, 3000));
        assert!(Lease::hold(&store, 2, 6000, 3000), "lapsed: taken over");
        assert!(!Lease::hold(&store, 1, 6001, 3000));
        assert_eq!(Lease::owner(&store), Some(2));
    }
}
