//! The gateways' owner: the gateways (one per Envoy) kvmesh-cp hears from, by id (bounded in
//! length and in number: kvmesh-cp takes one gRPC token, so the bound is that token's), their
//! open `Watch` streams (bounded per id) and `Report` streams, when each was last seen, and the
//! budget of index hashes each may report. Only this file writes them. A new id is always
//! admitted while some id has no stream: the one idle longest is forgotten to make room, so a
//! restarted Envoy (a new id) is never refused because of ids no one uses.

use std::collections::HashMap;
use std::time::{Duration, Instant};

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

/// What kvmesh-cp keeps about one gateway (one Envoy).
#[derive(Debug)]
struct Gateway {
    seen: Instant,
    /// Open `Report` streams under this id (two while the stream moves between VMs).
    reporting: u32,
    /// Open `Watch` streams under this id (at most [`MAX_WATCHES`]).
    watching: u32,
    /// The insert budget: a token bucket of hashes.
    budget: f64,
    budget_at: Instant,
}

impl Gateway {
    fn idle(&self) -> bool {
        self.reporting == 0 && self.watching == 0
    }
}

/// Which stream a gateway opens.
#[derive(Clone, Copy)]
pub(super) enum Stream {
    Report,
    Watch,
}

/// The gateways kvmesh-cp tracks (read through `&Gateways`, written through `&mut`).
#[derive(Default)]
pub(super) struct Gateways(HashMap<String, Gateway>);

impl Gateways {
    // ---- reads

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn ids(&self) -> Vec<&String> {
        self.0.keys().collect()
    }

    #[cfg(test)]
    pub(super) fn contains(&self, id: &str) -> bool {
        self.0.contains_key(id)
    }

    /// The gateways last seen [`INFLIGHT_TTL`] or more before `now`.
    pub(super) fn silent(&self, now: Instant) -> Vec<String> {
        self.0
            .iter()
            .filter(|(_, g)| now.saturating_duration_since(g.seen) >= INFLIGHT_TTL)
            .map(|(id, _)| id.clone())
            .collect()
    }

    // ---- writes

    /// A `stream` of `gateway` opened (at most [`MAX_WATCHES`] `Watch` streams per id): its
    /// entry, made if new with a full budget of `burst` hashes, seen now. A new id takes the
    /// place of the one idle longest when [`MAX_GATEWAYS`] are kept: that id is returned, for
    /// what it said to be forgotten too.
    pub(super) fn opened(&mut self, gateway: &str, stream: Stream, burst: f64) -> Result<Option<String>, GatewayError> {
        if matches!(stream, Stream::Watch) && self.0.get(gateway).is_some_and(|g| g.watching >= MAX_WATCHES) {
            return Err(GatewayError::TooManyWatches);
        }
        let now = Instant::now();
        let mut forgotten = None;
        if !self.0.contains_key(gateway) && self.0.len() >= MAX_GATEWAYS {
            let idle = self.0.iter().filter(|(_, g)| g.idle()).min_by_key(|(_, g)| g.seen).map(|(id, _)| id.clone());
            let Some(idle) = idle else { return Err(GatewayError::TooMany) };
            tracing::info!(gateway = %idle, "gateway id forgotten to admit a new one (idle longest)");
            self.0.remove(&idle);
            forgotten = Some(idle);
        }
        let g = self.0.entry(gateway.to_string()).or_insert(Gateway {
            seen: now,
            reporting: 0,
            watching: 0,
            budget: burst,
            budget_at: now,
        });
        g.seen = now;
        match stream {
            Stream::Report => g.reporting += 1,
            Stream::Watch => g.watching += 1,
        }
        Ok(forgotten)
    }

    /// A `stream` of `gateway` ended. Says whether it was its last `Report` stream (false for
    /// an id not tracked).
    pub(super) fn closed(&mut self, gateway: &str, stream: Stream) -> bool {
        let Some(g) = self.0.get_mut(gateway) else { return false };
        g.seen = Instant::now();
        match stream {
            Stream::Report => {
                g.reporting = g.reporting.saturating_sub(1);
                g.reporting == 0
            }
            Stream::Watch => {
                g.watching = g.watching.saturating_sub(1);
                false
            }
        }
    }

    /// Forgets the gateways without a stream last seen [`GATEWAY_TTL`] or more before `now`;
    /// returns them.
    pub(super) fn remove_gone(&mut self, now: Instant) -> Vec<String> {
        let gone: Vec<String> = self
            .0
            .iter()
            .filter(|(_, g)| g.idle() && now.saturating_duration_since(g.seen) >= GATEWAY_TTL)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            self.0.remove(id);
        }
        gone
    }

    /// How many hashes `gateway` may report now: its budget refilled at `rate` per second
    /// (up to `burst`) for the time since it last reported, within `per_report` (a gateway
    /// not tracked: `per_report`). It is seen now.
    pub(super) fn allowance(&mut self, gateway: &str, rate: f64, burst: f64, per_report: usize) -> usize {
        let now = Instant::now();
        match self.0.get_mut(gateway) {
            Some(g) => {
                g.seen = now;
                g.budget = (g.budget + now.saturating_duration_since(g.budget_at).as_secs_f64() * rate).min(burst);
                g.budget_at = now;
                (g.budget as usize).min(per_report)
            }
            // Reports outside a tracked stream (tests): the per-report limit only.
            None => per_report,
        }
    }

    /// `taken` hashes of `gateway`'s budget are spent.
    pub(super) fn spend(&mut self, gateway: &str, taken: usize) {
        if let Some(g) = self.0.get_mut(gateway) {
            g.budget = (g.budget - taken as f64).max(0.0);
        }
    }
}
