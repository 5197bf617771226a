//! State shared by every VM (one per Envoy worker thread) of one plugin, kept in Envoy's
//! shared data behind the small [`SharedStore`] trait so the logic is testable natively.
//!
//! - [`Inflight`]: in-flight requests per worker, updated by compare-and-swap.
//! - [`DeltaLog`]: a ring of recent prefix-index changes, so that a prefix routed on one
//!   thread (or pushed by the control plane) is known to the others before their next request.
//! - [`Lease`]: which VM owns the control-plane streams.
//!
//! Values are small byte strings (the host copies a value in and out on every access).

use kvmesh_core::WorkerId;

/// Why a write to shared data failed.
#[derive(Debug, PartialEq, Eq)]
pub enum SetError {
    /// Another VM wrote the key since we read it.
    CasMismatch,
    Other,
}

/// Envoy's shared data (or a fake): values with a version for compare-and-swap.
pub trait SharedStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
}

const CAS_RETRIES: usize = 32;

/// Reads `key`, applies `update` and writes it back with compare-and-swap, retrying on
/// conflicts. Returns whether the write went through.
pub fn update(store: &dyn SharedStore, key: &str, mut update: impl FnMut(&mut Vec<u8>)) -> bool {
    for _ in 0..CAS_RETRIES {
        let (value, cas) = store.get(key);
        let mut value = value.unwrap_or_default();
        update(&mut value);
        match store.set(key, &value, cas) {
            Ok(()) => return true,
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Other) => return false,
        }
    }
    false
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// Per-worker request counts of this Envoy, and the head of the [`DeltaLog`], in one value:
/// `head u64` then 16-byte entries `(worker u32, in flight u32, finished u32, failed u32)`,
/// updated by compare-and-swap. One read per routed request serves both the loads and the
/// log; one CAS counts the request, takes a log sequence number and writes the requests that
/// ended in this VM since (see [`Ended`]: an ending request touches no shared data).
#[derive(Debug)]
pub struct Inflight {
    value: Vec<u8>,
    cas: Option<u32>,
    /// `(worker, in flight)` as read, by worker: a candidate's load is a binary search, not a
    /// scan of every entry (64 workers would make that 2,000 entry reads a request).
    loads: Vec<(WorkerId, u32)>,
}

/// Requests to one worker that ended in this VM and are not yet written to [`Inflight`]. A VM
/// alone in its Envoy folds them into its next write (the next routed request's CAS, or the
/// tick's), so that the end of a stream costs no shared-data round trip, and discounts them
/// from its own decisions at once; with other VMs they are written as they end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ended {
    /// Leaves the in-flight count (finished, failed, or cancelled before it ran).
    pub left: u32,
    /// Ran to its end (counted finished).
    pub finished: u32,
    /// Of those, failed.
    pub failed: u32,
}

/// [`Ended`] requests by worker.
pub type EndedBy = std::collections::BTreeMap<WorkerId, Ended>;

const ENTRY: usize = 16;
const HEAD: usize = 8;

/// One worker's counts (finished and failed wrap at 2^32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub worker: WorkerId,
    pub in_flight: u32,
    pub finished: u32,
    pub failed: u32,
}

fn entries(value: &[u8]) -> impl Iterator<Item = Counts> + '_ {
    value.get(HEAD..).unwrap_or_default().chunks_exact(ENTRY).filter_map(|c| {
        Some(Counts {
            worker: u32_at(c, 0)?,
            in_flight: u32_at(c, 4)?,
            finished: u32_at(c, 8)?,
            failed: u32_at(c, 12)?,
        })
    })
}

fn head_of(value: &[u8]) -> u64 {
    u64_at(value, 0).unwrap_or(0)
}

/// Takes the next log sequence number in `value`.
fn next_seq(value: &mut Vec<u8>) -> u64 {
    if value.len() < HEAD {
        value.resize(HEAD, 0);
    }
    let seq = head_of(value) + 1;
    if let Some(head) = value.get_mut(..HEAD) {
        head.copy_from_slice(&seq.to_le_bytes());
    }
    seq
}

impl Inflight {
    const KEY: &'static str = "kvmesh.state";

    /// Reads the current counts and log head (one host call), keeping the version for a
    /// later update.
    pub fn load(store: &dyn SharedStore) -> Self {
        let (value, cas) = store.get(Self::KEY);
        let value = value.unwrap_or_default();
        let mut loads: Vec<(WorkerId, u32)> = entries(&value).map(|c| (c.worker, c.in_flight)).collect();
        loads.sort_unstable();
        Self { value, cas, loads }
    }

