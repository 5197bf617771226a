//! The bounds on what gateways send: message size, hashes per report and per second, the
//! global index.

use super::{Args, BadArgs};
use crate::settings::Limits;

/// The bounds.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct LimitFlags {
    /// Largest gRPC message kvmesh-cp decodes, in bytes (kvmesh). Default 16777216 (16 MiB).
    #[arg(long, help_heading = "Limits")]
    pub max_message_bytes: Option<usize>,
    /// Most index hashes merged from one report message; the rest are dropped and counted
    /// (kvmesh). Default 1048576.
    #[arg(long, help_heading = "Limits")]
    pub max_inserts_per_report: Option<usize>,
    /// Index hashes per second one gateway may report (bursts of four seconds' worth); the
    /// rest are dropped and counted (kvmesh). Default 1048576.
    #[arg(long, help_heading = "Limits")]
    pub max_inserts_per_sec: Option<u64>,
    /// Most (worker, block) entries in the global prefix index: past it (and 1/8 slack) the
    /// least recently used are evicted at once, not only every --eviction-interval-secs
    /// (kvmesh). Default 2097152.
    #[arg(long, help_heading = "Limits")]
    pub max_index_entries: Option<u64>,
}

impl Args {
    /// The bounds on messages, reports and the global index.
    pub(super) fn limit_settings(&self) -> Result<Limits, BadArgs> {
        let defaults = Limits::default();
        Ok(Limits {
            max_message_bytes: usize::try_from(self.positive(
                "max_message_bytes",
                self.limits.max_message_bytes.map(|n| n as u64),
                defaults.max_message_bytes as u64,
            )?)
            .unwrap_or(usize::MAX),
            max_inserts_per_report: usize::try_from(self.positive(
                "max_inserts_per_report",
                self.limits.max_inserts_per_report.map(|n| n as u64),
                defaults.max_inserts_per_report as u64,
            )?)
            .unwrap_or(usize::MAX),
            max_inserts_per_sec: self.positive(
                "max_inserts_per_sec",
                self.limits.max_inserts_per_sec,
                defaults.max_inserts_per_sec,
            )?,
            max_index_entries: self.positive(
                "max_index_entries",
                self.limits.max_index_entries,
                defaults.max_index_entries,
            )?,
        })
    }
}
