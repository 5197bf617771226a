//! The tenants' owner (issue 47's fair shares and limits across gateways): each gateway's last
//! reported usage per tenant, and the fleet's sum as the snapshots last shipped it; one for
//! tokens, one for admitted requests (the same arithmetic). Only this file writes them. The arithmetic (decay, sums, bounds, what counts as a change) is
//! [`kvmesh_core::fleet`]'s.

use std::collections::HashMap;

use kvmesh_core::fleet::{self, Usage, MAX_SHIPPED};

use super::gateways::MAX_GATEWAYS;

/// The gateways' usage tables and what went out (read through `&TenantUsage`, written
/// through `&mut`).
#[derive(Default)]
pub(super) struct TenantUsage {
    /// Each gateway's last report (at most [`MAX_GATEWAYS`], each at most [`MAX_SHIPPED`]
    /// tenants), counted when it arrived.
    reported: HashMap<String, Usage>,
    /// The fleet's usage as the last delta (or none yet) carried it.
    shipped: Usage,
    /// A report or a gateway gone since the last [`Self::due`] (decay alone is no change).
    dirty: bool,
}

impl TenantUsage {
    // ---- reads

    /// Every gateway's last report summed, at `now_ms` (at most [`MAX_SHIPPED`] tenants).
    pub(super) fn fleet(&self, now_ms: u64) -> Usage {
        fleet::sum(self.reported.values(), MAX_SHIPPED, now_ms)
    }

    /// What the last delta carried.
    pub(super) fn shipped(&self) -> &Usage {
        &self.shipped
    }

    // ---- writes