    /// The delta log's head as read.
    pub fn head(&self) -> u64 {
        head_of(&self.value)
    }

    /// The loads as read, less the requests that ended in this VM and are not written yet.
    pub fn discount(mut self, ended: &EndedBy) -> Self {
        for (worker, e) in ended {
            if let Ok(i) = self.loads.binary_search_by_key(worker, |&(w, _)| w) {
                if let Some((_, n)) = self.loads.get_mut(i) {
                    *n = n.saturating_sub(e.left);
                }
            }
        }
        self
    }

    /// `worker`'s in-flight count.
    pub fn count(&self, worker: WorkerId) -> u32 {
        match self.loads.binary_search_by_key(&worker, |&(w, _)| w) {
            Ok(i) => self.loads.get(i).map_or(0, |&(_, n)| n),
            Err(_) => 0,
        }
    }

    /// In-flight counts as `(worker, count)` pairs.
    pub fn read(store: &dyn SharedStore) -> Vec<(WorkerId, u32)> {
        Self::counts(store).into_iter().map(|c| (c.worker, c.in_flight)).collect()
    }

    /// Every worker's counts.
    pub fn counts(store: &dyn SharedStore) -> Vec<Counts> {
        entries(&store.get(Self::KEY).0.unwrap_or_default()).collect()
    }

    /// Applies in-flight `deltas` and the `ended` requests to the value loaded by
    /// [`load`](Self::load) and, with `take_seq`, takes a log sequence number, in one CAS
    /// (falling back to a read-modify-write loop if another VM wrote in between). Returns
    /// whether the counts were written (`ended` with them) and the sequence number taken.
    pub fn commit(
        mut self,
        store: &dyn SharedStore,
        deltas: &[(WorkerId, i32)],
        ended: &EndedBy,
        take_seq: bool,
    ) -> (bool, Option<u64>) {
        let change = |value: &mut Vec<u8>| {
            for &(worker, delta) in deltas {
                apply(value, worker, delta);
            }
            write_ended(value, ended);
            take_seq.then(|| next_seq(value))
        };
        let seq = change(&mut self.value);
        match store.set(Self::KEY, &self.value, self.cas) {
            Ok(()) => (true, seq),
            Err(SetError::CasMismatch) => {
                let mut seq = None;
                let ok = update(store, Self::KEY, |value| seq = change(value));
                (ok, seq.filter(|_| ok))
            }
            Err(SetError::Other) => (false, None),
        }
    }

    /// Adds `delta` to `worker`'s in-flight count (never below zero).
    pub fn add(store: &dyn SharedStore, worker: WorkerId, delta: i32) -> bool {
        update(store, Self::KEY, |value| apply(value, worker, delta))
    }

    /// A request to `worker` finished: one less in flight, one more finished (and failed).
    /// Tests only: the filter's requests end through [`Inflight::end`].
    #[cfg(test)]
    pub fn finish(store: &dyn SharedStore, worker: WorkerId, failed: bool) -> bool {
        let ended = Ended { left: 1, finished: 1, failed: u32::from(failed) };
        Self::end(store, &EndedBy::from([(worker, ended)]))
    }

    /// Writes the `ended` requests (one read-modify-write). Returns whether it went through.
    pub fn end(store: &dyn SharedStore, ended: &EndedBy) -> bool {
        update(store, Self::KEY, |value| write_ended(value, ended))
    }

    /// Takes a log sequence number on its own.
    fn take_seq(store: &dyn SharedStore) -> Option<u64> {
        let mut seq = 0;
        update(store, Self::KEY, |value| seq = next_seq(value)).then_some(seq)
    }
}

fn write_ended(value: &mut Vec<u8>, ended: &EndedBy) {
    for (&worker, e) in ended {
        let at = entry_at(value, worker);
        bump(value, at + 4, |n| n.saturating_sub(e.left));
        bump(value, at + 8, |n| n.wrapping_add(e.finished));
        bump(value, at + 12, |n| n.wrapping_add(e.failed));
    }
}

/// The offset of `worker`'s entry in `value`, added (zeroed) if it has none.
fn entry_at(value: &mut Vec<u8>, worker: WorkerId) -> usize {
    if value.len() < HEAD {
        value.resize(HEAD, 0);
    }
    let existing = value.get(HEAD..).unwrap_or_default().chunks_exact(ENTRY).position(|c| u32_at(c, 0) == Some(worker));
    match existing {
        Some(i) => HEAD + i * ENTRY,
        None => {
            value.extend_from_slice(&worker.to_le_bytes());
            value.extend_from_slice(&[0; ENTRY - 4]);
            value.len() - ENTRY
        }
    }
}

