//! `kvmesh-cp` flags, mirroring `python -m sglang_router.launch_router`, and `--config FILE`
//! (YAML with the same keys, `-` or `_`). Flags win over the file. A bad value is one line
//! naming the flag, and exit code 2.

use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser};
use kvmesh_core::policy::PolicyKind;
use serde::Deserialize;

/// kvmesh control plane: one place to configure kvmesh (sglang-router's flags); streams
/// workers, load and the shared prefix index to every Envoy running the kvmesh filter.
#[derive(Clone, Debug, Default, Parser, Deserialize)]
#[command(name = "kvmesh-cp", version)]
#[serde(default, deny_unknown_fields, rename_all = "snake_case")]
pub struct Args {
    /// YAML file with the same keys as the flags (flags win).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long)]
    pub host: Option<String>,
    /// gRPC port (the filters' snapshot stream).
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// HTTP port: admin API (/add_worker, /workers, ...) and /metrics.
    #[arg(long)]
    pub http_port: Option<u16>,
    /// A separate port for /metrics only (sglang-router's flag).
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Regular workers.
    #[arg(long, num_args = 1..)]
    pub worker_urls: Vec<String>,
    /// Routing policy.
    #[arg(long)]
    pub policy: Option<String>,
    /// Prefill/decode disaggregation.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub pd_disaggregation: Option<bool>,
    /// A prefill worker and its bootstrap port (or `none`); repeatable.
    #[arg(long = "prefill", id = "prefill", num_args = 1..=2, action = clap::ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"])]
    #[serde(skip)]
    pub prefill_flat: Vec<String>,
    /// `--prefill` occurrences, grouped (filled by [`Args::parse_from`]).
    #[arg(skip)]
    pub prefill: Vec<Vec<String>>,
    /// A decode worker; repeatable.
    #[arg(long, action = clap::ArgAction::Append)]
    pub decode: Vec<String>,
    #[arg(long)]
    pub prefill_policy: Option<String>,
    #[arg(long)]
    pub decode_policy: Option<String>,
    /// PD decider: always | prefix.
    #[arg(long)]
    pub pd_decider: Option<String>,
    #[arg(long)]
    pub non_cached_tokens: Option<u64>,
    #[arg(long)]
    pub cache_threshold: Option<f64>,
    #[arg(long)]
    pub balance_abs_threshold: Option<u64>,
    #[arg(long)]
    pub balance_rel_threshold: Option<f64>,
    #[arg(long)]
    pub eviction_interval_secs: Option<u64>,
    #[arg(long)]
    pub max_tree_size: Option<u64>,
    #[arg(long)]
    pub block_size: Option<usize>,
    #[arg(long)]
    pub max_payload_size: Option<u64>,
    #[arg(long)]
    pub request_timeout_secs: Option<u64>,
    #[arg(long)]
    pub cb_failure_threshold: Option<u32>,
    #[arg(long)]
    pub cb_timeout_duration_secs: Option<u64>,
    #[arg(long)]
    pub health_check_interval_secs: Option<u64>,
    #[arg(long)]
    pub health_check_timeout_secs: Option<u64>,
    #[arg(long)]
    pub health_failure_threshold: Option<u32>,
    #[arg(long)]
    pub health_success_threshold: Option<u32>,
    #[arg(long)]
    pub health_check_endpoint: Option<String>,
    /// How often worker load is polled (`/get_load`, else `/metrics`), in milliseconds.
    #[arg(long)]
    pub load_poll_interval_ms: Option<u64>,
    /// How often index deltas are pushed to the filters, in milliseconds.
    #[arg(long)]
    pub push_interval_ms: Option<u64>,
    /// Discover workers as Kubernetes pods (in-cluster, or KUBECONFIG).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub service_discovery: Option<bool>,
    /// Pod labels workers carry (k=v ...).
    #[arg(long, num_args = 1..)]
    pub selector: Vec<String>,
    /// PD: labels of prefill pods (k=v ...).
    #[arg(long, num_args = 1..)]
    pub prefill_selector: Vec<String>,
    /// PD: labels of decode pods (k=v ...).
    #[arg(long, num_args = 1..)]
    pub decode_selector: Vec<String>,
    /// Namespace to watch (all namespaces when unset).
    #[arg(long)]
    pub service_discovery_namespace: Option<String>,
    /// The workers' HTTP port in the pods.
    #[arg(long)]
    pub service_discovery_port: Option<u16>,
    /// Pod annotation holding a prefill pod's bootstrap port.
    #[arg(long)]
    pub bootstrap_port_annotation: Option<String>,
    /// Pod label giving the PD role (prefill | decode | both), as llm-d uses.
    #[arg(long)]
    pub role_label: Option<String>,
}

