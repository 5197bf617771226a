//! The kvmesh routing core.
//!
//! Pure Rust with no proxy-wasm, tokio or clock access: everything that varies (time,
//! randomness, worker loads) is passed in as plain data. The filter (compiled to
//! `wasm32-wasip1`) and the control plane both build on it, and its tests run natively and
//! under wasm32.
//!
//! - [`request`]: parse a request body and extract the routing text.
//! - [`blocks`]: chained xxh3 block hashes of the routing text (the prefix index's keys).
//! - [`index`]: the prefix index with LRU eviction.
//! - [`usage`]: `cached_tokens` and completion metrics read from responses as they pass.
//! - [`feedback`]: a worker's `cached_tokens` against the prefix the gateway predicted.
//! - [`policy`]: the routing policies (one file each, each owning its state) over plain-data
//!   candidates.
//! - [`settings`]: the routing settings, declared once (flags, plugin JSON, protobuf).
//! - [`config`]: the configuration, validated once from the settings.
//! - [`models`]: the names workers serve and the pool a request's `model` picks.
//! - [`worker`]: the worker table (a snapshot of workers) the policies choose from.
//! - [`breaker`]: per-worker circuit breakers (a state machine, and its shared-data encoding).
//! - [`admission`]: the token bucket behind the concurrency limit and queue.
//! - [`priority`]: request classes, their reserved slots and queue bounds (issue 47).
//! - [`tenant`]: where a request's tenant id comes from, and its rate-limit window.
//! - [`errors`]: the OpenAI-style JSON error body the gateway answers with.

// Linked into the `.wasm`: a panic there kills the VM and every request on its Envoy thread.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod admission;
pub mod blocks;
pub mod bootstrap;
pub mod breaker;
pub mod chat_shape;
pub mod config;
pub mod dp;
pub mod errors;
pub mod fair;
pub mod feedback;
pub mod fleet;
pub mod index;
pub mod logprobs;
pub mod models;
mod named;
pub mod paths;
pub mod pd;
pub mod pd_protocol;
pub mod policy;
pub mod priority;
pub mod request;
pub mod rng;
pub mod router;
pub mod secrets;
pub mod settings;
pub mod tenant;
pub mod usage;
pub mod vllm;
pub mod worker;

pub use config::{Config, ConfigError};
pub use errors::ErrorBody;
pub use request::{Endpoint, ParsedRequest, RequestError};
pub use router::{Decision, Router, RouterParams, RoutingText};
pub use settings::RoutingSettings;
pub use worker::{Role, Worker, WorkerId, WorkerTable};