fn bump(value: &mut [u8], at: usize, f: impl Fn(u32) -> u32) {
    let v = f(u32_at(value, at).unwrap_or(0));
    if let Some(slot) = value.get_mut(at..at + 4) {
        slot.copy_from_slice(&v.to_le_bytes());
    }
}

/// Adds `delta` to `worker`'s in-flight count (never below zero).
fn apply(value: &mut Vec<u8>, worker: WorkerId, delta: i32) {
    let at = entry_at(value, worker);
    bump(value, at + 4, |n| n.saturating_add_signed(delta));
}

/// One change to the prefix index, as passed between the VMs of one Envoy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delta {
    pub worker: WorkerId,
    pub evict: bool,
    /// Came from the control plane (so it is not reported back to it).
    pub from_cp: bool,
    pub hashes: Vec<u64>,
}

/// A ring of the last [`DeltaLog::SLOTS`] batches of index changes. The writer takes a
/// sequence number by CAS on the head, then writes its slot; readers follow the head and
/// apply what other VMs wrote: their routing decisions, and the control plane's deltas that
/// the stream owner received.
pub struct DeltaLog {
    /// The last sequence number this VM has applied or skipped.
    cursor: u64,
    vm: u32,
    /// Sequence numbers past the cursor that this VM wrote itself, in order: skipped without
    /// reading them back (with several VMs, a VM's own batch is often ahead of the cursor).
    own: std::collections::VecDeque<u64>,
}

impl DeltaLog {
    pub const SLOTS: u64 = 256;

    /// A reader/writer for VM `vm` that starts with the batches still in the ring.
    pub fn new(store: &dyn SharedStore, vm: u32) -> Self {
        let head = Inflight::load(store).head();
        Self { cursor: head.saturating_sub(Self::SLOTS), vm, own: std::collections::VecDeque::new() }
    }

    pub fn vm(&self) -> u32 {
        self.vm
    }

    fn slot_key(seq: u64) -> String {
        format!("kvmesh.log.{}", seq % Self::SLOTS)
    }

    /// Appends a batch made by this VM (taking a sequence number on its own).
    pub fn append(&mut self, store: &dyn SharedStore, deltas: &[Delta]) {
        if deltas.is_empty() {
            return;
        }
        if let Some(seq) = Inflight::take_seq(store) {
            self.write(store, seq, deltas);
        }
    }

    /// Writes the batch of sequence number `seq` (taken by [`Inflight::commit`]).
    pub fn write(&mut self, store: &dyn SharedStore, seq: u64, deltas: &[Delta]) {
        let size: usize = deltas.iter().map(|d| 12 + d.hashes.len() * 8).sum();
        let mut entry = Vec::with_capacity(12 + size);
        entry.extend_from_slice(&seq.to_le_bytes());
        entry.extend_from_slice(&self.vm.to_le_bytes());
        for d in deltas {
            let flags = u32::from(d.evict) | (u32::from(d.from_cp) << 1);
            entry.extend_from_slice(&d.worker.to_le_bytes());
            entry.extend_from_slice(&flags.to_le_bytes());
            entry.extend_from_slice(&(d.hashes.len() as u32).to_le_bytes());
            for h in &d.hashes {
                entry.extend_from_slice(&h.to_le_bytes());
            }
        }
        // The slot belongs to this sequence number; no CAS needed.
        let _ = store.set(&Self::slot_key(seq), &entry, None);
        // Read up to just before it: nothing to read back (a VM alone pays no read per write).
        if self.cursor + 1 == seq {
            self.cursor = seq;
        } else if seq > self.cursor && self.own.len() < Self::SLOTS as usize {
            self.own.push_back(seq);
        }
    }

