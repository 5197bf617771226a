//! `kvmesh-cp` flags, mirroring `python -m sglang_router.launch_router`, and `--config FILE`.
//!
//! The routing flags are [`RoutingSettings`] (declared once in the core), flattened here. The
//! YAML file is translated into command-line arguments for the same clap command — a key
//! `worker-urls`/`worker_urls` becomes `--worker-urls a b`, `true` the bare flag, `prefill:
//! [[url, port], [url]]` repeated `--prefill` — leaving out the keys whose flag is on the real
//! command line (flags win), and the whole is parsed once. So the file accepts exactly what
//! the flags accept. A bad flag, key or value is one line naming it, and exit code 2.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches, Parser};
use kvmesh_core::RoutingSettings;

use crate::peer_flags::{PeerFlags, NOT_YET, NO_EFFECT, REFUSED};
use crate::settings::{DiscoveryConfig, Settings};

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
    /// No active health checks: workers stay healthy unless passive health (circuit
    /// breakers) takes them out.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub disable_health_check: bool,
    /// How often worker load is polled (`/get_load`, else `/metrics`), in milliseconds
    /// (kvmesh). Default 1000.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub load_poll_interval_ms: Option<u64>,
    /// How often pending changes are pushed to the filters, in milliseconds (kvmesh). Default 10.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub push_interval_ms: Option<u64>,
    /// Discover workers as Kubernetes pods (in-cluster, or KUBECONFIG).
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub service_discovery: bool,
    /// Pod labels workers carry (k=v ...).
    #[arg(long, num_args = 1.., help_heading = "Workers: health, load, discovery")]
    pub selector: Vec<String>,
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
    /// Pod label giving the PD role (prefill | decode | both), as llm-d uses (kvmesh). Default
    /// llm-d.ai/role.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub role_label: Option<String>,
    /// Log level: debug, info, warn, error (RUST_LOG wins). Default info.
    #[arg(long, value_parser = ["debug", "info", "warn", "error"], help_heading = "Logging and authentication")]
    pub log_level: Option<String>,
    /// Accepted, not yet enforced: the API key kvmesh-cp sends to the workers.
    #[arg(long, help_heading = "Logging and authentication")]
    pub api_key: Option<String>,
    /// Accepted, not yet enforced: keys (id:name:role:key) that authenticate the admin API.
    #[arg(long, num_args = 0.., help_heading = "Logging and authentication")]
    pub control_plane_api_keys: Vec<String>,
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

/// A YAML scalar as a command-line value.
fn scalar(key: &str, v: &serde_yaml::Value) -> Result<String, String> {
    match v {
        serde_yaml::Value::String(s) => Ok(s.clone()),
        serde_yaml::Value::Number(n) => Ok(n.to_string()),
        serde_yaml::Value::Bool(b) => Ok(b.to_string()),
        _ => Err(format!("`{key}` takes a single value here, not a list or a mapping")),
    }
}

fn items(v: &serde_yaml::Value) -> Vec<serde_yaml::Value> {
    match v {
        serde_yaml::Value::Sequence(s) => s.clone(),
        other => vec![other.clone()],
    }
}

