//! `kvmesh.models.v1` and `kvmesh.tenant_series.v1`: the `model` and `tenant` label values
//! this Envoy's VMs have given out, so that the bound on labelled series
//! ([`crate::host::MAX_LABEL_SERIES`]) holds for the whole Envoy, not for each of its VMs. A
//! value is the labels, each followed by a line feed (a label holds none,
//! [`crate::host::Labels`]). A VM reads it only when it meets a label it has not given out
//! itself: once per label and VM.

use super::{update, SharedStore};

/// Where the `model` labels live in shared data.
pub const MODEL_SERIES_KEY: &str = "kvmesh.models.v1";
/// Where the `tenant` labels live (issue 47).
pub const TENANT_SERIES_KEY: &str = "kvmesh.tenant_series.v1";

/// Whether `label` has (or now gets) a series of its own under `key`, `max` labels at most
/// for the Envoy.
pub fn admit(store: &dyn SharedStore, key: &str, label: &str, max: usize) -> bool {
    let listed = |v: &[u8]| v.split(|&b| b == b'\n').any(|l| l == label.as_bytes());
    if store.get(key).0.is_some_and(|v| listed(&v)) {
        return true;
    }
    let mut admitted = false;
    let written = update(store, key, |v| {
        admitted = listed(v);
        if !admitted && v.iter().filter(|&&b| b == b'\n').count() < max {
            v.extend_from_slice(label.as_bytes());
            v.push(b'\n');
            admitted = true;
        }
    });
    written && admitted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    fn the_bound_is_the_envoys() {
        let store = FakeStore::default();
        assert!(admit(&store, MODEL_SERIES_KEY, "a", 2));
        assert!(admit(&store, MODEL_SERIES_KEY, "a", 2), "again");
        assert!(admit(&store, MODEL_SERIES_KEY, "b", 2));
        assert!(!admit(&store, MODEL_SERIES_KEY, "c", 2), "a third label for the Envoy");
        assert!(admit(&store, MODEL_SERIES_KEY, "b", 2), "one given out stays");
    }
}

#[cfg(test)]
mod tenant_tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    fn each_key_has_its_own_bound() {
        let store = FakeStore::default();
        assert!(admit(&store, MODEL_SERIES_KEY, "a", 1));
        assert!(admit(&store, TENANT_SERIES_KEY, "t", 1), "tenants count apart from models");
        assert!(!admit(&store, TENANT_SERIES_KEY, "u", 1));
    }
}
