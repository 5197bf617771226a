//! Logs and traces: the log level, OpenTelemetry export.

use clap::ArgAction;

use super::{Args, BadArgs};

/// Logging and tracing.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct ObservabilityFlags {
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
}

impl Args {
    /// Where traces go, if anywhere: with --enable-trace, --otlp-traces-endpoint, else `env`
    /// (`OTEL_EXPORTER_OTLP_ENDPOINT`), else localhost:4317; without it, `env` alone. A
    /// host:port gets `http://`.
    pub(crate) fn otlp_endpoint(&self, env: Option<String>) -> Result<Option<String>, BadArgs> {
        let env = env.map(|e| e.trim().to_string()).filter(|e| !e.is_empty());
        let endpoint = match (self.observability.enable_trace, &self.observability.otlp_traces_endpoint) {
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
}
