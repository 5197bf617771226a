//! The gateways (one per Envoy) kvmesh-cp hears from: their ids (bounded in length and in
//! number: kvmesh-cp takes one gRPC token, so the bound is that token's), their `Watch`
//! streams (bounded per id) and `Report` streams (a gateway's in-flight counts and circuit
//! breakers count while one is open and the gateway is not silent), how long an id without
//! streams is remembered, and the budget of index hashes each may report. A new id is always
//! admitted while some id has no stream: the one idle longest is forgotten to make room, so a
//! restarted Envoy (a new id) is never refused because of ids no one uses.

use std::time::{Duration, Instant};

use super::store::{Gateway, Inner, State};

/// Most gateway ids kvmesh-cp keeps at once; past it, a new id takes the place of the one idle
/// longest, and is refused only when every id has a stream open.
pub const MAX_GATEWAYS: usize = 1024;
/// Most `Watch` streams open at once under one gateway id (one Envoy holds one, two while the
/// streams move between its threads).
pub const MAX_WATCHES: u32 = 4;
/// Longest gateway id, in bytes.
pub const MAX_GATEWAY_ID: usize = 128;
/// A reporting gateway silent this long no longer counts in flight.
pub const INFLIGHT_TTL: Duration = Duration::from_secs(30);
/// A gateway with no stream open this long is forgotten (with the cumulative counts it
/// reported: should it come back after that, its counts are taken anew).
pub const GATEWAY_TTL: Duration = Duration::from_secs(300);

/// Why a gateway is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum GatewayError {
    BadId(String),
    TooMany,
    TooManyWatches,
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadId(why) => write!(f, "bad gateway_id: {why}"),
            Self::TooMany => write!(f, "kvmesh-cp already tracks {MAX_GATEWAYS} gateways, each with a stream open"),
            Self::TooManyWatches => write!(f, "this gateway_id already has {MAX_WATCHES} Watch streams open"),
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
        let g = self.admit(&mut inner, gateway)?;
        g.reporting += 1;
        Ok(())
    }

    /// `gateway`'s entry, made if new (a new id takes the place of the one idle longest when
    /// [`MAX_GATEWAYS`] are kept), seen now.
    fn admit<'a>(&self, inner: &'a mut Inner, gateway: &str) -> Result<&'a mut Gateway, GatewayError> {
        let now = Instant::now();
        if !inner.gateways.contains_key(gateway) && inner.gateways.len() >= MAX_GATEWAYS {
            let idle = inner
                .gateways
                .iter()
                .filter(|(_, g)| g.reporting == 0 && g.watching == 0)
                .min_by_key(|(_, g)| g.seen)
                .map(|(id, _)| id.clone());
            let Some(idle) = idle else { return Err(GatewayError::TooMany) };
            tracing::info!(gateway = %idle, "gateway id forgotten to admit a new one (idle longest)");
            Self::forget(inner, &idle);
        }
        let burst = self.burst();
        let g = inner.gateways.entry(gateway.to_string()).or_insert(Gateway {
            seen: now,
            reporting: 0,
            watching: 0,
            budget: burst,
            budget_at: now,
        });
        g.seen = now;
        Ok(g)
    }

    /// Forgets `gateway`: its id, in-flight counts, breakers and the cumulative counts it
    /// reported.
    fn forget(inner: &mut Inner, gateway: &str) {
        Self::drop_inflight(inner, gateway);
        inner.gateways.remove(gateway);
        for w in inner.workers.values_mut() {
            w.last_counts.remove(gateway);
        }
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
            .filter(|(_, g)| {
                g.reporting == 0 && g.watching == 0 && now.saturating_duration_since(g.seen) >= GATEWAY_TTL
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            Self::forget(&mut inner, id);
        }
        inner.gateways.len()
    }

    /// A gateway opened `Watch` (at most [`MAX_WATCHES`] at once per id): tracked until the
    /// stream closes ([`watch_closed`](Self::watch_closed)), then for [`GATEWAY_TTL`].
    pub fn gateway_connected(&self, id: &str) -> Result<(), GatewayError> {
        check_gateway_id(id)?;
        let mut inner = self.lock();
        if inner.gateways.get(id).is_some_and(|g| g.watching >= MAX_WATCHES) {
            return Err(GatewayError::TooManyWatches);
        }
        let g = self.admit(&mut inner, id)?;
        g.watching += 1;
        Ok(())
    }

    /// A `Watch` stream of `id` ended.
    pub fn watch_closed(&self, id: &str) {
        let mut inner = self.lock();
        if let Some(g) = inner.gateways.get_mut(id) {
            g.watching = g.watching.saturating_sub(1);
            g.seen = Instant::now();
        }
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
        let known = |id: &str| s.lock().gateways.contains_key(id);
        assert!(known("restarted") && known("gw-1") && !known("gw-0") && known("gw-2"));
        assert_eq!(s.lock().gateways.len(), MAX_GATEWAYS);
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
