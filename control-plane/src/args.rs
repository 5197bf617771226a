//! `kvmesh-cp` flags, mirroring `python -m sglang_router.launch_router`, and `--config FILE`.
//!
//! The routing flags are [`RoutingSettings`] (declared once in the core), flattened here. The
//! YAML file is translated (`args/config_file.rs`) into command-line arguments for the same
//! clap command — a key `worker-urls`/`worker_urls` becomes `--worker-urls a b`, `true` the
//! bare flag, `prefill: [[url, port], [url]]` repeated `--prefill` — leaving out the keys
//! whose flag is on the real command line (flags win), and the whole is parsed once. So the
//! file accepts exactly what the flags accept. A bad flag, key or value is one line naming
//! it, and exit code 2.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgAction, Command, CommandFactory, FromArgMatches, Parser};
use kvmesh_core::policy::PolicyKind;
use kvmesh_core::RoutingSettings;
use kvmesh_proto::v1::Role;

use crate::peer_flags::{PeerFlags, NOT_YET, NO_EFFECT, REFUSED};
use crate::settings::{worker_api_key_or_env, ApiKey, AuthSettings, DiscoveryConfig, Limits, Settings, WorkerPolicy};
use crate::urls::Cidr;

mod config_file;

/// kvmesh control plane: one place to configure kvmesh (sglang-router's flags); streams
/// workers, load, the routing settings and the shared prefix index to every Envoy running
/// the kvmesh filter.
#[derive(Clone, Debug, Default, PartialEq, Parser)]
#[command(name = "kvmesh-cp", version)]
pub struct Args {
    /// YAML file whose keys are these flags' names (`-` or `_`); flags given on the command
    /// line win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address kvmesh-cp listens on. Default 127.0.0.1.
    #[arg(long)]
    pub host: Option<String>,
    /// gRPC port: the filters' snapshot and report streams (kvmesh). Default 18000.
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// HTTP port: the admin API (/add_worker, /workers, ...) and /metrics (kvmesh). Default 18001.
    #[arg(long)]
    pub http_port: Option<u16>,
    /// Address of the admin API (and /metrics) listener, e.g. loopback while the gRPC port is
    /// on the cluster network (kvmesh). Default: --host.
    #[arg(long)]
    pub http_host: Option<String>,
    /// Serve /metrics alone on this port too. Default: only on --http-port.
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Address of the --prometheus-port listener. Default: --host.
    #[arg(long)]
    pub prometheus_host: Option<String>,
    /// Regular workers (URLs).
    #[arg(long, num_args = 0..)]
    pub worker_urls: Vec<String>,
    /// A prefill worker and its bootstrap port (or `none`); repeatable.
    #[arg(long = "prefill", id = "prefill", num_args = 1.., action = ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"])]
    pub prefill_flat: Vec<String>,
    /// `--prefill` occurrences, grouped (filled by [`Args::parse_from`]).
    #[arg(skip)]
    pub prefill: Vec<Vec<String>>,
    /// A decode worker (URL); repeatable.
    #[arg(long, action = ArgAction::Append)]
    pub decode: Vec<String>,
    #[command(flatten)]
    pub routing: RoutingSettings,
    /// Seconds between active health checks. Default 60.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub health_check_interval_secs: Option<u64>,
    /// Timeout of one health check, in seconds. Default 5.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub health_check_timeout_secs: Option<u64>,
    /// Consecutive failed health checks that mark a worker unhealthy. Default 3.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub health_failure_threshold: Option<u32>,
    /// Consecutive passed health checks that mark it healthy again. Default 2.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub health_success_threshold: Option<u32>,
    /// Health check path. Default /health.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub health_check_endpoint: Option<String>,
    /// No active health checks: workers stay healthy unless passive health (breakers) takes them out.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub disable_health_check: bool,
    /// How often worker load is polled (`/get_load`, else `/metrics`), in milliseconds
    /// (kvmesh). Default 1000.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub load_poll_interval_ms: Option<u64>,
    /// Seconds a healthy worker may answer none of its health and load probes before it is
    /// taken out of rotation, until it answers one (kvmesh: a hung worker, accepting
    /// connections and answering nothing, leaves every gateway within about this plus a
    /// second; a worker busy generating still answers its probes). 0 turns it off. Default 3.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub worker_unresponsive_secs: Option<u64>,
    /// How often pending changes are pushed to the filters, in milliseconds (kvmesh). Default 10.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub push_interval_ms: Option<u64>,
    /// Longest a worker table that adds or heals workers waits for every Envoy's EDS to list
    /// them before going to the filters, and how long a removed worker stays in EDS after, in
    /// milliseconds (kvmesh). 0: no wait. Default 1000.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub eds_wait_ms: Option<u64>,
    /// Discover workers as Kubernetes pods (in-cluster, or KUBECONFIG).
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub service_discovery: bool,
    /// Pod labels workers carry (k=v ...).
    #[arg(long, num_args = 1.., help_heading = "Workers: health, load, discovery")]
    pub selector: Vec<String>,
    /// Workers are the pods of this Gateway API Inference Extension InferencePool
    /// (inference.networking.k8s.io/v1, in --service-discovery-namespace, else the client's
    /// namespace): its spec.selector and spec.targetPorts, followed as they change; implies
    /// --service-discovery, not with --selector or --service-discovery-port (kvmesh).
    #[arg(long, value_name = "NAME", help_heading = "Workers: health, load, discovery")]
    pub inference_pool: Option<String>,
    /// PD: labels of prefill pods (k=v ...).
    #[arg(long, num_args = 1.., help_heading = "Workers: health, load, discovery")]
    pub prefill_selector: Vec<String>,
    /// PD: labels of decode pods (k=v ...).
    #[arg(long, num_args = 1.., help_heading = "Workers: health, load, discovery")]
    pub decode_selector: Vec<String>,
    /// Namespace to watch. Default: all namespaces.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub service_discovery_namespace: Option<String>,
    /// The workers' HTTP port in the pods. Default 80.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub service_discovery_port: Option<u16>,
    /// Pod annotation holding a prefill pod's bootstrap port (kvmesh). Default
    /// sglang.ai/bootstrap-port.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub bootstrap_port_annotation: Option<String>,
    /// Pod label giving the PD role (prefill | decode | both: either role), as llm-d uses
    /// (kvmesh). Default llm-d.ai/role. A pod's kvmesh.io/pd-protocol annotation names the PD
    /// protocol it speaks when not --pd-protocol's.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub role_label: Option<String>,
    /// A model name for each discovered pod from its metadata (SMG's flag): `namespace`,
    /// `label:<key>` or `annotation:<key>`. The pod serves it besides the names its
    /// /v1/models lists. Default none.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub model_id_from: Option<String>,
    /// A LoRA adapter to keep loaded (repeatable; kvmesh): whenever no healthy worker serves
    /// NAME, it is loaded from PATH on the least-loaded healthy worker serving BASE (vLLM's
    /// /v1/load_lora_adapter, SGLang's /load_lora_adapter). Default none.
    #[arg(long, value_name = "NAME@BASE=PATH", help_heading = "Workers: health, load, discovery")]
    pub lora_adapter: Vec<String>,
    /// Data-parallel ranks as routing targets (sglang-router's and SMG's flag): a regular
    /// worker whose /get_server_info reports dp_size N (2 to 64) becomes N targets, URL@0 ..
    /// URL@N-1, each with its own prefix index and load (/get_load's entry for its dp_rank);
    /// the gateway writes "data_parallel_rank" into the body it forwards. PD workers stay one
    /// target each. Default off.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub dp_aware: bool,
    /// Log level: debug, info, warn, error (RUST_LOG wins). Default info.
    #[arg(long, value_parser = ["debug", "info", "warn", "error"], help_heading = "Logging and authentication")]
    pub log_level: Option<String>,
    /// Export OpenTelemetry traces (reports, snapshots, discovery, admin calls) over OTLP/gRPC
    /// to --otlp-traces-endpoint, as service kvmesh-cp. Default off; OTEL_EXPORTER_OTLP_ENDPOINT
    /// set in the environment turns it on too.
    #[arg(long, action = ArgAction::SetTrue, help_heading = "Logging and authentication")]
    pub enable_trace: bool,
    /// The OTLP/gRPC collector for --enable-trace: host:port (as sglang-router) or an http(s)
    /// URL. Default: OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4317.
    #[arg(long, help_heading = "Logging and authentication")]
    pub otlp_traces_endpoint: Option<String>,
    /// The key kvmesh-cp sends the workers (`Authorization: Bearer KEY`); default KVMESH_WORKER_API_KEY.
    #[arg(long, help_heading = "Logging and authentication")]
    pub api_key: Option<String>,
    /// Admin API keys: `id:name:role:key` (as SMG) or a bare key; clients send
    /// `Authorization: Bearer KEY`. Role `admin` (and a bare key) may add, remove and administer workers,
    /// other roles may only read. Default: KVMESH_CP_API_KEYS (space or comma separated); none
    /// leaves the admin API open (refused off loopback, see --allow-insecure).
    #[arg(long, num_args = 0.., help_heading = "Logging and authentication")]
    pub control_plane_api_keys: Vec<String>,
    /// File holding the bearer token the filters must present on the gRPC streams (their
    /// `control_plane_token`) (kvmesh). Default: KVMESH_CP_TOKEN; none leaves the streams open
    /// (refused off loopback, see --allow-insecure).
    #[arg(long, help_heading = "Logging and authentication")]
    pub grpc_token_file: Option<PathBuf>,
    /// Read-only admin endpoints (/list_workers, /workers, /snapshot, /metrics) need an API key
    /// too; /health stays open (kvmesh). Default: open (POST /match, which tells which worker
    /// holds a text, needs a key whenever keys are configured).
    #[arg(long, help_heading = "Logging and authentication")]
    pub protect_read_endpoints: bool,
    /// Listen on a non-loopback --host without a gRPC token and API keys: anyone who reaches
    /// kvmesh-cp can then change where prompts go. Logged as a warning at startup (kvmesh).
    #[arg(long, help_heading = "Logging and authentication")]
    pub allow_insecure: bool,
    /// Networks workers must be in (CIDR ...; e.g. 10.0.0.0/8), whatever their source: flags,
    /// /add_worker or discovery (kvmesh). Default: any address but unspecified, link-local
    /// (cloud metadata) and multicast ones, which are always refused.
    #[arg(long, num_args = 1.., help_heading = "Workers: health, load, discovery")]
    pub worker_cidrs: Vec<String>,
    /// JSON file keeping the workers added through the API and every worker's id across
    /// restarts (written on each change) (kvmesh). Default: none, API workers are forgotten.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub state_file: Option<PathBuf>,
    /// A worker's KV capacity in tokens, `URL=TOKENS`, for engines that do not report
    /// `max_total_num_tokens` in `/get_server_info` (or to override it); repeatable. The
    /// worker's part of the prefix index is kept within it (kvmesh).
    #[arg(long, value_name = "URL=TOKENS", help_heading = "Workers: health, load, discovery")]
    pub worker_kv_capacity: Vec<String>,
    /// Largest gRPC message kvmesh-cp decodes, in bytes (kvmesh). Default 16777216 (16 MiB).
    #[arg(long, help_heading = "Limits")]
    pub max_message_bytes: Option<usize>,
    /// Most index hashes merged from one report message; the rest are dropped and counted
    /// (kvmesh). Default 1048576.
    #[arg(long, help_heading = "Limits")]
    pub max_inserts_per_report: Option<usize>,
    /// Index hashes per second one gateway may report (bursts of four seconds' worth); the
    /// rest are dropped and counted (kvmesh). Default 1048576.
    #[arg(long, help_heading = "Limits")]
    pub max_inserts_per_sec: Option<u64>,
    /// Most (worker, block) entries in the global prefix index: past it (and 1/8 slack) the
    /// least recently used are evicted at once, not only every --eviction-interval-secs
    /// (kvmesh). Default 2097152.
    #[arg(long, help_heading = "Limits")]
    pub max_index_entries: Option<u64>,
    #[command(flatten)]
    pub leader: crate::election::LeaderElectArgs,
    #[command(flatten)]
    pub peer: PeerFlags,
    /// Ids of the arguments given (on the command line or in the file).
    #[arg(skip)]
    pub given: Vec<String>,
    /// Ids of the arguments the `--config` file gave.
    #[arg(skip)]
    pub from_file: Vec<String>,
}

