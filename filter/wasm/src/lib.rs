//! kvmesh's proxy-wasm filter: the `.wasm` Envoy and Istio load.
//!
//! Translation only: `envoy.rs` implements kvmesh-gateway's host traits over
//! `proxy_wasm::hostcalls` and forwards Envoy's callbacks to [`kvmesh_gateway::plugin::Plugin`]
//! and [`kvmesh_gateway::request::RequestFilter`]. Every decision lives in kvmesh-gateway,
//! which is tested natively against its mock host.

// Linked into the `.wasm`: a panic there kills the VM and every request on its Envoy thread.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[cfg(target_arch = "wasm32")]
mod envoy;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    envoy::install_panic_hook();
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(envoy::Root::new(id)) });
}}
