//! `kvmesh.state`: in-flight, finished and failed requests per worker of this Envoy, the head
//! of the delta log, the breakers' generation and the log's latest batches, in one value
//! updated by compare-and-swap.

use kvmesh_core::WorkerId;

use super::{u32_at, u64_at, update, SetError, SharedStore};

/// Per-worker request counts of this Envoy, the head of the [`DeltaLog`], the breakers'
/// generation and the log's latest batches, in one value: `head u64, breakers u64, workers
/// u32, 0 u32`, then `workers` 16-byte entries `(worker u32, in flight u32, finished u32,
/// failed u32)`, then the recent batches (see [`RECENT_BATCHES`]), updated by compare-and-swap. One read per routed
/// request serves the loads, the log and the breakers (a VM that sees a new generation reads
/// `kvmesh.breakers` before it decides: a breaker opened on another thread is obeyed by the
/// next request anywhere); one CAS counts the request, takes a log sequence number and writes the requests that
/// ended in this VM since (see [`Ended`]: an ending request touches no shared data). A VM
/// alone in its Envoy does both on its tick instead (`Gateway::refresh`).
#[derive(Debug)]
pub struct Inflight {
    value: Vec<u8>,
    cas: Option<u32>,
    /// `(worker, in flight)` as read, by worker: a candidate's load is a binary search, not a
    /// scan of every entry (64 workers would make that 2,000 entry reads a request).
    loads: Vec<(WorkerId, u32)>,
    /// A VM's local view (see [`Inflight::with_local`]), never written back.
    local: bool,
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
const HEAD: usize = 24;
/// Where the breakers' generation is in the head.
const BREAKERS: usize = 8;
/// Where the number of worker entries is in the head.
const WORKERS: usize = 16;

/// The latest log batches a commit carries in the value itself, each as `(length u32, the
/// slot's bytes)`: a VM catching up with the others reads them with the counts it reads
/// anyway, not slot by slot (with N threads routing, each request found up to N - 1 new
/// slots). At most this many, and [`RECENT_BYTES`] in all; older or larger batches are read
/// from their slots. The slots are still written, for readers further behind.
pub const RECENT_BATCHES: usize = 8;
/// See [`RECENT_BATCHES`].
pub const RECENT_BYTES: usize = 2048;

/// One worker's counts (finished and failed wrap at 2^32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub worker: WorkerId,
    pub in_flight: u32,
    pub finished: u32,
    pub failed: u32,
}

/// Where the worker entries end (and the recent batches start).
fn entries_end(value: &[u8]) -> usize {
    let n = u32_at(value, WORKERS).unwrap_or(0) as usize;
    HEAD.saturating_add(n.saturating_mul(ENTRY)).min(value.len().max(HEAD))
}

