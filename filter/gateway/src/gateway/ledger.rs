//! The in-flight ledger: this VM's share of the Envoy-wide counts in [`Inflight`] — what it
//! has in flight (published with its heartbeat, so that the counts of a VM that dies are taken
//! back by a survivor, see [`VmLedger`]) and the requests that ended here and are not written
//! yet.

use std::collections::BTreeMap;

use kvmesh_core::WorkerId;

use crate::routed::Routed;
use crate::shared::{Delta, DeltaLog, EndedBy, Inflight, SharedStore, VmLedger};

/// One VM's in-flight bookkeeping.
pub struct Ledger {
    /// This VM's id in shared data.
    vm: u32,
    /// Alone in its Envoy, a VM reads and writes no shared data per request: `seen` is what
    /// `kvmesh.state` held at its last write or tick, `unlogged` the index inserts not yet in
    /// the delta log (both written on the tick, see [`Ledger::write_ended`]).
    seen: Inflight,
    unlogged: Vec<Delta>,
    unlogged_hashes: usize,
    /// What this VM has in flight, per worker, as counted in [`Inflight`] (published by
    /// [`Ledger::heartbeat`]): requests that ended leave it when their end is written.
    mine: BTreeMap<WorkerId, u32>,
    /// Requests that ended here and are not written to [`Inflight`] yet: this VM's next commit
    /// (its next routed request's compare-and-swap) or tick writes them, and its own decisions
    /// discount them meanwhile. Other VMs count them as load until then — so a VM that is not
    /// alone writes them at once when its last request in flight ended (a session's next turn,
    /// sent as the last one ended, could land on another VM and be moved off its worker);
    /// while it has others in flight, its next commit is near.
    ended: EndedBy,
    /// Requests this VM routed and has not counted in [`Inflight`] yet: a VM `alone` counts
    /// them with its next write (its tick's), not one compare-and-swap each; its own decisions
    /// add them at once (see [`Ledger::local_loads`]).
    started: BTreeMap<WorkerId, u32>,
    /// This VM was the only one registered at its last two heartbeats (a second apart): the
    /// VMs of one Envoy start together, and one that registered a moment before the others
    /// must not take itself for alone until they have registered.
    alone: bool,
    /// The registry held only this VM at the last heartbeat.
    only_me: bool,
    /// Heartbeats so far, and those since the VM routed its first request (two registry
    /// checks tell whether it routes alone).
    pub(super) checks: u32,
    serving_checks: u32,
    /// The VM has routed a request (see [`Ledger::serve`]).
    serving: bool,
    /// The host ticks this VM only on its streams' hooks: with other VMs, every end is
    /// written at once (see [`Ledger::write_ends_at_once`]).
    untimed: bool,
    /// `mine` changed since it was last published.
    mine_changed: bool,
    last_heartbeat_ms: u64,
}

impl Ledger {
    pub(super) fn new(vm: u32, store: &dyn SharedStore) -> Self {
        Self {
            vm,
            seen: Inflight::load(store),
            unlogged: Vec::new(),
            unlogged_hashes: 0,
            mine: BTreeMap::new(),
            ended: EndedBy::new(),
            started: BTreeMap::new(),
            alone: false,
            only_me: false,
            checks: 0,
            serving_checks: 0,
            serving: false,
            untimed: false,
            mine_changed: false,
            last_heartbeat_ms: 0,
        }
    }

    /// The requests that ended here and are not written yet (discounted from the loads this
    /// VM reads, and folded into its next write).
    pub(super) fn ended(&self) -> &EndedBy {
        &self.ended
    }

    /// Requests to `workers` were routed by this VM alone and are not counted in [`Inflight`]
    /// yet (see [`Ledger::write_started`]).
    pub(super) fn start(&mut self, workers: impl IntoIterator<Item = WorkerId>) {
        for worker in workers {
            *self.started.entry(worker).or_default() += 1;
        }
    }

    /// Whether requests routed here wait to be counted in [`Inflight`].
    pub(super) fn started_any(&self) -> bool {
        !self.started.is_empty()
    }

