//! Logs on stderr and, with `--enable-trace` (or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`
//! set), traces exported over OTLP/gRPC as service `kvmesh-cp` (`Args::otlp_endpoint` says
//! where). Off by default. The spans exported are the ones created with target [`SPANS`]:
//!
//! | span | when | attributes |
//! | --- | --- | --- |
//! | `report` | a gateway's report batch is merged | `gateway`, `inserts`, `hashes` |
//! | `snapshot.publish` | a delta is built and broadcast to the watching gateways | `version`, `workers_changed`, `inserts`, `evictions`, `watchers` |
//! | `snapshot.full` | a gateway's full snapshot is built (it connected, or fell behind) | `gateway`, `version`, `blocks` |
//! | `discovery.reconcile` | Kubernetes discovery applies the pods it sees | `wanted`, `workers` |
//! | `admin` | an HTTP admin or metrics call | `http.request.method`, `url.path`, `http.response.status_code` |
//!
//! They stay out of the log lines (which read as before). The standard `OTEL_*` variables of
//! the OpenTelemetry SDK apply (`OTEL_BSP_SCHEDULE_DELAY`, `OTEL_EXPORTER_OTLP_TIMEOUT`, ...).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The target of the spans that are exported (and kept out of the logs).
pub const SPANS: &str = "kvmesh_cp::spans";

/// The service name the traces carry.
pub const SERVICE_NAME: &str = "kvmesh-cp";

/// The trace pipeline, flushed by [`Telemetry::shutdown`].
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports what is left (at exit).
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            if let Err(e) = provider.shutdown() {
                eprintln!("kvmesh-cp: flushing traces: {e}");
            }
        }
    }
}

/// Installs the logs at `log_level` (`RUST_LOG` wins) and, with `otlp`, the trace exporter.
/// Runs inside the tokio runtime: the exporter's gRPC channel lives on it.
pub fn init(log_level: &str, otlp: Option<&str>) -> Result<Telemetry, String> {
    let logs = EnvFilter::try_from_default_env().unwrap_or_else(|_| log_level.into());
    let hidden = format!("{SPANS}=off").parse().map_err(|e| format!("{e}"))?;
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(logs.add_directive(hidden));
    let (traces, provider) = match otlp {
        None => (None, None),
        Some(url) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(url)
                .build()
                .map_err(|e| format!("--otlp-endpoint {url}: {e}"))?;
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(Resource::builder().with_service_name(SERVICE_NAME).build())
                .build();
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer(SERVICE_NAME))
                .with_filter(Targets::new().with_target(SPANS, LevelFilter::INFO));
            (Some(layer), Some(provider))
        }
    };
    tracing_subscriber::registry().with(fmt).with(traces).try_init().map_err(|e| e.to_string())?;
    if let Some(url) = otlp {
        tracing::info!(%url, "exporting traces over OTLP");
    }
    Ok(Telemetry { provider })
}
