//! `kvmesh.tenant_tokens`: each tenant's tokens in the current minute, Envoy-wide (the
//! tokens-per-minute limit of issue 47, [`kvmesh_core::tenant::TokenWindow`]). A request of a
//! configured limit reads it once (its verdict) and changes it by compare-and-swap twice (its
//! uncached prompt as it is routed, its generated tokens as it ends). At most `max_tenants`
//! entries plus [`OTHER`]'s: a tenant past the bound takes the entry of one idle since an
//! earlier minute, or counts as `other`.
//!
//! Format: entries of `len u8, id (len bytes), minute u64, tokens u64`, little-endian.

use kvmesh_core::tenant::{TokenWindow, Verdict, OTHER};

use super::{u64_at, SharedStore};

pub const KEY: &str = "kvmesh.tenant_tokens.v1";

fn decode(bytes: &[u8]) -> Vec<(String, TokenWindow)> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(&len) = bytes.get(at) {
        let start = at + 1;
        let end = start + usize::from(len);
        let (Some(id), Some(minute), Some(tokens)) =
            (bytes.get(start..end), u64_at(bytes, end), u64_at(bytes, end + 8))
        else {
            break;
        };
        let Ok(id) = std::str::from_utf8(id) else { break };
        out.push((id.to_string(), TokenWindow { minute, tokens }));
        at = end + 16;
    }
    out
}

fn encode(entries: &[(String, TokenWindow)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * 40);
    for (id, w) in entries {
        let id = id.as_bytes().get(..255).unwrap_or(id.as_bytes());
        out.push(u8::try_from(id.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(id);
        out.extend_from_slice(&w.minute.to_le_bytes());
        out.extend_from_slice(&w.tokens.to_le_bytes());
    }
    out
}

/// The window `tenant` is counted in: its own, else (the table full) [`OTHER`]'s.
fn window_of(entries: &[(String, TokenWindow)], tenant: &str, max_tenants: usize) -> TokenWindow {
    let own = entries.iter().find(|(id, _)| id == tenant);
    let full = entries.iter().filter(|(id, _)| id != OTHER).count() >= max_tenants;
    let other = || entries.iter().find(|(id, _)| id == OTHER).filter(|_| full);
    own.or_else(other).map(|(_, w)| *w).unwrap_or_default()
}

/// What `limit` tokens per minute say about one more request of `tenant` at `now_ms`: this
/// Envoy's minute, plus the rest of the fleet's where kvmesh-cp ships tenants' usage (its
/// steady-rate estimate from `super::tenant_usage`: approximate, a snapshot behind).
pub fn verdict(store: &dyn SharedStore, tenant: &str, limit: u64, max_tenants: usize, now_ms: u64) -> Verdict {
    let entries = store.get(KEY).0.map(|v| decode(&v)).unwrap_or_default();
    let rest = super::tenant_usage::read(store).map_or(0.0, |(_, rest)| rest.get(tenant, now_ms));
    window_of(&entries, tenant, max_tenants).verdict_with(limit, kvmesh_core::fleet::per_minute(rest), now_ms)
}

/// Counts `tokens` for `tenant` at `now_ms`; false when shared data refused every write.
pub fn charge(store: &dyn SharedStore, tenant: &str, tokens: u64, max_tenants: usize, now_ms: u64) -> bool {
    super::update(store, KEY, |value| {
        let mut entries = decode(value);
        let minute = now_ms / 60_000;
        let known = entries.iter().any(|(id, _)| id == tenant);
        let id = if known || entries.iter().filter(|(id, _)| id != OTHER).count() < max_tenants {
            tenant
        } else if let Some(i) = entries.iter().position(|(id, w)| id != OTHER && w.minute < minute) {
            entries.swap_remove(i);
            tenant
        } else {
            OTHER
        };
        match entries.iter_mut().find(|(e, _)| e == id) {
            Some((_, w)) => w.charge(tokens, now_ms),
            None => {
                let mut w = TokenWindow { minute, tokens: 0 };
                w.charge(tokens, now_ms);
                entries.push((id.to_string(), w));
            }
        }
        *value = encode(&entries);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    fn a_tenant_is_refused_once_its_minute_reached_the_limit() {
        let store = FakeStore::default();
        assert!(verdict(&store, "a", 100, 8, 0).allowed);
        assert!(charge(&store, "a", 60, 8, 1_000));
        assert_eq!(verdict(&store, "a", 100, 8, 1_000).remaining, 40);
        assert!(charge(&store, "a", 60, 8, 2_000));
        let v = verdict(&store, "a", 100, 8, 30_000);
        assert_eq!((v.allowed, v.remaining, v.reset_ms), (false, 0, 30_000));
        assert!(verdict(&store, "b", 100, 8, 30_000).allowed, "another tenant");
        assert!(verdict(&store, "a", 100, 8, 60_000).allowed, "the next minute");
    }

    /// Across gateways: the rest of the fleet's usage (kvmesh-cp's less this Envoy's) counts
    /// as its steady-rate estimate in the minute.
    #[test]
    fn the_rest_of_the_fleets_usage_counts_in_the_minute() {
        use kvmesh_core::fleet::Usage;
        let store = FakeStore::default();
        assert!(charge(&store, "a", 100, 8, 0));
        assert_eq!(verdict(&store, "a", 1_000, 8, 0).remaining, 900);
        // 100 tokens of usage elsewhere: about 416 a minute.
        assert!(crate::shared::tenant_usage::set_rest(&store, &Usage::sanitized([("a", 100.0)], 8, 0)));
        assert_eq!(verdict(&store, "a", 1_000, 8, 0).remaining, 1_000 - 100 - 415);
        assert!(crate::shared::tenant_usage::set_rest(&store, &Usage::sanitized([("a", 1_000.0)], 8, 0)));
        assert!(!verdict(&store, "a", 1_000, 8, 0).allowed);
        assert!(verdict(&store, "b", 1_000, 8, 0).allowed, "another tenant");
    }

    #[test]
    fn past_the_bound_tenants_share_other_and_garbage_reads_as_empty() {
        let store = FakeStore::default();
        for i in 0..1_000 {
            assert!(charge(&store, &format!("t{i}"), u64::MAX, 3, 0));
        }
        let value = store.get(KEY).0.unwrap();
        assert!(value.len() <= 4 * (1 + 5 + 16), "bounded: {} bytes", value.len());
        assert!(!verdict(&store, "t999", 1_000, 3, 0).allowed, "counted as other");
        store.set(KEY, &[200, 1, 2], None).unwrap();
        assert!(verdict(&store, "a", 1, 4, 0).allowed);
    }
}