    /// The batches other VMs wrote up to `head` (from [`Inflight::head`]) since the last
    /// call, oldest first.
    pub fn poll(&mut self, store: &dyn SharedStore, head: u64) -> Vec<Delta> {
        if head <= self.cursor {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut seq = self.cursor.max(head.saturating_sub(Self::SLOTS)) + 1;
        while self.own.front().is_some_and(|&o| o < seq) {
            self.own.pop_front();
        }
        while seq <= head {
            if self.own.front() == Some(&seq) {
                // Written here: nothing to apply.
                self.own.pop_front();
                self.cursor = seq;
                seq += 1;
                continue;
            }
            let entry = store.get(&Self::slot_key(seq)).0.unwrap_or_default();
            let written = u64_at(&entry, 0).unwrap_or(0);
            if written < seq {
                break; // Taken but not written yet: read it next time.
            }
            if written == seq && u32_at(&entry, 8) != Some(self.vm) {
                decode_deltas(entry.get(12..).unwrap_or_default(), &mut out);
            }
            self.cursor = seq;
            seq += 1;
        }
        out
    }
}

/// What each VM has in flight, published with a heartbeat, so that the counts of a VM that
/// died (a trap, out of memory: Envoy replaces it, and its streams' `on_log` never runs) can be
/// taken back out of [`Inflight`] by the VMs that live on.
///
/// - `kvmesh.vms`: the registered VM ids (4 bytes each), changed by compare-and-swap;
/// - `kvmesh.vm.<id>`: that VM's heartbeat (ms) and `(worker, in flight)` pairs.
///
/// A VM silent for longer than [`VmLedger::STALE_MS`] is taken off the registry by CAS — so
/// exactly one survivor does it — and that survivor subtracts the dead VM's last published
/// counts. The error is bounded by what changed in its last heartbeat interval.
pub struct VmLedger;

impl VmLedger {
    const REGISTRY: &'static str = "kvmesh.vms";
    /// Far above any single callback (a 256 MiB body is parsed in about 3 s).
    pub const STALE_MS: u64 = 10_000;

    fn key(vm: u32) -> String {
        format!("kvmesh.vm.{vm:08x}")
    }

    fn registered(store: &dyn SharedStore) -> Vec<u32> {
        let value = store.get(Self::REGISTRY).0.unwrap_or_default();
        value.chunks_exact(4).filter_map(|c| u32_at(c, 0)).collect()
    }

    /// Registers `vm` if it is not (yet, or any more: a VM that was merely slow comes back).
    /// Checked once a second, not on every publish. Returns the VMs registered then.
    pub fn register(store: &dyn SharedStore, vm: u32) -> Vec<u32> {
        let mut ids = Self::registered(store);
        if !ids.contains(&vm) {
            update(store, Self::REGISTRY, |value| {
                ids = value.chunks_exact(4).filter_map(|c| u32_at(c, 0)).collect();
                if !ids.contains(&vm) {
                    value.extend_from_slice(&vm.to_le_bytes());
                    ids.push(vm);
                }
            });
        }
        ids
    }

    /// Publishes `vm`'s in-flight counts with a heartbeat at `now_ms` (one write).
    pub fn publish(store: &dyn SharedStore, vm: u32, now_ms: u64, counts: &[(WorkerId, u32)]) {
        let mut value = now_ms.to_le_bytes().to_vec();
        for &(worker, n) in counts {
            value.extend_from_slice(&worker.to_le_bytes());
            value.extend_from_slice(&n.to_le_bytes());
        }
        let _ = store.set(&Self::key(vm), &value, None);
    }

    /// Refreshes the heartbeat of every registered VM, keeping its counts (by CAS: a VM that
    /// publishes meanwhile is alive anyway). For a host whose plugins cannot die apart from
    /// their process — the native build, whose idle threads do not tick — so that none is
    /// taken for dead, its requests in flight subtracted, while it holds them.
    pub fn keep_alive(store: &dyn SharedStore, now_ms: u64) {
        for vm in Self::registered(store) {
            let key = Self::key(vm);
            let (value, cas) = store.get(&key);
            let mut value = value.unwrap_or_default();
            if value.len() < 8 {
                value = vec![0; 8];
            }
            if let Some(heartbeat) = value.get_mut(..8) {
                heartbeat.copy_from_slice(&now_ms.to_le_bytes());
            }
            let _ = store.set(&key, &value, cas);
        }
    }

