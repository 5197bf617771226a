//! `kvmesh.cp.version`, `kvmesh.cp.table`, `kvmesh.cp.polled`: the control plane's worker
//! table as the stream owner last received it, for the other VMs.

use kvmesh_core::{Worker, WorkerId};
use kvmesh_proto::v1 as proto;

use super::{u32_at, u64_at, SharedStore};

/// The worker table (and routing configuration) from the control plane, as the stream owner
/// last received it: a version key read on every tick, the value only when it changed.
pub struct SharedTable;

/// What the control plane polls of one worker: the part of the table that changes on most
/// snapshots (every load or health change), shared apart from the table itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Polled {
    pub id: WorkerId,
    pub healthy: bool,
    pub load: u64,
    pub waiting: Option<u64>,
    pub kv_usage: Option<f64>,
    pub utility: Option<f64>,
    /// Hung (see `kvmesh_core::worker::Worker::unresponsive`).
    pub unresponsive: bool,
}

/// The control plane's message: what it polled of the worker. A polled flag is added here,
/// in [`Polled::apply_to`], `From<&Worker>` and the record's bytes below.
impl From<&proto::Worker> for Polled {
    fn from(w: &proto::Worker) -> Self {
        Self {
            id: w.id,
            healthy: w.healthy,
            load: w.load,
            waiting: w.waiting,
            kv_usage: w.kv_usage,
            utility: w.utility,
            unresponsive: w.unresponsive,
        }
    }
}

/// A worker of the table: what is shared of it on every table change.
impl From<&Worker> for Polled {
    fn from(w: &Worker) -> Self {
        Self {
            id: w.id,
            healthy: w.healthy,
            load: w.load,
            waiting: w.waiting,
            kv_usage: w.kv_usage,
            utility: w.utility,
            unresponsive: w.unresponsive,
        }
    }
}

impl Polled {
    /// The way back into the table (not a `From`: a worker holds more than is polled): the
    /// polled state into `worker` (scores that are not finite: none).
    pub fn apply_to(&self, worker: &mut Worker) {
        worker.healthy = self.healthy;
        worker.load = self.load;
        worker.waiting = self.waiting;
        worker.kv_usage = self.kv_usage.filter(|u| u.is_finite());
        worker.utility = self.utility.filter(|u| u.is_finite());
        worker.unresponsive = self.unresponsive;
    }
}

/// Bytes of one [`Polled`] record.
const POLLED_RECORD: usize = 40;

impl SharedTable {
    const VERSION: &'static str = "kvmesh.cp.version.v1";
    const VALUE: &'static str = "kvmesh.cp.table.v1";
    const POLLED: &'static str = "kvmesh.cp.polled.v1";

    /// Publishes version `version`: the table itself (protobuf: workers and settings) only
    /// when the workers or the settings changed, and always what is polled of each worker,
    /// `table u64` (the version of the table value the records go with) then per worker
    /// `id u32, flags u32, load u64, waiting u64, kv_usage f64, utility f64` (flags: 1
    /// healthy, 2 waiting known, 4 KV use known, 8 utility known, 16 unresponsive). The version goes last, so a
    /// VM that sees it finds everything it names, as `version u64, epoch u64`: the epoch
    /// changes with each connection's first snapshot, so that a restarted control plane's
    /// version 2 is not taken for the last one's.
    pub fn publish(
        store: &dyn SharedStore,
        version: u64,
        epoch: u64,
        table: Option<&[u8]>,
        table_version: u64,
        polled: &[Polled],
    ) {
        if let Some(encoded) = table {
            let _ = store.set(Self::VALUE, encoded, None);
        }
        let mut bytes = Vec::with_capacity(8 + polled.len() * POLLED_RECORD);
        bytes.extend_from_slice(&table_version.to_le_bytes());
        for p in polled {
            let flags = u32::from(p.healthy)
                | if p.waiting.is_some() { 2 } else { 0 }
                | if p.kv_usage.is_some() { 4 } else { 0 }
                | if p.utility.is_some() { 8 } else { 0 }
                | if p.unresponsive { 16 } else { 0 };
            bytes.extend_from_slice(&p.id.to_le_bytes());
            bytes.extend_from_slice(&flags.to_le_bytes());
            bytes.extend_from_slice(&p.load.to_le_bytes());
            bytes.extend_from_slice(&p.waiting.unwrap_or(0).to_le_bytes());
            bytes.extend_from_slice(&p.kv_usage.unwrap_or(0.0).to_le_bytes());
            bytes.extend_from_slice(&p.utility.unwrap_or(0.0).to_le_bytes());
        }
        let _ = store.set(Self::POLLED, &bytes, None);
        let mut stamp = [0u8; 16];
        stamp[..8].copy_from_slice(&version.to_le_bytes());
        stamp[8..].copy_from_slice(&epoch.to_le_bytes());
        let _ = store.set(Self::VERSION, &stamp, None);
    }

