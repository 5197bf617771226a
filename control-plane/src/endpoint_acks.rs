//! What every Envoy has acknowledged of the workers' endpoints (EDS), so that a worker table
//! naming a new or healed worker reaches the filters only once Envoy's cluster holds it.
//!
//! A filter names its pick in `x-gateway-destination-endpoint`, and Envoy's `override_host`
//! load balancer can send a request only to an endpoint its cluster lists healthy. The table
//! (the `Watch` stream) and the endpoints (EDS) are two streams: without this, a filter could
//! pick a worker a few milliseconds before Envoy had it, and the request would fail (or, with
//! a fallback load balancer, go to any endpoint: a worker of another model or role).
//!
//! Each EDS stream records the healthy endpoints of the last assignment Envoy acknowledged; a
//! `Watch` stream about to send a table waits until every stream that has acknowledged one
//! lists the table's healthy workers, at most `--eds-wait-ms`. A stream that has acknowledged
//! nothing yet is not waited for (Envoy does not start its listeners before its clusters'
//! first endpoints, and after a control-plane failover it keeps the endpoints it had).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

/// An endpoint as EDS sends it: IP address and port.
pub type Endpoint = (String, u32);

/// The endpoints every EDS stream acknowledged, and a signal when that changes.
pub struct EndpointAcks {
    streams: Mutex<Streams>,
    changed: watch::Sender<u64>,
    /// The longest a table waits (`--eds-wait-ms`; zero: it does not wait).
    wait: Duration,
    /// Tables held now, waiting for an acknowledgement (`kvmesh_tables_held_for_endpoints`).
    held: Gauge,
}

#[derive(Default)]
struct Streams {
    next_id: u64,
    /// Healthy endpoints each stream's Envoy acknowledged last (`None`: nothing yet).
    acked: BTreeMap<u64, Option<BTreeSet<Endpoint>>>,
}

/// One EDS stream's entry; the stream leaves the registry when this is dropped.
pub struct AckStream {
    acks: Arc<EndpointAcks>,
    id: u64,
}

impl EndpointAcks {
    pub fn new(wait: Duration, held: Gauge) -> Arc<Self> {
        Arc::new(Self { streams: Mutex::new(Streams::default()), changed: watch::Sender::new(0), wait, held })
    }

    fn lock(&self) -> MutexGuard<'_, Streams> {
        self.streams.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The longest a table waits (`--eds-wait-ms`).
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// A new EDS stream, which has acknowledged nothing yet.
    pub fn open(self: &Arc<Self>) -> AckStream {
        let mut streams = self.lock();
        let id = streams.next_id;
        streams.next_id += 1;
        streams.acked.insert(id, None);
        AckStream { acks: self.clone(), id }
    }

    /// Whether every stream that acknowledged an assignment lists all of `needed` healthy.
    pub fn covers(&self, needed: &[Endpoint]) -> bool {
        self.missing(needed).is_empty()
    }

    /// Those of `needed` that some stream which acknowledged an assignment does not list
    /// healthy.
    pub fn missing(&self, needed: &[Endpoint]) -> Vec<Endpoint> {
        let streams = self.lock();
        let acked: Vec<&BTreeSet<Endpoint>> = streams.acked.values().flatten().collect();
        needed.iter().filter(|e| acked.iter().any(|a| !a.contains(*e))).cloned().collect()
    }

    /// Waits until [`covers`](Self::covers) holds, at most the configured wait. Returns false
    /// when it gave up (a zero wait never waits, and never gives up).
    pub async fn wait_for(&self, needed: &[Endpoint]) -> bool {
        if needed.is_empty() || self.wait.is_zero() {
            return true;
        }
        // Subscribed before each check, so that an acknowledgement in between wakes it.
        let mut changes = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + self.wait;
        let mut holding = None;
        loop {
            changes.borrow_and_update();
            if self.covers(needed) {
                return true;
            }
            holding.get_or_insert_with(|| Held::new(&self.held));
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                // Timed out (the sender lives as long as `self`).
                _ => return self.covers(needed),
            }
        }
    }
}

/// One table counted in the held gauge while it waits (however the wait ends).
struct Held(Gauge);

impl Held {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl AckStream {
    /// Envoy acknowledged an assignment of these endpoints (`(ip, port, healthy)`).
    pub fn acked(&self, endpoints: &[(String, u32, bool)]) {
        let healthy = endpoints.iter().filter(|(_, _, h)| *h).map(|(ip, port, _)| (ip.clone(), *port)).collect();
        self.acks.lock().acked.insert(self.id, Some(healthy));
        self.acks.bump();
    }
}

impl Drop for AckStream {
    fn drop(&mut self) {
        self.acks.lock().acked.remove(&self.id);
        self.acks.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(port: u32) -> Endpoint {
        ("127.0.0.1".to_string(), port)
    }

    #[tokio::test]
    async fn a_table_waits_for_every_stream_that_acknowledged_and_no_longer() {
        let acks = EndpointAcks::new(Duration::from_secs(60), Gauge::default());
        // No stream, or one that has acknowledged nothing: nothing to wait for.
        assert!(acks.covers(&[ep(1)]));
        let a = acks.open();
        assert!(acks.wait_for(&[ep(1)]).await);
        a.acked(&[("127.0.0.1".into(), 1, true), ("127.0.0.1".into(), 2, false)]);
        let b = acks.open();
        b.acked(&[]);
        // Port 2 is listed unhealthy: override_host would not pick it.
        assert!(!acks.covers(&[ep(1)]) && !acks.covers(&[ep(2)]));
        let waiting = {
            let acks = acks.clone();
            tokio::spawn(async move { acks.wait_for(&[ep(1)]).await })
        };
        b.acked(&[("127.0.0.1".into(), 1, true)]);
        assert!(waiting.await.unwrap());
        assert_eq!(acks.missing(&[ep(1), ep(2)]), vec![ep(2)]);
        // A stream that ends is no longer waited for.
        let c = acks.open();
        c.acked(&[]);
        assert!(!acks.covers(&[ep(1)]));
        drop(c);
        assert!(acks.covers(&[ep(1)]));
        drop((a, b));
    }

    #[tokio::test]
    async fn the_wait_is_bounded() {
        let acks = EndpointAcks::new(Duration::from_millis(20), Gauge::default());
        let a = acks.open();
        a.acked(&[]);
        assert!(!acks.wait_for(&[ep(1)]).await, "gave up after the wait");
        let no_wait = EndpointAcks::new(Duration::ZERO, Gauge::default());
        let b = no_wait.open();
        b.acked(&[]);
        assert!(no_wait.wait_for(&[ep(1)]).await, "zero: does not wait");
    }
}