    /// Whether anything routed or ended here waits to be written to [`Inflight`].
    pub(super) fn unwritten(&self) -> bool {
        !self.started.is_empty() || !self.ended.is_empty()
    }

    /// The loads this VM alone decides on: `seen` (what [`Inflight`] held at its last write or
    /// tick, which nobody else writes while it is alone) with its own requests since, started
    /// and ended.
    pub(super) fn local_loads(&self) -> Inflight {
        self.seen.with_local(&self.started, &self.ended)
    }

    /// Counts the started and ended requests in [`Inflight`] (one read, one compare-and-swap)
    /// and, given an encoded `batch`, takes a log sequence number (stamped into the batch) and
    /// carries the batch in the same write. Returns whether it went through and the number taken.
    pub(super) fn write_started(
        &mut self,
        store: &dyn SharedStore,
        batch: Option<&mut Vec<u8>>,
    ) -> (bool, Option<u64>) {
        let counts: Vec<(WorkerId, i32)> =
            self.started.iter().map(|(&w, &n)| (w, i32::try_from(n).unwrap_or(i32::MAX))).collect();
        let (ok, seq) = Inflight::load(store).commit(store, &counts, &self.ended, batch);
        if ok {
            self.written();
            for (worker, n) in std::mem::take(&mut self.started) {
                *self.mine.entry(worker).or_default() += n;
            }
            self.mine_changed = true;
        }
        (ok, seq)
    }

    /// Requests to `workers` were counted in [`Inflight`] by this VM.
    pub(super) fn counted(&mut self, workers: impl IntoIterator<Item = WorkerId>) {
        for worker in workers {
            *self.mine.entry(worker).or_default() += 1;
        }
        self.mine_changed = true;
    }

    /// A counted leg that never ran to its end (a prefill callout cancelled with its stream):
    /// off the in-flight table, not counted as finished.
    pub fn release(&mut self, store: &dyn SharedStore, routed: &Routed) {
        if routed.counted {
            self.ended.entry(routed.worker).or_default().left += 1;
            self.write_if_idle(store);
        }
    }

    /// The stream of a counted request ended (completed, failed or reset): written with this
    /// VM's next commit or tick (its own decisions discount it until then), or at once when
    /// other VMs route too and it was this VM's last request in flight.
    pub fn finish(&mut self, store: &dyn SharedStore, routed: &Routed, ok: bool) {
        if routed.counted {
            let e = self.ended.entry(routed.worker).or_default();
            e.left += 1;
            e.finished += 1;
            e.failed += u32::from(!ok);
            self.write_if_idle(store);
        }
    }

    fn write_if_idle(&mut self, store: &dyn SharedStore) {
        // A VM alone (the common case) counts nothing here: its tick writes.
        if self.alone || !self.started.is_empty() {
            return;
        }
        let idle = || self.mine.values().sum::<u32>() <= self.ended.values().map(|e| e.left).sum::<u32>();
        if self.untimed || idle() {
            self.write_ends(store);
        }
    }

    /// Writes the requests that ended here since the last write.
    fn write_ends(&mut self, store: &dyn SharedStore) {
        if !self.ended.is_empty() && Inflight::end(store, &self.ended) {
            self.written();
        }
    }

    /// The ended requests are in [`Inflight`] now: no longer this VM's there either.
    pub(super) fn written(&mut self) {
        for (worker, e) in std::mem::take(&mut self.ended) {
            if let Some(n) = self.mine.get_mut(&worker) {
                *n = n.saturating_sub(e.left);
                if *n == 0 {
                    self.mine.remove(&worker);
                }
                self.mine_changed = true;
            }
        }
    }

