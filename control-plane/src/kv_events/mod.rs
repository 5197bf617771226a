//! Ingestion of the engines' own KV-cache events (vLLM's and SGLang's ZMQ publishers), once
//! for every gateway: one subscriber per worker that has a publisher, its blocks re-keyed onto
//! the gateways' text-block chain (`rekey.rs`) and entered in the global index for that
//! worker (`State::engine_stored`), removed when the engine removes them, all of them dropped
//! when it clears, restarts (its sequence starts again) or leaves the registry.
//!
//! `wire.rs` the formats, `zmtp.rs` the sockets' protocol (bounded), `vocab.rs` token ids as bytes, `rekey.rs` the chain, `subscriber.rs`
//! the sockets, sequence numbers, gaps and replays; this file which workers have a publisher
//! (`--kv-events-*`, the add-worker API), the tasks, the metrics.

pub mod chat;
pub mod rekey;
mod subscriber;
pub mod vocab;
pub mod wire;
pub mod zmtp;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::label::LabelValue;
use crate::settings::{KvEventEndpoints, KvEventSettings};
use crate::state::{State, WorkerEntry};
use rekey::Rekeyer;
use vocab::Vocab;

/// The labels of the per-worker KV-event series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct EventLabels {
    pub worker: LabelValue,
}

/// The KV-event series.
#[derive(Default)]
pub struct EventMetrics {
    pub received: Family<EventLabels, Counter>,
    pub applied: Family<EventLabels, Counter>,
    pub refused: Family<EventLabels, Counter>,
    pub gaps: Family<EventLabels, Counter>,
    pub replays: Family<EventLabels, Counter>,
    pub restarts: Family<EventLabels, Counter>,
    pub dropped: Family<EventLabels, Counter>,
    pub lag_ms: Family<EventLabels, Gauge>,
    pub blocks: Family<EventLabels, Gauge>,
}

impl EventMetrics {
    /// Registers the families.
    pub fn register(&self, r: &mut Registry) {
        r.register("kvmesh_kv_events_received", "KV events received from the engines", self.received.clone());
        r.register("kvmesh_kv_events_applied", "KV events applied to the global index", self.applied.clone());
        r.register(
            "kvmesh_kv_events_refused",
            "Engine blocks not applied (unknown parent or token, LoRA, another tier, over the bound)",
            self.refused.clone(),
        );
        r.register("kvmesh_kv_events_gaps", "Gaps found in a publisher's sequence numbers", self.gaps.clone());
        r.register("kvmesh_kv_events_replays", "Replays asked of a publisher's replay socket", self.replays.clone());
        r.register(
            "kvmesh_kv_events_restarts",
            "Engine restarts seen (sequence started again): the worker's entries dropped",
            self.restarts.clone(),
        );
        r.register(
            "kvmesh_kv_events_dropped",
            "Live batches dropped over the per-worker rate bound (32 MiB/s): the worker's entries dropped",
            self.dropped.clone(),
        );
        r.register(
            "kvmesh_kv_events_lag_ms",
            "Milliseconds from the engine's batch timestamp to its application, at the last batch",
            self.lag_ms.clone(),
        );
        r.register("kvmesh_kv_events_engine_blocks", "Engine blocks known per worker", self.blocks.clone());
    }
}

struct Running {
    endpoints: KvEventEndpoints,
    /// The pool seed its blocks are keyed from.
    seed: u64,
    task: tokio::task::JoinHandle<()>,
    rekeyer: Arc<Mutex<Rekeyer>>,
}

/// The subscribers.
pub struct KvEvents {
    settings: KvEventSettings,
    /// The flags' endpoints by worker URL (the first entry for a URL wins).
    by_url: HashMap<String, KvEventEndpoints>,
    block_size: usize,
    vocab: Arc<Vocab>,
    running: Mutex<HashMap<u32, Running>>,
    pub metrics: EventMetrics,
}

impl KvEvents {
    /// From the settings (the tokenizer read now: an error stops kvmesh-cp at startup).
    pub fn new(settings: &KvEventSettings, block_size: usize) -> Result<Arc<Self>, vocab::VocabError> {
        let vocab = match settings.tokenizer.as_deref() {
            Some(path) => {
                let v = Vocab::load(path)?;
                tracing::info!(%path, ids = v.len(), "KV events: tokenizer read");
                v
            }
            None => Vocab::default(),
        };
        let mut by_url = HashMap::new();
        for (url, e) in &settings.workers {
            by_url.entry(url.clone()).or_insert_with(|| e.clone());
        }
        Ok(Arc::new(Self {
            settings: settings.clone(),
            by_url,
            block_size,
            vocab: Arc::new(vocab),
            running: Mutex::default(),
            metrics: EventMetrics::default(),
        }))
    }

