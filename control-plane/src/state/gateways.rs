//! The gateways (one per Envoy) kvmesh-cp hears from: their ids (bounded in length and in
//! number), their `Report` streams (a gateway's in-flight counts and circuit breakers count
//! while one is open and the gateway is not silent), how long they are remembered, and the
//! budget of index hashes each may report.

use std::time::{Duration, Instant};

use super::store::{Gateway, Inner, State};

/// Most gateway ids kvmesh-cp keeps at once; past it, new ids are refused.
pub const MAX_GATEWAYS: usize = 1024;
/// Longest gateway id, in bytes.
pub const MAX_GATEWAY_ID: usize = 128;
/// A reporting gateway silent this long no longer counts in flight.
pub const INFLIGHT_TTL: Duration = Duration::from_secs(30);
/// A gateway gone this long is forgotten (with the cumulative counts it reported: should it
/// come back after that, its counts are taken anew).
pub const GATEWAY_TTL: Duration = Duration::from_secs(3600);

/// Why a gateway is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum GatewayError {
    BadId(String),
    TooMany,
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadId(why) => write!(f, "bad gateway_id: {why}"),
            Self::TooMany => write!(f, "kvmesh-cp already tracks {MAX_GATEWAYS} gateways"),
        }
    }
}

/// A gateway id is 1 to [`MAX_GATEWAY_ID`] visible ASCII characters.
pub fn check_gateway_id(id: &str) -> Result<(), GatewayError> {
    if id.is_empty() || id.len() > MAX_GATEWAY_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(GatewayError::BadId(format!("must be 1 to {MAX_GATEWAY_ID} visible ASCII characters")));
    }
    Ok(())
}

impl State {
    /// A `Report` stream of `gateway` opened: it is tracked (up to [`MAX_GATEWAYS`]) until the
    /// last of its streams closes.
    pub fn report_stream_opened(&self, gateway: &str) -> Result<(), GatewayError> {
        check_gateway_id(gateway)?;
        let mut inner = self.lock();
        let now = Instant::now();
        let burst = self.burst();
        if !inner.gateways.contains_key(gateway) && inner.gateways.len() >= MAX_GATEWAYS {
            return Err(GatewayError::TooMany);
        }
        let g = inner.gateways.entry(gateway.to_string()).or_insert(Gateway {
            seen: now,
            reporting: 0,
            budget: burst,
            budget_at: now,
        });
        g.reporting += 1;
        g.seen = now;
        Ok(())
    }

    /// A `Report` stream of `gateway` ended. When it was the last one, the gateway's in-flight
    /// counts are dropped (its requests no longer count as load), and so are its circuit
    /// breakers; its cumulative counts are kept, so that the same gateway reporting again is
    /// not counted twice.
    pub fn report_stream_closed(&self, gateway: &str) {
        let mut inner = self.lock();
        let Some(g) = inner.gateways.get_mut(gateway) else { return };
        g.reporting = g.reporting.saturating_sub(1);
        g.seen = Instant::now();
        if g.reporting == 0 {
            Self::drop_inflight(&mut inner, gateway);
        }
    }

    /// Forgets what `gateway` said about now: its in-flight counts and breaker states.
    fn drop_inflight(inner: &mut Inner, gateway: &str) {
        let mut changed = false;
        for w in inner.workers.values_mut() {
            w.breakers.remove(gateway);
            if w.inflight.remove(gateway).is_some_and(|n| n != 0) && w.polled_load.is_none() {
                changed = true;
            }
        }
        inner.workers_dirty |= changed;
    }

    /// Forgets the in-flight counts of gateways silent for [`INFLIGHT_TTL`] and gateways gone
    /// for [`GATEWAY_TTL`]. Returns how many gateways are left.
    pub fn prune_gateways(&self, now: Instant) -> usize {
        let mut inner = self.lock();
        let silent: Vec<String> = inner
            .gateways
            .iter()
            .filter(|(_, g)| now.saturating_duration_since(g.seen) >= INFLIGHT_TTL)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &silent {
            Self::drop_inflight(&mut inner, id);
        }
        let gone: Vec<String> = inner
            .gateways
            .iter()
            .filter(|(_, g)| g.reporting == 0 && now.saturating_duration_since(g.seen) >= GATEWAY_TTL)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            inner.gateways.remove(id);
            for w in inner.workers.values_mut() {
                w.last_counts.remove(id);
            }
        }
        inner.gateways.len()
    }

    /// A gateway opened `Watch` (it is listed in `/snapshot`, not tracked past its TTL).
    pub fn gateway_connected(&self, id: &str) -> Result<(), GatewayError> {
        check_gateway_id(id)?;
        let mut inner = self.lock();
        if !inner.gateways.contains_key(id) && inner.gateways.len() >= MAX_GATEWAYS {
            return Err(GatewayError::TooMany);
        }
        let now = Instant::now();
        let burst = self.burst();
        inner
            .gateways
            .entry(id.to_string())
            .or_insert(Gateway { seen: now, reporting: 0, budget: burst, budget_at: now })
            .seen = now;
        Ok(())
    }

    /// Hashes a gateway may report at once (four seconds' worth).
    fn burst(&self) -> f64 {
        self.settings.limits.max_inserts_per_sec as f64 * 4.0
    }

    /// How many hashes `gateway` may report now: its budget refilled for the time since it
    /// last reported, within the per-report limit.
    pub(super) fn insert_allowance(&self, inner: &mut Inner, gateway: &str) -> usize {
        let now = Instant::now();
        let (rate, burst) = (self.settings.limits.max_inserts_per_sec as f64, self.burst());
        match inner.gateways.get_mut(gateway) {
            Some(g) => {
                g.seen = now;
                g.budget = (g.budget + now.saturating_duration_since(g.budget_at).as_secs_f64() * rate).min(burst);
                g.budget_at = now;
                (g.budget as usize).min(self.settings.limits.max_inserts_per_report)
            }
            // Reports outside a tracked stream (tests): the per-report limit only.
            None => self.settings.limits.max_inserts_per_report,
        }
    }
}

/// `taken` hashes of `gateway`'s budget are spent.
pub(super) fn spend_allowance(inner: &mut Inner, gateway: &str, taken: usize) {
    if let Some(g) = inner.gateways.get_mut(gateway) {
        g.budget = (g.budget - taken as f64).max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::registry::tests::state;

    #[test]
    fn gateway_ids_are_bounded() {
        let s = state(&[]);
        assert!(matches!(s.report_stream_opened(&"x".repeat(MAX_GATEWAY_ID + 1)), Err(GatewayError::BadId(_))));
        assert!(matches!(s.report_stream_opened(""), Err(GatewayError::BadId(_))));
        assert!(matches!(s.gateway_connected("a b"), Err(GatewayError::BadId(_))));
        for i in 0..MAX_GATEWAYS {
            s.gateway_connected(&format!("gw-{i}")).unwrap();
        }
        assert_eq!(s.report_stream_opened("one-too-many"), Err(GatewayError::TooMany));
        assert!(s.report_stream_opened("gw-7").is_ok(), "known ids still work");
    }
}
