//! Engine feedback on the gateway: what a worker's response said it had cached
//! (`cached_tokens`) against the prefix this gateway's index matched for it when the request
//! was routed. The comparison is counted per worker (`kvmesh.feedback`, reported to the
//! control plane); when the worker held less, the blocks it did not hold are dropped for it —
//! here, in the other VMs (through the delta log) and, through the report, in the control
//! plane and so in every gateway.

use kvmesh_core::feedback::{judge, Judged, Verdict};
use kvmesh_core::usage::Usage;
use kvmesh_core::WorkerId;

use super::Gateway;
use crate::shared::{Delta, SharedStore};

/// What the gateway believed a worker held when it routed a request there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prediction {
    pub worker: WorkerId,
    /// Bytes of the routing text the index matched for that worker.
    pub matched_bytes: u64,
    /// How many leading blocks that is.
    pub matched_blocks: usize,
    /// The hashes of all the request's blocks, in order (indexed for the worker when the
    /// request was routed).
    pub hashes: Vec<u64>,
}

impl Prediction {
    /// The prediction of a decision for `worker` that matched `matched_bytes` of a routing
    /// text cut into `blocks` of `block_size` bytes.
    pub fn new(worker: WorkerId, matched_bytes: usize, blocks: &[u64], block_size: usize) -> Self {
        let n = matched_bytes.div_ceil(block_size.max(1)).min(blocks.len());
        Self { worker, matched_bytes: matched_bytes as u64, matched_blocks: n, hashes: blocks.to_vec() }
    }
}

impl Gateway {
    /// A response of `prediction`'s worker ended, carrying `usage`: judged, counted, and the
    /// stale blocks dropped. Returns the judgement (None: the response said no
    /// `cached_tokens`).
    pub fn feedback(&mut self, store: &dyn SharedStore, prediction: &Prediction, usage: &Usage) -> Option<Judged> {
        let config = &self.view.config;
        let (block_size, per_token) = (config.block_size as u64, config.bytes_per_token);
        let judged = usage
            .cached_tokens
            .map(|cached| judge(prediction.matched_bytes, prediction.matched_blocks, cached, block_size, per_token));
        self.pending_feedback.add(prediction.worker, judged.as_ref(), usage);
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
            let cp = self.has_control_plane();
            self.publisher.queue_stale(cp, delta.worker, delta.hashes);
        }
        judged
    }

    /// A response of `worker` that carried completion metrics but had no prediction to judge.
    pub fn count_usage(&mut self, worker: WorkerId, usage: &Usage) {
        self.pending_feedback.add(worker, None, usage);
    }

    /// On the tick: this VM's feedback since the last tick into the shared counts.
    pub fn flush_feedback(&mut self, store: &dyn SharedStore) {
        self.pending_feedback.flush(store);
    }
}
