//! The PD protocols (`--pd-protocol`, a pod's `kvmesh.io/pd-protocol`): how the two legs of a
//! disaggregated request meet. Below the settings and the worker table, which both name it.

crate::named::named_enum! {
    /// How the two legs of a disaggregated request meet (`--pd-protocol`).
    pub enum PdProtocol as "PD protocol" {
        /// SGLang's bootstrap: `bootstrap_host/port/room` in both bodies, the prefill leg sent
        /// by the gateway beside the decode leg (sglang-router's behaviour).
        Sglang = 1 => "sglang",
        /// llm-d's routing sidecar: the request goes to the decode pod, which runs the prefill
        /// itself on the pod that `x-prefiller-host-port` names when the gateway splits.
        LlmD = 2 => "llm-d",
        /// vLLM's KV transfer: the gateway sends the prefill leg first (one token, asking for
        /// a remote decode) and gives its `kv_transfer_params` to the decode leg.
        Vllm = 3 => "vllm",
    }
}