/// The validated settings.
#[derive(Clone, Debug)]
pub struct Settings {
    pub host: String,
    pub grpc_port: u16,
    pub http_port: u16,
    pub prometheus_port: Option<u16>,
    pub workers: Vec<String>,
    pub pd: bool,
    /// `(url, bootstrap port)`.
    pub prefill: Vec<(String, Option<u16>)>,
    pub decode: Vec<String>,
    /// The filter's routing configuration (JSON keys), pushed in snapshots.
    pub policy_json: serde_json::Value,
    pub block_size: usize,
    pub max_tree_size: u64,
    pub eviction_interval_secs: u64,
    pub health_interval_secs: u64,
    pub health_timeout_secs: u64,
    pub health_failure_threshold: u32,
    pub health_success_threshold: u32,
    pub health_endpoint: String,
    pub load_poll_interval_ms: u64,
    pub push_interval_ms: u64,
    pub discovery: Option<crate::discovery::DiscoveryConfig>,
}

fn selector(flag: &str, pairs: &[String]) -> Result<std::collections::BTreeMap<String, String>, BadArgs> {
    pairs
        .iter()
        .map(|p| match p.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(bad(flag, format!("`{p}` is not a label key=value"))),
        })
        .collect()
}

/// A bad flag or configuration value: printed as one line, exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadArgs(pub String);

fn bad(flag: &str, why: impl std::fmt::Display) -> BadArgs {
    BadArgs(format!("--{}: {why}", flag.replace('_', "-")))
}

macro_rules! merge {
    ($cli:ident, $file:ident, $($field:ident),*) => {
        $( if $cli.$field.is_none() { $cli.$field = $file.$field.take(); } )*
    };
}

