//! The gateway's tests, through its public face as `request.rs` and `plugin.rs` use it.

use super::*;
#[allow(unused_imports)]
use crate::headers::Headers;
#[allow(unused_imports)]
use kvmesh_core::breaker::BreakerState;
#[allow(unused_imports)]
use kvmesh_core::WorkerId;
#[allow(unused_imports)]
use kvmesh_proto::v1::IndexInsert;

mod control_plane;
mod dp;
mod models;
mod pd_pairs;
mod routing;