    /// The version last published and its epoch (0 when a value has none).
    pub fn version(store: &dyn SharedStore) -> Option<(u64, u64)> {
        let v = store.get(Self::VERSION).0?;
        Some((u64_at(&v, 0)?, u64_at(&v, 8).unwrap_or(0)))
    }

    pub fn value(store: &dyn SharedStore) -> Option<Vec<u8>> {
        store.get(Self::VALUE).0
    }

    /// The polled records and the version of the table value they go with (a truncated
    /// record ends them).
    pub fn polled(store: &dyn SharedStore) -> Option<(u64, Vec<Polled>)> {
        let bytes = store.get(Self::POLLED).0?;
        let table_version = u64_at(&bytes, 0)?;
        let records = bytes.get(8..).unwrap_or_default().chunks_exact(POLLED_RECORD);
        let f64_at = |r: &[u8], at| u64_at(r, at).map(f64::from_bits);
        let polled = records
            .filter_map(|r| {
                let flags = u32_at(r, 4)?;
                Some(Polled {
                    id: u32_at(r, 0)?,
                    healthy: flags & 1 != 0,
                    load: u64_at(r, 8)?,
                    waiting: u64_at(r, 16).filter(|_| flags & 2 != 0),
                    kv_usage: f64_at(r, 24).filter(|_| flags & 4 != 0),
                    utility: f64_at(r, 32).filter(|_| flags & 8 != 0),
                    unresponsive: flags & 16 != 0,
                })
            })
            .collect();
        Some((table_version, polled))
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake;
    use super::*;

    #[test]
    fn polled_records_round_trip_and_a_truncated_value_ends_them() {
        let store = fake::FakeStore::default();
        let a = Polled {
            id: 3,
            healthy: true,
            load: 7,
            waiting: Some(2),
            kv_usage: Some(0.5),
            utility: None,
            unresponsive: false,
        };
        let b = Polled {
            id: 9,
            healthy: false,
            load: 0,
            waiting: None,
            kv_usage: None,
            utility: Some(-1.25),
            unresponsive: true,
        };
        SharedTable::publish(&store, 12, 77, Some(b"table"), 10, &[a, b]);
        assert_eq!(SharedTable::version(&store), Some((12, 77)));
        assert_eq!(SharedTable::value(&store).as_deref(), Some(&b"table"[..]));
        assert_eq!(SharedTable::polled(&store), Some((10, vec![a, b])));
        // No table value this time: the last one stays.
        SharedTable::publish(&store, 13, 77, None, 10, &[b]);
        assert_eq!(SharedTable::value(&store).as_deref(), Some(&b"table"[..]));
        assert_eq!(SharedTable::polled(&store), Some((10, vec![b])));
        let (bytes, _) = store.get(SharedTable::POLLED);
        let mut bytes = bytes.unwrap();
        bytes.truncate(8 + 39);
        store.set(SharedTable::POLLED, &bytes, None).unwrap();
        assert_eq!(SharedTable::polled(&store), Some((10, vec![])));
        store.set(SharedTable::POLLED, b"short", None).unwrap();
        assert_eq!(SharedTable::polled(&store), None);
    }
}
