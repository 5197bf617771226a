//! kvmesh's filter <-> control-plane API (`kvmesh.proto`).

#![allow(clippy::all)]

/// `kvmesh.v1`: generated from `kvmesh.proto`.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/kvmesh.v1.rs"));
}

pub use prost::Message;

/// The gRPC service path segments, as `open_grpc_stream` needs them.
pub const SERVICE: &str = "kvmesh.v1.Kvmesh";
pub const WATCH: &str = "Watch";
pub const REPORT: &str = "Report";
