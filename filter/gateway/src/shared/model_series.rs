//! `kvmesh.models.v1`: the `model` label values this Envoy's VMs have given out, so that the
//! bound on per-model series ([`crate::host::MAX_MODEL_SERIES`]) holds for the whole Envoy,
//! not for each of its VMs. The value is the labels, each followed by a line feed (a label
//! holds none, [`crate::host::ModelLabels`]). A VM reads it only when it meets a label it
//! has not given out itself: once per model and VM.

use super::{update, SharedStore};

/// Where the labels live in shared data.
pub const MODEL_SERIES_KEY: &str = "kvmesh.models.v1";

/// Whether `label` has (or now gets) a series of its own, `max` labels at most for the Envoy.
pub fn admit(store: &dyn SharedStore, label: &str, max: usize) -> bool {
    let listed = |v: &[u8]| v.split(|&b| b == b'\n').any(|l| l == label.as_bytes());
    if store.get(MODEL_SERIES_KEY).0.is_some_and(|v| listed(&v)) {
        return true;
    }
    let mut admitted = false;
    let written = update(store, MODEL_SERIES_KEY, |v| {
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
        assert!(admit(&store, "a", 2));
        assert!(admit(&store, "a", 2), "again");
        assert!(admit(&store, "b", 2));
        assert!(!admit(&store, "c", 2), "a third label for the Envoy");
        assert!(admit(&store, "b", 2), "one given out stays");
    }
}