/// The `--config` file as command-line arguments for `cmd`, leaving out what `cli` (the real
/// command line) gives. Returns the arguments and the ids they set.
fn file_args(cmd: &Command, cli: &ArgMatches, text: &str) -> Result<(Vec<OsString>, Vec<String>), String> {
    let doc: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string().replace('\n', " "))?;
    let map = match doc {
        serde_yaml::Value::Mapping(m) => m,
        serde_yaml::Value::Null => serde_yaml::Mapping::new(),
        _ => return Err("the configuration must be a mapping of flag names to values".into()),
    };
    let mut out: Vec<OsString> = Vec::new();
    let mut ids = Vec::new();
    for (k, v) in &map {
        let key = k.as_str().ok_or("keys must be strings")?;
        let flag = key.replace('_', "-");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(flag.as_str()) && !matches!(flag.as_str(), "config" | "help" | "version"))
            .ok_or_else(|| format!("unknown key `{key}`"))?;
        let id = arg.get_id().as_str();
        if cli.value_source(id) == Some(ValueSource::CommandLine) || v.is_null() {
            continue;
        }
        ids.push(id.to_string());
        let long = format!("--{flag}");
        let range = arg.get_num_args().unwrap_or_default();
        if range.max_values() == 0 {
            match v {
                serde_yaml::Value::Bool(true) => out.push(long.into()),
                serde_yaml::Value::Bool(false) => {}
                _ => return Err(format!("`{key}` takes true or false")),
            }
        } else if id == "prefill" {
            for item in items(v) {
                out.push(long.clone().into());
                for part in items(&item) {
                    out.push(scalar(key, &part)?.into());
                }
            }
        } else if range.max_values() > 1 {
            out.push(long.into());
            for item in items(v) {
                out.push(scalar(key, &item)?.into());
            }
        } else if matches!(arg.get_action(), ArgAction::Append) {
            for item in items(v) {
                out.push(format!("{long}={}", scalar(key, &item)?).into());
            }
        } else {
            out.push(format!("{long}={}", scalar(key, v)?).into());
        }
    }
    Ok((out, ids))
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
            let (extra, ids) = file_args(&cmd, &matches, &text).map_err(file_error)?;
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

    /// Validates everything into [`Settings`].
    pub fn load(self) -> Result<Settings, BadArgs> {
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
        let pd = self.routing.pd_disaggregation.unwrap_or(false) || !self.prefill.is_empty() || !self.decode.is_empty();
        if pd && !self.worker_urls.is_empty() {
            return Err(self.bad("worker_urls", "not with --pd-disaggregation (use --prefill and --decode)"));
        }
        for url in &self.worker_urls {
            kvmesh_core::worker::socket_addr(url).map_err(|e| self.bad("worker_urls", e))?;
        }
        for url in &self.decode {
            kvmesh_core::worker::socket_addr(url).map_err(|e| self.bad("decode", e))?;
        }
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
            kvmesh_core::worker::socket_addr(&url).map_err(|e| self.bad("prefill", e))?;
            prefill.push((url, port));
        }
        // What the filters get; the core validates it exactly as the filters will.
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
        let selector = |flag: &str, pairs: &[String]| {
            pairs
                .iter()
                .map(|p| match p.split_once('=') {
                    Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
                    _ => Err(self.bad(flag, format!("`{p}` is not a label key=value"))),
                })
                .collect::<Result<std::collections::BTreeMap<_, _>, _>>()
        };
        let discovery = if self.service_discovery {
            Some(DiscoveryConfig {
                namespace: self.service_discovery_namespace.clone(),
                selector: selector("selector", &self.selector)?,
                prefill_selector: selector("prefill_selector", &self.prefill_selector)?,
                decode_selector: selector("decode_selector", &self.decode_selector)?,
                port: self.service_discovery_port.unwrap_or(80),
                bootstrap_annotation: self
                    .bootstrap_port_annotation
                    .clone()
                    .unwrap_or_else(|| "sglang.ai/bootstrap-port".into()),
                role_label: self.role_label.clone().unwrap_or_else(|| "llm-d.ai/role".into()),
                pd,
            })
        } else {
            None
        };
        let positive = |flag: &str, v: Option<u64>, default: u64| match v {
            Some(0) => Err(self.bad(flag, "must be greater than 0")),
            Some(v) => Ok(v),
            None => Ok(default),
        };
        let threshold = |flag: &str, v: Option<u32>, default: u32| {
            positive(flag, v.map(u64::from), u64::from(default)).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        };
        let host = self.host.clone().unwrap_or_else(|| "127.0.0.1".into());
        Ok(Settings {
            prometheus_host: self.prometheus_host.clone().unwrap_or_else(|| host.clone()),
            host,
            grpc_port: self.grpc_port.unwrap_or(18000),
            http_port: self.http_port.unwrap_or(18001),
            prometheus_port: self.prometheus_port,
            pd,
            prefill,
            routing,
            block_size: checked.block_size,
            max_tree_size: checked.max_tree_size,
            eviction_interval_secs: checked.eviction_interval_secs,
            health_checks: !self.disable_health_check,
            health_interval_secs: positive("health_check_interval_secs", self.health_check_interval_secs, 60)?,
            health_timeout_secs: positive("health_check_timeout_secs", self.health_check_timeout_secs, 5)?,
            health_failure_threshold: threshold("health_failure_threshold", self.health_failure_threshold, 3)?,
            health_success_threshold: threshold("health_success_threshold", self.health_success_threshold, 2)?,
            health_endpoint: self.health_check_endpoint.clone().unwrap_or_else(|| "/health".into()),
            load_poll_interval_ms: positive("load_poll_interval_ms", self.load_poll_interval_ms, 1000)?,
            push_interval_ms: positive("push_interval_ms", self.push_interval_ms, 10)?,
            discovery,
            log_level: self.log_level.clone().unwrap_or_else(|| "info".into()),
            warnings,
            workers: self.worker_urls,
            decode: self.decode,
        })
    }
}

#[cfg(test)]
mod tests;
