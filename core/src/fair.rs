//! Fair shares by tenant weight (issue 47): backlogged tenants share the concurrency limit's
//! capacity by weight, counted in tokens (uncached prompt tokens plus generated tokens).
//!
//! Each tenant's usage is a count of tokens that decays by half every [`HALF_LIFE_MS`] (so a
//! tenant idle for a while starts again almost even, and the count never grows without
//! bound). Among the requests waiting in one class, the one whose tenant has the least usage
//! per unit of weight goes first (the oldest on a tie): a virtual-time scheme, as AIBrix's
//! virtual token counter or a deficit round robin over tokens, with one number per tenant.
//! The table is bounded ([`Shares::new`]); tenants past it share [`OTHER`]'s entry. Hostile
//! values clamp: a charge above [`MAX_CHARGE`] counts as that, a weight to 1..=[`MAX_WEIGHT`].

use crate::tenant::{valid_tenant, OTHER};

/// Usage halves over this many milliseconds.
pub const HALF_LIFE_MS: u64 = 10_000;
/// The most tokens one charge counts.
pub const MAX_CHARGE: u64 = 1 << 24;
/// The largest weight (the smallest is 1, every tenant's default).
pub const MAX_WEIGHT: u32 = 1_000;
/// The most `tenant=W` entries a configuration may give.
pub const MAX_WEIGHTS: usize = 4_096;

/// Parses `tenant=W` entries (`tenant_weight`), one per tenant at most.
pub fn parse_weights(entries: &[String]) -> Result<Vec<(String, u32)>, String> {
    if entries.len() > MAX_WEIGHTS {
        return Err(format!("{} entries: at most {MAX_WEIGHTS}", entries.len()));
    }
    let mut out: Vec<(String, u32)> = Vec::with_capacity(entries.len());
    for entry in entries {
        let (tenant, w) = entry.rsplit_once('=').ok_or_else(|| format!("`{entry}` is not tenant=W"))?;
        let tenant = tenant.trim();
        if !valid_tenant(tenant) {
            return Err(format!("`{tenant}` is not a tenant id"));
        }
        let w: u32 = w.trim().parse().map_err(|_| format!("`{}` is not a whole number", w.trim()))?;
        if !(1..=MAX_WEIGHT).contains(&w) {
            return Err(format!("weight {w} of `{tenant}` is not within 1..={MAX_WEIGHT}"));
        }
        if out.iter().any(|(t, _)| t == tenant) {
            return Err(format!("tenant `{tenant}` given twice"));
        }
        out.push((tenant.to_string(), w));
    }
    Ok(out)
}

/// A tenant's weight under `weights` (1 when it has none).
pub fn weight_of(weights: &[(String, u32)], tenant: &str) -> u32 {
    weights.iter().find(|(t, _)| t == tenant).map_or(1, |(_, w)| (*w).clamp(1, MAX_WEIGHT))
}

/// `usage` counted at `at_ms`, decayed to `now_ms` (a clock going back decays nothing).
pub fn decayed(usage: f64, at_ms: u64, now_ms: u64) -> f64 {
    let elapsed = now_ms.saturating_sub(at_ms);
    if elapsed == 0 {
        return usage;
    }
    usage * 0.5f64.powf(elapsed as f64 / HALF_LIFE_MS as f64)
}

#[derive(Clone, Debug, PartialEq)]
struct Entry {
    tenant: String,
    usage: f64,
    at_ms: u64,
}

/// Each tenant's decayed token usage, at most `max` tenants plus [`OTHER`].
#[derive(Clone, Debug, PartialEq)]
pub struct Shares {
    entries: Vec<Entry>,
    max: usize,
}

impl Default for Shares {
    fn default() -> Self {
        Self::new(64)
    }
}

impl Shares {
    pub fn new(max: usize) -> Self {
        Self { entries: Vec::new(), max: max.max(1) }
    }

    /// Counts `tokens` more for `tenant` at `now_ms`. A tenant past the bound takes the entry
    /// of one whose usage decayed below one token, else is counted as [`OTHER`].
    pub fn charge(&mut self, tenant: &str, tokens: u64, now_ms: u64) {
        let tokens = tokens.min(MAX_CHARGE) as f64;
        let i = match self.entries.iter().position(|e| e.tenant == tenant) {
            Some(i) => i,
            None => {
                let named = self.entries.iter().filter(|e| e.tenant != OTHER).count();
                let idle =
                    self.entries.iter().position(|e| e.tenant != OTHER && decayed(e.usage, e.at_ms, now_ms) < 1.0);
                let id = if named < self.max {
                    tenant
                } else if let Some(i) = idle {
                    self.entries.swap_remove(i);
                    tenant
                } else {
                    OTHER
                };
                match self.entries.iter().position(|e| e.tenant == id) {
                    Some(i) => i,
                    None => {
                        self.entries.push(Entry { tenant: id.to_string(), usage: 0.0, at_ms: now_ms });
                        self.entries.len() - 1
                    }
                }
            }
        };
        if let Some(e) = self.entries.get_mut(i) {
            e.usage = (decayed(e.usage, e.at_ms, now_ms) + tokens).min(1e15);
            e.at_ms = e.at_ms.max(now_ms);
        }
    }

    /// `tenant`'s usage at `now_ms` (one past the bound: [`OTHER`]'s; one never seen: 0).
    pub fn usage(&self, tenant: &str, now_ms: u64) -> f64 {
        let e = self.entries.iter().find(|e| e.tenant == tenant);
        let full = || self.entries.iter().filter(|e| e.tenant != OTHER).count() >= self.max;
        let e = e.or_else(|| if full() { self.entries.iter().find(|e| e.tenant == OTHER) } else { None });
        e.map_or(0.0, |e| decayed(e.usage, e.at_ms, now_ms))
    }

