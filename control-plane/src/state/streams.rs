//! The gateways' streams as the state sees them: a `Report` or `Watch` stream opening or
//! closing under a gateway id ([`Gateways`] keeps the ids), and what a gateway said that stops
//! counting when it goes quiet: its in-flight counts and circuit breakers while one of its
//! `Report` streams is open and it is not silent, its cumulative counts while it is tracked.

use std::time::Instant;

use super::gateways::{check_gateway_id, GatewayError, Stream};
use super::store::{Locked, State};

impl State {
    /// A `Report` stream of `gateway` opened: it is tracked (up to
    /// [`MAX_GATEWAYS`](super::gateways::MAX_GATEWAYS)) until the last of its streams closes.
    pub fn report_stream_opened(&self, gateway: &str) -> Result<(), GatewayError> {
        self.opened(gateway, Stream::Report)
    }

    /// A gateway opened `Watch` (at most [`MAX_WATCHES`](super::gateways::MAX_WATCHES) at once
    /// per id): tracked until the stream closes ([`watch_closed`](Self::watch_closed)), then
    /// for [`GATEWAY_TTL`](super::gateways::GATEWAY_TTL).
    pub fn gateway_connected(&self, id: &str) -> Result<(), GatewayError> {
        self.opened(id, Stream::Watch)
    }

    fn opened(&self, gateway: &str, stream: Stream) -> Result<(), GatewayError> {
        check_gateway_id(gateway)?;
        let mut inner = self.lock();
        if let Some(idle) = inner.gateways_mut().opened(gateway, stream, self.burst())? {
            Self::forget(&mut inner, &idle);
        }
        Ok(())
    }

    /// Forgets what `gateway` (no longer tracked) said: its in-flight counts, breakers and the
    /// cumulative counts it reported.
    fn forget(inner: &mut Locked, gateway: &str) {
        Self::drop_inflight(inner, gateway);
        for w in inner.registry_mut().entries_mut() {
            w.forget_gateway_counts(gateway);
        }
    }

    /// A `Report` stream of `gateway` ended. When it was the last one, the gateway's in-flight
    /// counts are dropped (its requests no longer count as load), and so are its circuit
    /// breakers; its cumulative counts are kept, so that the same gateway reporting again is
    /// not counted twice.
    pub fn report_stream_closed(&self, gateway: &str) {
        let mut inner = self.lock();
        if inner.gateways_mut().closed(gateway, Stream::Report) {
            Self::drop_inflight(&mut inner, gateway);
        }
    }

    /// A `Watch` stream of `id` ended.
    pub fn watch_closed(&self, id: &str) {
        self.lock().gateways_mut().closed(id, Stream::Watch);
    }

    /// Forgets what `gateway` said about now: its in-flight counts, breaker states, tenant
    /// usage and admitted requests.
    fn drop_inflight(inner: &mut Locked, gateway: &str) {
        inner.tenants_mut().forget(gateway);
        inner.tenant_requests_mut().forget(gateway);
        let mut changed = false;
        for w in inner.registry_mut().entries_mut() {
            changed |= w.drop_gateway_now(gateway);
        }
        if changed {
            inner.publication_mut().workers_changed();
        }
    }

    /// Forgets the in-flight counts of gateways silent for
    /// [`INFLIGHT_TTL`](super::gateways::INFLIGHT_TTL) and gateways gone for
    /// [`GATEWAY_TTL`](super::gateways::GATEWAY_TTL). Returns how many gateways are left.
    pub fn prune_gateways(&self, now: Instant) -> usize {
        let mut inner = self.lock();
        for id in inner.gateways().silent(now) {
            Self::drop_inflight(&mut inner, &id);
        }
        for id in inner.gateways_mut().remove_gone(now) {
            Self::forget(&mut inner, &id);
        }
        inner.gateways().len()
    }

    /// Hashes a gateway may report at once (four seconds' worth).
    pub(super) fn burst(&self) -> f64 {
        self.settings.limits.max_inserts_per_sec as f64 * 4.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::gateways::{GATEWAY_TTL, MAX_GATEWAYS, MAX_GATEWAY_ID, MAX_WATCHES};
    use crate::state::workers::tests::state;
    use std::time::Duration;

    #[test]
    fn gateway_ids_are_bounded() {
        let s = state(&[]);
        assert!(matches!(s.report_stream_opened(&"x".repeat(MAX_GATEWAY_ID + 1)), Err(GatewayError::BadId(_))));
        assert!(matches!(s.report_stream_opened(""), Err(GatewayError::BadId(_))));
        assert!(matches!(s.gateway_connected("a b"), Err(GatewayError::BadId(_))));
        for i in 0..MAX_GATEWAYS {
            s.gateway_connected(&format!("gw-{i}")).unwrap();
        }
        assert_eq!(s.report_stream_opened("one-too-many"), Err(GatewayError::TooMany), "every id has a stream");
        assert!(s.report_stream_opened("gw-7").is_ok(), "known ids still work");
    }

    #[test]
    fn a_new_gateway_takes_the_place_of_the_one_idle_longest() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        // A token holder registers every id it may, each with a stream that then closes.
        for i in 0..MAX_GATEWAYS {
            let id = format!("gw-{i}");
            s.gateway_connected(&id).unwrap();
            s.watch_closed(&id);
        }
        s.report_stream_opened("gw-1").unwrap(); // one still reporting: never evicted
                                                 // A restarted Envoy (a new id) is admitted: the id idle longest (gw-0) is forgotten.
        s.gateway_connected("restarted").unwrap();
        s.report_stream_opened("restarted").unwrap();
        let known = |id: &str| s.lock().gateways().contains(id);
        assert!(known("restarted") && known("gw-1") && !known("gw-0") && known("gw-2"));
        assert_eq!(s.lock().gateways().len(), MAX_GATEWAYS);
        // Ids without a stream expire after GATEWAY_TTL; those with one never do.
        assert_eq!(s.prune_gateways(Instant::now() + GATEWAY_TTL + Duration::from_secs(1)), 2);
        assert!(known("restarted") && known("gw-1"));
    }

    #[test]
    fn watch_streams_per_id_are_bounded() {
        let s = state(&[]);
        for _ in 0..MAX_WATCHES {
            s.gateway_connected("gw").unwrap();
        }
        assert_eq!(s.gateway_connected("gw"), Err(GatewayError::TooManyWatches));
        s.watch_closed("gw");
        assert!(s.gateway_connected("gw").is_ok(), "one closed: room for one more");
        assert!(s.gateway_connected("other").is_ok(), "per id");
    }
}
