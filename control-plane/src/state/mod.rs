//! The control plane's state: the worker registry (static, API and discovery sources), their
//! health and load, the global prefix index merged from every gateway's reports, and the
//! versioned snapshots streamed to the filters (full on connect, deltas after).
//!
//! [`State`] holds it all behind one lock (`store.rs`); each job on it is a module of its own.
//! Listed from the bottom up, each imports only modules listed before it, and none imports
//! this one (which only re-exports):
//!
//! - `worker.rs`: one worker's record and the views of it;
//! - `store.rs`: the state, its lock, its counters;
//! - `persist.rs`: `--state-file`, read at the start and written on each change;
//! - `registry.rs`: adding and removing workers (ids never reused), health thresholds, load;
//! - `dp.rs`: a worker's data-parallel ranks as entries of their own (`--dp-aware`);
//! - `gateways.rs`: gateway ids, their report streams and insert budgets;
//! - `index.rs`: reads of the global index and each worker's bound in it;
//! - `publish.rs`: pending changes, versioned deltas, full snapshots, their broadcast;
//! - `reports.rs`: merging the gateways' reports (inserts, stale blocks, counts);
//! - `eviction.rs`: evicting from the index (periodic, on a reported capacity, a flush).

mod dp;
mod eviction;
mod gateways;
mod index;
mod persist;
mod publish;
mod registry;
mod reports;
mod store;
mod worker;

pub use dp::RankLoad;
pub use gateways::GatewayError;
pub use store::State;
pub use worker::{role_name, Pressure, Source, WorkerEntry};

/// A state from kvmesh-cp's command line (tests).
#[cfg(test)]
pub(crate) use registry::tests::state as test_state;
