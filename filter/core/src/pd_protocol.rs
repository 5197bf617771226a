//! The PD protocols (`--pd-protocol`, a pod's `kvmesh.io/pd-protocol`): how the two legs of a
//! disaggregated request meet. Below the settings and the worker table, which both name it.

use std::fmt;
use std::str::FromStr;

/// How the two legs of a disaggregated request meet (`--pd-protocol`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PdProtocol {
    /// SGLang's bootstrap: `bootstrap_host/port/room` in both bodies, the prefill leg sent by
    /// the gateway beside the decode leg (sglang-router's behaviour).
    Sglang,
    /// llm-d's routing sidecar: the request goes to the decode pod, which runs the prefill
    /// itself on the pod that `x-prefiller-host-port` names when the gateway splits.
    LlmD,
    /// vLLM's KV transfer: the gateway sends the prefill leg first (one token, asking for a
    /// remote decode) and gives its `kv_transfer_params` to the decode leg.
    Vllm,
}

impl PdProtocol {
    pub const ALL: [PdProtocol; 3] = [Self::Sglang, Self::LlmD, Self::Vllm];

    pub fn name(self) -> &'static str {
        match self {
            Self::Sglang => "sglang",
            Self::LlmD => "llm-d",
            Self::Vllm => "vllm",
        }
    }
}

impl fmt::Display for PdProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PdProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown PD protocol `{s}` (sglang, llm-d, vllm)"))
    }
}
