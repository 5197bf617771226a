//! The control plane's state: the worker registry (static, API and discovery sources), their
//! health and load, the global prefix index merged from every gateway's reports, and the
//! versioned snapshots streamed to the filters (full on connect, deltas after).
//!
//! [`State`] holds it all behind one lock (`store.rs`), as four owners that keep their data
//! private and change it only through their methods (each piece of data is written in its
//! owner's file): the registry, the global index, the publication, the gateways, the tenants'
//! usage. A job that
//! spans parts holds the one guard and calls each part. The jobs are modules of their own.
//! Listed from the bottom up, each imports only modules listed before it, and none imports
//! this one (which only re-exports):
//!
//! - `worker.rs`: one worker's record, its probe state, and the views of it; `counts.rs` (below
//!   it) one gateway's cumulative counts for it and whether the next ones are plausible;
//! - the owners: `registry.rs` (entries by id, ids by name, remembered ids, the next id),
//!   `global_index.rs` (the prefix index), `publication.rs` (version, pending inserts,
//!   evictions and table change; the deltas' channel), `gateways.rs` (gateway ids, their
//!   streams and insert budgets), `tenants.rs` (each gateway's reported tenant usage, the
//!   fleet's sum and what the deltas last shipped);
//! - `store.rs`: the state, its lock (the guard holding the five owners), its counters;
//! - `persist.rs`: `--state-file`, read at the start and written on each change;
//! - `workers.rs`: adding and removing workers (ids never reused), health thresholds, load;
//! - `dp.rs`: a worker's data-parallel ranks as entries of their own (`--dp-aware`);
//! - `streams.rs`: gateways' streams opening and closing, what a gateway gone quiet said;
//! - `index.rs`: reads of the global index and each worker's bound in it;
//! - `publish.rs`: versioned deltas, full snapshots, their broadcast;
//! - `reports.rs`: merging the gateways' reports (inserts, stale blocks, counts);
//! - `eviction.rs`: evicting from the index (periodic, on a reported capacity, a flush);
//! - `engine.rs`: what the engines' KV events say a worker holds, in and out of the index;
//! - `objectives.rs`: the InferenceObjective priorities discovery found, in the shipped settings.

mod counts;
mod dp;
mod engine;
mod eviction;
mod gateways;
mod global_index;
mod index;
mod objectives;
mod persist;
mod publication;
mod publish;
mod registry;
mod reports;
mod store;
mod streams;
mod tenants;
mod worker;
mod workers;

pub use dp::RankLoad;
pub use gateways::GatewayError;
pub use store::State;
pub use worker::{role_name, Pressure, Source, WorkerEntry};

/// A state from kvmesh-cp's command line (tests).
#[cfg(test)]
pub(crate) use workers::tests::state as test_state;
