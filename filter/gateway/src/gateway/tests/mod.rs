//! The gateway's tests, through its public face as `request.rs` and `plugin.rs` use it.

use super::*;

mod control_plane;
mod dp;
mod models;
mod pd_pairs;
mod routing;
