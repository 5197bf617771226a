//! kvmesh's filter <-> control-plane API (`kvmesh.proto`).

// Linked into the `.wasm`: a panic there kills the VM and every request on its Envoy thread.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

/// `kvmesh.v1`: generated from `kvmesh.proto` (prost's code, not ours to lint for style).
#[allow(clippy::all)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/kvmesh.v1.rs"));
}

/// `envoy.service.endpoint.v3`: the subset of Envoy's EDS API that kvmesh-cp serves
/// (`envoy_eds.proto`).
#[allow(clippy::all)]
pub mod eds {
    include!(concat!(env!("OUT_DIR"), "/envoy.service.endpoint.v3.rs"));
}

/// The resource type of EDS responses.
pub const CLUSTER_LOAD_ASSIGNMENT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

mod settings;

pub use prost::Message;
pub use settings::{pd_protocol_from_wire, pd_protocol_to_wire, SettingsError};

/// The gRPC service path segments, as `open_grpc_stream` needs them.
pub const SERVICE: &str = "kvmesh.v1.Kvmesh";
pub const WATCH: &str = "Watch";
pub const REPORT: &str = "Report";

/// A tenant usage table on the wire (issue 47's fair shares across gateways).
pub fn usage_to_wire(u: &kvmesh_core::fleet::Usage) -> v1::TenantUsage {
    let tenants = u.entries.iter().map(|(tenant, tokens)| v1::TenantTokens { tenant: tenant.clone(), tokens: *tokens });
    v1::TenantUsage { tenants: tenants.collect() }
}

/// A tenant usage table from the wire, counted at `at_ms` (sanitized: ids checked, values
/// clamped, at most `max` tenants, [`kvmesh_core::fleet::Usage::sanitized`]).
pub fn usage_from_wire(u: &v1::TenantUsage, max: usize, at_ms: u64) -> kvmesh_core::fleet::Usage {
    kvmesh_core::fleet::Usage::sanitized(u.tenants.iter().map(|t| (t.tenant.as_str(), t.tokens)), max, at_ms)
}
