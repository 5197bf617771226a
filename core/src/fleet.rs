//! Fair shares across gateways (issue 47): tenants' token usage as it travels between the
//! VMs of one Envoy, the gateways and kvmesh-cp.
//!
//! A [`Usage`] is a table of tenants' usage counted at one instant (`at_ms`), decaying as
//! [`crate::fair`]'s does (the same half-life), so two tables add, subtract and compare once
//! decayed to the same instant. Every table that crossed a process boundary is hostile:
//! [`Usage::sanitized`] drops ids that are not tenant ids, clamps values (NaN and negative to
//! 0, infinite and huge to [`MAX_USAGE`]), sums duplicates and keeps at most `max` tenants
//! (the largest; the rest counted as [`OTHER`]).
//!
//! The flow: each VM charges its own [`crate::fair::Shares`] and adds it to its Envoy's table
//! on its tick; the Envoy reports its table; kvmesh-cp sums the gateways' last reports
//! ([`sum`]) and ships the sum when it [`Usage::changed_enough`]; a gateway takes off what it
//! reported itself ([`Usage::minus`]) and adds its own table back, up to date: the fleet's
//! usage, counted once.

use crate::fair::{decayed, HALF_LIFE_MS};
use crate::tenant::{valid_tenant, OTHER};

/// The largest usage a table holds for one tenant.
pub const MAX_USAGE: f64 = 1e15;
/// The most tenants a report, a snapshot or a shared table carries (past it: [`OTHER`]).
pub const MAX_SHIPPED: usize = 256;
/// A change a snapshot's delta need not carry: within this fraction of the larger value...
pub const CHANGE_FRACTION: f64 = 0.1;
/// ... or within this many tokens (a usage table) ...
pub const CHANGE_TOKENS: f64 = 64.0;
/// ... or this many requests (an admitted-requests table: about 0.07 requests a second).
pub const CHANGE_REQUESTS: f64 = 1.0;

/// A usage value from outside, clamped: not a number or below 0 → 0, above [`MAX_USAGE`] →
/// that.
pub fn clamp(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 {
        0.0
    } else {
        v.min(MAX_USAGE)
    }
}

/// Tenants' usage counted at `at_ms`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    pub at_ms: u64,
    pub entries: Vec<(String, f64)>,
}

impl Usage {
    /// A table from untrusted `entries` counted at `at_ms` (see the module's doc).
    pub fn sanitized<'a>(entries: impl IntoIterator<Item = (&'a str, f64)>, max: usize, at_ms: u64) -> Self {
        let mut out = Self { at_ms, entries: Vec::new() };
        for (tenant, v) in entries {
            if !valid_tenant(tenant) {
                continue;
            }
            out.add_one(tenant, clamp(v));
            // Bounded while it is built, so a hostile list costs O(max) memory.
            if out.entries.len() > 2 * max.max(1) + 1 {
                out.bound(max);
            }
        }
        out.bound(max);
        out
    }

    fn add_one(&mut self, tenant: &str, v: f64) {
        match self.entries.iter_mut().find(|(t, _)| t == tenant) {
            Some((_, u)) => *u = (*u + v).min(MAX_USAGE),
            None => self.entries.push((tenant.to_string(), v)),
        }
    }

    /// At most `max` tenants besides [`OTHER`]: the largest kept, the rest added to it.
    fn bound(&mut self, max: usize) {
        let max = max.max(1);
        self.entries.retain(|(_, v)| *v > 0.0);
        if self.entries.iter().filter(|(t, _)| t != OTHER).count() <= max {
            return;
        }
        let mut other = self.entries.iter().find(|(t, _)| t == OTHER).map_or(0.0, |(_, v)| *v);
        self.entries.retain(|(t, _)| t != OTHER);
        self.entries.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        for (_, v) in self.entries.drain(max..) {
            other += v;
        }
        self.entries.push((OTHER.to_string(), other.min(MAX_USAGE)));
    }

    /// `tenant`'s usage at `now_ms`: its own entry, else [`OTHER`]'s where the table has one
    /// (it went past its bound), else 0.
    pub fn get(&self, tenant: &str, now_ms: u64) -> f64 {
        let own = self.entries.iter().find(|(t, _)| t == tenant);
        let e = own.or_else(|| self.entries.iter().find(|(t, _)| t == OTHER));
        e.map_or(0.0, |(_, v)| decayed(*v, self.at_ms, now_ms))
    }

    /// The table decayed to `now_ms` (a clock going back decays nothing); entries below a
    /// hundredth of a token go.
    pub fn at(&self, now_ms: u64) -> Self {
        let at_ms = self.at_ms.max(now_ms);
        let entries = self
            .entries
            .iter()
            .map(|(t, v)| (t.clone(), decayed(*v, self.at_ms, at_ms)))
            .filter(|(_, v)| *v >= 0.01)
            .collect();
        Self { at_ms, entries }
    }

    /// This table plus `more`, at `now_ms`, at most `max` tenants.
    pub fn plus(&self, more: &Usage, max: usize, now_ms: u64) -> Self {
        let mut out = self.at(now_ms);
        let at_ms = out.at_ms;
        for (t, v) in &more.entries {
            out.add_one(t, clamp(decayed(*v, more.at_ms, at_ms)));
        }
        out.bound(max);
        out
    }

    /// This table less `own` (a part of it), tenant by tenant and never below 0, at `now_ms`.
    pub fn minus(&self, own: &Usage, now_ms: u64) -> Self {
        let mut out = self.at(now_ms);
        let at_ms = out.at_ms;
        for (t, v) in &mut out.entries {
            let mine = own.entries.iter().find(|(o, _)| o == t).map_or(0.0, |(_, u)| decayed(*u, own.at_ms, at_ms));
            *v = (*v - mine).max(0.0);
        }
        out.entries.retain(|(_, v)| *v >= 0.01);
        out
    }

    /// Whether this table differs from `shipped` (both decayed to `now_ms`) by more than a
    /// delta need carry: a tenant's value moved past [`CHANGE_FRACTION`] of the larger and
    /// `min` ([`CHANGE_TOKENS`] or [`CHANGE_REQUESTS`]).
    pub fn changed_enough(&self, shipped: &Usage, min: f64, now_ms: u64) -> bool {
        let (a, b) = (self.at(now_ms), shipped.at(now_ms));
        let moved = |x: f64, y: f64| (x - y).abs() > (CHANGE_FRACTION * x.max(y)).max(min);
        let value = |u: &Usage, t: &str| u.entries.iter().find(|(o, _)| o == t).map_or(0.0, |(_, v)| *v);
        a.entries.iter().any(|(t, v)| moved(*v, value(&b, t))) || b.entries.iter().any(|(t, v)| moved(*v, value(&a, t)))
    }
}

