//! What admission made of a request, counted per priority class and per tenant (issue 47), the
//! replies of the refused, and the record's `class` and `tenant`. Class series are counted
//! only under a concurrency limit, tenant series only where tenants are configured: a request
//! without either makes no host call here.

use kvmesh_core::priority::Class;

use crate::admission::Entry;
use crate::gateway::Reply;
use crate::host::{LabelledMetric, StreamHost};

/// Who a request is, for its series and its record: its class (under a concurrency limit)
/// and its tenant (tenants configured: an id, or `anonymous`).
#[derive(Clone, Copy)]
pub(super) struct Who<'a> {
    pub class: Option<Class>,
    pub tenant: Option<&'a str>,
}

impl Who<'_> {
    /// Counts `class_metric` for the class and `tenant_metric` (if any) for the tenant.
    pub fn count(self, host: &dyn StreamHost, class_metric: LabelledMetric, tenant_metric: Option<LabelledMetric>) {
        if let Some(class) = self.class {
            host.increment_labelled(class_metric, class.name());
        }
        if let (Some(tenant), Some(metric)) = (self.tenant, tenant_metric) {
            host.increment_labelled(metric, tenant);
        }
    }

    /// Counts what admission said (`entry`); the reply of a refused request.
    pub fn entered(self, host: &dyn StreamHost, entry: &Entry) -> Option<Reply> {
        match entry {
            Entry::Admitted => {
                self.count(host, LabelledMetric::ClassAdmitted, None);
                None
            }
            Entry::Queued => {
                self.count(host, LabelledMetric::ClassQueued, Some(LabelledMetric::TenantQueued));
                None
            }
            Entry::Shed => {
                self.count(host, LabelledMetric::ClassShed, Some(LabelledMetric::TenantShed));
                let msg = "the gateway is at its concurrency limit: sheddable requests are refused";
                Some(Reply { retry_after: Some(1), ..Reply::error(503, "shed", msg) })
            }
            Entry::Full => {
                self.count(host, LabelledMetric::ClassRefused, None);
                let msg = "the concurrency limit is reached and the queue is full";
                Some(Reply { retry_after: Some(1), ..Reply::error(429, "too_many_requests", msg) })
            }
        }
    }

    /// The decision record with `;class=…;tenant=…` added where they apply (no copy when
    /// neither does).
    pub fn record(self, record: &str) -> std::borrow::Cow<'_, str> {
        if self.class.is_none() && self.tenant.is_none() {
            return record.into();
        }
        let mut out = String::with_capacity(record.len() + 48);
        out.push_str(record);
        crate::gateway::push_who(&mut out, self.class.map(Class::name), self.tenant);
        out.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;

    #[test]
    fn outcomes_count_per_class_and_tenant_and_refusals_reply() {
        let host = MockHost::default();
        let who = Who { class: Some(Class::Sheddable), tenant: Some("team-a") };
        assert!(who.entered(&host, &Entry::Admitted).is_none());
        let shed = who.entered(&host, &Entry::Shed).unwrap();
        assert_eq!((shed.status, shed.retry_after), (503, Some(1)));
        let full = Who { class: Some(Class::Default), tenant: None }.entered(&host, &Entry::Full).unwrap();
        assert_eq!(full.status, 429);
        let counts = host.labelled_metrics.borrow();
        let n = |m, l: &str| counts.get(&(m, l.to_string())).copied().unwrap_or(0);
        assert_eq!(n(LabelledMetric::ClassAdmitted, "sheddable"), 1);
        assert_eq!(n(LabelledMetric::ClassShed, "sheddable"), 1);
        assert_eq!(n(LabelledMetric::TenantShed, "team-a"), 1);
        assert_eq!(n(LabelledMetric::ClassRefused, "default"), 1);
        assert_eq!(counts.len(), 4, "{counts:?}");
    }

    #[test]
    fn the_record_names_class_and_tenant_only_when_configured() {
        let base = "policy=random;worker=1.2.3.4:8000;cached_bytes=0";
        assert_eq!(Who { class: None, tenant: None }.record(base), base);
        let who = Who { class: Some(Class::Interactive), tenant: Some("spiffe://c/ns/a") };
        assert_eq!(who.record(base), format!("{base};class=interactive;tenant=spiffe://c/ns/a"));
        assert_eq!(Who { class: None, tenant: Some("t") }.record(base), format!("{base};tenant=t"));
    }
}