    /// `gateway` reported `usage` (sanitized, counted as it arrived): it replaces its last.
    /// A new gateway past [`MAX_GATEWAYS`] takes the place of the one that reported longest ago.
    pub(super) fn reported(&mut self, gateway: &str, usage: Usage) {
        if !self.reported.contains_key(gateway) && self.reported.len() >= MAX_GATEWAYS {
            let oldest = self.reported.iter().min_by_key(|(_, u)| u.at_ms).map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                self.reported.remove(&oldest);
            }
        }
        self.reported.insert(gateway.to_string(), usage);
        self.dirty = true;
    }

    /// `gateway` went away: its usage no longer counts.
    pub(super) fn forget(&mut self, gateway: &str) {
        self.dirty |= self.reported.remove(gateway).is_some();
    }

    /// For the next delta at `now_ms`: the fleet's usage, when it changed enough (a tenant's
    /// value by a tenth and by `min`) since the last one shipped (which it then is).
    pub(super) fn due(&mut self, min: f64, now_ms: u64) -> Option<Usage> {
        if !std::mem::take(&mut self.dirty) {
            return None;
        }
        let now = self.fleet(now_ms);
        if !now.changed_enough(&self.shipped, min, now_ms) {
            return None;
        }
        self.shipped = now.clone();
        Some(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::fair::HALF_LIFE_MS;

    fn usage(entries: &[(&str, f64)], at_ms: u64) -> Usage {
        Usage::sanitized(entries.iter().copied(), MAX_SHIPPED, at_ms)
    }

    #[test]
    fn the_fleet_is_the_sum_of_each_gateways_last_report_until_it_goes() {
        let mut t = TenantUsage::default();
        t.reported("gw-1", usage(&[("a", 1_000.0)], 0));
        t.reported("gw-1", usage(&[("a", 2_000.0)], 0)); // replaces, not adds
        t.reported("gw-2", usage(&[("a", 1_000.0), ("b", 500.0)], 0));
        let f = t.fleet(0);
        assert_eq!((f.get("a", 0), f.get("b", 0)), (3_000.0, 500.0));
        assert!((t.fleet(HALF_LIFE_MS).get("a", HALF_LIFE_MS) - 1_500.0).abs() < 1e-6, "decayed");
        t.forget("gw-2");
        assert_eq!((t.fleet(0).get("a", 0), t.fleet(0).get("b", 0)), (2_000.0, 0.0));
    }

    #[test]
    fn a_delta_carries_the_usage_only_when_it_changed_enough() {
        let mut t = TenantUsage::default();
        assert_eq!(t.due(fleet::CHANGE_TOKENS, 0), None, "nothing to ship");
        t.reported("gw-1", usage(&[("a", 1_000.0)], 0));
        assert_eq!(t.due(fleet::CHANGE_TOKENS, 0).map(|u| u.get("a", 0)), Some(1_000.0));
        assert_eq!(t.shipped().get("a", 0), 1_000.0);
        t.reported("gw-1", usage(&[("a", 1_050.0)], 0));
        assert_eq!(t.due(fleet::CHANGE_TOKENS, 0), None, "within the thresholds");
        // The same table reported again later: it decayed as the shipped one did.
        t.reported("gw-1", usage(&[("a", 500.0)], HALF_LIFE_MS));
        assert_eq!(t.due(fleet::CHANGE_TOKENS, HALF_LIFE_MS), None);
        t.forget("gw-1");
        assert_eq!(
            t.due(fleet::CHANGE_TOKENS, HALF_LIFE_MS).map(|u| u.entries.len()),
            Some(0),
            "a gateway gone is shipped"
        );
    }

    /// Through the state: a report's usage (hostile entries dropped) goes out in the next
    /// delta and in full snapshots; the same usage again sends nothing; the gateway's last
    /// `Report` stream closing takes its usage out.
    #[test]
    fn reported_usage_is_shipped_until_its_gateway_goes() {
        use kvmesh_proto::v1::{ReportBatch, TenantTokens, TenantUsage as Wire};
        let s = crate::state::test_state(&[]);
        let mut deltas = s.subscribe();
        s.publish(); // the initial worker set
        let _ = deltas.try_recv();
        s.report_stream_opened("gw-1").unwrap();
        let tokens = |tenant: &str, tokens: f64| TenantTokens { tenant: tenant.into(), tokens };
        let usage = Wire { tenants: vec![tokens("a", 1_000.0), tokens("bad id", 5.0), tokens("b", f64::NAN)] };
        let requests = Wire { tenants: vec![tokens("c", 40.0)] };
        let report = ReportBatch {
            gateway_id: "gw-1".into(),
            tenant_usage: Some(usage),
            tenant_requests: Some(requests),
            ..Default::default()
        };
        s.report(report.clone());
        assert!(s.publish().is_some());
        let delta = deltas.try_recv().unwrap();
        let names = |u: &Option<Wire>| u.iter().flat_map(|u| &u.tenants).map(|t| t.tenant.clone()).collect::<Vec<_>>();
        assert_eq!(names(&delta.tenant_usage), ["a"]);
        assert_eq!(names(&delta.tenant_requests), ["c"], "admitted requests travel beside the usage");
        let full = s.full_snapshot();
        assert_eq!((names(&full.tenant_usage), names(&full.tenant_requests)), (vec!["a".into()], vec!["c".into()]));
        s.report(report);
        assert_eq!(s.publish(), None, "unchanged");
        s.report_stream_closed("gw-1");
        assert!(s.publish().is_some());
        let delta = deltas.try_recv().unwrap();
        assert_eq!(
            (delta.tenant_usage.clone(), delta.tenant_requests.clone()),
            (Some(Wire::default()), Some(Wire::default())),
            "gone"
        );
        assert_eq!((s.full_snapshot().tenant_usage, s.full_snapshot().tenant_requests), (None, None));
    }

    #[test]
    fn gateways_and_tenants_are_bounded() {
        let mut t = TenantUsage::default();
        let names: Vec<String> = (0..2 * MAX_SHIPPED).map(|i| format!("t{i}")).collect();
        let u = Usage::sanitized(names.iter().map(|n| (n.as_str(), 1.0)), MAX_SHIPPED, 0);
        assert_eq!(u.entries.len(), MAX_SHIPPED + 1);
        for g in 0..MAX_GATEWAYS + 10 {
            t.reported(&format!("gw-{g}"), Usage { at_ms: g as u64, ..u.clone() });
        }
        assert_eq!(t.reported.len(), MAX_GATEWAYS);
        assert!(!t.reported.contains_key("gw-0"), "the oldest report made room");
        assert!(t.fleet(0).entries.len() <= MAX_SHIPPED + 1);
    }
}
