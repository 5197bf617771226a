//! Engine feedback: what a worker's response said it had cached (`cached_tokens`)
//! against the prefix this gateway's index matched for it when the request was routed.
//! The comparison is counted per worker (`kvmesh.feedback`, reported to the control
//! plane); when the worker held less, the blocks it did not hold are dropped for it — here,
//! in the other VMs (through the delta log) and, through the report, in the control plane
//! and so in every gateway.

use kvmesh_core::feedback::{judge, Judged, Verdict};
use kvmesh_core::usage::Usage;
use kvmesh_core::WorkerId;

use super::plan::Prediction;
use super::publisher::Publisher;
use super::view::RoutingView;
use crate::shared::feedback::Pending;
use crate::shared::{Delta, DeltaLog, SharedStore};

/// A [`super::Gateway`]'s parts that engine feedback changes ([`super::Gateway::feedback`]).
pub struct EngineFeedback<'a> {
    pub(super) view: &'a mut RoutingView,
    pub(super) log: &'a mut DeltaLog,
    pub(super) publisher: &'a mut Publisher,
    pub(super) pending: &'a mut Pending,
    /// A control plane is configured (stale blocks are then reported).
    pub(super) cp: bool,
}

impl EngineFeedback<'_> {
    /// A response of `prediction`'s worker ended, carrying `usage`: judged, counted, and the
    /// stale blocks dropped. Returns the judgement (None: the response said no
    /// `cached_tokens`).
    pub fn judge(&mut self, store: &dyn SharedStore, prediction: &Prediction, usage: &Usage) -> Option<Judged> {
        let config = &self.view.config;
        let (block_size, per_token) = (config.block_size as u64, config.bytes_per_token);
        let judged = usage
            .cached_tokens
            .map(|cached| judge(prediction.matched_bytes, prediction.matched_blocks, cached, block_size, per_token));
        self.pending.add(prediction.worker, judged.as_ref(), usage);
        // From the first block the worker did not hold to the request's last: the routing
        // indexed the whole request for it, and a worker's blocks stay a run from the first
        // (what the index's binary search relies on).
        let stale = match judged.as_ref().filter(|j| j.verdict == Verdict::Over) {
            Some(j) => prediction.hashes.get(j.stale.start..).unwrap_or_default().to_vec(),
            None => Vec::new(),
        };
        if let (false, Some(j)) = (stale.is_empty(), judged.as_ref()) {
            log::debug!(
                "worker {}: {} cached tokens where {} were predicted; {} blocks dropped",
                prediction.worker,
                j.cached_tokens,
                j.predicted_tokens,
                stale.len()
            );
            let delta = Delta { worker: prediction.worker, evict: true, from_cp: false, hashes: stale };
            self.view.apply_delta(&delta);
            self.log.append(store, std::slice::from_ref(&delta));
            self.publisher.queue_stale(self.cp, delta.worker, delta.hashes);
        }
        judged
    }

    /// A response of `worker` that carried completion metrics but had no prediction to judge.
    pub fn count(&mut self, worker: WorkerId, usage: &Usage) {
        self.pending.add(worker, None, usage);
    }

    /// On the tick: this VM's feedback since the last tick into the shared counts.
    pub fn flush(&mut self, store: &dyn SharedStore) {
        self.pending.flush(store);
    }
}
