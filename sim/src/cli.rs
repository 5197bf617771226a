//! Command-line flags of `kvmesh-sim`.

use clap::{Parser, ValueEnum};

/// Which server the simulator plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// SGLang: `/generate` and the OpenAI endpoints, `sglang:*` metrics, PD through bootstrap
    /// rooms.
    Sglang,
    /// vLLM: the OpenAI endpoints only, `vllm:*` metrics, PD through `kv_transfer_params`
    /// (NIXL-like).
    Vllm,
}

/// The KV-event wire format published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvEventsEncoding {
    /// vLLM ≤ 0.11: positional arrays, integer hashes, the data-parallel rank.
    VllmArray,
    /// vLLM now: tagged maps, 32-byte hashes.
    VllmTagged,
    /// SGLang: positional arrays, one `BlockStored` per page.
    Sglang,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Regular,
    Prefill,
    Decode,
}

/// A simulated SGLang or vLLM worker: SGLang's and OpenAI's endpoints (vLLM: OpenAI's only), a
/// prefix KV cache with LRU capacity and a latency model. Runs on machines without GPUs.
#[derive(Clone, Debug, Parser)]
#[command(name = "kvmesh-sim", version)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port.
    #[arg(long, default_value_t = 30001)]
    pub port: u16,
    /// Which server to simulate. `vllm`: OpenAI endpoints only (`/generate` is a 404), `usage`
    /// with `prompt_tokens_details.cached_tokens`, `vllm:*` metrics, `/v1/models` owned by
    /// `vllm`, and PD through `kv_transfer_params` instead of bootstrap rooms.
    #[arg(long, value_enum, default_value_t = EngineKind::Sglang)]
    pub engine: EngineKind,
    /// Worker role. Prefill and decode roles serve PD disaggregation. With `--engine vllm`, a
    /// prefill answers `kv_transfer_params` to requests asking `do_remote_decode`, and a decode
    /// pulls the KV that `do_remote_prefill` parameters name from that prefill (a 500 if it
    /// cannot, or if that KV is another prompt's); either asked of the other role, or of a
    /// regular worker, is a 400.
    #[arg(long, value_enum, default_value_t = Role::Regular)]
    pub role: Role,
    /// Bootstrap port of a prefill worker (where decode workers fetch the KV of a room; SGLang
    /// only).
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// Multiplies every simulated delay; 0 answers as fast as possible, 1 is real time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Extra slowness factor of this worker (2 = twice as slow).
    #[arg(long, default_value_t = 1.0)]
    pub slowdown: f64,
    /// Probability (0..1) that a request fails with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// KV cache capacity in tokens (LRU beyond it).
    #[arg(long, default_value_t = 262_144)]
    pub kv_capacity_tokens: u64,
    /// Requests decoded at once; more wait in the queue.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Prefill cost per uncached prompt token, in microseconds.
    #[arg(long, default_value_t = 40.0)]
    pub prefill_us_per_token: f64,
    /// Decode cost per output token with an empty batch, in milliseconds.
    #[arg(long, default_value_t = 8.0)]
    pub decode_ms_per_token: f64,
    /// Relative growth of the decode step per running request.
    #[arg(long, default_value_t = 0.02)]
    pub batch_slowdown: f64,
    /// Output tokens when the request does not say.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u64,
    /// Bootstrap port a decode worker uses when a request's `bootstrap_port` is null.
    #[arg(long, default_value_t = 8998)]
    pub default_bootstrap_port: u16,
    /// How long a decode worker waits for the prefill's KV, in milliseconds (SGLang: the
    /// bootstrap room; vLLM: the pull from `remote_host:remote_port`).
    #[arg(long, default_value_t = 5000)]
    pub bootstrap_timeout_ms: u64,
    /// A key every request must carry as `Authorization: Bearer <key>`, as the engine checks
    /// it: SGLang all but `/health*` and `/metrics`, vLLM only `/v1/*` (the `/sim/*` controls
    /// never). A request without it is a 401.
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model (vLLM's `root` in `/v1/models`); also its served name unless
    /// `--served-model-name` is given.
    #[arg(long, default_value = "kvmesh-sim")]
    pub model: String,
    /// The names the model is served under (one or more, as vLLM takes them; repeatable;
    /// default: `--model`). The first one is the name answers carry. A request naming a model
    /// that is not served (nor a `--lora` adapter) is a 404; with `--engine sglang` only when
    /// this or `--lora` is given.
    #[arg(long = "served-model-name", value_name = "NAME", num_args = 1..)]
    pub served_model_names: Vec<String>,
    /// A LoRA adapter served on top of the model (repeatable): listed in `/v1/models` with
    /// `parent` = the first served name; its prompts never hit the base model's cache.
    #[arg(long = "lora", value_name = "NAME")]
    pub loras: Vec<String>,
    /// vLLM: the engine id a prefill names in `kv_transfer_params.remote_engine_id` (default: a
    /// random id per process, so it identifies this sim instance).
    #[arg(long)]
    pub engine_id: Option<String>,
    /// vLLM: the host a prefill names in `kv_transfer_params.remote_host`, where decode workers
    /// pull its KV (default: `--host`). `remote_port` is `--port`.
    #[arg(long)]
    pub advertise_host: Option<String>,
    /// vLLM decode only: behave as llm-d's routing sidecar. A request with header
    /// `x-prefiller-host-port: HOST:PORT` first goes to that prefill worker (with
    /// `kv_transfer_params.do_remote_decode`, `"stream": false`, `max_tokens` 1), then decodes
    /// here with the `kv_transfer_params` it answered; without the header it runs here alone.
    #[arg(long)]
    pub llm_d_sidecar: bool,
    /// Data-parallel attention: N ranks, each with its own prefix cache (the `--kv-capacity-tokens`
    /// pool shared); `/get_server_info` says `dp_size`, `/get_load` lists each rank's requests,
    /// and a request's `data_parallel_rank` must name one (else a 400); without one, the ranks
    /// take requests in turn. 1 to 64.
    #[arg(long, default_value_t = 1)]
    pub dp_size: usize,
    /// How long the `--llm-d-sidecar` waits for the prefill worker's answer, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub sidecar_prefill_timeout_ms: u64,
    /// Publish KV-cache events on a ZMQ PUB socket on this port (needs --tokenizer). The
    /// event block cache is then the truth: `cached_tokens` is what it held of a prompt on
    /// arrival (whole pages, 4 bytes a token), and finished outputs take cache space.
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// The replay socket (ZMQ ROUTER) for the KV events.
    #[arg(long)]
    pub kv_events_replay_port: Option<u16>,
    /// The KV events' wire format.
    #[arg(long, value_enum, default_value_t = KvEventsEncoding::VllmTagged)]
    pub kv_events_encoding: KvEventsEncoding,
    /// Tokens per engine block (vLLM's block size, SGLang's page size) in the KV events.
    #[arg(long, default_value_t = 16)]
    pub kv_events_page_tokens: usize,
    /// A byte-level BPE `tokenizer.json` the prompts are tokenized with for the KV events.
    #[arg(long)]
    pub tokenizer: Option<String>,
}

