//! `kvmesh.log.<n>`: a ring of recent prefix-index changes, so that a prefix routed on one
//! thread (or pushed by the control plane) is known to the others before their next request.

use kvmesh_core::WorkerId;

use super::inflight::{Inflight, Recent};
use super::{u32_at, u64_at, SharedStore};

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

    /// Hashes per slot past which a batch is split over several slots (between its deltas),
    /// so that a reader can stop after any of them: a full snapshot's inserts are read a few
    /// slots at a time, not in one go on one request.
    pub const SLOT_HASHES: usize = 1 << 14;

    /// A reader/writer for VM `vm` that starts with the batches still in the ring.
    pub fn new(store: &dyn SharedStore, vm: u32) -> Self {
        let head = Inflight::load(store).head();
        Self { cursor: head.saturating_sub(Self::SLOTS), vm, own: std::collections::VecDeque::new() }
    }

    pub fn vm(&self) -> u32 {
        self.vm
    }

    fn slot_key(seq: u64) -> String {
        format!("kvmesh.log.v1.{}", seq % Self::SLOTS)
    }

    /// Appends a batch made by this VM (taking a sequence number on its own).
    pub fn append(&mut self, store: &dyn SharedStore, deltas: &[Delta]) {
        let mut rest = deltas;
        while !rest.is_empty() {
            let mut hashes = 0;
            let n = rest
                .iter()
                .take_while(|d| {
                    hashes += d.hashes.len();
                    hashes <= Self::SLOT_HASHES
                })
                .count()
                .max(1);
            let (batch, after) = rest.split_at(n.min(rest.len()));
            match Inflight::take_seq(store) {
                Some(seq) => self.write(store, seq, batch),
                None => return,
            }
            rest = after;
        }
    }

    /// The bytes of batch `seq` written by VM `vm`: what its slot holds (and what
    /// [`Inflight::commit`] carries among the recent batches).
    pub fn encode(seq: u64, vm: u32, deltas: &[Delta]) -> Vec<u8> {
        let size: usize = deltas.iter().map(|d| 12 + d.hashes.len() * 8).sum();
        let mut entry = Vec::with_capacity(12 + size);
        entry.extend_from_slice(&seq.to_le_bytes());
        entry.extend_from_slice(&vm.to_le_bytes());
        for d in deltas {
            let flags = u32::from(d.evict) | (u32::from(d.from_cp) << 1);
            entry.extend_from_slice(&d.worker.to_le_bytes());
            entry.extend_from_slice(&flags.to_le_bytes());
            entry.extend_from_slice(&(d.hashes.len() as u32).to_le_bytes());
            for h in &d.hashes {
                entry.extend_from_slice(&h.to_le_bytes());
            }
        }
        entry
    }

    /// Writes the batch of sequence number `seq` (taken by [`Inflight::commit`]).
    pub fn write(&mut self, store: &dyn SharedStore, seq: u64, deltas: &[Delta]) {
        let entry = Self::encode(seq, self.vm, deltas);
        self.write_encoded(store, seq, &entry);
    }

    /// Writes batch `seq` as [`DeltaLog::encode`] gave it (with `seq` stamped in).
    pub fn write_encoded(&mut self, store: &dyn SharedStore, seq: u64, entry: &[u8]) {
        // The slot belongs to this sequence number; no CAS needed.
        let _ = store.set(&Self::slot_key(seq), entry, None);
        // Read up to just before it: nothing to read back (a VM alone pays no read per write).
        if self.cursor + 1 == seq {
            self.cursor = seq;
        } else if seq > self.cursor && self.own.len() < Self::SLOTS as usize {
            self.own.push_back(seq);
        }
    }

    /// The batches other VMs wrote up to `head` (from [`Inflight::head`]) since the last
    /// call, oldest first, each from `recent` (the batches the same read carried) or else
    /// its slot; it stops after the batch that brings them to `max_hashes` hashes (the rest
    /// is read by the next call) — unless this VM is half the ring behind, when stopping
    /// could let writers overwrite slots it has not read.
    pub fn poll(&mut self, store: &dyn SharedStore, recent: Recent<'_>, head: u64, max_hashes: usize) -> Vec<Delta> {
        if head <= self.cursor {
            return Vec::new();
        }
        let max_hashes = if head - self.cursor > Self::SLOTS / 2 { usize::MAX } else { max_hashes };
        let mut out = Vec::new();
        let mut seq = self.cursor.max(head.saturating_sub(Self::SLOTS)) + 1;
        while self.own.front().is_some_and(|&o| o < seq) {
            self.own.pop_front();
        }
        let mut hashes = 0;
        while seq <= head && hashes < max_hashes {
            if self.own.front() == Some(&seq) {
                // Written here: nothing to apply.
                self.own.pop_front();
                self.cursor = seq;
                seq += 1;
                continue;
            }
            let read;
            let entry = match recent.get(seq) {
                Some(carried) => carried,
                None => {
                    read = store.get(&Self::slot_key(seq)).0.unwrap_or_default();
                    &read
                }
            };
            let written = u64_at(entry, 0).unwrap_or(0);
            if written < seq {
                break; // Taken but not written yet: read it next time.
            }
            if written == seq && u32_at(entry, 8) != Some(self.vm) {
                let before = out.len();
                decode_deltas(entry.get(12..).unwrap_or_default(), &mut out);
                hashes += out.get(before..).unwrap_or_default().iter().map(|d| d.hashes.len()).sum::<usize>();
            }
            self.cursor = seq;
            seq += 1;
        }
        out
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
mod tests {
    use super::super::fake::FakeStore;
    use super::super::inflight::Inflight;
    use super::*;

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
        assert_eq!(
            a.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX),
            vec![ins(6, &[12]), evict]
        );
        assert_eq!(
            b.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX),
            vec![ins(5, &[10, 11])]
        );
        assert!(a.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX).is_empty());
        // A VM started later replays what the ring still holds.
        let mut c = DeltaLog::new(&store, 3);
        assert_eq!(c.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX).len(), 3);
    }

    #[test]
    fn batches_carried_in_the_state_are_read_with_it_not_from_their_slots() {
        use super::super::inflight::EndedBy;
        let store = FakeStore::default();
        let mut a = DeltaLog::new(&store, 1);
        let mut b = DeltaLog::new(&store, 2);
        for i in 0..3 {
            let mut batch = DeltaLog::encode(0, 1, &[ins(5, &[i])]);
            let (_, seq) = Inflight::load(&store).commit(&store, &[], &EndedBy::new(), Some(&mut batch));
            a.write_encoded(&store, seq.unwrap(), &batch);
        }
        let read = Inflight::load(&store);
        let before = store.gets();
        let got = b.poll(&store, read.recent(), read.head(), usize::MAX);
        assert_eq!(got, vec![ins(5, &[0]), ins(5, &[1]), ins(5, &[2])]);
        assert_eq!(store.gets(), before, "no slot read: the three came with the counts");
        // A batch that took its number on its own is not carried: read from its slot.
        a.append(&store, &[ins(6, &[9])]);
        let read = Inflight::load(&store);
        let before = store.gets();
        assert_eq!(b.poll(&store, read.recent(), read.head(), usize::MAX), vec![ins(6, &[9])]);
        assert_eq!(store.gets() - before, 1);
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
        assert!(a.poll(&store, Recent::default(), head, usize::MAX).is_empty());
        assert_eq!(store.gets(), before, "no slot read: they were all its own");
        let mut b = DeltaLog::new(&store, 2);
        b.append(&store, &[ins(2, &[9])]);
        a.append(&store, &[ins(1, &[10])]);
        assert_eq!(
            a.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX),
            vec![ins(2, &[9])],
            "another VM's slot is read"
        );
        // Interleaved with another VM: its own slots ahead of its cursor are not read either.
        for i in 0..4 {
            b.append(&store, &[ins(2, &[100 + i])]);
            a.append(&store, &[ins(1, &[200 + i])]);
        }
        let head = Inflight::load(&store).head();
        let before = store.gets();
        let got = a.poll(&store, Recent::default(), head, usize::MAX);
        assert_eq!(got.iter().map(|d| d.hashes[0]).collect::<Vec<_>>(), [100, 101, 102, 103]);
        assert_eq!(store.gets() - before, 4, "the other VM's four slots, not its own");
        assert!(a.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX).is_empty());
    }

    #[test]
    fn a_reader_that_falls_behind_skips_overwritten_slots() {
        let store = FakeStore::default();
        let mut a = DeltaLog::new(&store, 1);
        let mut b = DeltaLog::new(&store, 2);
        for i in 0..(DeltaLog::SLOTS + 10) {
            a.append(&store, &[ins(1, &[i])]);
        }
        let got = b.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX);
        assert_eq!(got.len() as u64, DeltaLog::SLOTS);
        assert_eq!(got[0].hashes, vec![10]);
    }

    #[test]
    fn a_large_batch_is_read_a_budget_at_a_time() {
        let store = FakeStore::default();
        let mut a = DeltaLog::new(&store, 1);
        let mut b = DeltaLog::new(&store, 2);
        // A full snapshot's inserts: 40 workers' 4,096 hashes each, in one append.
        let batch: Vec<Delta> =
            (0..40).map(|w| ins(w, &(0..4096).map(|h| h + u64::from(w) * 4096).collect::<Vec<_>>())).collect();
        a.append(&store, &batch);
        assert_eq!(Inflight::load(&store).head(), 10, "split into slots of 2^14 hashes");
        let head = Inflight::load(&store).head();
        let first = b.poll(&store, Recent::default(), head, 20_000);
        assert_eq!(first.len(), 8, "two slots: the budget is passed after the second");
        let rest = b.poll(&store, Recent::default(), head, usize::MAX);
        assert_eq!([first, rest].concat(), batch, "nothing lost or repeated");
        // Half the ring behind, a reader reads on whatever its budget: nothing is overwritten
        // before it is read.
        for i in 0..(DeltaLog::SLOTS / 2 + 1) {
            a.append(&store, &[ins(1, &[i])]);
        }
        let behind = b.poll(&store, Recent::default(), Inflight::load(&store).head(), 1);
        assert_eq!(behind.len() as u64, DeltaLog::SLOTS / 2 + 1);
    }

    /// The bound the docs state: a poll within half the ring reads at most its budget plus one
    /// slot (the slot that passes the budget is read whole); further behind, the whole ring.
    #[test]
    fn a_poll_reads_its_budget_and_at_most_one_slot_more() {
        let store = FakeStore::default();
        let mut a = DeltaLog::new(&store, 1);
        let mut b = DeltaLog::new(&store, 2);
        let full = |w: u32| ins(w, &(0..DeltaLog::SLOT_HASHES as u64).collect::<Vec<_>>());
        for w in 0..8 {
            a.append(&store, &[full(w)]);
        }
        let head = Inflight::load(&store).head();
        let budget = 2 * DeltaLog::SLOT_HASHES + 1;
        let read: usize = b.poll(&store, Recent::default(), head, budget).iter().map(|d| d.hashes.len()).sum();
        assert_eq!(read, budget - 1 + DeltaLog::SLOT_HASHES, "the budget, then the slot that passed it");
        for w in 0..DeltaLog::SLOTS as u32 {
            a.append(&store, &[ins(w, &[u64::from(w)])]);
        }
        let behind = b.poll(&store, Recent::default(), Inflight::load(&store).head(), 1);
        assert!(behind.len() as u64 > DeltaLog::SLOTS / 2 && behind.len() as u64 <= DeltaLog::SLOTS);
    }

    #[test]
    fn a_taken_but_unwritten_slot_is_read_later() {
        let store = FakeStore::default();
        let mut b = DeltaLog::new(&store, 2);
        // Another VM took sequence 1 but has not written its slot yet.
        assert_eq!(Inflight::take_seq(&store), Some(1));
        assert!(b.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX).is_empty());
        let mut entry = 1u64.to_le_bytes().to_vec();
        entry.extend_from_slice(&9u32.to_le_bytes());
        for v in [4u32, 0, 1] {
            entry.extend_from_slice(&v.to_le_bytes());
        }
        entry.extend_from_slice(&77u64.to_le_bytes());
        store.set("kvmesh.log.v1.1", &entry, None).unwrap();
        assert_eq!(b.poll(&store, Recent::default(), Inflight::load(&store).head(), usize::MAX), vec![ins(4, &[77])]);
    }
}
