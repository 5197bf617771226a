//! `kvmesh.tenants`: each tenant's requests in the current second, Envoy-wide (the per-tenant
//! limit of issue 47, [`kvmesh_core::tenant`]). One compare-and-swap per request of a
//! configured limit; at most `max_tenants` entries plus [`OTHER`]'s: a tenant past the bound
//! takes the entry of one idle since an earlier second, or counts as `other`.
//!
//! Format: entries of `len u8, id (len bytes), second u64, count u32`, little-endian.

use kvmesh_core::tenant::{Verdict, Window, OTHER};

use super::{u32_at, u64_at, SharedStore};

pub const KEY: &str = "kvmesh.tenants.v1";

struct Entry {
    id: String,
    window: Window,
}

fn decode(bytes: &[u8]) -> Vec<Entry> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(&len) = bytes.get(at) {
        let start = at + 1;
        let end = start + usize::from(len);
        let (Some(id), Some(second), Some(count)) = (bytes.get(start..end), u64_at(bytes, end), u32_at(bytes, end + 8))
        else {
            break;
        };
        let Ok(id) = std::str::from_utf8(id) else { break };
        out.push(Entry { id: id.to_string(), window: Window { second, count } });
        at = end + 12;
    }
    out
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * 32);
    for e in entries {
        let id = e.id.as_bytes().get(..255).unwrap_or(e.id.as_bytes());
        out.push(u8::try_from(id.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(id);
        out.extend_from_slice(&e.window.second.to_le_bytes());
        out.extend_from_slice(&e.window.count.to_le_bytes());
    }
    out
}

/// Counts one request of `tenant` at `now_ms` under `limit` per second; returns the verdict
/// and the id it was counted under (`tenant`, or [`OTHER`] past the bound). `None`: shared
/// data refused every write (the request goes on, uncounted).
pub fn hit(
    store: &dyn SharedStore,
    tenant: &str,
    limit: u32,
    max_tenants: usize,
    now_ms: u64,
) -> Option<(Verdict, bool)> {
    let mut result = None;
    let written = super::update(store, KEY, |value| {
        let mut entries = decode(value);
        let second = now_ms / 1000;
        let found = entries.iter().position(|e| e.id == tenant);
        let index = match found {
            Some(i) => Some(i),
            None if entries.iter().filter(|e| e.id != OTHER).count() < max_tenants => None,
            None => {
                // The bound: an idle tenant's entry is taken over, else `other`'s is used.
                match entries.iter().position(|e| e.id != OTHER && e.window.second < second) {
                    Some(i) => {
                        entries.remove(i);
                        None
                    }
                    None => Some(entries.iter().position(|e| e.id == OTHER).unwrap_or_else(|| {
                        entries.push(Entry { id: OTHER.to_string(), window: Window { second, count: 0 } });
                        entries.len() - 1
                    })),
                }
            }
        };
        let index = index.unwrap_or_else(|| {
            entries.push(Entry { id: tenant.to_string(), window: Window { second, count: 0 } });
            entries.len() - 1
        });
        let Some(entry) = entries.get_mut(index) else { return };
        let other = entry.id != tenant;
        result = Some((entry.window.hit(limit, now_ms), other));
        *value = encode(&entries);
    });
    if written {
        result
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    fn each_tenant_has_its_own_window() {
        let store = FakeStore::default();
        assert!(hit(&store, "a", 2, 8, 1_000).unwrap().0.allowed);
        assert!(hit(&store, "a", 2, 8, 1_100).unwrap().0.allowed);
        let (v, other) = hit(&store, "a", 2, 8, 1_200).unwrap();
        assert!(!v.allowed && !other);
        assert_eq!((v.remaining, v.reset_ms), (0, 800));
        assert!(hit(&store, "b", 2, 8, 1_300).unwrap().0.allowed, "another tenant");
        assert!(hit(&store, "a", 2, 8, 2_000).unwrap().0.allowed, "the next second");
    }

    #[test]
    fn past_the_bound_tenants_share_other_and_idle_entries_are_reused() {
        let store = FakeStore::default();
        for i in 0..3 {
            assert!(!hit(&store, &format!("t{i}"), 100, 3, 1_000).unwrap().1);
        }
        for i in 3..1_000 {
            let (_, other) = hit(&store, &format!("t{i}"), 100_000, 3, 1_500).unwrap();
            assert!(other, "t{i}");
        }
        let value = store.get(KEY).0.unwrap();
        assert!(value.len() <= 4 * (1 + 5 + 12), "bounded: {} bytes", value.len());
        assert!(!hit(&store, "new", 100, 3, 2_000).unwrap().1, "an idle entry is taken over");
    }

    #[test]
    fn garbage_reads_as_an_empty_table() {
        let store = FakeStore::default();
        store.set(KEY, &[200, 1, 2, 3], None).unwrap();
        assert!(hit(&store, "a", 1, 4, 0).unwrap().0.allowed);
    }
}