impl Args {
    /// Checks value ranges clap cannot express.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(format!("--fail-rate {} is not between 0 and 1", self.fail_rate));
        }
        if !(self.time_scale >= 0.0 && self.time_scale.is_finite()) {
            return Err(format!("--time-scale {} must be >= 0", self.time_scale));
        }
        if !(self.slowdown > 0.0 && self.slowdown.is_finite()) {
            return Err(format!("--slowdown {} must be > 0", self.slowdown));
        }
        if !(1..=64).contains(&self.dp_size) {
            return Err(format!("--dp-size {} is not between 1 and 64", self.dp_size));
        }
        if self.max_running == 0 {
            return Err("--max-running must be at least 1".into());
        }
        if self.kv_capacity_tokens == 0 {
            return Err("--kv-capacity-tokens must be at least 1".into());
        }
        if self.llm_d_sidecar && (self.engine != EngineKind::Vllm || self.role != Role::Decode) {
            return Err("--llm-d-sidecar needs --engine vllm --role decode".into());
        }
        let default = [self.model.clone()];
        let served = if self.served_model_names.is_empty() { &default[..] } else { &self.served_model_names[..] };
        let names = served.iter().chain(&self.loras);
        if let Some(bad) = names.clone().find(|n| n.is_empty() || n.len() > 256) {
            return Err(format!("model name `{bad}` must be 1 to 256 bytes"));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = names.clone().find(|n| !seen.insert(*n)) {
            return Err(format!("model name `{dup}` is given twice"));
        }
        if self.kv_events_port.is_some() && self.tokenizer.is_none() {
            return Err("--kv-events-port needs --tokenizer".into());
        }
        if !(1..=4096).contains(&self.kv_events_page_tokens) {
            return Err("--kv-events-page-tokens must be 1 to 4096".into());
        }
        if self.engine_id.as_ref().is_some_and(|id| id.is_empty() || id.len() > 256) {
            return Err("--engine-id must be 1 to 256 bytes".into());
        }
        Ok(())
    }
}
