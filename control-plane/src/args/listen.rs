//! Where kvmesh-cp listens: the filters' gRPC streams, the admin API and `/metrics`.

/// The listeners' flags.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct ListenFlags {
    /// Address kvmesh-cp listens on. Default 127.0.0.1.
    #[arg(long)]
    pub host: Option<String>,
    /// gRPC port: the filters' snapshot and report streams (kvmesh). Default 18000.
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// HTTP port: the admin API (/add_worker, /workers, ...) and /metrics (kvmesh). Default 18001.
    #[arg(long)]
    pub http_port: Option<u16>,
    /// Address of the admin API (and /metrics) listener, e.g. loopback while the gRPC port is
    /// on the cluster network (kvmesh). Default: --host.
    #[arg(long)]
    pub http_host: Option<String>,
    /// Serve /metrics alone on this port too. Default: only on --http-port.
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Address of the --prometheus-port listener. Default: --host.
    #[arg(long)]
    pub prometheus_host: Option<String>,
}
