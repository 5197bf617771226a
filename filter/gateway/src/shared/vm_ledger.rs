//! `kvmesh.vms` and `kvmesh.vm.<id>`: the registered VMs and what each has in flight, so that
//! the counts of a VM that died are taken back by one survivor.

use kvmesh_core::WorkerId;

use super::{u32_at, u64_at, update, SharedStore};

/// What each VM has in flight, published with a heartbeat, so that the counts of a VM that
/// died (a trap, out of memory: Envoy replaces it, and its streams' `on_log` never runs) can be
/// taken back out of [`Inflight`] by the VMs that live on.
///
/// - `kvmesh.vms`: the registered VM ids (4 bytes each), changed by compare-and-swap;
/// - `kvmesh.vm.<id>`: that VM's heartbeat (ms) and `(worker, in flight)` pairs.
///
/// A VM silent for longer than [`VmLedger::STALE_MS`] is taken off the registry by CAS — so
/// exactly one survivor does it — and that survivor subtracts the dead VM's last published
/// counts. The error is bounded by what changed in its last heartbeat interval.
pub struct VmLedger;

impl VmLedger {
    const REGISTRY: &'static str = "kvmesh.vms.v1";
    /// Far above any single callback (a 256 MiB body is parsed in about 3 s).
    pub const STALE_MS: u64 = 10_000;

    fn key(vm: u32) -> String {
        format!("kvmesh.vm.v1.{vm:08x}")
    }

    /// The registered VMs (one read).
    pub fn registered(store: &dyn SharedStore) -> Vec<u32> {
        let value = store.get(Self::REGISTRY).0.unwrap_or_default();
        value.chunks_exact(4).filter_map(|c| u32_at(c, 0)).collect()
    }

    /// Registers `vm` if it is not (yet, or any more: a VM that was merely slow comes back).
    /// Checked once a second, not on every publish. Returns the VMs registered then.
    pub fn register(store: &dyn SharedStore, vm: u32) -> Vec<u32> {
        let mut ids = Self::registered(store);
        if !ids.contains(&vm) {
            update(store, Self::REGISTRY, |value| {
                ids = value.chunks_exact(4).filter_map(|c| u32_at(c, 0)).collect();
                if !ids.contains(&vm) {
                    value.extend_from_slice(&vm.to_le_bytes());
                    ids.push(vm);
                }
            });
        }
        ids
    }

    /// Publishes `vm`'s in-flight counts with a heartbeat at `now_ms` (one write).
    pub fn publish(store: &dyn SharedStore, vm: u32, now_ms: u64, counts: &[(WorkerId, u32)]) {
        let mut value = now_ms.to_le_bytes().to_vec();
        for &(worker, n) in counts {
            value.extend_from_slice(&worker.to_le_bytes());
            value.extend_from_slice(&n.to_le_bytes());
        }
        let _ = store.set(&Self::key(vm), &value, None);
    }

    /// Refreshes the heartbeat of every registered VM, keeping its counts (by CAS: a VM that
    /// publishes meanwhile is alive anyway). For a host whose plugins cannot die apart from
    /// their process — the native build, whose idle threads do not tick — so that none is
    /// taken for dead, its requests in flight subtracted, while it holds them.
    pub fn keep_alive(store: &dyn SharedStore, now_ms: u64) {
        for vm in Self::registered(store) {
            let key = Self::key(vm);
            let (value, cas) = store.get(&key);
            let mut value = value.unwrap_or_default();
            if value.len() < 8 {
                value = vec![0; 8];
            }
            if let Some(heartbeat) = value.get_mut(..8) {
                heartbeat.copy_from_slice(&now_ms.to_le_bytes());
            }
            let _ = store.set(&key, &value, cas);
        }
    }