    /// Takes every VM silent since `now_ms - STALE_MS` (other than `me`) off the registry;
    /// returns the in-flight counts of those this call took off (to be subtracted).
    pub fn reap(store: &dyn SharedStore, me: u32, now_ms: u64) -> Vec<(WorkerId, u32)> {
        let mut out = Vec::new();
        for vm in Self::registered(store).into_iter().filter(|&vm| vm != me) {
            let value = store.get(&Self::key(vm)).0.unwrap_or_default();
            let heartbeat = u64_at(&value, 0).unwrap_or(0);
            if now_ms.saturating_sub(heartbeat) <= Self::STALE_MS {
                continue;
            }
            // Off the registry by CAS: whoever succeeds owns the subtraction.
            let (reg, cas) = store.get(Self::REGISTRY);
            let reg = reg.unwrap_or_default();
            let kept: Vec<u8> =
                reg.chunks_exact(4).filter(|c| u32_at(c, 0) != Some(vm)).flat_map(|c| c.to_vec()).collect();
            if kept.len() == reg.len() || store.set(Self::REGISTRY, &kept, cas).is_err() {
                continue; // another VM took it off first (or it raced): not ours to subtract
            }
            let entries = value.get(8..).unwrap_or_default();
            out.extend(entries.chunks_exact(8).filter_map(|c| Some((u32_at(c, 0)?, u32_at(c, 4)?))));
            let _ = store.set(&Self::key(vm), &[], None);
        }
        out
    }
}

/// The control-plane stream ownership: one VM per Envoy holds a lease in shared data, renews
/// it on every tick, and another takes over when it lapses.
pub struct Lease;

impl Lease {
    const KEY: &'static str = "kvmesh.cp.lease";

    /// Takes or renews the lease for `vm` until `now_ms + ttl_ms` when it is free, lapsed or
    /// already `vm`'s. True when `vm` holds it afterwards.
    pub fn hold(store: &dyn SharedStore, vm: u32, now_ms: u64, ttl_ms: u64) -> bool {
        let (value, cas) = store.get(Self::KEY);
        if let Some(v) = value {
            let (owner, until) = (u32_at(&v, 0), u64_at(&v, 4).unwrap_or(0));
            if owner != Some(vm) && until > now_ms {
                return false;
            }
        }
        let mut lease = vm.to_le_bytes().to_vec();
        lease.extend_from_slice(&(now_ms + ttl_ms).to_le_bytes());
        if store.set(Self::KEY, &lease, cas).is_err() {
            return false;
        }
        // Two VMs may both have found the key missing: the last writer wins.
        store.get(Self::KEY).0.and_then(|v| u32_at(&v, 0)) == Some(vm)
    }

    /// The VM named in the lease (lapsed or not): for the `test-crash` build's hook that stops
    /// the owner, and for tests.
    #[cfg(any(test, feature = "test-crash"))]
    pub fn owner(store: &dyn SharedStore) -> Option<u32> {
        store.get(Self::KEY).0.and_then(|v| u32_at(&v, 0))
    }
}

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
}

/// Bytes of one [`Polled`] record.
const POLLED_RECORD: usize = 40;

impl SharedTable {
    const VERSION: &'static str = "kvmesh.cp.version";
    const VALUE: &'static str = "kvmesh.cp.table";
    const POLLED: &'static str = "kvmesh.cp.polled";

    /// Publishes version `version`: the table itself (protobuf: workers and settings) only
    /// when the workers or the settings changed, and always what is polled of each worker,
    /// `table u64` (the version of the table value the records go with) then per worker
    /// `id u32, flags u32, load u64, waiting u64, kv_usage f64, utility f64` (flags: 1
    /// healthy, 2 waiting known, 4 KV use known, 8 utility known). The version goes last, so a
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
                | if p.utility.is_some() { 8 } else { 0 };
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
                })
            })
            .collect();
        Some((table_version, polled))
    }
}

fn decode_deltas(mut bytes: &[u8], out: &mut Vec<Delta>) {
    while let (Some(worker), Some(flags), Some(n)) = (u32_at(bytes, 0), u32_at(bytes, 4), u32_at(bytes, 8)) {
        // A length that does not fit the value ends decoding (no wrap-around on 32-bit usize).
        let Some(end) = (n as usize).checked_mul(8).and_then(|b| b.checked_add(12)) else { return };
        let (Some(body), Some(rest)) = (bytes.get(12..end), bytes.get(end..)) else { return };
        let hashes = body.chunks_exact(8).filter_map(|c| u64_at(c, 0)).collect();
        out.push(Delta { worker, evict: flags & 1 != 0, from_cp: flags & 2 != 0, hashes });
        bytes = rest;
    }
}

#[cfg(test)]
pub mod fake {
    //! An in-memory [`SharedStore`] with Envoy's CAS semantics.
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    use super::{SetError, SharedStore};

    #[derive(Default)]
    pub struct FakeStore {
        data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        gets: Cell<u32>,
    }

    impl FakeStore {
        /// How many reads were made (each is a host call that copies the value in Envoy).
        pub fn gets(&self) -> u32 {
            self.gets.get()
        }
    }

