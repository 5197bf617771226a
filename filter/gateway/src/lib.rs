//! kvmesh's filter logic, independent of the host (the `.wasm` and the native build are
//! thin glues over it).
//!
//! The logic is host-independent and tested natively against [`host::mock::MockHost`]:
//! [`request`] (one HTTP request), [`pd_leg`] (the PD legs' state machine), [`plugin`] (the
//! root context: configuration, tick) and [`link`] (the control-plane link's state machine),
//! over [`gateway`] (one VM's routing state, decide-then-commit), [`shared`] (state shared by
//! the VMs of one Envoy), [`health`] (passive health) and [`stall`] (the stall window), [`admission`] (the concurrency limit and its queue). Everything they ask of Envoy goes
//! through the [`host::StreamHost`] trait; `envoy.rs`, compiled for wasm32 only, implements it over
//! `proxy_wasm::hostcalls` and translates Envoy's callbacks into calls on that logic.
//!
//! A panic would abort the VM and fail every request on its Envoy thread, so `unwrap`,
//! `expect`, `panic!` and slice indexing are denied outside tests (workspace lints), and a
//! panic hook logs through the host before the VM dies.

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
pub mod pd_leg;
pub mod plugin;
pub mod request;
pub mod response_feedback;
pub mod shared;
pub mod stall;
