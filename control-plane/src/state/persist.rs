//! `--state-file`: what it keeps across restarts, read once at the start and written (a new
//! file renamed over the old one) on every change of the registry.

use std::collections::BTreeMap;
use std::path::Path;

use kvmesh_proto::v1::Role;

use super::store::State;
use super::worker::{role_name, Source};

/// What `--state-file` keeps across restarts: the workers added through the API, and every
/// worker's id by URL, so that static, API and discovered workers keep their ids (filters'
/// index entries stay right) and ids are never reused.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Persisted {
    pub next_id: u32,
    pub ids: BTreeMap<String, u32>,
    pub api_workers: Vec<PersistedWorker>,
}

/// A worker added through the API, as the state file keeps it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct PersistedWorker {
    pub url: String,
    pub role: String,
    pub bootstrap_port: Option<u16>,
    /// The model name the API gave it (`model_id`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
}

/// Most ids of workers not registered now that the state file remembers.
const MAX_REMEMBERED: usize = 4096;

/// What the state file at `path` keeps (no file, or none yet: a first start).
pub(super) fn read(path: Option<&Path>) -> Result<Persisted, String> {
    match path {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| format!("--state-file {}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Persisted::default()),
            Err(e) => Err(format!("--state-file {}: {e}", path.display())),
        },
        None => Ok(Persisted::default()),
    }
}

impl PersistedWorker {
    /// Its role (a name not known reads as regular).
    pub(super) fn role(&self) -> Role {
        match self.role.as_str() {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            "both" => Role::Both,
            _ => Role::Regular,
        }
    }
}

impl State {
    /// Writes `--state-file` (a new file renamed over the old one).
    pub(super) fn persist(&self) {
        let Some(path) = &self.settings.state_file else { return };
        let persisted = {
            let inner = self.lock();
            let registry = inner.registry();
            let mut ids: BTreeMap<String, u32> =
                registry.remembered().take(MAX_REMEMBERED).map(|(u, id)| (u.clone(), id)).collect();
            ids.extend(registry.entries().map(|w| (w.name(), w.id)));
            Persisted {
                next_id: registry.next_id(),
                ids,
                api_workers: registry
                    .entries()
                    // One entry per worker (its data-parallel ranks come back from its answer).
                    .filter(|w| w.source == Source::Api && w.dp_rank.is_none_or(|r| r == 0))
                    .map(|w| PersistedWorker {
                        url: w.url.clone(),
                        role: role_name(w.role).into(),
                        bootstrap_port: w.bootstrap_port,
                        model_id: w.model_id.clone(),
                    })
                    .collect(),
            }
        };
        let tmp = path.with_extension("tmp");
        let written = serde_json::to_vec_pretty(&persisted)
            .map_err(|e| e.to_string())
            .and_then(|bytes| std::fs::write(&tmp, bytes).map_err(|e| e.to_string()))
            .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
        if let Err(e) = written {
            tracing::error!(path = %path.display(), "cannot write the state file: {e}");
        }
    }
}