    impl SharedStore for FakeStore {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.gets.set(self.gets.get() + 1);
            match self.data.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            }
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            let mut data = self.data.borrow_mut();
            let entry = data.entry(key.to_string()).or_insert((Vec::new(), 0));
            if matches!(cas, Some(c) if c != 0 && c != entry.1) {
                return Err(SetError::CasMismatch);
            }
            *entry = (value.to_vec(), entry.1 + 1);
            Ok(())
        }
    }

    /// What another VM does to the store.
    type Race<'a> = Box<dyn FnOnce(&FakeStore) + 'a>;

    /// A [`FakeStore`] that another VM writes to once, between our read and our first
    /// write, so that write meets a real CAS conflict. Counts writes and conflicts.
    pub struct Racing<'a> {
        inner: &'a FakeStore,
        race: RefCell<Option<Race<'a>>>,
        sets: Cell<u32>,
        conflicts: Cell<u32>,
    }

    impl<'a> Racing<'a> {
        pub fn new(inner: &'a FakeStore, race: impl FnOnce(&FakeStore) + 'a) -> Self {
            Self { inner, race: RefCell::new(Some(Box::new(race))), sets: Cell::new(0), conflicts: Cell::new(0) }
        }

        /// `(writes attempted, writes refused for a stale version)`.
        pub fn writes(&self) -> (u32, u32) {
            (self.sets.get(), self.conflicts.get())
        }
    }

    impl SharedStore for Racing<'_> {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.inner.get(key)
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            let race = self.race.borrow_mut().take();
            if let Some(race) = race {
                race(self.inner);
            }
            self.sets.set(self.sets.get() + 1);
            let result = self.inner.set(key, value, cas);
            if result == Err(SetError::CasMismatch) {
                self.conflicts.set(self.conflicts.get() + 1);
            }
            result
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn polled_records_round_trip_and_a_truncated_value_ends_them() {
        let store = fake::FakeStore::default();
        let a = Polled { id: 3, healthy: true, load: 7, waiting: Some(2), kv_usage: Some(0.5), utility: None };
        let b = Polled { id: 9, healthy: false, load: 0, waiting: None, kv_usage: None, utility: Some(-1.25) };
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
    use super::fake::FakeStore;
    use super::*;

    #[test]
    fn inflight_counts_per_worker_and_never_negative() {
        let store = FakeStore::default();
        assert!(Inflight::add(&store, 3, 1));
        assert!(Inflight::add(&store, 3, 1));
        assert!(Inflight::add(&store, 7, 1));
        assert!(Inflight::add(&store, 3, -1));
        assert_eq!(Inflight::read(&store), vec![(3, 1), (7, 1)]);
        assert!(Inflight::add(&store, 7, -5));
        assert_eq!(Inflight::read(&store), vec![(3, 1), (7, 0)]);
    }

    #[test]
    fn finishing_counts_requests_and_failures() {
        let store = FakeStore::default();
        Inflight::add(&store, 4, 1);
        Inflight::add(&store, 4, 1);
        Inflight::finish(&store, 4, false);
        Inflight::finish(&store, 4, true);
        assert_eq!(Inflight::counts(&store), vec![Counts { worker: 4, in_flight: 0, finished: 2, failed: 1 }]);
    }

    #[test]
    fn a_loaded_snapshot_updates_once_or_retries() {
        let store = FakeStore::default();
        Inflight::add(&store, 1, 2);
        let snap = Inflight::load(&store);
        assert_eq!((snap.count(1), snap.count(9)), (2, 0));
        assert_eq!(snap.commit(&store, &[(1, 1)], &EndedBy::new(), false), (true, None));
        let stale = Inflight::load(&store);
        Inflight::add(&store, 1, 1); // another VM
        let ended = EndedBy::from([(1, Ended { left: 2, finished: 1, failed: 1 })]);
        assert_eq!(stale.commit(&store, &[(1, 1)], &ended, true), (true, Some(1)), "retried after the conflict");
        assert_eq!(Inflight::counts(&store), vec![Counts { worker: 1, in_flight: 3, finished: 1, failed: 1 }]);
    }

    #[test]
    fn ended_requests_are_discounted_then_written_once() {
        let store = FakeStore::default();
        Inflight::add(&store, 1, 3);
        Inflight::add(&store, 2, 1);
        let ended = EndedBy::from([(1, Ended { left: 2, finished: 2, failed: 0 }), (9, Ended::default())]);
        let snap = Inflight::load(&store).discount(&ended);
        assert_eq!((snap.count(1), snap.count(2), snap.count(9)), (1, 1, 0));
        assert!(Inflight::end(&store, &ended));
        let c = Inflight::counts(&store);
        assert_eq!((c[0].worker, c[0].in_flight, c[0].finished), (1, 1, 2));
        assert_eq!((c[1].worker, c[1].in_flight), (2, 1));
    }

    /// The native build: a thread that does not tick keeps its counts while kept alive.
    #[test]
    fn a_vm_kept_alive_is_never_reaped_and_keeps_its_counts() {
        let store = FakeStore::default();
        VmLedger::register(&store, 1);
        VmLedger::register(&store, 2);
        VmLedger::publish(&store, 1, 1_000, &[(7, 2)]);
        VmLedger::publish(&store, 2, 1_000, &[]);
        for t in (2_000..=60_000).step_by(1_000) {
            VmLedger::keep_alive(&store, t);
            assert!(VmLedger::reap(&store, 2, t).is_empty(), "VM 1 is idle, not dead, at {t}");
        }
        assert_eq!(VmLedger::registered(&store), vec![1, 2]);
        let value = store.get(&VmLedger::key(1)).0.unwrap();
        assert_eq!((u64_at(&value, 0), u32_at(&value, 8), u32_at(&value, 12)), (Some(60_000), Some(7), Some(2)));
    }

    #[test]
    fn a_dead_vms_counts_are_taken_back_once() {
        let store = FakeStore::default();
        assert_eq!(VmLedger::register(&store, 1), vec![1], "alone");
        assert_eq!(VmLedger::register(&store, 2), vec![1, 2]);
        assert_eq!(VmLedger::register(&store, 3), vec![1, 2, 3]);
        assert_eq!(VmLedger::register(&store, 1), vec![1, 2, 3], "once");
        VmLedger::publish(&store, 1, 1_000, &[(7, 3), (8, 1)]);
        VmLedger::publish(&store, 2, 1_000, &[]);
        VmLedger::publish(&store, 3, 1_000, &[]);
        // VM 1 dies; 2 and 3 keep publishing.
        for t in [5_000, 9_000, 11_500] {
            VmLedger::publish(&store, 2, t, &[]);
            VmLedger::publish(&store, 3, t, &[]);
        }
        assert!(VmLedger::reap(&store, 2, 9_000).is_empty(), "not stale yet");
        let mut taken = VmLedger::reap(&store, 2, 11_500);
        taken.sort();
        assert_eq!(taken, vec![(7, 3), (8, 1)]);
        assert!(VmLedger::reap(&store, 3, 11_600).is_empty(), "taken back once only");
        assert_eq!(VmLedger::registered(&store), vec![2, 3]);
        // A VM that was merely slow registers again on its next heartbeat.
        assert_eq!(VmLedger::register(&store, 1), vec![2, 3, 1]);
        VmLedger::publish(&store, 1, 12_000, &[(7, 1)]);
        assert_eq!(VmLedger::registered(&store), vec![2, 3, 1]);
    }

    #[test]
    fn one_vm_holds_the_lease_until_it_lapses() {
        let store = FakeStore::default();
        assert!(Lease::hold(&store, 1, 1000, 3000));
        assert!(!Lease::hold(&store, 2, 2000, 3000), "held by 1 until 4000");
        assert!(Lease::hold(&store, 1, 3000, 3000), "renewed until 6000");
        assert!(!Lease::hold(&store, 2, 5999, 3000));
        assert!(Lease::hold(&store, 2, 6000, 3000), "lapsed: taken over");
        assert!(!Lease::hold(&store, 1, 6001, 3000));
        assert_eq!(Lease::owner(&store), Some(2));
    }

    #[test]
    fn a_stale_cas_is_retried() {
        use super::fake::Racing;
        let store = FakeStore::default();
        assert!(Inflight::add(&store, 1, 1));

        // `update`: another VM counts a request between our read and our write.
        let racing = Racing::new(&store, |other| assert!(Inflight::add(other, 1, 1)));
        assert!(Inflight::add(&racing, 1, 1));
        assert_eq!(racing.writes(), (2, 1), "the stale write was refused, then retried once");
        assert_eq!(Inflight::read(&store), vec![(1, 3)], "neither VM's count was lost");

        // `commit`: the value loaded for routing is stale by the time the request is counted.
        let racing = Racing::new(&store, |other| assert!(Inflight::finish(other, 1, false)));
        let loaded = Inflight::load(&racing);
        assert_eq!(loaded.commit(&racing, &[(1, 1), (2, 1)], &EndedBy::new(), true), (true, Some(1)));
        assert_eq!(racing.writes(), (2, 1), "the stale commit was refused, then redone on fresh data");
        assert_eq!(
            Inflight::counts(&store),
            vec![
                Counts { worker: 1, in_flight: 3, finished: 1, failed: 0 },
                Counts { worker: 2, in_flight: 1, finished: 0, failed: 0 },
            ]
        );
        assert_eq!(Inflight::load(&store).head(), 1, "one sequence number taken, once");
    }

    fn ins(worker: WorkerId, hashes: &[u64]) -> Delta {
        Delta { worker, evict: false, from_cp: false, hashes: hashes.to_vec() }
    }

    #[test]
    fn deltas_reach_other_vms_only() {
        let store = FakeStore::default();
        let mut a = DeltaLog::new(&store, 1);
        let mut b = DeltaLog::new(&store, 2);
        a.append(&store, &[ins(5, &[10, 11])]);
        let evict = Delta { worker: 7, evict: true, from_cp: true, hashes: vec![13] };
        b.append(&store, &[ins(6, &[12]), evict.clone()]);
        assert_eq!(a.poll(&store, Inflight::load(&store).head()), vec![ins(6, &[12]), evict]);
        assert_eq!(b.poll(&store, Inflight::load(&store).head()), vec![ins(5, &[10, 11])]);
        assert!(a.poll(&store, Inflight::load(&store).head()).is_empty());
        // A VM started later replays what the ring still holds.
        let mut c = DeltaLog::new(&store, 3);
        assert_eq!(c.poll(&store, Inflight::load(&store).head()).len(), 3);
    }

    #[test]
    fn a_vm_never_reads_back_the_slots_it_wrote() {
        let store = FakeStore::default();
        let mut a = DeltaLog::new(&store, 1);
        for i in 0..5 {
            a.append(&store, &[ins(1, &[i])]);
        }
        let head = Inflight::load(&store).head();
        let before = store.gets();
        assert!(a.poll(&store, head).is_empty());
        assert_eq!(store.gets(), before, "no slot read: they were all its own");
        let mut b = DeltaLog::new(&store, 2);
        b.append(&store, &[ins(2, &[9])]);
        a.append(&store, &[ins(1, &[10])]);
        assert_eq!(a.poll(&store, Inflight::load(&store).head()), vec![ins(2, &[9])], "another VM's slot is read");
        // Interleaved with another VM: its own slots ahead of its cursor are not read either.
        for i in 0..4 {
            b.append(&store, &[ins(2, &[100 + i])]);
            a.append(&store, &[ins(1, &[200 + i])]);
        }
        let head = Inflight::load(&store).head();
        let before = store.gets();
        let got = a.poll(&store, head);
        assert_eq!(got.iter().map(|d| d.hashes[0]).collect::<Vec<_>>(), [100, 101, 102, 103]);
        assert_eq!(store.gets() - before, 4, "the other VM's four slots, not its own");
        assert!(a.poll(&store, Inflight::load(&store).head()).is_empty());
    }

    #[test]
    fn a_reader_that_falls_behind_skips_overwritten_slots() {
        let store = FakeStore::default();
        let mut a = DeltaLog::new(&store, 1);
        let mut b = DeltaLog::new(&store, 2);
        for i in 0..(DeltaLog::SLOTS + 10) {
            a.append(&store, &[ins(1, &[i])]);
        }
        let got = b.poll(&store, Inflight::load(&store).head());
        assert_eq!(got.len() as u64, DeltaLog::SLOTS);
        assert_eq!(got[0].hashes, vec![10]);
    }

    #[test]
    fn a_taken_but_unwritten_slot_is_read_later() {
        let store = FakeStore::default();
        let mut b = DeltaLog::new(&store, 2);
        // Another VM took sequence 1 but has not written its slot yet.
        assert_eq!(Inflight::take_seq(&store), Some(1));
        assert!(b.poll(&store, Inflight::load(&store).head()).is_empty());
        let mut entry = 1u64.to_le_bytes().to_vec();
        entry.extend_from_slice(&9u32.to_le_bytes());
        for v in [4u32, 0, 1] {
            entry.extend_from_slice(&v.to_le_bytes());
        }
        entry.extend_from_slice(&77u64.to_le_bytes());
        store.set("kvmesh.log.1", &entry, None).unwrap();
        assert_eq!(b.poll(&store, Inflight::load(&store).head()), vec![ins(4, &[77])]);
    }
}
