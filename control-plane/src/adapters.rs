//! `--lora-adapter NAME@BASE=PATH`: LoRA adapters kvmesh-cp keeps loaded. A request for an
//! adapter no worker serves is the gateway's 404; with the adapter configured here, kvmesh-cp
//! loads it on the least-loaded healthy worker serving its base model whenever no healthy
//! worker serves it (at start, after that worker is gone, after it was unloaded), through the
//! engine's own API (vLLM's `POST /v1/load_lora_adapter`, SGLang's `POST /load_lora_adapter`,
//! `{"lora_name", "lora_path"}`), then reads the worker's `/v1/models` again so the filters
//! route the adapter there from the next snapshot. Workers that already serve it are left
//! alone: which adapters a worker keeps is otherwise the operator's (or the engine's) call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::settings::AdapterSpec;
use crate::state::{State, WorkerEntry};

/// Where each adapter no healthy worker serves is to be loaded: the least-loaded healthy
/// worker serving its base model (as a base model, not as another adapter), if any.
pub fn placements<'a>(specs: &'a [AdapterSpec], workers: &[WorkerEntry]) -> Vec<(&'a AdapterSpec, u32, String)> {
    let serves = |w: &WorkerEntry, name: &str, base: bool| {
        w.served().iter().any(|m| m.id == name && (!base || m.parent.is_none()))
    };
    specs
        .iter()
        .filter(|spec| !workers.iter().any(|w| w.healthy && serves(w, &spec.name, false)))
        .filter_map(|spec| {
            let host =
                workers.iter().filter(|w| w.healthy && serves(w, &spec.base, true)).min_by_key(|w| (w.load(), w.id))?;
            let sglang = host.served().iter().any(|m| m.id == spec.base && m.owned_by == "sglang");
            let path = if sglang { "/load_lora_adapter" } else { "/v1/load_lora_adapter" };
            Some((spec, host.id, path.to_string()))
        })
        .collect()
}

/// How long after a failed load the same adapter is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// How often the adapters are checked.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Keeps every configured adapter loaded somewhere (see the module's doc).
pub async fn keep_loaded(state: Arc<State>, specs: Vec<AdapterSpec>) {
    let mut failed: HashMap<String, Instant> = HashMap::new();
    let mut tick = tokio::time::interval(CHECK_EVERY);
    let timeout = Duration::from_secs(state.settings.health_timeout_secs.max(1));
    loop {
        tick.tick().await;
        let workers = state.workers();
        for (spec, id, path) in placements(&specs, &workers) {
            if failed.get(&spec.name).is_some_and(|at| at.elapsed() < RETRY_AFTER) {
                continue;
            }
            let Some(addr) = workers
                .iter()
                .find(|w| w.id == id)
                .and_then(|w| kvmesh_core::worker::socket_addr(&w.url).ok())
                .map(|a| a.to_string())
            else {
                continue;
            };
            let body = serde_json::json!({"lora_name": spec.name, "lora_path": spec.path}).to_string();
            let answer = crate::probe::post_json(&addr, &path, &body, timeout, state.settings.worker_key()).await;
            // An engine that has it already (a load racing another) says so with a 400.
            let loaded = match &answer {
                Ok((200..=299, _)) => true,
                Ok((400, text)) => text.contains("already"),
                _ => false,
            };
            if loaded { &state.counters.adapter_loads } else { &state.counters.adapter_load_failures }.inc();
            if loaded {
                tracing::info!(adapter = %spec.name, base = %spec.base, worker = %addr, "LoRA adapter loaded");
                failed.remove(&spec.name);
                // Every data-parallel rank of that worker serves it now.
                let ids: Vec<u32> = state.ranks_of(id).into_iter().map(|(id, _)| id).collect();
                crate::probe::poll_models(&state, &ids, &addr, timeout).await;
            } else {
                tracing::warn!(adapter = %spec.name, worker = %addr, ?answer, "LoRA adapter not loaded; retrying in 5 s");
                failed.insert(spec.name.clone(), Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_the_adapter_its_base_and_its_path() {
        let spec: AdapterSpec = "sql@llama=/adapters/sql".parse().unwrap();
        assert_eq!(spec, AdapterSpec { name: "sql".into(), base: "llama".into(), path: "/adapters/sql".into() });
        for bad in ["sql=/a", "sql@llama", "@llama=/a", "sql@=/a", "sql@llama=", "x@x=/a"] {
            assert!(bad.parse::<AdapterSpec>().is_err(), "{bad}");
        }
    }
}
