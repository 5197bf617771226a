//! The control plane's validated settings: plain data that the flags and `--config` fill
//! (`args.rs`), and that every other module reads (none of them imports `args`; this module
//! imports nothing from it either).

use std::collections::BTreeMap;

use kvmesh_core::RoutingSettings;

/// Everything `kvmesh-cp` runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub host: String,
    pub grpc_port: u16,
    pub http_port: u16,
    /// The admin API's address (`--http-host`, else `--host`).
    pub http_host: String,
    /// `/metrics` alone on this port, when set.
    pub prometheus_port: Option<u16>,
    /// The address of that listener (`--prometheus-host`, else `--host`).
    pub prometheus_host: String,
    pub workers: Vec<String>,
    pub pd: bool,
    /// `(url, bootstrap port)`.
    pub prefill: Vec<(String, Option<u16>)>,
    pub decode: Vec<String>,
    /// The routing settings shipped to every filter (validated; `pd_disaggregation` set).
    pub routing: RoutingSettings,
    pub block_size: usize,
    /// Bytes of routing text per engine token (`--bytes-per-token`).
    pub bytes_per_token: u64,
    /// `--worker-kv-capacity`: KV capacity in tokens by worker URL (wins over what the
    /// worker reports).
    pub kv_capacity: BTreeMap<String, u64>,
    pub max_tree_size: u64,
    /// prefix_hash: the roles whose policy it is, and the blocks each of their workers keeps
    /// in the index (`--lru-capacity-per-server`, within `--max-tree-size`).
    pub prefix_hash_roles: Vec<kvmesh_proto::v1::Role>,
    pub lru_capacity_per_server: u64,
    /// marginal_utility's parameters, when a policy in force is marginal_utility (kvmesh-cp
    /// then keeps the windows and ships the scores).
    pub utility: Option<kvmesh_core::policy::UtilityParams>,
    pub eviction_interval_secs: u64,
    /// Active health checks (`--disable-health-check` turns them off).
    pub health_checks: bool,
    pub health_interval_secs: u64,
    pub health_timeout_secs: u64,
    pub health_failure_threshold: u32,
    pub health_success_threshold: u32,
    pub health_endpoint: String,
    /// `--api-key`: sent to the workers with every request kvmesh-cp makes of them.
    pub worker_api_key: Option<WorkerKey>,
    /// `--dp-aware`: each data-parallel rank of a regular worker is a routing target.
    pub dp_aware: bool,
    pub load_poll_interval_ms: u64,
    /// A healthy worker that answered none of its health and load probes for this long is
    /// taken out until it answers one (`--worker-unresponsive-secs`; 0: never, nor without
    /// health checks).
    pub unresponsive_ms: u64,
    /// `--lora-adapter`: adapters kept loaded on a worker of their base model.
    pub lora_adapters: Vec<AdapterSpec>,
    pub push_interval_ms: u64,
    /// How long a table naming new healthy workers waits for Envoy's EDS (`--eds-wait-ms`).
    pub eds_wait_ms: u64,
    pub discovery: Option<DiscoveryConfig>,
    /// `--log-level` (`RUST_LOG` wins).
    pub log_level: String,
    /// Where traces go over OTLP/gRPC (`--enable-trace`, `--otlp-traces-endpoint`,
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`); none: no traces.
    pub otlp_endpoint: Option<String>,
    /// What to warn about at startup: flags given that have no effect (yet).
    pub warnings: Vec<String>,
    /// Who may talk to kvmesh-cp.
    pub auth: AuthSettings,
    /// Which worker addresses are accepted.
    pub worker_policy: WorkerPolicy,
    /// Bounds on what the gateways can make kvmesh-cp hold.
    pub limits: Limits,
    /// Where API-added workers and every worker's id are kept across restarts.
    pub state_file: Option<std::path::PathBuf>,
    /// The engines' KV-event streams (`--kv-events-*`).
    pub kv_events: KvEventSettings,
}

/// Where the engines publish their KV events, and how they are read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvEventSettings {
    /// Every worker's publisher, `{host}` for its host.
    pub endpoint: Option<String>,
    /// Every worker's replay socket, `{host}` for its host.
    pub replay_endpoint: Option<String>,
    /// Per worker (canonical URL), over the templates.
    pub workers: Vec<(String, KvEventEndpoints)>,
    /// The topic prefix subscribed to.
    pub topic: String,
    /// The served model's `tokenizer.json`.
    pub tokenizer: Option<String>,
    /// Most engine blocks kept per worker.
    pub max_blocks: usize,
}

/// One worker's publisher and replay socket.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvEventEndpoints {
    pub publisher: String,
    pub replay: Option<String>,
}

impl Settings {
    /// The key to send the workers, if any (see [`crate::probe::Key`]).
    pub fn worker_key(&self) -> Option<&str> {
        self.worker_api_key.as_ref().map(|k| k.0.as_str())
    }
}

/// The workers' API key (its `Debug` leaves it out).
#[derive(Clone, PartialEq)]
pub struct WorkerKey(String);

impl std::fmt::Debug for WorkerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerKey(..)")
    }
}

/// `--api-key` as kvmesh-cp sends it in a header: 1 to 1024 bytes of visible ASCII.
pub fn worker_api_key(key: Option<&str>) -> Result<Option<WorkerKey>, String> {
    match key {
        None => Ok(None),
        Some(k) if !k.is_empty() && k.len() <= 1024 && k.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(WorkerKey(k.into())))
        }
        Some(_) => Err("the key must be 1 to 1024 bytes of visible ASCII (no spaces or line breaks)".into()),
    }
}

/// Where `--api-key` is read when the flag is not given: the environment keeps the key off
/// the command line (`ps`, `/proc/PID/cmdline`), as the Helm chart passes it.
pub const WORKER_KEY_ENV: &str = "KVMESH_WORKER_API_KEY";

/// `--api-key`, else [`WORKER_KEY_ENV`] when set and not empty.
pub fn worker_api_key_or_env(flag: Option<&str>) -> Result<Option<WorkerKey>, String> {
    if flag.is_some() {
        return worker_api_key(flag);
    }
    let env = std::env::var(WORKER_KEY_ENV).ok().filter(|v| !v.is_empty());
    worker_api_key(env.as_deref()).map_err(|why| format!("{WORKER_KEY_ENV}: {why}"))
}

/// Authentication of the gRPC streams and of the admin API.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AuthSettings {
    /// The bearer token the filters present on `Watch`/`Report` (none: the streams are open).
    pub grpc_token: Option<String>,
    /// Admin API keys (none: the admin API is open).
    pub api_keys: Vec<ApiKey>,
    /// Read-only endpoints (`/health` excepted) need a key too.
    pub protect_reads: bool,
    /// Listening on a non-loopback address without authentication was asked for explicitly.
    pub insecure: bool,
    /// With no API keys, `/match` (what the caches hold) answers: the admin API listens on
    /// loopback, or `--allow-insecure` was given.
    pub keyless_cache_reads: bool,
}

/// One `--control-plane-api-keys` entry: `id:name:role:key` (as SMG) or a bare key (admin).
#[derive(Clone, PartialEq)]
pub struct ApiKey {
    pub id: String,
    /// `admin` may change workers; any other role may only read.
    pub admin: bool,
    pub key: String,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey").field("id", &self.id).field("admin", &self.admin).finish_non_exhaustive()
    }
}

pub use crate::urls::WorkerPolicy;

/// Bounds on reports and on the global index.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Largest gRPC message kvmesh-cp decodes, in bytes.
    pub max_message_bytes: usize,
    /// Most index hashes merged from one report batch (the rest are dropped and counted).
    pub max_inserts_per_report: usize,
    /// Index hashes per second one gateway may report (a token bucket holding four seconds'
    /// worth, so a full report on connect fits).
    pub max_inserts_per_sec: u64,
    /// The global index holds at most this many (worker, block) entries.
    pub max_index_entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: 16 << 20,
            max_inserts_per_report: 1 << 20,
            max_inserts_per_sec: 1 << 20,
            max_index_entries: 1 << 21,
        }
    }
}

/// What Kubernetes discovery looks for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiscoveryConfig {
    pub namespace: Option<String>,
    pub selector: BTreeMap<String, String>,
    pub prefill_selector: BTreeMap<String, String>,
    pub decode_selector: BTreeMap<String, String>,
    /// The workers' ports in each pod: one worker per pod and port.
    pub ports: Vec<u16>,
    /// `--inference-pool`: the InferencePool whose `spec.selector` and `spec.targetPorts`
    /// replace `selector` and `ports` (followed as the pool changes).
    pub inference_pool: Option<String>,
    pub bootstrap_annotation: String,
    pub role_label: String,
    /// Where a pod's own model name comes from (`--model-id-from`), if anywhere.
    pub model_id_from: Option<ModelIdFrom>,
    pub pd: bool,
}

/// `--model-id-from`: the pod metadata that names a pod's model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelIdFrom {
    Namespace,
    Label(String),
    Annotation(String),
}

impl std::str::FromStr for ModelIdFrom {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let key = |k: &str| (!k.is_empty() && k.len() <= 317).then(|| k.to_string());
        match s.split_once(':') {
            None if s == "namespace" => Some(Self::Namespace),
            Some(("label", k)) => key(k).map(Self::Label),
            Some(("annotation", k)) => key(k).map(Self::Annotation),
            _ => None,
        }
        .ok_or_else(|| format!("`{s}` is not namespace, label:<key> or annotation:<key>"))
    }
}

/// One `--lora-adapter` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterSpec {
    pub name: String,
    pub base: String,
    pub path: String,
}

impl std::str::FromStr for AdapterSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let shape = || format!("`{s}` is not NAME@BASE=PATH");
        let (names, path) = s.split_once('=').ok_or_else(shape)?;
        let (name, base) = names.split_once('@').ok_or_else(shape)?;
        let (name, base, path) = (name.trim(), base.trim(), path.trim());
        let fits = |n: &str| !n.is_empty() && n.len() <= kvmesh_core::models::MAX_MODEL_NAME;
        if !fits(name) || !fits(base) || path.is_empty() || path.len() > 4096 || name == base {
            return Err(format!(
                "`{s}`: the adapter and its base need 1 to {} bytes each and must differ, the path 1 to 4096",
                kvmesh_core::models::MAX_MODEL_NAME
            ));
        }
        Ok(Self { name: name.into(), base: base.into(), path: path.into() })
    }
}