    /// Publishes what this VM has in flight (when it changed, and at least once a
    /// second as a heartbeat), and takes back the counts of VMs that died (see [`VmLedger`]).
    fn beat(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let vm = self.vm;
        let due = now_ms.saturating_sub(self.last_heartbeat_ms) >= 1_000;
        if !self.serving {
            // Envoy's main-thread VM (it ticks, may hold the control-plane streams, never
            // routes), or a worker thread's before its first request: nothing to count, and
            // not one of the VMs the others must share with.
            if due {
                self.last_heartbeat_ms = now_ms;
                self.checks = self.checks.saturating_add(1);
            }
            return;
        }
        if due {
            let registered = VmLedger::register(store, vm);
            self.checks = self.checks.saturating_add(1);
            self.serving_checks = self.serving_checks.saturating_add(1);
            let only_me = registered == [vm];
            self.set_alone(vm, only_me && self.only_me, &registered);
            self.only_me = only_me;
        } else if self.alone {
            // Alone, it reads nobody's changes per request: a VM that starts routing is
            // noticed on the next tick, not a second later.
            let registered = VmLedger::registered(store);
            if registered != [vm] {
                self.only_me = false;
                self.set_alone(vm, false, &registered);
            }
        }
        if self.mine_changed || due {
            let counts: Vec<(WorkerId, u32)> = self.mine.iter().map(|(&w, &n)| (w, n)).collect();
            VmLedger::publish(store, vm, now_ms, &counts);
            self.mine_changed = false;
        }
        if due {
            self.last_heartbeat_ms = now_ms;
            for (worker, n) in VmLedger::reap(store, vm, now_ms) {
                log::warn!("a VM that died had {n} requests in flight to worker {worker}: taken back");
                Inflight::add(store, worker, -i32::try_from(n).unwrap_or(i32::MAX));
            }
        }
    }

    fn set_alone(&mut self, vm: u32, alone: bool, registered: &[u32]) {
        if alone != self.alone {
            match alone {
                true => log::info!("VM {vm:08x} routes alone in its Envoy: its shared data goes out on its tick"),
                false => log::info!("VM {vm:08x} no longer routes alone (VMs {registered:08x?})"),
            }
        }
        self.alone = alone;
    }

    /// The VM routes its first request: from now on it is one of the VMs that count requests
    /// (registered at once, so that a VM alone until now notices it on its next tick).
    /// Its heartbeat goes out with the registration: a VM registered without one looks long
    /// dead to the others, whose next heartbeat would take it off the registry (and a VM alone
    /// until then could take itself for alone again).
    pub fn serve(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let vm = self.vm;
        if !self.serving {
            self.serving = true;
            VmLedger::publish(store, vm, now_ms, &[]);
            VmLedger::register(store, vm);
        }
    }

    /// Whether the VM knows if it routes alone: two registry checks a second apart while
    /// routing (one that routes nothing: two checks at all).
    pub fn settled(&self) -> bool {
        match self.serving {
            true => self.serving_checks >= 2,
            false => self.checks >= 2,
        }
    }

    /// This VM's id in shared data (lease owner, log writer).
    pub fn vm(&self) -> u32 {
        self.vm
    }

    /// Whether this VM is the only one in its Envoy (it then reads no shared data per request).
    pub fn alone(&self) -> bool {
        self.alone
    }

    /// For a host whose plugins tick only on their streams' hooks: every end is written at
    /// once when other VMs route too (a busy stream without hooks would keep the ends of the
    /// requests before it from the others, and from the Envoy-wide gauge, while it runs).
    pub fn write_ends_at_once(&mut self) {
        self.untimed = true;
    }

    /// A decision on `inflight` committed: its legs to `workers` counted in flight and its
    /// index inserts `deltas` logged — in one compare-and-swap with the ends this VM has not
    /// written (the insert batch encoded once, stamped with the sequence number it takes), or
    /// for a VM alone with its tick's write. Returns whether the legs are counted.
    pub(super) fn commit(
        &mut self,
        store: &dyn SharedStore,
        log: &mut DeltaLog,
        inflight: Inflight,
        workers: impl Iterator<Item = WorkerId> + Clone,
        deltas: &[Delta],
    ) -> bool {
        if inflight.is_local() {
            self.start_alone(store, log, workers, deltas);
            return true;
        }
        let counts: Vec<(WorkerId, i32)> = workers.clone().map(|w| (w, 1)).collect();
        let mut batch = (!deltas.is_empty()).then(|| DeltaLog::encode(0, self.vm, deltas));
        let (counted, seq) = inflight.commit(store, &counts, &self.ended, batch.as_mut());
        if counted {
            self.written();
        }
        if let (Some(seq), Some(batch)) = (seq, &batch) {
            log.write_encoded(store, seq, batch);
        }
        if counted {
            self.counted(workers);
        }
        counted
    }

