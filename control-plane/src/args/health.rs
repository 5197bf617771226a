//! Probing the workers: active health checks and their thresholds, load polling, a silent
//! worker taken out; how often changes are pushed, how long a table waits for EDS.

/// Health checks, load polling and pacing.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct HealthFlags {
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
    /// No active health checks: workers stay healthy unless passive health (breakers) takes them out.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub disable_health_check: bool,
    /// How often worker load is polled (`/get_load`, else `/metrics`), in milliseconds
    /// (kvmesh). Default 1000.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub load_poll_interval_ms: Option<u64>,
    /// Seconds a healthy worker may answer none of its health and load probes before it is
    /// taken out of rotation, until it answers one (kvmesh: a hung worker, accepting
    /// connections and answering nothing, leaves every gateway within about this plus a
    /// second; a worker busy generating still answers its probes). 0 turns it off. Default 3.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub worker_unresponsive_secs: Option<u64>,
    /// How often pending changes are pushed to the filters, in milliseconds (kvmesh). Default 10.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub push_interval_ms: Option<u64>,
    /// Longest a worker table that adds or heals workers waits for every Envoy's EDS to list
    /// them before going to the filters, and how long a removed worker stays in EDS after, in
    /// milliseconds (kvmesh). 0: no wait. Default 1000.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub eds_wait_ms: Option<u64>,
}