/// A bad flag or configuration value: printed as one line, exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadArgs(pub String);

fn bad(flag: &str, why: impl std::fmt::Display) -> BadArgs {
    BadArgs(format!("--{}: {why}", flag.replace('_', "-")))
}

/// Why parsing stopped: clap's own answer (help, version, a bad flag) or a bad `--config`.
#[derive(Debug, thiserror::Error)]
pub enum ArgsError {
    #[error(transparent)]
    Clap(#[from] clap::Error),
    #[error(transparent)]
    Bad(#[from] BadArgs),
}

impl ArgsError {
    /// One line, without clap's `error: ` and its hints.
    pub fn one_line(&self) -> String {
        match self {
            Self::Clap(e) => first_line(e),
            Self::Bad(b) => b.0.clone(),
        }
    }
}

fn first_line(e: &clap::Error) -> String {
    let text = e.to_string();
    text.lines().next().unwrap_or("bad arguments").trim_start_matches("error: ").to_string()
}

/// The `--long` name of an argument.
fn long_of(cmd: &Command, id: &str) -> Option<String> {
    cmd.get_arguments().find(|a| a.get_id() == id).and_then(|a| a.get_long()).map(str::to_string)
}

fn help_of(cmd: &Command, id: &str) -> String {
    cmd.get_arguments().find(|a| a.get_id() == id).and_then(|a| a.get_help()).map(|h| h.to_string()).unwrap_or_default()
}

/// The command with every argument's settings resolved (the number of values a bare
/// `bool` flag takes is known only then).
pub fn built() -> Command {
    let mut cmd = Args::command();
    cmd.build();
    cmd
}

impl Args {
    /// Parses the command line and the `--config` file it names (flags win), grouping each
    /// `--prefill URL [PORT]`.
    pub fn parse_from<I, T>(argv: I) -> Result<Self, ArgsError>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
        let cmd = built();
        let mut matches = cmd.clone().try_get_matches_from(&argv)?;
        let mut from_file = Vec::new();
        if let Some(path) = matches.get_one::<PathBuf>("config").cloned() {
            let file_error = |why: String| BadArgs(format!("--config {}: {why}", path.display()));
            let text = std::fs::read_to_string(&path).map_err(|e| file_error(e.to_string()))?;
            let (extra, ids) = config_file::file_args(&cmd, &matches, &text).map_err(file_error)?;
            from_file = ids;
            matches =
                cmd.try_get_matches_from(argv.into_iter().chain(extra)).map_err(|e| file_error(first_line(&e)))?;
        }
        let mut args = Self::from_arg_matches(&matches)?;
        args.prefill = matches
            .get_occurrences::<String>("prefill")
            .map(|occ| occ.map(|o| o.cloned().collect()).collect())
            .unwrap_or_default();
        args.given = matches
            .ids()
            .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
            .map(|id| id.to_string())
            .collect();
        args.from_file = from_file;
        Ok(args)
    }

    /// A bad value of `flag` (a field or argument id): names the flag, and the file when the
    /// value came from it.
    fn bad(&self, flag: &str, why: impl std::fmt::Display) -> BadArgs {
        let e = bad(flag, why);
        match &self.config {
            Some(path) if self.from_file.iter().any(|id| id == flag) => {
                BadArgs(format!("--config {}: {}", path.display(), e.0))
            }
            _ => e,
        }
    }

    /// The authentication settings; refuses a non-loopback `host` without them unless
    /// `--allow-insecure`.
    fn auth(&self, host: &str, http_host: &str, warnings: &mut Vec<String>) -> Result<AuthSettings, BadArgs> {
        let grpc_token = match &self.grpc_token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| self.bad("grpc_token_file", format!("{}: {e}", path.display())))?;
                Some(checked_secret(text.trim()).map_err(|e| self.bad("grpc_token_file", e))?)
            }
            None => match std::env::var("KVMESH_CP_TOKEN") {
                Ok(t) if !t.trim().is_empty() => {
                    Some(checked_secret(t.trim()).map_err(|e| BadArgs(format!("KVMESH_CP_TOKEN: {e}")))?)
                }
                _ => None,
            },
        };
        let (entries, from_env): (Vec<String>, bool) = if self.control_plane_api_keys.is_empty() {
            let env = std::env::var("KVMESH_CP_API_KEYS").unwrap_or_default();
            (
                env.split(|c: char| c == ',' || c.is_whitespace())
                    .filter(|k| !k.is_empty())
                    .map(String::from)
                    .collect(),
                true,
            )
        } else {
            (self.control_plane_api_keys.clone(), false)
        };
        let api_keys = entries
            .iter()
            .enumerate()
            .map(|(n, e)| {
                api_key(n, e).map_err(|why| {
                    if from_env {
                        BadArgs(format!("KVMESH_CP_API_KEYS: {why}"))
                    } else {
                        self.bad("control_plane_api_keys", why)
                    }
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let loopback = |h: &str| {
            h.eq_ignore_ascii_case("localhost") || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
        };
        let http_flag = if self.http_host.is_some() { "http_host" } else { "host" };
        // What would be open off loopback: (flag, address, what).
        let open: Vec<(&str, &str, &str)> = [
            (grpc_token.is_none() && !loopback(host)).then_some((
                "host",
                host,
                "the gRPC streams (--grpc-token-file or KVMESH_CP_TOKEN)",
            )),
            (api_keys.is_empty() && !loopback(http_host)).then_some((
                http_flag,
                http_host,
                "the admin API (--control-plane-api-keys or KVMESH_CP_API_KEYS)",
            )),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let Some(&(flag, address, _)) = open.first() {
            let what = open.iter().map(|o| o.2).collect::<Vec<_>>().join(" and ");
            if !self.allow_insecure {
                return Err(self.bad(
                    flag,
                    format!(
                        "{address} is not a loopback address and {what} would be open to anyone who reaches \
                         it: give a token and API keys, or --allow-insecure"
                    ),
                ));
            }
            warnings.push(format!(
                "INSECURE (--allow-insecure): listening on {address} with {what} unauthenticated; anyone \
                 who reaches kvmesh-cp can read the topology and change where every tenant's prompts go"
            ));
        }
        if self.protect_read_endpoints && api_keys.is_empty() {
            return Err(self.bad("protect_read_endpoints", "needs --control-plane-api-keys"));
        }
        Ok(AuthSettings {
            grpc_token,
            api_keys,
            protect_reads: self.protect_read_endpoints,
            insecure: !open.is_empty(),
            keyless_cache_reads: loopback(http_host) || self.allow_insecure,
        })
    }

    /// Validates everything into [`Settings`], in this order (the first bad value is the
    /// error): the flags given, the workers, the routing settings, discovery, authentication,
    /// the worker URL policy, KV capacities, limits, then health checks and intervals.
    pub fn load(self) -> Result<Settings, BadArgs> {
        let mut warnings = self.flags_given()?;
        let pd = self.pd()?;
        let prefill = self.prefill()?;
        let (routing, checked) = self.routing(pd)?;
        let discovery = self.discovery(pd)?;
        let host = self.host.clone().unwrap_or_else(|| "127.0.0.1".into());
        let http_host = self.http_host.clone().unwrap_or_else(|| host.clone());
        let auth = self.auth(&host, &http_host, &mut warnings)?;
        let (worker_policy, workers) = self.worker_policy(prefill, &mut warnings)?;
        let kv_capacity = self.kv_capacity()?;
        let limits = self.limits()?;
        if self.otlp_traces_endpoint.is_some() && !self.enable_trace {
            warnings.push("--otlp-traces-endpoint has no effect without --enable-trace (as in sglang-router)".into());
        }
        if self.dp_aware && pd {
            warnings.push(
                "--dp-aware: no effect on PD workers (each stays one target; docs/configuration.md says why)".into(),
            );
        }
        Ok(Settings {
            dp_aware: self.dp_aware && !pd,
            state_file: self.state_file.clone(),
            auth,
            worker_policy,
            limits,
            prometheus_host: self.prometheus_host.clone().unwrap_or_else(|| host.clone()),
            http_host,
            host,
            grpc_port: self.grpc_port.unwrap_or(18000),
            http_port: self.http_port.unwrap_or(18001),
            prometheus_port: self.prometheus_port,
            pd,
            prefill: workers.prefill,
            routing,
            block_size: checked.block_size,
            bytes_per_token: checked.bytes_per_token,
            kv_capacity,
            max_tree_size: checked.max_tree_size,
            prefix_hash_roles: roles_of(&checked, PolicyKind::PrefixHash),
            lru_capacity_per_server: checked.prefix_hash.lru_capacity,
            utility: (!roles_of(&checked, PolicyKind::MarginalUtility).is_empty()).then_some(checked.utility),
            eviction_interval_secs: checked.eviction_interval_secs,
            health_checks: !self.disable_health_check,
            health_interval_secs: self.positive("health_check_interval_secs", self.health_check_interval_secs, 60)?,
            health_timeout_secs: self.positive("health_check_timeout_secs", self.health_check_timeout_secs, 5)?,
            health_failure_threshold: self.threshold("health_failure_threshold", self.health_failure_threshold, 3)?,
            health_success_threshold: self.threshold("health_success_threshold", self.health_success_threshold, 2)?,
            health_endpoint: self.health_check_endpoint.clone().unwrap_or_else(|| "/health".into()),
            worker_api_key: worker_api_key_or_env(self.api_key.as_deref()).map_err(|e| self.bad("api_key", e))?,
            load_poll_interval_ms: self.positive("load_poll_interval_ms", self.load_poll_interval_ms, 1000)?,
            push_interval_ms: self.positive("push_interval_ms", self.push_interval_ms, 10)?,
            eds_wait_ms: self.eds_wait_ms.unwrap_or(1000),
            unresponsive_ms: if self.disable_health_check {
                0
            } else {
                self.worker_unresponsive_secs.unwrap_or(3).saturating_mul(1000)
            },
            lora_adapters: self
                .lora_adapter
                .iter()
                .map(|spec| spec.parse().map_err(|e: String| self.bad("lora_adapter", e)))
                .collect::<Result<_, _>>()?,
            discovery,
            log_level: self.log_level.clone().unwrap_or_else(|| "info".into()),
            otlp_endpoint: self.otlp_endpoint(std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())?,
            warnings,
            workers: workers.regular,
            decode: workers.decode,
        })
    }

    /// Where traces go, if anywhere: with --enable-trace, --otlp-traces-endpoint, else `env`
    /// (`OTEL_EXPORTER_OTLP_ENDPOINT`), else localhost:4317; without it, `env` alone. A
    /// host:port gets `http://`.
    pub(crate) fn otlp_endpoint(&self, env: Option<String>) -> Result<Option<String>, BadArgs> {
        let env = env.map(|e| e.trim().to_string()).filter(|e| !e.is_empty());
        let endpoint = match (self.enable_trace, &self.otlp_traces_endpoint) {
            (true, Some(given)) => given.trim().to_string(),
            (true, None) => env.unwrap_or_else(|| "localhost:4317".into()),
            (false, _) => match env {
                Some(env) => env,
                None => return Ok(None),
            },
        };
        let url = if endpoint.starts_with("http://") || endpoint.starts_with("https://") {
            endpoint
        } else if endpoint.contains("://") || endpoint.is_empty() || endpoint.contains(char::is_whitespace) {
            return Err(self.bad("otlp_traces_endpoint", format!("`{endpoint}` is not host:port or an http(s) URL")));
        } else {
            format!("http://{endpoint}")
        };
        Ok(Some(url))
    }

    /// The flags given that kvmesh refuses (an error), and those with no effect (yet): the
    /// warnings to log at startup.
    fn flags_given(&self) -> Result<Vec<String>, BadArgs> {
        let cmd = Self::command();
        let mut warnings = Vec::new();
        for id in &self.given {
            let help = help_of(&cmd, id);
            let flag = long_of(&cmd, id).unwrap_or_else(|| id.clone());
            if let Some(why) = help.strip_prefix(REFUSED) {
                return Err(self.bad(id, why.trim()));
            }
            if help.starts_with(NO_EFFECT) || help.starts_with(NOT_YET) {
                warnings.push(format!("--{flag}: {help}"));
            }
        }
        if self.peer.backend.as_deref() == Some("openai") {
            return Err(self.bad("backend", "`openai` is refused in kvmesh: kvmesh routes to SGLang and vLLM workers; route OpenAI-hosted models with a separate Envoy route"));
        }
        Ok(warnings)
    }

    /// Whether prefill and decode are disaggregated (then no regular workers); the regular
    /// and decode workers' URLs are checked to be ones.
    fn pd(&self) -> Result<bool, BadArgs> {
        let pd = self.routing.pd_disaggregation.unwrap_or(false) || !self.prefill.is_empty() || !self.decode.is_empty();
        if pd && !self.worker_urls.is_empty() {
            return Err(self.bad("worker_urls", "not with --pd-disaggregation (use --prefill and --decode)"));
        }
        for url in &self.worker_urls {
            crate::urls::canonical(url).map_err(|e| self.bad("worker_urls", e))?;
        }
        for url in &self.decode {
            crate::urls::canonical(url).map_err(|e| self.bad("decode", e))?;
        }
        Ok(pd)
    }

    /// The prefill workers (`--prefill URL [BOOTSTRAP_PORT|none]`) with their bootstrap ports.
    fn prefill(&self) -> Result<Vec<(String, Option<u16>)>, BadArgs> {
        let mut prefill = Vec::new();
        for entry in &self.prefill {
            let (url, port) =
                match entry.as_slice() {
                    [url] => (url.clone(), None),
                    [url, p] if p.eq_ignore_ascii_case("none") => (url.clone(), None),
                    [url, p] => (
                        url.clone(),
                        Some(p.parse::<u16>().map_err(|_| {
                            self.bad("prefill", format!("bootstrap port `{p}` is not a port or `none`"))
                        })?),
                    ),
                    _ => return Err(self.bad("prefill", "takes URL [BOOTSTRAP_PORT|none]")),
                };
            crate::urls::canonical(&url).map_err(|e| self.bad("prefill", e))?;
            prefill.push((url, port));
        }
        Ok(prefill)
    }

    /// What the filters get, and the configuration the core validates from it exactly as the
    /// filters will.
    fn routing(&self, pd: bool) -> Result<(RoutingSettings, kvmesh_core::Config), BadArgs> {
        let mut routing = self.routing.clone();
        routing.pd_disaggregation = Some(pd);
        if pd {
            // `--policy` is both legs' default (as in sglang-router): said explicitly, so that it
            // also wins over leg policies in a filter's plugin configuration.
            routing.prefill_policy = routing.prefill_policy.or(routing.policy);
            routing.decode_policy = routing.decode_policy.or(routing.policy);
        }
        let checked = kvmesh_core::Config::from_settings(&routing).map_err(|e| match e {
            kvmesh_core::ConfigError::Invalid { field, reason } => self.bad(field, reason),
            other => BadArgs(other.to_string()),
        })?;
        Ok((routing, checked))
    }

    /// Kubernetes discovery, when `--service-discovery` or `--inference-pool`.
    fn discovery(&self, pd: bool) -> Result<Option<DiscoveryConfig>, BadArgs> {
        if !self.service_discovery && self.inference_pool.is_none() {
            return Ok(None);
        }
        if let Some(name) = &self.inference_pool {
            let dns_label = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
            if name.len() > 253 || !name.split(['.', '-']).all(dns_label) {
                return Err(self.bad("inference_pool", format!("`{name}` is not a Kubernetes object name")));
            }
            let why = "the pool's spec.selector and spec.targetPorts select the workers";
            for (flag, given) in [
                ("selector", !self.selector.is_empty()),
                ("service_discovery_port", self.service_discovery_port.is_some()),
            ] {
                if given {
                    return Err(self.bad("inference_pool", format!("not with --{}: {why}", flag.replace('_', "-"))));
                }
            }
        }
        Ok(Some(DiscoveryConfig {
            inference_pool: self.inference_pool.clone(),
            namespace: self.service_discovery_namespace.clone(),
            selector: self.labels("selector", &self.selector)?,
            prefill_selector: self.labels("prefill_selector", &self.prefill_selector)?,
            decode_selector: self.labels("decode_selector", &self.decode_selector)?,
            ports: vec![self.service_discovery_port.unwrap_or(80)],
            bootstrap_annotation: self
                .bootstrap_port_annotation
                .clone()
                .unwrap_or_else(|| "sglang.ai/bootstrap-port".into()),
            role_label: self.role_label.clone().unwrap_or_else(|| "llm-d.ai/role".into()),
            model_id_from: match self.model_id_from.as_deref() {
                None => None,
                Some(spec) => Some(spec.parse().map_err(|e: String| self.bad("model_id_from", e))?),
            },
            pd,
        }))
    }

    /// A pod label selector: `key=value` pairs.
    fn labels(&self, flag: &str, pairs: &[String]) -> Result<BTreeMap<String, String>, BadArgs> {
        pairs
            .iter()
            .map(|p| match p.split_once('=') {
                Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
                _ => Err(self.bad(flag, format!("`{p}` is not a label key=value"))),
            })
            .collect()
    }

    /// `--worker-cidrs`, which every worker given on the command line must already pass; and
    /// those workers under their canonical URLs (regular, prefill, decode), each once (a
    /// warning names a second spelling of one).
    fn worker_policy(
        &self,
        prefill: Vec<(String, Option<u16>)>,
        warnings: &mut Vec<String>,
    ) -> Result<(WorkerPolicy, Workers), BadArgs> {
        let worker_policy = WorkerPolicy {
            cidrs: self
                .worker_cidrs
                .iter()
                .map(|c| Cidr::parse(c).map_err(|e| self.bad("worker_cidrs", e)))
                .collect::<Result<_, _>>()?,
        };
        let mut seen = BTreeMap::new();
        let mut canonical = |flag: &str, url: &String| -> Result<Option<String>, BadArgs> {
            let c = crate::urls::check(url, &worker_policy).map_err(|e| self.bad(flag, e))?;
            match seen.get(&c) {
                Some(first) => {
                    warnings.push(format!(
                        "--{}: {url} is {c} again (given as {first}): registered once",
                        flag.replace('_', "-")
                    ));
                    Ok(None)
                }
                None => {
                    seen.insert(c.clone(), url.clone());
                    Ok(Some(c))
                }
            }
        };
        let mut workers = Workers::default();
        for url in &self.worker_urls {
            workers.regular.extend(canonical("worker_urls", url)?);
        }
        let mut decode = Vec::new();
        for url in &self.decode {
            decode.extend(canonical("decode", url)?);
        }
        for (url, port) in prefill {
            workers.prefill.extend(canonical("prefill", &url)?.map(|c| (c, port)));
        }
        workers.decode = decode;
        Ok((worker_policy, workers))
    }

    /// `--worker-kv-capacity`: tokens by worker URL.
    fn kv_capacity(&self) -> Result<BTreeMap<String, u64>, BadArgs> {
        let mut kv_capacity = BTreeMap::new();
        for entry in &self.worker_kv_capacity {
            let (url, tokens) = kv_capacity_entry(entry).map_err(|e| self.bad("worker_kv_capacity", e))?;
            kv_capacity.insert(url, tokens);
        }
        Ok(kv_capacity)
    }

    /// The bounds on messages, reports and the global index.
    fn limits(&self) -> Result<Limits, BadArgs> {
        let defaults = Limits::default();
        Ok(Limits {
            max_message_bytes: usize::try_from(self.positive(
                "max_message_bytes",
                self.max_message_bytes.map(|n| n as u64),
                defaults.max_message_bytes as u64,
            )?)
            .unwrap_or(usize::MAX),
            max_inserts_per_report: usize::try_from(self.positive(
                "max_inserts_per_report",
                self.max_inserts_per_report.map(|n| n as u64),
                defaults.max_inserts_per_report as u64,
            )?)
            .unwrap_or(usize::MAX),
            max_inserts_per_sec: self.positive(
                "max_inserts_per_sec",
                self.max_inserts_per_sec,
                defaults.max_inserts_per_sec,
            )?,
            max_index_entries: self.positive(
                "max_index_entries",
                self.max_index_entries,
                defaults.max_index_entries,
            )?,
        })
    }

    /// `v` (0 is refused), else `default`.
    fn positive(&self, flag: &str, v: Option<u64>, default: u64) -> Result<u64, BadArgs> {
        match v {
            Some(0) => Err(self.bad(flag, "must be greater than 0")),
            Some(v) => Ok(v),
            None => Ok(default),
        }
    }

    /// A number of health checks: [`positive`](Self::positive), within `u32`.
    fn threshold(&self, flag: &str, v: Option<u32>, default: u32) -> Result<u32, BadArgs> {
        self.positive(flag, v.map(u64::from), u64::from(default)).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }
}

/// The worker roles whose policy is `kind`.
fn roles_of(config: &kvmesh_core::Config, kind: PolicyKind) -> Vec<Role> {
    match &config.pd {
        None if config.policy == kind => vec![Role::Regular],
        None => Vec::new(),
        Some(pd) => [(pd.prefill_policy, Role::Prefill), (pd.decode_policy, Role::Decode)]
            .into_iter()
            .filter(|(p, _)| *p == kind)
            .map(|(_, r)| r)
            .collect(),
    }
}

/// One `--worker-kv-capacity` entry: `URL=TOKENS`.
fn kv_capacity_entry(entry: &str) -> Result<(String, u64), String> {
    let (url, tokens) = entry.rsplit_once('=').ok_or_else(|| format!("`{entry}` is not URL=TOKENS"))?;
    let tokens: u64 = tokens.trim().parse().map_err(|_| format!("`{tokens}` is not a number of tokens"))?;
    if tokens == 0 {
        return Err(format!("`{entry}`: the capacity must be at least 1 token"));
    }
    Ok((crate::urls::canonical(url.trim())?, tokens))
}

/// The workers given on the command line, under their canonical URLs.
#[derive(Default)]
struct Workers {
    regular: Vec<String>,
    prefill: Vec<(String, Option<u16>)>,
    decode: Vec<String>,
}

/// A token or key as it goes into an `authorization` header: visible ASCII, no spaces.
fn checked_secret(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("empty".into());
    }
    if text.len() > 4096 || !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be at most 4096 visible ASCII characters, without spaces".into());
    }
    Ok(text.to_string())
}

/// One API key entry: `id:name:role:key` or a bare key (an admin key).
fn api_key(n: usize, entry: &str) -> Result<ApiKey, String> {
    let parts: Vec<&str> = entry.splitn(4, ':').collect();
    let (id, admin, key) = match parts.as_slice() {
        [key] => (format!("key{n}"), true, *key),
        [id, _name, role, key] => (id.to_string(), role.eq_ignore_ascii_case("admin"), *key),
        _ => return Err(format!("`{}` is not id:name:role:key or a bare key", entry.split(':').next().unwrap_or(""))),
    };
    let key = checked_secret(key).map_err(|e| format!("the key of entry {} is {e}", n + 1))?;
    Ok(ApiKey { id, admin, key })
}

#[cfg(test)]
mod tests;