    /// `tenant`'s usage per unit of its weight: the smaller goes first.
    pub fn virtual_time(&self, tenant: &str, weight: u32, now_ms: u64) -> f64 {
        self.usage(tenant, now_ms) / f64::from(weight.clamp(1, MAX_WEIGHT))
    }

    /// Every tenant's usage at `now_ms` (for reports), at most `max + 1` of them.
    pub fn each(&self, now_ms: u64) -> impl Iterator<Item = (&str, f64)> {
        self.entries.iter().map(move |e| (e.tenant.as_str(), decayed(e.usage, e.at_ms, now_ms)))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Forgets every tenant (their usage went elsewhere: [`crate::fleet`]).
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Of `waiting` (each its tenant and weight, oldest first), the position of the one to go
/// next: the least virtual time, the oldest on a tie. `None` when nothing waits.
pub fn pick<'a>(shares: &Shares, waiting: impl Iterator<Item = (Option<&'a str>, u32)>, now_ms: u64) -> Option<usize> {
    pick_by(|t| shares.usage(t, now_ms), waiting)
}

/// As [`pick`], by the usage `usage` gives each tenant (the fleet's: [`crate::fleet`]).
pub fn pick_by<'a>(
    usage: impl Fn(&str) -> f64,
    waiting: impl Iterator<Item = (Option<&'a str>, u32)>,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, (tenant, weight)) in waiting.enumerate() {
        let vt = tenant.map_or(0.0, |t| usage(t) / f64::from(weight.clamp(1, MAX_WEIGHT)));
        if best.is_none_or(|(_, b)| vt < b) {
            best = Some((i, vt));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_parse_and_refuse_garbage() {
        let w = parse_weights(&["team-a=3".into(), " spiffe://c/ns/b = 1".into()]).unwrap();
        assert_eq!(w, vec![("team-a".to_string(), 3), ("spiffe://c/ns/b".to_string(), 1)]);
        assert_eq!(weight_of(&w, "team-a"), 3);
        assert_eq!(weight_of(&w, "nobody"), 1);
        assert!(parse_weights(&["a".into()]).is_err());
        assert!(parse_weights(&["a=0".into()]).is_err());
        assert!(parse_weights(&["a=1001".into()]).is_err());
        assert!(parse_weights(&["a b=1".into()]).is_err());
        assert!(parse_weights(&["a=1".into(), "a=2".into()]).unwrap_err().contains("twice"));
    }

    #[test]
    fn usage_decays_by_half_each_half_life() {
        let mut s = Shares::new(4);
        s.charge("a", 1_000, 0);
        assert_eq!(s.usage("a", 0), 1_000.0);
        assert!((s.usage("a", HALF_LIFE_MS) - 500.0).abs() < 1e-6);
        s.charge("a", 500, HALF_LIFE_MS);
        assert!((s.usage("a", HALF_LIFE_MS) - 1_000.0).abs() < 1e-6);
        assert_eq!(s.usage("a", 0), 1_000.0, "a clock going back decays nothing");
        assert_eq!(s.usage("never", 5), 0.0);
    }

    #[test]
    fn hostile_charges_and_tenants_stay_bounded() {
        let mut s = Shares::new(3);
        for i in 0..10_000u64 {
            s.charge(&format!("t{i}"), u64::MAX, i);
        }
        assert!(s.len() <= 4, "{}", s.len());
        assert!(s.each(10_000).all(|(_, u)| u.is_finite() && u <= 1e15));
        assert!(s.usage("t9999", 10_000) > 0.0, "past the bound: other's usage");
        // Long idle entries are taken over by newcomers.
        s.charge("late", 1, 10_000 + 100 * HALF_LIFE_MS);
        assert_eq!(s.usage("late", 10_000 + 100 * HALF_LIFE_MS), 1.0);
    }

    /// Two backlogged tenants, weights 3 and 1, each request 100 tokens: served one at a time
    /// by `pick`, they get tokens 3:1 (within one request).
    #[test]
    fn backlogged_tenants_are_served_by_weight() {
        let weights = parse_weights(&["a=3".into()]).unwrap();
        let mut s = Shares::new(8);
        let mut served = [0u32; 2];
        let names = ["a", "b"];
        for step in 0..400u64 {
            let waiting = names.iter().map(|t| (Some(*t), weight_of(&weights, t)));
            let i = pick(&s, waiting, step).unwrap();
            served[i] += 1;
            s.charge(names[i], 100, step);
        }
        assert!((served[0] as i64 - 300).abs() <= 1 && (served[1] as i64 - 100).abs() <= 1, "{served:?}");
    }

    #[test]
    fn ties_go_to_the_oldest_and_requests_without_a_tenant_are_not_held_back() {
        let mut s = Shares::new(8);
        assert_eq!(pick(&s, [(Some("a"), 1), (Some("b"), 1)].into_iter(), 0), Some(0));
        s.charge("a", 10, 0);
        assert_eq!(pick(&s, [(Some("a"), 1), (Some("b"), 1)].into_iter(), 0), Some(1));
        assert_eq!(pick(&s, [(Some("a"), 1), (None, 1)].into_iter(), 0), Some(1));
        assert_eq!(pick(&s, std::iter::empty(), 0), None);
    }
}