    /// A VM alone committed `legs` with index inserts `deltas`: counted and logged with the
    /// tick's write, or at once past [`UNLOGGED_HASHES`].
    fn start_alone(
        &mut self,
        store: &dyn SharedStore,
        log: &mut DeltaLog,
        legs: impl IntoIterator<Item = WorkerId>,
        deltas: &[Delta],
    ) {
        self.start(legs);
        self.unlogged_hashes += deltas.iter().map(|d| d.hashes.len()).sum::<usize>();
        self.unlogged.extend(deltas.iter().cloned());
        if self.unlogged_hashes >= UNLOGGED_HASHES {
            self.write_unwritten(store, log);
        }
    }

    /// On the tick: writes the requests that ended here since the last write (when no request
    /// was routed since, nothing else would) and, for a VM alone, those it routed and the
    /// inserts it has not logged yet; then reads `kvmesh.state` afresh for its next decisions.
    pub(super) fn write_ended(&mut self, store: &dyn SharedStore, log: &mut DeltaLog) {
        if self.alone {
            if !self.write_unwritten(store, log) {
                // Nothing of its own to write; a VM that died may have been taken back.
                self.seen = Inflight::load(store);
            }
        } else if self.started_any() || !self.unlogged.is_empty() {
            // Left from a time alone (a write that did not go through): out now.
            self.write_unwritten(store, log);
        } else {
            self.write_ends(store);
        }
    }

    /// A VM alone: its routed and ended requests into `kvmesh.state` and its inserts into the
    /// delta log, one write each. Returns whether it wrote; a VM alone then decides on what it
    /// wrote from now on (its written requests are in `seen`, no longer in its own counts).
    fn write_unwritten(&mut self, store: &dyn SharedStore, log: &mut DeltaLog) -> bool {
        if !self.unwritten() && self.unlogged.is_empty() {
            return false;
        }
        let batch = std::mem::take(&mut self.unlogged);
        self.unlogged_hashes = 0;
        let one_slot =
            !batch.is_empty() && batch.iter().map(|d| d.hashes.len()).sum::<usize>() <= DeltaLog::SLOT_HASHES;
        let mut encoded = one_slot.then(|| DeltaLog::encode(0, self.vm, &batch));
        let (_, seq) = self.write_started(store, encoded.as_mut());
        match (seq, &encoded) {
            (Some(seq), Some(encoded)) => log.write_encoded(store, seq, encoded),
            (Some(seq), None) => log.write(store, seq, &batch),
            // Past one slot, or the counts not written (kept for the next try): the inserts
            // are logged all the same.
            (None, _) if !batch.is_empty() => log.append(store, &batch),
            (None, _) => {}
        }
        self.seen = Inflight::load(store);
        true
    }

    /// On the tick: publishes what this VM has in flight and takes back the counts of VMs
    /// that died (see [`Ledger::beat`]); a VM that stops or starts being alone changes how it
    /// writes.
    pub(super) fn heartbeat(&mut self, store: &dyn SharedStore, now_ms: u64, log: &mut DeltaLog) {
        let was_alone = self.alone;
        self.beat(store, now_ms);
        match (was_alone, self.alone) {
            // Another VM registered: what this one kept for its tick goes out now.
            (true, false) => {
                self.write_unwritten(store, log);
            }
            // From now on it decides on what it last saw and its own requests.
            (false, true) => self.seen = Inflight::load(store),
            _ => {}
        }
    }
}

/// Index inserts a VM alone keeps for its tick's write: past these it writes them at once
/// (half a delta-log slot, so that one request's inserts on top still fit in one slot).
const UNLOGGED_HASHES: usize = DeltaLog::SLOT_HASHES / 2;
