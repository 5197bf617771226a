//! Command-line flags of `kvmesh-sim`.

use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Regular,
    Prefill,
    Decode,
}

/// A simulated SGLang worker: SGLang and OpenAI endpoints, a prefix KV cache with LRU
/// capacity and a latency model. Runs on machines without GPUs.
#[derive(Clone, Debug, Parser)]
#[command(name = "kvmesh-sim", version)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port.
    #[arg(long, default_value_t = 30001)]
    pub port: u16,
    /// Worker role. Prefill and decode roles serve PD disaggregation.
    #[arg(long, value_enum, default_value_t = Role::Regular)]
    pub role: Role,
    /// Bootstrap port of a prefill worker (where decode workers fetch the KV of a room).
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
    /// How long a decode worker waits for the prefill's KV, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub bootstrap_timeout_ms: u64,
    /// Model name reported by `/v1/models`.
    #[arg(long, default_value = "kvmesh-sim")]
    pub model: String,
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
        if self.max_running == 0 {
            return Err("--max-running must be at least 1".into());
        }
        if self.kv_capacity_tokens == 0 {
            return Err("--kv-capacity-tokens must be at least 1".into());
        }
        Ok(())
    }
}
