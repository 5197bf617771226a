//! kvmesh's filter logic, independent of the host: the `.wasm` (`filter/wasm`, proxy-wasm) and
//! the native build (`filter/native`, an Envoy dynamic module) are thin glues over it.
//!
//! [`request`] handles one HTTP request ([`pd`] the PD protocols, one module each, with
//! [`pd_leg`] SGLang's legs; [`response_feedback`] its response), [`plugin`] one VM (configuration, tick, admission wake-ups) with [`cp_client`]
//! and [`link`] for the control plane, over [`gateway`] (one VM's routing state: view,
//! follower, publisher, ledger), [`shared`] (Envoy shared data, one file per key), [`health`]
//! (passive health), [`stall`] (the stall window) and [`admission`] (the VM's queue).
//! Everything they ask of Envoy goes through the [`host`] traits — [`host::VmHost`],
//! [`host::LinkHost`], [`host::StreamHost`] — which `host::mock::MockHost` implements for the
//! tests.
//!
//! A panic would abort the VM and fail every request on its Envoy thread, so `unwrap`,
//! `expect`, `panic!` and slice indexing are denied outside tests (workspace lints), and the
//! `.wasm`'s panic hook logs through the host before the VM dies.

// Linked into the `.wasm`: a panic there kills the VM and every request on its Envoy thread.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod admission;
pub mod cp_client;
pub mod gateway;
pub mod headers;
pub mod health;
pub mod host;
pub mod link;
pub mod now;
pub mod pd;
pub mod pd_leg;
pub mod plugin;
pub mod request;
pub mod response_feedback;
pub mod routed;
pub mod shared;
pub mod stall;