fn entries(value: &[u8]) -> impl Iterator<Item = Counts> + '_ {
    value.get(HEAD..entries_end(value)).unwrap_or_default().chunks_exact(ENTRY).filter_map(|c| {
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

fn breakers_of(value: &[u8]) -> u64 {
    u64_at(value, BREAKERS).unwrap_or(0)
}

/// Takes the next log sequence number in `value`.
fn next_seq(value: &mut Vec<u8>) -> u64 {
    if value.len() < HEAD {
        value.resize(HEAD, 0);
    }
    let seq = head_of(value) + 1;
    if let Some(head) = value.get_mut(..BREAKERS) {
        head.copy_from_slice(&seq.to_le_bytes());
    }
    seq
}

impl Inflight {
    pub(crate) const KEY: &'static str = "kvmesh.state.v3";

    /// Reads the current counts and log head (one host call), keeping the version for a
    /// later update.
    pub fn load(store: &dyn SharedStore) -> Self {
        let (value, cas) = store.get(Self::KEY);
        let value = value.unwrap_or_default();
        let mut loads: Vec<(WorkerId, u32)> = entries(&value).map(|c| (c.worker, c.in_flight)).collect();
        loads.sort_unstable();
        Self { value, cas, loads, local: false }
    }

    /// The delta log's head as read.
    pub fn head(&self) -> u64 {
        head_of(&self.value)
    }

    /// The latest log batches as read (see [`RECENT_BATCHES`]): for [`DeltaLog::poll`].
    pub fn recent(&self) -> Recent<'_> {
        Recent(self.value.get(entries_end(&self.value)..).unwrap_or_default())
    }

    /// The breakers' generation as read: it moves whenever a breaker changes what it admits.
    pub fn breakers(&self) -> u64 {
        breakers_of(&self.value)
    }

    /// A breaker changed what it admits (opened, closed, a probe slot taken): moves the
    /// breakers' generation, so that every VM reads the breakers before its next decision.
    pub fn breakers_changed(store: &dyn SharedStore) -> bool {
        update(store, Self::KEY, |value| {
            if value.len() < HEAD {
                value.resize(HEAD, 0);
            }
            let generation = breakers_of(value).wrapping_add(1);
            if let Some(slot) = value.get_mut(BREAKERS..WORKERS) {
                slot.copy_from_slice(&generation.to_le_bytes());
            }
        })
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

    /// The loads as read, with `started` requests added and `ended` ones taken off: the view
    /// of a VM alone in its Envoy between its writes. It is for deciding only: the value is
    /// not kept, and [`Inflight::is_local`] says so.
    pub fn with_local(&self, started: &std::collections::BTreeMap<WorkerId, u32>, ended: &EndedBy) -> Self {
        let mut loads = self.loads.clone();
        for (&worker, &n) in started {
            match loads.binary_search_by_key(&worker, |&(w, _)| w) {
                Ok(i) => {
                    if let Some((_, count)) = loads.get_mut(i) {
                        *count = count.saturating_add(n);
                    }
                }
                Err(i) => loads.insert(i, (worker, n)),
            }
        }
        Self { value: Vec::new(), cas: None, loads, local: true }.discount(ended)
    }

    /// Whether these loads are a VM's local view ([`Inflight::with_local`]), not a value read
    /// to be written back.
    pub fn is_local(&self) -> bool {
        self.local
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
    /// [`load`](Self::load) and, given an encoded log `batch` (a slot's bytes, which start with
    /// its sequence number), takes a sequence number, stamps it into the batch and carries the
    /// batch among the recent ones, in one CAS (falling back to a read-modify-write loop if
    /// another VM wrote in between). Returns whether the counts were written (`ended` with
    /// them) and the sequence number taken.
    pub fn commit(
        mut self,
        store: &dyn SharedStore,
        deltas: &[(WorkerId, i32)],
        ended: &EndedBy,
        mut batch: Option<&mut Vec<u8>>,
    ) -> (bool, Option<u64>) {
        if self.local {
            return (false, None); // a view for deciding, not a value to write back
        }
        let mut change = |value: &mut Vec<u8>| {
            for &(worker, delta) in deltas {
                apply(value, worker, delta);
            }
            write_ended(value, ended);
            batch.as_deref_mut().map(|bytes| {
                let seq = next_seq(value);
                if let Some(at) = bytes.get_mut(..8) {
                    at.copy_from_slice(&seq.to_le_bytes());
                }
                push_recent(value, bytes);
                seq
            })
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
    pub(crate) fn take_seq(store: &dyn SharedStore) -> Option<u64> {
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

/// The offset of `worker`'s entry in `value`, added (zeroed, after the others) if it has none.
fn entry_at(value: &mut Vec<u8>, worker: WorkerId) -> usize {
    if value.len() < HEAD {
        value.resize(HEAD, 0);
    }
    let end = entries_end(value);
    let existing =
        value.get(HEAD..end).unwrap_or_default().chunks_exact(ENTRY).position(|c| u32_at(c, 0) == Some(worker));
    match existing {
        Some(i) => HEAD + i * ENTRY,
        None => {
            let entry = worker.to_le_bytes().into_iter().chain([0; ENTRY - 4]);
            value.splice(end..end, entry);
            let n = u32_at(value, WORKERS).unwrap_or(0).saturating_add(1);
            if let Some(slot) = value.get_mut(WORKERS..WORKERS + 4) {
                slot.copy_from_slice(&n.to_le_bytes());
            }
            end
        }
    }
}

/// The recent batches of a value as read: `(length u32, bytes)` each, oldest first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Recent<'a>(&'a [u8]);

impl<'a> Recent<'a> {
    fn batches(self) -> impl Iterator<Item = &'a [u8]> {
        let mut rest = self.0;
        std::iter::from_fn(move || {
            let len = u32_at(rest, 0)? as usize;
            let batch = rest.get(4..4usize.checked_add(len)?)?;
            rest = rest.get(4 + len..)?;
            Some(batch)
        })
    }

    /// The batch of sequence number `seq` (a slot's bytes: it starts with `seq`), if carried.
    pub fn get(self, seq: u64) -> Option<&'a [u8]> {
        self.batches().find(|b| u64_at(b, 0) == Some(seq))
    }
}

/// Adds `batch` to the recent batches of `value`, dropping the oldest past [`RECENT_BATCHES`]
/// or [`RECENT_BYTES`] (a batch larger than that alone is not carried: read from its slot).
fn push_recent(value: &mut Vec<u8>, batch: &[u8]) {
    let start = entries_end(value);
    if value.len() < start {
        value.resize(start, 0);
    }
    let Some(section) = value.get(start..) else { return };
    let mut kept: Vec<&[u8]> = Recent(section).batches().collect();
    if batch.len() + 4 > RECENT_BYTES {
        return;
    }
    let mut bytes = batch.len() + 4;
    let mut keep = 0;
    for b in kept.iter().rev() {
        if keep + 1 >= RECENT_BATCHES || bytes + b.len() + 4 > RECENT_BYTES {
            break;
        }
        bytes += b.len() + 4;
        keep += 1;
    }
    let old = kept.split_off(kept.len() - keep);
    let mut out = Vec::with_capacity(bytes);
    for b in old.into_iter().chain(std::iter::once(batch)) {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    value.truncate(start);
    value.extend_from_slice(&out);
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

#[cfg(test)]
mod tests {
    use super::super::fake::FakeStore;
    use super::*;

    /// A log batch of sequence number `seq` (its bytes start with it), `extra` bytes long after.
    fn sized(seq: u64, extra: usize) -> Vec<u8> {
        let mut b = seq.to_le_bytes().to_vec();
        b.resize(8 + extra, 7);
        b
    }

    fn batch(seq: u64) -> Vec<u8> {
        sized(seq, 4)
    }

    #[test]
    fn a_commit_carries_the_latest_batches_within_their_bounds_and_keeps_the_counts() {
        let store = FakeStore::default();
        for i in 1..=(RECENT_BATCHES as u64 + 3) {
            // A new worker each time: its entry goes before the batches, which stay whole.
            let (ok, seq) =
                Inflight::load(&store).commit(&store, &[(i as u32, 1)], &EndedBy::new(), Some(&mut batch(0)));
            assert_eq!((ok, seq), (true, Some(i)));
        }
        let read = Inflight::load(&store);
        let head = read.head();
        assert_eq!(head, RECENT_BATCHES as u64 + 3);
        let carried: Vec<u64> = (1..=head).filter(|&s| read.recent().get(s).is_some()).collect();
        assert_eq!(carried, ((head - RECENT_BATCHES as u64 + 1)..=head).collect::<Vec<_>>(), "the latest, in order");
        assert_eq!(read.recent().get(head), Some(&batch(head)[..]));
        assert_eq!(Inflight::read(&store).len(), head as usize, "every worker's count kept");
        assert!(Inflight::end(&store, &EndedBy::from([(1, Ended { left: 1, finished: 1, failed: 0 })])));
        assert!(Inflight::breakers_changed(&store) && Inflight::add(&store, 99, 1));
        assert!(Inflight::load(&store).recent().get(head).is_some(), "kept by every other write");
        // Bytes bound them too; a batch past the bound alone is not carried (its slot is read).
        let big = |seq: u64| sized(seq, RECENT_BYTES / 2);
        let (_, first) = Inflight::load(&store).commit(&store, &[], &EndedBy::new(), Some(&mut big(0)));
        let read = Inflight::load(&store);
        assert!(read.recent().get(first.unwrap()).is_some() && read.recent().get(head).is_some());
        let (_, seq) = Inflight::load(&store).commit(&store, &[], &EndedBy::new(), Some(&mut big(0)));
        let (read, seq) = (Inflight::load(&store), seq.unwrap());
        assert!(read.recent().get(seq).is_some());
        assert!(read.recent().get(seq - 1).is_none() && read.recent().get(head).is_none(), "dropped for the bytes");
        let huge = |seq: u64| sized(seq, RECENT_BYTES);
        let (_, last) = Inflight::load(&store).commit(&store, &[], &EndedBy::new(), Some(&mut huge(0)));
        let read = Inflight::load(&store);
        assert!(read.recent().get(last.unwrap()).is_none() && read.recent().get(seq).is_some());
        assert_eq!(Inflight::read(&store).len(), head as usize + 1);
    }

    /// A value another build or a bug left malformed: a worker count past its end, batches
    /// whose lengths overrun. Read and written without a panic; nothing bogus is carried.
    #[test]
    fn a_malformed_value_is_read_and_written_without_panicking() {
        let store = FakeStore::default();
        let mut value = vec![0u8; HEAD];
        value[WORKERS..WORKERS + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        value.extend_from_slice(&[1, 0, 0, 0, 5, 0, 0, 0]);
        store.set(Inflight::KEY, &value, None).unwrap();
        let read = Inflight::load(&store);
        assert_eq!((read.count(1), read.recent().get(0)), (0, None));
        let mut value = vec![0u8; HEAD];
        value.extend_from_slice(&u32::MAX.to_le_bytes()); // a batch longer than the value
        value.extend_from_slice(&[9; 12]);
        store.set(Inflight::KEY, &value, None).unwrap();
        assert!(Inflight::load(&store).recent().get(0).is_none());
        let (ok, seq) = Inflight::load(&store).commit(&store, &[(3, 1)], &EndedBy::new(), Some(&mut batch(0)));
        assert_eq!((ok, seq), (true, Some(1)));
        let read = Inflight::load(&store);
        assert_eq!((read.count(3), read.recent().get(1)), (1, Some(&batch(1)[..])));
    }

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
        assert_eq!(snap.commit(&store, &[(1, 1)], &EndedBy::new(), None), (true, None));
        let stale = Inflight::load(&store);
        Inflight::add(&store, 1, 1); // another VM
        let ended = EndedBy::from([(1, Ended { left: 2, finished: 1, failed: 1 })]);
        assert_eq!(
            stale.commit(&store, &[(1, 1)], &ended, Some(&mut batch(0))),
            (true, Some(1)),
            "retried after the conflict"
        );
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

    #[test]
    fn a_stale_cas_is_retried() {
        use super::super::fake::Racing;
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
        assert_eq!(loaded.commit(&racing, &[(1, 1), (2, 1)], &EndedBy::new(), Some(&mut batch(0))), (true, Some(1)));
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

    #[test]
    fn the_breakers_generation_moves_alone() {
        let store = FakeStore::default();
        assert_eq!(Inflight::load(&store).breakers(), 0);
        assert!(Inflight::breakers_changed(&store));
        Inflight::add(&store, 5, 1);
        assert_eq!(Inflight::take_seq(&store), Some(1));
        assert!(Inflight::breakers_changed(&store));
        let read = Inflight::load(&store);
        assert_eq!((read.breakers(), read.head(), read.count(5)), (2, 1, 1), "counts and log head kept");
    }
}
