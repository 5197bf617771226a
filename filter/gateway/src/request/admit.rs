//! What admission made of a request, counted per priority class and per tenant (issue 47), the
//! replies of the refused, and the record's `class` and `tenant`. Class series are counted
//! only under a concurrency limit, tenant series only where tenants are configured: a request
//! without either makes no host call here.

use kvmesh_core::priority::Class;

use super::{Admission, RequestFilter};
use crate::admission::Entry;
use crate::gateway::Reply;
use crate::host::{Action, LabelledMetric, StreamHost};
use crate::shared::admission::SharedBucket;

/// Prompt bytes per token, for the uncached prompt a request is charged as it is routed
/// (before the worker says how many tokens it read).
const BYTES_PER_TOKEN: usize = 4;

impl RequestFilter {
    /// Admission, when a concurrency limit is configured: a token, a place in the VM's queue,
    /// or a 429. Without a seat (no queue to wait in), a request that would wait is admitted.
    pub(super) fn enter(&mut self, host: &dyn StreamHost) -> Entry {
        let Some((Some(params), vm)) = self.with_gateway(|g| (g.config().admission, g.ledger().vm())) else {
            return Entry::Admitted;
        };
        let now_ms = crate::host::now_ms(host);
        let Some(seat) = &self.seat else { return Entry::Admitted };
        let Ok(mut room) = seat.room.try_borrow_mut() else { return Entry::Admitted };
        // Shared data refusing the write: let the request through (holding nothing) rather
        // than fail it.
        let class = self.class.unwrap_or_default();
        let Some(entry) = SharedBucket::enter(host, &params, vm, class, room.counts(), now_ms) else {
            return Entry::Admitted;
        };
        match entry {
            Entry::Admitted => {
                room.took(now_ms);
                self.admission = Admission::Holds;
            }
            Entry::Queued => {
                let tenant = self.tenant.as_deref().zip(self.weight);
                room.push_for(seat.ctx, class, tenant, now_ms, (class, seat.me.clone()));
                self.admission = Admission::Waiting;
            }
            Entry::Full | Entry::Shed => {}
        }
        entry
    }

    /// The tick admitted this waiting request (its context entered) and took a slot for it:
    /// route it and let it go. False if it was not waiting (the slot is not its to keep).
    pub fn admitted(&mut self, host: &dyn StreamHost) -> bool {
        if self.admission != Admission::Waiting {
            return false;
        }
        self.admission = Admission::Holds;
        self.who().count(host, LabelledMetric::ClassAdmitted, None);
        if self.route_body(host) == Action::Continue {
            if let Err(e) = host.resume_request() {
                log::warn!("cannot resume a request admitted from the queue: {e}");
            }
        }
        true
    }

    /// The tick found this request waiting past the queue timeout (its context entered).
    pub fn expired(&mut self, host: &dyn StreamHost) {
        if self.admission != Admission::Waiting {
            return;
        }
        self.admission = Admission::Free;
        self.who().count(host, LabelledMetric::ClassRefused, None);
        let class = self.class.unwrap_or_default();
        let timeout = self.with_gateway(|g| g.config().admission.map(|p| p.timeout_ms(class) / 1000)).flatten();
        let msg = format!("waited in the queue for {} s without a free slot", timeout.unwrap_or(0));
        self.reply(host, Reply::error(408, "queue_timeout", &msg));
    }

    pub(super) fn who(&self) -> Who<'_> {
        Who { class: self.class, tenant: self.tenant.as_deref() }
    }

    /// Charges the request's tenant `tokens`: in its VM's usage table (fair shares) and in
    /// the Envoy's minute (a tokens-per-minute limit).
    fn charge(&self, host: &dyn StreamHost, tokens: u64) {
        let Some(tenant) = self.tenant.as_deref().filter(|_| self.metered) else { return };
        let limits = self.with_gateway(|g| g.config().tenants.as_ref().map(|t| (t.max_tenants, t.tokens_per_minute)));
        let (max, per_minute) = limits.flatten().unwrap_or((64, None));
        let now_ms = crate::host::now_ms(host);
        // Into the VM's table either way: shared on its tick, reported to kvmesh-cp, it counts
        // in the fleet's fair shares and tokens-per-minute limits.
        if let Some(seat) = &self.seat {
            if let Ok(mut room) = seat.room.try_borrow_mut() {
                room.charge(tenant, tokens, max, now_ms);
            }
        }
        if per_minute.is_some() && !crate::shared::tenant_tokens::charge(host, tenant, tokens, max, now_ms) {
            log::debug!("cannot count tenant {tenant}'s tokens: shared data refused the write");
        }
    }

    /// As it is routed: its prompt's bytes the chosen worker was not believed to hold, in
    /// tokens (estimated).
    pub(super) fn charge_routed(&self, host: &dyn StreamHost, body_size: usize, cached_bytes: usize) {
        if self.metered {
            let uncached = body_size.saturating_sub(cached_bytes) / BYTES_PER_TOKEN;
            self.charge(host, u64::try_from(uncached).unwrap_or(u64::MAX));
        }
    }

    /// As its response ends: the tokens the worker generated.
    pub(super) fn charge_generated(&self, host: &dyn StreamHost, generated: Option<u64>) {
        if let (true, Some(tokens)) = (self.metered, generated) {
            self.charge(host, tokens);
        }
    }
}

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
