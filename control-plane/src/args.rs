//! `kvmesh-cp` flags, mirroring `python -m sglang_router.launch_router`, and `--config FILE`.
//!
//! The routing flags are [`RoutingSettings`] (declared once in the core), flattened here. The
//! YAML file is translated (`args/config_file.rs`) into command-line arguments for the same
//! clap command — a key `worker-urls`/`worker_urls` becomes `--worker-urls a b`, `true` the
//! bare flag, `prefill: [[url, port], [url]]` repeated `--prefill` — leaving out the keys
//! whose flag is on the real command line (flags win), and the whole is parsed once. So the
//! file accepts exactly what the flags accept. A bad flag, key or value is one line naming
//! it, and exit code 2. The flags are declared by group, one file each under `args/`
//! (listen, workers, health, discovery, observability, auth, registry, limits; the routing
//! settings come from the core), each with the checks of its own values; [`Args::load`]
//! runs them all, in one order.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{Command, CommandFactory, FromArgMatches, Parser};
use kvmesh_core::policy::PolicyKind;
use kvmesh_core::RoutingSettings;

use crate::peer_flags::{PeerFlags, NOT_YET, NO_EFFECT, REFUSED};
use crate::settings::{worker_api_key_or_env, Settings};

// One file per flag group: its flags (flattened into [`Args`] in this order, which is the
// order of `--help`) and what checks them.
mod auth;
mod config_file;
mod discovery;
mod health;
mod kv_events;
mod limits;
mod listen;
mod observability;
mod registry;
mod routing;
mod workers;

// What args/tests.rs reaches through `use super::*`.
use routing::roles_of;
#[cfg(test)]
use {clap::ArgAction, registry::kv_capacity_entry};

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
    #[command(flatten)]
    pub listen: listen::ListenFlags,
    #[command(flatten)]
    pub workers: workers::WorkerFlags,
    #[command(flatten)]
    pub routing: RoutingSettings,
    #[command(flatten)]
    pub health: health::HealthFlags,
    #[command(flatten)]
    pub discovery: discovery::DiscoveryFlags,
    #[command(flatten)]
    pub observability: observability::ObservabilityFlags,
    #[command(flatten)]
    pub auth: auth::AuthFlags,
    #[command(flatten)]
    pub registry: registry::RegistryFlags,
    #[command(flatten)]
    pub limits: limits::LimitFlags,
    #[command(flatten)]
    pub kv_events: kv_events::KvEventFlags,
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
        args.workers.prefill = matches
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

    /// Validates everything into [`Settings`], in this order (the first bad value is the
    /// error): the flags given, the workers, the routing settings, discovery, authentication,
    /// the worker URL policy, KV capacities, limits, then health checks and intervals.
    pub fn load(self) -> Result<Settings, BadArgs> {
        let mut warnings = self.flags_given()?;
        let pd = self.pd()?;
        let prefill = self.prefill()?;
        let (routing, checked) = self.routing(pd)?;
        let discovery = self.discovery_config(pd)?;
        let host = self.listen.host.clone().unwrap_or_else(|| "127.0.0.1".into());
        let http_host = self.listen.http_host.clone().unwrap_or_else(|| host.clone());
        let auth = self.auth_settings(&host, &http_host, &mut warnings)?;
        let (worker_policy, workers) = self.worker_policy(prefill, &mut warnings)?;
        let kv_capacity = self.kv_capacity()?;
        let limits = self.limit_settings()?;
        let kv_events = self.kv_event_settings()?;
        if self.observability.otlp_traces_endpoint.is_some() && !self.observability.enable_trace {
            warnings.push("--otlp-traces-endpoint has no effect without --enable-trace (as in sglang-router)".into());
        }
        if self.discovery.dp_aware && pd {
            warnings.push(
                "--dp-aware: no effect on PD workers (each stays one target; docs/configuration.md says why)".into(),
            );
        }
        Ok(Settings {
            dp_aware: self.discovery.dp_aware && !pd,
            state_file: self.registry.state_file.clone(),
            auth,
            worker_policy,
            limits,
            kv_events,
            prometheus_host: self.listen.prometheus_host.clone().unwrap_or_else(|| host.clone()),
            http_host,
            host,
            grpc_port: self.listen.grpc_port.unwrap_or(18000),
            http_port: self.listen.http_port.unwrap_or(18001),
            prometheus_port: self.listen.prometheus_port,
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
            health_checks: !self.health.disable_health_check,
            health_interval_secs: self.positive(
                "health_check_interval_secs",
                self.health.health_check_interval_secs,
                60,
            )?,
            health_timeout_secs: self.positive(
                "health_check_timeout_secs",
                self.health.health_check_timeout_secs,
                5,
            )?,
            health_failure_threshold: self.threshold(
                "health_failure_threshold",
                self.health.health_failure_threshold,
                3,
            )?,
            health_success_threshold: self.threshold(
                "health_success_threshold",
                self.health.health_success_threshold,
                2,
            )?,
            health_endpoint: self.health.health_check_endpoint.clone().unwrap_or_else(|| "/health".into()),
            worker_api_key: worker_api_key_or_env(self.auth.api_key.as_deref()).map_err(|e| self.bad("api_key", e))?,
            load_poll_interval_ms: self.positive("load_poll_interval_ms", self.health.load_poll_interval_ms, 1000)?,
            push_interval_ms: self.positive("push_interval_ms", self.health.push_interval_ms, 10)?,
            eds_wait_ms: self.health.eds_wait_ms.unwrap_or(1000),
            unresponsive_ms: if self.health.disable_health_check {
                0
            } else {
                self.health.worker_unresponsive_secs.unwrap_or(3).saturating_mul(1000)
            },
            lora_adapters: self
                .discovery
                .lora_adapter
                .iter()
                .map(|spec| spec.parse().map_err(|e: String| self.bad("lora_adapter", e)))
                .collect::<Result<_, _>>()?,
            discovery,
            log_level: self.observability.log_level.clone().unwrap_or_else(|| "info".into()),
            otlp_endpoint: self.otlp_endpoint(std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())?,
            warnings,
            workers: workers.regular,
            decode: workers.decode,
        })
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

#[cfg(test)]
mod tests;
