//! A worker as a routed request's legs name it (below the gateway, the request and the PD
//! protocols, which all pass it around).

use kvmesh_core::WorkerId;

/// A worker as the glue needs it: id, address, and what it was believed to hold.
#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    pub worker: WorkerId,
    pub addr: String,
    /// Whether it was added to the in-flight table (and must be taken off when done).
    pub counted: bool,
    /// Bytes of the routing text the worker was believed to hold already.
    pub matched_bytes: usize,
    /// The data-parallel rank it is (see [`kvmesh_core::Worker::dp_rank`]): with its address,
    /// what tells it from the other ranks of its worker.
    pub dp_rank: Option<u32>,
}
