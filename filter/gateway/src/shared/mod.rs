//! Envoy shared data: the state the VMs (one per Envoy worker thread) of one plugin share,
//! behind the small [`SharedStore`] trait so that the logic is testable natively. One file per
//! key or family of keys, each with its value's format; [`KEYS`] lists them all.
//!
//! Values are small byte strings (the host copies a value in and out on every access). Each
//! key names the version of its value's format (`.v1`): a change of format bumps it, so that
//! the VMs of an older and a newer build sharing one Envoy (a rolling upgrade with the same
//! `vm_id`) never read each other's values.

pub mod admission;
mod breakers;
mod delta_log;
#[cfg(test)]
pub mod fake;
pub mod feedback;
mod gateway_id;
mod inflight;
mod lease;
pub mod series;
mod table;
pub mod tenant_requests;
pub mod tenant_tokens;
pub mod tenant_usage;
pub mod tenants;
mod vm_ledger;

pub use breakers::SharedBreakers;
pub use delta_log::{Delta, DeltaLog};
pub use gateway_id::gateway_id;
pub use inflight::{Counts, Ended, EndedBy, Inflight};
pub use lease::Lease;
pub use table::{Polled, SharedTable};
pub use vm_ledger::VmLedger;

/// Why a write to shared data failed.
#[derive(Debug, PartialEq, Eq)]
pub enum SetError {
    /// Another VM wrote the key since we read it.
    CasMismatch,
    Other,
}

/// Envoy's shared data (or a fake): values with a version for compare-and-swap.
pub trait SharedStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
}

pub(crate) const CAS_RETRIES: usize = 32;

/// Reads `key`, applies `update` and writes it back with compare-and-swap, retrying on
/// conflicts. Returns whether the write went through.
pub fn update(store: &dyn SharedStore, key: &str, mut update: impl FnMut(&mut Vec<u8>)) -> bool {
    for _ in 0..CAS_RETRIES {
        let (value, cas) = store.get(key);
        let mut value = value.unwrap_or_default();
        update(&mut value);
        match store.set(key, &value, cas) {
            Ok(()) => return true,
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Other) => return false,
        }
    }
    false
}

pub(crate) fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

pub(crate) fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}
/// Every key (a pattern where the key names a VM or a slot) and the file that owns it.
/// `docs/ARCHITECTURE.md` lists the same keys; a test checks that both agree.
pub const KEYS: &[(&str, &str)] = &[
    ("kvmesh.state.v3", "inflight.rs"),
    ("kvmesh.log.v1.<slot>", "delta_log.rs"),
    ("kvmesh.vms.v1", "vm_ledger.rs"),
    ("kvmesh.vm.v1.<vm>", "vm_ledger.rs"),
    ("kvmesh.cp.lease.v1", "lease.rs"),
    ("kvmesh.cp.version.v1", "table.rs"),
    ("kvmesh.cp.table.v1", "table.rs"),
    ("kvmesh.cp.polled.v1", "table.rs"),
    ("kvmesh.breakers.v1", "breakers.rs"),
    ("kvmesh.feedback.v1", "feedback.rs"),
    ("kvmesh.admission.v3", "admission.rs"),
    ("kvmesh.gateway.id.v1", "gateway_id.rs"),
    ("kvmesh.models.v1", "series.rs"),
    ("kvmesh.tenants.v2", "tenants.rs"),
    ("kvmesh.tenant_requests.v1", "tenant_requests.rs"),
    ("kvmesh.tenant_series.v1", "series.rs"),
    ("kvmesh.tenant_tokens.v1", "tenant_tokens.rs"),
    ("kvmesh.tenant_usage.v1", "tenant_usage.rs"),
];

#[cfg(test)]
mod tests {
    use super::KEYS;

    /// Each key in [`KEYS`] is spelled in its file, no file of this module spells a key that
    /// [`KEYS`] leaves out, and docs/ARCHITECTURE.md names exactly these keys.
    #[test]
    fn the_key_list_matches_the_code_and_the_docs() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/shared");
        let literal = |key: &str| key.split('<').next().unwrap_or(key).to_string();
        for (key, file) in KEYS {
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            assert!(text.contains(&format!("\"{}", literal(key))), "{file} does not define {key}");
        }
        // Every "kvmesh.…" string literal under src/ (outside this file and tests' fixtures)
        // is one of the keys.
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![src];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                // record.rs names the request's filter-state keys, not shared data.
                if path.ends_with("shared/mod.rs") || path.ends_with("gateway/record.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                for found in code.split("\"kvmesh.").skip(1) {
                    let key = format!("kvmesh.{}", found.split(['"', '{']).next().unwrap_or_default());
                    assert!(
                        KEYS.iter()
                            .any(|(k, _)| literal(k) == key
                                || literal(k).trim_end_matches('.') == key.trim_end_matches('.')),
                        "{} uses shared-data key {key}, which KEYS does not list",
                        path.display()
                    );
                }
            }
        }
        let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/ARCHITECTURE.md");
        let docs = std::fs::read_to_string(docs).unwrap();
        let documented: std::collections::BTreeSet<String> = docs
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|s| s.starts_with("kvmesh.") && !s.contains(' '))
            .map(str::to_string)
            .collect();
        let listed: std::collections::BTreeSet<String> = KEYS.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(documented, listed, "docs/ARCHITECTURE.md's shared-data keys differ from shared::KEYS");
    }
}