/// Tokens per minute a tenant with `usage` (decayed, as shipped) uses, were its rate steady:
/// a steady rate `r` a millisecond decays to `r` × [`HALF_LIFE_MS`] / ln 2, so the minute is
/// that × 60,000 ln 2 / [`HALF_LIFE_MS`] (≈ 4.16 × `usage`). An estimate: tokens-per-minute
/// limits across gateways (kvmesh-cp ships usage, not minutes).
pub fn per_minute(usage: f64) -> u64 {
    let minute = clamp(usage) * 60_000.0 * std::f64::consts::LN_2 / HALF_LIFE_MS as f64;
    minute.min(u64::MAX as f64) as u64
}

/// Requests per second a tenant with request `usage` (decayed, as shipped) makes, were its
/// rate steady (as [`per_minute`], over a second; rounded down): an estimate for
/// requests-per-second limits across gateways.
pub fn per_second(usage: f64) -> u32 {
    let second = clamp(usage) * 1_000.0 * std::f64::consts::LN_2 / HALF_LIFE_MS as f64;
    second.min(f64::from(u32::MAX)) as u32
}

/// The sum of several tables (each gateway's last report) at `now_ms`, at most `max` tenants.
/// O(entries) with a map, as kvmesh-cp sums up to a thousand gateways' tables.
pub fn sum<'a>(tables: impl IntoIterator<Item = &'a Usage>, max: usize, now_ms: u64) -> Usage {
    let mut all: std::collections::HashMap<&str, f64> = std::collections::HashMap::new();
    for t in tables {
        for (tenant, v) in &t.entries {
            let v = clamp(decayed(*v, t.at_ms, now_ms));
            let e = all.entry(tenant.as_str()).or_insert(0.0);
            *e = (*e + v).min(MAX_USAGE);
        }
    }
    let mut out = Usage { at_ms: now_ms, entries: all.into_iter().map(|(t, v)| (t.to_string(), v)).collect() };
    out.entries.sort_by(|a, b| a.0.cmp(&b.0));
    out.bound(max);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A steady 100 tokens a second, charged each second for a long while, decays to a usage
    /// whose estimate is 6,000 a minute (within the second's granularity).
    #[test]
    fn a_steady_rates_usage_estimates_its_minute() {
        let mut u = Usage::default();
        for s in 0..600u64 {
            u = u.plus(&Usage::sanitized([("a", 100.0)], 8, s * 1_000), 8, s * 1_000);
        }
        let minute = per_minute(u.get("a", 599_000));
        assert!((5_800..=6_400).contains(&minute), "{minute}");
        assert_eq!(per_minute(f64::NAN), 0);
        // 20 requests a second, steady: 20 × 10 s / ln 2 ≈ 288.5 decayed.
        assert_eq!(per_second(288.6), 20);
        assert_eq!((per_second(f64::NAN), per_second(-1.0)), (0, 0));
        assert!(per_second(f64::INFINITY) > 0, "clamped, not overflowed");
        assert!(per_minute(f64::INFINITY) > 0);
    }

    fn table(entries: &[(&str, f64)], at_ms: u64) -> Usage {
        Usage::sanitized(entries.iter().copied(), 8, at_ms)
    }

    #[test]
    fn hostile_tables_are_clamped_deduplicated_and_bounded() {
        let u = Usage::sanitized(
            [("a", f64::NAN), ("b", f64::INFINITY), ("c", -5.0), ("d", 1e300), ("b", 1.0), ("bad id", 9.0), ("", 3.0)],
            8,
            0,
        );
        assert_eq!(u.get("a", 0), 0.0);
        assert_eq!(u.get("b", 0), MAX_USAGE);
        assert_eq!(u.get("c", 0), 0.0);
        assert_eq!(u.get("d", 0), MAX_USAGE);
        assert!(u.entries.iter().all(|(t, v)| valid_tenant(t) && v.is_finite()));
        assert_eq!(u.entries.len(), 2, "{u:?}");
        let names: Vec<String> = (0..10_000).map(|i| format!("t{i}")).collect();
        let big = Usage::sanitized(names.iter().map(|n| (n.as_str(), 1.0)), 3, 0);
        assert_eq!(big.entries.len(), 4, "three tenants and other");
        assert!((big.get(OTHER, 0) - 9_997.0).abs() < 1e-6);
        assert_eq!(big.get("t9999", 0), big.get(OTHER, 0), "past the bound: other's");
    }

    #[test]
    fn tables_add_and_subtract_at_one_instant() {
        let a = table(&[("x", 1_000.0), ("y", 100.0)], 0);
        let b = table(&[("x", 1_000.0)], HALF_LIFE_MS);
        let s = sum([&a, &b], 8, HALF_LIFE_MS);
        assert!((s.get("x", HALF_LIFE_MS) - 1_500.0).abs() < 1e-6);
        assert!((s.get("y", HALF_LIFE_MS) - 50.0).abs() < 1e-6);
        let rest = s.minus(&b, HALF_LIFE_MS);
        assert!((rest.get("x", HALF_LIFE_MS) - 500.0).abs() < 1e-6);
        assert_eq!(table(&[("x", 5.0)], 0).minus(&table(&[("x", 9.0)], 0), 0).get("x", 0), 0.0, "never below 0");
        assert_eq!(a.at(0).get("x", 0), a.at(0).at(0).get("x", 0));
        assert_eq!(a.at(HALF_LIFE_MS * 100).entries, vec![], "long idle entries go");
    }

    #[test]
    fn only_a_change_past_the_thresholds_is_shipped() {
        let shipped = table(&[("x", 10_000.0)], 0);
        assert!(!table(&[("x", 10_500.0)], 0).changed_enough(&shipped, CHANGE_TOKENS, 0));
        assert!(table(&[("x", 12_000.0)], 0).changed_enough(&shipped, CHANGE_TOKENS, 0));
        assert!(!table(&[("x", 10_000.0), ("y", 10.0)], 0).changed_enough(&shipped, CHANGE_TOKENS, 0), "a few tokens");
        assert!(
            table(&[("x", 10_000.0), ("y", 1_000.0)], 0).changed_enough(&shipped, CHANGE_TOKENS, 0),
            "a new tenant"
        );
        assert!(Usage::default().changed_enough(&shipped, CHANGE_TOKENS, 0), "a tenant gone");
        // Decay alone changes nothing: both sides decay alike.
        assert!(!shipped.at(HALF_LIFE_MS).changed_enough(&shipped, CHANGE_TOKENS, 3 * HALF_LIFE_MS));
        let requests = table(&[("x", 10.0)], 0);
        assert!(table(&[("x", 12.0)], 0).changed_enough(&requests, CHANGE_REQUESTS, 0), "2 requests moved");
        assert!(!table(&[("x", 10.5)], 0).changed_enough(&requests, CHANGE_REQUESTS, 0));
    }
}
