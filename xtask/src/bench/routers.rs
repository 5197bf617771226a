//! What the quality workloads share: a router configuration to compare (kvmesh at N gateways,
//! a peer at N replicas), starting it in front of the workers, and reading the workers'
//! counters before and after.

use kvmesh_testkit::Sim;
use serde_json::Value;

use super::stack::{self, Peer, PeerBins, Running, Workers};

#[derive(Clone, Debug)]
pub(super) struct Config {
    pub router: &'static str,
    pub replicas: usize,
    pub mesh: bool,
    pub policy: &'static str,
}

impl Config {
    pub fn label(&self) -> String {
        let (what, unit) = match self.router {
            "kvmesh" => ("kvmesh", "gateway"),
            "smg" => ("SMG 1.13.0", "replica"),
            _ => ("sglang-router 0.3.2", "replica"),
        };
        let mesh = if self.mesh { " +mesh" } else { "" };
        let s = if self.replicas > 1 { "s" } else { "" };
        format!("{what} ×{} {unit}{s}{mesh} ({})", self.replicas, self.policy)
    }
}

/// `threads`: each kvmesh gateway's Envoy worker threads (1 by default: eight gateways share
/// two cores; `--threads 2` has every gateway's VMs share its counts and inserts as well).
pub(super) fn start(bins: &PeerBins, c: &Config, workers: &Workers, threads: u32) -> anyhow::Result<Running> {
    match c.router {
        "kvmesh" => stack::kvmesh(workers, threads.max(1), c.replicas, c.policy, true),
        "smg" => stack::peer(bins, Peer::Smg, workers, c.replicas, c.mesh, c.policy),
        _ => stack::peer(bins, Peer::SglangRouter, workers, c.replicas, false, c.policy),
    }
}

pub(super) fn stats(sims: &[Sim]) -> Vec<Value> {
    sims.iter().map(|s| s.stats().unwrap_or(Value::Null)).collect()
}

pub(super) fn delta(after: &[Value], before: &[Value], key: &str) -> Vec<f64> {
    after.iter().zip(before).map(|(a, b)| a[key].as_f64().unwrap_or(0.0) - b[key].as_f64().unwrap_or(0.0)).collect()
}
