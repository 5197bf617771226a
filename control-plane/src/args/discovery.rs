//! Kubernetes discovery (pods by label, or an InferencePool), names and LoRA adapters for
//! the discovered workers, data-parallel ranks.

use std::collections::BTreeMap;

use super::{Args, BadArgs};
use crate::settings::DiscoveryConfig;

/// Discovery, model names, adapters, data-parallel ranks.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct DiscoveryFlags {
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
}

impl Args {
    /// Kubernetes discovery, when `--service-discovery` or `--inference-pool`.
    pub(super) fn discovery_config(&self, pd: bool) -> Result<Option<DiscoveryConfig>, BadArgs> {
        if !self.discovery.service_discovery && self.discovery.inference_pool.is_none() {
            return Ok(None);
        }
        if let Some(name) = &self.discovery.inference_pool {
            let dns_label = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
            if name.len() > 253 || !name.split(['.', '-']).all(dns_label) {
                return Err(self.bad("inference_pool", format!("`{name}` is not a Kubernetes object name")));
            }
            let why = "the pool's spec.selector and spec.targetPorts select the workers";
            for (flag, given) in [
                ("selector", !self.discovery.selector.is_empty()),
                ("service_discovery_port", self.discovery.service_discovery_port.is_some()),
            ] {
                if given {
                    return Err(self.bad("inference_pool", format!("not with --{}: {why}", flag.replace('_', "-"))));
                }
            }
        }
        Ok(Some(DiscoveryConfig {
            inference_pool: self.discovery.inference_pool.clone(),
            namespace: self.discovery.service_discovery_namespace.clone(),
            selector: self.labels("selector", &self.discovery.selector)?,
            prefill_selector: self.labels("prefill_selector", &self.discovery.prefill_selector)?,
            decode_selector: self.labels("decode_selector", &self.discovery.decode_selector)?,
            ports: vec![self.discovery.service_discovery_port.unwrap_or(80)],
            bootstrap_annotation: self
                .discovery
                .bootstrap_port_annotation
                .clone()
                .unwrap_or_else(|| "sglang.ai/bootstrap-port".into()),
            role_label: self.discovery.role_label.clone().unwrap_or_else(|| "llm-d.ai/role".into()),
            model_id_from: match self.discovery.model_id_from.as_deref() {
                None => None,
                Some(spec) => Some(spec.parse().map_err(|e: String| self.bad("model_id_from", e))?),
            },
            pd,
        }))
    }

    /// A pod label selector: `key=value` pairs.
    pub(super) fn labels(&self, flag: &str, pairs: &[String]) -> Result<BTreeMap<String, String>, BadArgs> {
        pairs
            .iter()
            .map(|p| match p.split_once('=') {
                Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
                _ => Err(self.bad(flag, format!("`{p}` is not a label key=value"))),
            })
            .collect()
    }
}