    /// Where worker `w` publishes, if anywhere: its own (a pod annotation, the add-worker
    /// API), the flag's for its URL, the template.
    fn endpoints_of(&self, w: &WorkerEntry) -> Option<KvEventEndpoints> {
        let own = w.kv_events.clone().or_else(|| self.by_url.get(&w.url).cloned());
        let e = match own {
            Some(e) => e,
            None => {
                let host = host_of(&w.url)?;
                KvEventEndpoints {
                    publisher: self.settings.endpoint.as_deref()?.replace("{host}", host),
                    replay: self.settings.replay_endpoint.as_deref().map(|r| r.replace("{host}", host)),
                }
            }
        };
        let rank = w.dp_rank.unwrap_or(0);
        Some(KvEventEndpoints {
            publisher: offset_port(&e.publisher, rank)?,
            replay: e.replay.as_deref().and_then(|r| offset_port(r, rank)),
        })
    }

    /// Whether gateway block `hash` of worker `worker` is held through its engine's events.
    pub fn holds(&self, worker: u32, hash: u64) -> bool {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.get(&worker).is_some_and(|r| r.rekeyer.lock().is_ok_and(|k| k.holds(hash)))
    }

    /// Starts a subscriber for each worker with a publisher, stops those of workers gone
    /// (their entries went with them), whose publisher changed, or whose pool's seed changed
    /// (the model names it serves became known): that one starts again at once, and its
    /// replay on connect brings back what the engine holds, keyed anew; every 200 ms.
    pub async fn run(self: Arc<Self>, state: Arc<State>) {
        loop {
            self.sync(&state);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn sync(self: &Arc<Self>, state: &Arc<State>) {
        let workers = state.workers();
        let seeds = state.engine_seeds();
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let wanted: HashMap<u32, (KvEventEndpoints, u64)> =
            workers.iter().filter_map(|w| Some((w.id, (self.endpoints_of(w)?, *seeds.get(&w.id)?)))).collect();
        running.retain(|id, r| {
            let keep = wanted.get(id).is_some_and(|(e, seed)| *e == r.endpoints && *seed == r.seed);
            if !keep {
                r.task.abort();
                let gone = r.rekeyer.lock().map(|mut k| k.clear()).unwrap_or_default();
                state.engine_removed(*id, gone);
                tracing::info!(worker = id, "KV-event subscriber stopped");
            }
            keep
        });
        let by_id: HashMap<u32, &WorkerEntry> = workers.iter().map(|w| (w.id, w)).collect();
        for (id, (endpoints, seed)) in wanted {
            if running.contains_key(&id) {
                continue;
            }
            let Some(w) = by_id.get(&id) else { continue };
            let rekeyer =
                Arc::new(Mutex::new(Rekeyer::new(self.vocab.clone(), self.block_size, seed, self.settings.max_blocks)));
            let sub = subscriber::Subscriber {
                state: state.clone(),
                events: self.clone(),
                worker: id,
                labels: EventLabels { worker: LabelValue::from(w.name()) },
                endpoints: endpoints.clone(),
                topic: self.settings.topic.clone(),
                rekeyer: rekeyer.clone(),
            };
            tracing::info!(worker = %w.name(), publisher = %endpoints.publisher, "KV-event subscriber starting");
            let task = tokio::spawn(sub.run());
            running.insert(id, Running { endpoints, seed, task, rekeyer });
        }
    }
}

/// The host of `http://host:port` (an IPv6 one in brackets kept).
fn host_of(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    Some(authority.rsplit_once(':').map_or(authority, |(h, _)| h))
}

/// `tcp://host:port` with the port moved up by `rank` (vLLM's data-parallel ranks).
fn offset_port(endpoint: &str, rank: u32) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_string());
    }
    let (base, port) = endpoint.rsplit_once(':')?;
    let port = u16::try_from(u32::from(port.parse::<u16>().ok()?).checked_add(rank)?).ok()?;
    Some(format!("{base}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_rank_ports() {
        assert_eq!(host_of("http://10.0.0.7:8000"), Some("10.0.0.7"));
        assert_eq!(host_of("http://[::1]:8000"), Some("[::1]"));
        assert_eq!(offset_port("tcp://10.0.0.7:5557", 0).as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(offset_port("tcp://10.0.0.7:5557", 3).as_deref(), Some("tcp://10.0.0.7:5560"));
        assert_eq!(offset_port("tcp://10.0.0.7:65535", 1), None);
    }
}