impl Args {
    /// Parses the command line, grouping each `--prefill URL [PORT]`.
    pub fn parse_from<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Self::command().try_get_matches_from(argv)?;
        let mut args = Self::from_arg_matches(&matches)?;
        args.prefill = matches
            .get_occurrences::<String>("prefill")
            .map(|occ| occ.map(|o| o.cloned().collect()).collect())
            .unwrap_or_default();
        Ok(args)
    }

    /// Flags, then the `--config` file under them.
    pub fn load(mut self) -> Result<Settings, BadArgs> {
        if let Some(path) = self.config.clone() {
            let text = std::fs::read_to_string(&path).map_err(|e| bad("config", format!("{}: {e}", path.display())))?;
            let normalised = normalise_keys(&text).map_err(|e| bad("config", format!("{}: {e}", path.display())))?;
            let mut file: Args = serde_yaml::from_value(normalised.clone())
                .map_err(|e| bad("config", format!("{}: {}", path.display(), explain(&normalised, &e))))?;
            merge!(
                self,
                file,
                host,
                grpc_port,
                http_port,
                prometheus_port,
                policy,
                pd_disaggregation,
                prefill_policy,
                decode_policy,
                pd_decider,
                non_cached_tokens,
                cache_threshold,
                balance_abs_threshold,
                balance_rel_threshold,
                eviction_interval_secs,
                max_tree_size,
                block_size,
                max_payload_size,
                request_timeout_secs,
                cb_failure_threshold,
                cb_timeout_duration_secs,
                health_check_interval_secs,
                health_check_timeout_secs,
                health_failure_threshold,
                health_success_threshold,
                health_check_endpoint,
                load_poll_interval_ms,
                push_interval_ms
            );
            if self.worker_urls.is_empty() {
                self.worker_urls = std::mem::take(&mut file.worker_urls);
            }
            if self.prefill.is_empty() {
                self.prefill = std::mem::take(&mut file.prefill);
            }
            if self.decode.is_empty() {
                self.decode = std::mem::take(&mut file.decode);
            }
            for (mine, theirs) in [
                (&mut self.selector, &mut file.selector),
                (&mut self.prefill_selector, &mut file.prefill_selector),
                (&mut self.decode_selector, &mut file.decode_selector),
            ] {
                if mine.is_empty() {
                    *mine = std::mem::take(theirs);
                }
            }
        }
        self.validate()
    }

    fn validate(self) -> Result<Settings, BadArgs> {
        let pd = self.pd_disaggregation.unwrap_or(false) || !self.prefill.is_empty() || !self.decode.is_empty();
        if pd && !self.worker_urls.is_empty() {
            return Err(bad("worker_urls", "not with --pd-disaggregation (use --prefill and --decode)"));
        }
        for url in self.worker_urls.iter().chain(&self.decode) {
            kvmesh_core::worker::socket_addr(url).map_err(|e| bad(if pd { "decode" } else { "worker_urls" }, e))?;
        }
        let mut prefill = Vec::new();
        for entry in &self.prefill {
            let (url, port) = match entry.as_slice() {
                [url] => (url.clone(), None),
                [url, p] if p.eq_ignore_ascii_case("none") => (url.clone(), None),
                [url, p] => (
                    url.clone(),
                    Some(
                        p.parse::<u16>()
                            .map_err(|_| bad("prefill", format!("bootstrap port `{p}` is not a port or `none`")))?,
                    ),
                ),
                _ => return Err(bad("prefill", "takes URL [BOOTSTRAP_PORT|none]")),
            };
            kvmesh_core::worker::socket_addr(&url).map_err(|e| bad("prefill", e))?;
            prefill.push((url, port));
        }
        for (flag, value) in
            [("policy", &self.policy), ("prefill_policy", &self.prefill_policy), ("decode_policy", &self.decode_policy)]
        {
            if let Some(v) = value {
                let kind = v.parse::<PolicyKind>().map_err(|e| bad(flag, e))?;
                if !kind.implemented() {
                    return Err(bad(flag, format!("`{kind}` is not available in this build yet")));
                }
            }
        }
        // The routing keys the filters get; the core validates them exactly as the filter will.
        let mut policy = serde_json::Map::new();
        macro_rules! put {
            ($($field:ident),*) => { $( if let Some(v) = &self.$field { policy.insert(stringify!($field).into(), serde_json::json!(v)); } )* };
        }
        put!(
            policy,
            prefill_policy,
            decode_policy,
            pd_decider,
            non_cached_tokens,
            cache_threshold,
            balance_abs_threshold,
            balance_rel_threshold,
            eviction_interval_secs,
            max_tree_size,
            block_size,
            max_payload_size,
            request_timeout_secs,
            cb_failure_threshold,
            cb_timeout_duration_secs
        );
        if pd {
            policy.insert("pd_disaggregation".into(), serde_json::json!(true));
        }
        let policy_json = serde_json::Value::Object(policy);
        let checked = kvmesh_core::Config::from_json(policy_json.to_string().as_bytes()).map_err(|e| match e {
            kvmesh_core::ConfigError::Invalid { field, reason } => bad(field, reason),
            other => BadArgs(other.to_string()),
        })?;
        let discovery = if self.service_discovery.unwrap_or(false) {
            Some(crate::discovery::DiscoveryConfig {
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
            Some(0) => Err(bad(flag, "must be greater than 0")),
            Some(v) => Ok(v),
            None => Ok(default),
        };
        Ok(Settings {
            host: self.host.unwrap_or_else(|| "127.0.0.1".into()),
            grpc_port: self.grpc_port.unwrap_or(18000),
            http_port: self.http_port.unwrap_or(18001),
            prometheus_port: self.prometheus_port,
            workers: self.worker_urls,
            pd,
            prefill,
            decode: self.decode,
            policy_json,
            block_size: checked.block_size,
            max_tree_size: checked.max_tree_size,
            eviction_interval_secs: checked.eviction_interval_secs,
            health_interval_secs: positive("health_check_interval_secs", self.health_check_interval_secs, 60)?,
            health_timeout_secs: positive("health_check_timeout_secs", self.health_check_timeout_secs, 5)?,
            health_failure_threshold: positive(
                "health_failure_threshold",
                self.health_failure_threshold.map(u64::from),
                3,
            )? as u32,
            health_success_threshold: positive(
                "health_success_threshold",
                self.health_success_threshold.map(u64::from),
                2,
            )? as u32,
            health_endpoint: self.health_check_endpoint.unwrap_or_else(|| "/health".into()),
            load_poll_interval_ms: positive("load_poll_interval_ms", self.load_poll_interval_ms, 1000)?,
            push_interval_ms: positive("push_interval_ms", self.push_interval_ms, 10)?,
            discovery,
        })
    }
}

/// Names the key a YAML error is about (serde's type errors do not say).
fn explain(doc: &serde_yaml::Value, e: &serde_yaml::Error) -> String {
    let first = e.to_string().lines().next().unwrap_or("").to_string();
    if let serde_yaml::Value::Mapping(map) = doc {
        for (k, v) in map {
            let mut one = serde_yaml::Mapping::new();
            one.insert(k.clone(), v.clone());
            if let Err(err) = serde_yaml::from_value::<Args>(serde_yaml::Value::Mapping(one)) {
                let key = k.as_str().unwrap_or("?").replace('_', "-");
                return format!("`{key}`: {}", err.to_string().lines().next().unwrap_or(""));
            }
        }
    }
    first
}

/// YAML keys may use `-` like the flags; the struct uses `_`.
fn normalise_keys(text: &str) -> Result<serde_yaml::Value, String> {
    let v: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
    let serde_yaml::Value::Mapping(map) = v else {
        return Err("the configuration must be a mapping of flag names to values".into());
    };
    let mut out = serde_yaml::Mapping::new();
    for (k, v) in map {
        let key = k.as_str().ok_or("keys must be strings")?.replace('-', "_");
        out.insert(key.into(), v);
    }
    Ok(serde_yaml::Value::Mapping(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Settings, String> {
        let mut argv = vec!["kvmesh-cp"];
        argv.extend(args);
        Args::parse_from(argv).map_err(|e| e.to_string())?.load().map_err(|e| e.to_string())
    }

    #[test]
    fn sglang_router_flags() {
        let s = parse(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            "--policy",
            "cache_aware",
            "--cache-threshold",
            "0.5",
        ])
        .unwrap();
        assert_eq!(s.workers.len(), 2);
        assert_eq!(s.policy_json["cache_threshold"], 0.5);
        assert!(!s.pd);
        let s = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://127.0.0.1:1",
            "8998",
            "--prefill",
            "http://127.0.0.1:2",
            "none",
            "--decode",
            "http://127.0.0.1:3",
        ])
        .unwrap();
        assert_eq!(s.prefill, vec![("http://127.0.0.1:1".into(), Some(8998)), ("http://127.0.0.1:2".into(), None)]);
        assert!(s.pd && s.policy_json["pd_disaggregation"] == true);
    }

    #[test]
    fn bad_values_name_the_flag() {
        assert!(parse(&["--cache-threshold", "2"]).unwrap_err().contains("--cache-threshold"));
        assert!(parse(&["--policy", "fastest"]).unwrap_err().contains("--policy"));
        assert!(parse(&["--worker-urls", "10.0.0.1:80"]).unwrap_err().contains("--worker-urls"));
        assert!(parse(&["--prefill", "http://127.0.0.1:1", "x"]).unwrap_err().contains("--prefill"));
        assert!(parse(&["--health-check-interval-secs", "0"]).unwrap_err().contains("--health-check-interval-secs"));
        assert!(parse(&["--balance-abs-threshold", "x"]).unwrap_err().contains("--balance-abs-threshold"));
    }

    #[test]
    fn config_file_under_flags() {
        let dir = std::env::temp_dir().join(format!("kvmesh-cp-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cp.yaml");
        std::fs::write(&path, "worker-urls: [http://127.0.0.1:5]\npolicy: round_robin\ncache_threshold: 0.4\n")
            .unwrap();
        let s = parse(&["--config", path.to_str().unwrap(), "--cache-threshold", "0.6"]).unwrap();
        assert_eq!(s.workers, vec!["http://127.0.0.1:5".to_string()]);
        assert_eq!(s.policy_json["policy"], "round_robin");
        assert_eq!(s.policy_json["cache_threshold"], 0.6);
        std::fs::write(&path, "polcy: random\n").unwrap();
        let e = parse(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("--config") && e.contains("polcy"), "{e}");
        std::fs::write(&path, "cache_threshold: 7\n").unwrap();
        assert!(parse(&["--config", path.to_str().unwrap()]).unwrap_err().contains("--cache-threshold"));
    }
}
