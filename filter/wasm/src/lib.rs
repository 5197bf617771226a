//! kvmesh's proxy-wasm filter.
//!
//! The routing logic lives in `kvmesh-core` and in [`gateway`] (host-independent, tested
//! natively with a fake shared-data store). The proxy-wasm glue — [`root`] (configuration,
//! tick) and [`http`] (one request) — only translates host callbacks into calls on them and
//! is compiled for wasm32 alone. A panic would abort the VM and fail every request on its
//! Envoy thread, so `unwrap`, `expect` and `panic!` are denied here.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod gateway;
pub mod health;
pub mod shared;

#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(target_arch = "wasm32")]
mod http;
#[cfg(target_arch = "wasm32")]
mod root;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(root::Root::default()) });
}}
