//! The flags of `python -m sglang_router.launch_router` (0.3.2) that kvmesh accepts so that a
//! copied command line parses, but that have no effect here, or that kvmesh refuses. Each
//! one's help text starts with its status — `No effect in kvmesh:` (a warning at startup when
//! given) or `Refused in kvmesh:` (a one-line error naming the kvmesh equivalent) — and says
//! why. Values are taken as the peer takes them (same arity) and otherwise not checked.

use clap::ArgAction;

/// Help text prefixes: the status of a flag (`Args::load` warns about or refuses what is given).
pub const NO_EFFECT: &str = "No effect in kvmesh:";
pub const NOT_YET: &str = "Accepted, not yet enforced:";
pub const REFUSED: &str = "Refused in kvmesh:";

#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
#[command(next_help_heading = "sglang-router flags with no effect in kvmesh (accepted, warned about) or refused")]
pub struct PeerFlags {
    /// No effect in kvmesh: clients reach the gateway through Envoy's listener (envoy.yaml);
    /// kvmesh-cp listens on --grpc-port and --http-port.
    #[arg(long)]
    pub port: Option<String>,
    /// No effect in kvmesh: the bucket policy is not in kvmesh.
    #[arg(long)]
    pub bucket_adjust_interval_secs: Option<String>,
    /// No effect in kvmesh: the manual policy is not in kvmesh.
    #[arg(long)]
    pub max_idle_secs: Option<String>,
    /// No effect in kvmesh: the manual policy is not in kvmesh.
    #[arg(long)]
    pub assignment_mode: Option<String>,
    /// No effect in kvmesh: the filter always dispatches both PD legs itself (no MiniLB).
    #[arg(long, action = ArgAction::SetTrue)]
    pub mini_lb: bool,
    /// No effect in kvmesh: workers enter rotation as soon as they are added and leave it
    /// when health checks fail; kvmesh-cp does not wait for them at startup.
    #[arg(long)]
    pub worker_startup_timeout_secs: Option<String>,
    /// No effect in kvmesh: kvmesh-cp does not wait for workers at startup.
    #[arg(long)]
    pub worker_startup_check_interval: Option<String>,
    /// No effect in kvmesh: kvmesh-cp logs to stderr; let the process manager keep the logs.
    #[arg(long)]
    pub log_dir: Option<String>,
    /// No effect in kvmesh: kvmesh-cp exports no duration histograms; the filter's decision
    /// time histogram is in Envoy's /stats/prometheus.
    #[arg(long, num_args = 1..)]
    pub prometheus_duration_buckets: Vec<String>,
    /// No effect in kvmesh: the gateway uses Envoy's x-request-id (Envoy generates one when
    /// missing; see its request_id_extension).
    #[arg(long, num_args = 0..)]
    pub request_id_headers: Vec<String>,
    /// No effect in kvmesh: in-flight requests are Envoy's; drain Envoy (--drain-time-s).
    #[arg(long)]
    pub shutdown_grace_period_secs: Option<String>,
    /// No effect in kvmesh: CORS is Envoy's cors filter, in front of the kvmesh filter.
    #[arg(long, num_args = 0..)]
    pub cors_allowed_origins: Vec<String>,
    /// No effect in kvmesh: kvmesh routes on the request text and needs no tokenizer.
    #[arg(long)]
    pub model_path: Option<String>,
    /// No effect in kvmesh: kvmesh routes on the request text and needs no tokenizer.
    #[arg(long)]
    pub tokenizer_path: Option<String>,
    /// No effect in kvmesh: chat templates are applied by the workers.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// No effect in kvmesh: no tokenizer, so no tokenizer cache.
    #[arg(long, action = ArgAction::SetTrue)]
    pub tokenizer_cache_enable_l0: bool,
    /// No effect in kvmesh: no tokenizer, so no tokenizer cache.
    #[arg(long)]
    pub tokenizer_cache_l0_max_entries: Option<String>,
    /// No effect in kvmesh: no tokenizer, so no tokenizer cache.
    #[arg(long, action = ArgAction::SetTrue)]
    pub tokenizer_cache_enable_l1: bool,
    /// No effect in kvmesh: no tokenizer, so no tokenizer cache.
    #[arg(long)]
    pub tokenizer_cache_l1_max_memory: Option<String>,
    /// No effect in kvmesh: responses pass through unchanged; the workers parse reasoning.
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// No effect in kvmesh: responses pass through unchanged; the workers parse tool calls.
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// No effect in kvmesh: kvmesh does not call MCP servers.
    #[arg(long)]
    pub mcp_config_path: Option<String>,
    /// No effect in kvmesh: `sglang` is what kvmesh routes to (SGLang and vLLM workers over
    /// HTTP); `openai` is refused: route OpenAI-hosted models with a separate Envoy route.
    #[arg(long)]
    pub backend: Option<String>,
    /// No effect in kvmesh: kvmesh stores no conversations (the workers answer every request).
    #[arg(long)]
    pub history_backend: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_wallet_path: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_tns_alias: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_connect_descriptor: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_username: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_password: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_pool_min: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_pool_max: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub oracle_pool_timeout_secs: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub postgres_db_url: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub postgres_pool_max: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub redis_url: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long)]
    pub redis_pool_max: Option<String>,
    /// No effect in kvmesh: no history storage.
    #[arg(long, allow_negative_numbers = true)]
    pub redis_retention_days: Option<String>,
    /// No effect in kvmesh: Envoy connects to the workers; give the kvmesh_workers cluster a
    /// TLS transport_socket (envoy.yaml).
    #[arg(long)]
    pub client_cert_path: Option<String>,
    /// No effect in kvmesh: Envoy connects to the workers; give the kvmesh_workers cluster a
    /// TLS transport_socket (envoy.yaml).
    #[arg(long)]
    pub client_key_path: Option<String>,
    /// No effect in kvmesh: Envoy connects to the workers; give the kvmesh_workers cluster a
    /// TLS transport_socket with these CAs (envoy.yaml).
    #[arg(long, num_args = 0..)]
    pub ca_cert_paths: Vec<String>,
    /// No effect in kvmesh: clients connect to Envoy; give its listener a TLS transport_socket
    /// (envoy.yaml).
    #[arg(long)]
    pub tls_cert_path: Option<String>,
    /// No effect in kvmesh: clients connect to Envoy; give its listener a TLS transport_socket
    /// (envoy.yaml).
    #[arg(long)]
    pub tls_key_path: Option<String>,
    /// No effect in kvmesh: kvmesh-cp logs every worker added or removed (info level) anyway.
    #[arg(long, action = ArgAction::SetTrue)]
    pub control_plane_audit_enabled: bool,
    /// Refused in kvmesh: no JWT authentication of the admin API; use --control-plane-api-keys
    /// and keep --host on a private address, or front the API with Envoy's jwt_authn filter.
    #[arg(long)]
    pub jwt_issuer: Option<String>,
    /// Refused in kvmesh: no JWT authentication (see --jwt-issuer).
    #[arg(long)]
    pub jwt_audience: Option<String>,
    /// Refused in kvmesh: no JWT authentication (see --jwt-issuer).
    #[arg(long)]
    pub jwt_jwks_uri: Option<String>,
    /// Refused in kvmesh: no JWT authentication (see --jwt-issuer).
    #[arg(long, num_args = 0..)]
    pub jwt_role_mapping: Vec<String>,
}