    /// Takes every VM silent since `now_ms - STALE_MS` (other than `me`) off the registry;
    /// returns the in-flight counts of those this call took off (to be subtracted).
    pub fn reap(store: &dyn SharedStore, me: u32, now_ms: u64) -> Vec<(WorkerId, u32)> {
        let mut out = Vec::new();
        for vm in Self::registered(store).into_iter().filter(|&vm| vm != me) {
            let value = store.get(&Self::key(vm)).0.unwrap_or_default();
            let heartbeat = u64_at(&value, 0).unwrap_or(0);
            if now_ms.saturating_sub(heartbeat) <= Self::STALE_MS {
                continue;
            }
            // Off the registry by CAS: whoever succeeds owns the subtraction.
            let (reg, cas) = store.get(Self::REGISTRY);
            let reg = reg.unwrap_or_default();
            let kept: Vec<u8> =
                reg.chunks_exact(4).filter(|c| u32_at(c, 0) != Some(vm)).flat_map(|c| c.to_vec()).collect();
            if kept.len() == reg.len() || store.set(Self::REGISTRY, &kept, cas).is_err() {
                continue; // another VM took it off first (or it raced): not ours to subtract
            }
            let entries = value.get(8..).unwrap_or_default();
            out.extend(entries.chunks_exact(8).filter_map(|c| Some((u32_at(c, 0)?, u32_at(c, 4)?))));
            let _ = store.set(&Self::key(vm), &[], None);
        }
        out
    }

    /// For a host whose plugins tick only while their streams run (the native build's worker
    /// threads), a stand-in `me` keeps every registered VM's heartbeat fresh, so that a thread
    /// idle under a long request is never taken for dead and its counts subtracted (a thread
    /// cannot die apart from Envoy); registered itself, it also keeps every thread from taking
    /// itself for its Envoy's only VM. Once a second.
    pub fn stand_in(store: &dyn SharedStore, me: u32, now_ms: u64) {
        Self::register(store, me);
        Self::publish(store, me, now_ms, &[]);
        Self::keep_alive(store, now_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeStore;
    use super::*;

    /// The native build: a thread that does not tick keeps its counts while kept alive.
    #[test]
    fn a_vm_kept_alive_is_never_reaped_and_keeps_its_counts() {
        let store = FakeStore::default();
        VmLedger::register(&store, 1);
        VmLedger::register(&store, 2);
        VmLedger::publish(&store, 1, 1_000, &[(7, 2)]);
        VmLedger::publish(&store, 2, 1_000, &[]);
        for t in (2_000..=60_000).step_by(1_000) {
            VmLedger::keep_alive(&store, t);
            assert!(VmLedger::reap(&store, 2, t).is_empty(), "VM 1 is idle, not dead, at {t}");
        }
        assert_eq!(VmLedger::registered(&store), vec![1, 2]);
        let value = store.get(&VmLedger::key(1)).0.unwrap();
        assert_eq!((u64_at(&value, 0), u32_at(&value, 8), u32_at(&value, 12)), (Some(60_000), Some(7), Some(2)));
    }

    #[test]
    fn a_dead_vms_counts_are_taken_back_once() {
        let store = FakeStore::default();
        assert_eq!(VmLedger::register(&store, 1), vec![1], "alone");
        assert_eq!(VmLedger::register(&store, 2), vec![1, 2]);
        assert_eq!(VmLedger::register(&store, 3), vec![1, 2, 3]);
        assert_eq!(VmLedger::register(&store, 1), vec![1, 2, 3], "once");
        VmLedger::publish(&store, 1, 1_000, &[(7, 3), (8, 1)]);
        VmLedger::publish(&store, 2, 1_000, &[]);
        VmLedger::publish(&store, 3, 1_000, &[]);
        // VM 1 dies; 2 and 3 keep publishing.
        for t in [5_000, 9_000, 11_500] {
            VmLedger::publish(&store, 2, t, &[]);
            VmLedger::publish(&store, 3, t, &[]);
        }
        assert!(VmLedger::reap(&store, 2, 9_000).is_empty(), "not stale yet");
        let mut taken = VmLedger::reap(&store, 2, 11_500);
        taken.sort();
        assert_eq!(taken, vec![(7, 3), (8, 1)]);
        assert!(VmLedger::reap(&store, 3, 11_600).is_empty(), "taken back once only");
        assert_eq!(VmLedger::registered(&store), vec![2, 3]);
        // A VM that was merely slow registers again on its next heartbeat.
        assert_eq!(VmLedger::register(&store, 1), vec![2, 3, 1]);
        VmLedger::publish(&store, 1, 12_000, &[(7, 1)]);
        assert_eq!(VmLedger::registered(&store), vec![2, 3, 1]);
    }
}
