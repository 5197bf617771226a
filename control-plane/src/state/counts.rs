//! One gateway's last cumulative counts for one worker: what its next report's counts are
//! compared with, so that only the difference is added, and only when it is plausible.

use kvmesh_core::policy::UtilityWindow;
use kvmesh_proto::v1::{Feedback, WorkerCounts};

use crate::feedback::FeedbackTotals;

/// Most a gateway's cumulative count of one worker may grow between two of its reports
/// (reports go every fraction of a second; a first report, made after kvmesh-cp restarted,
/// may carry more than this: it is then taken as the starting point).
pub const MAX_COUNT_STEP: u32 = 1 << 20;
/// Most tokens, or milliseconds of latency, one response may add to the 64-bit sums.
const MAX_PER_RESPONSE: u64 = 1 << 24;

/// One gateway's last cumulative (wrapping) counts for one worker.
#[derive(Clone, Debug, Default)]
pub(super) struct LastCounts {
    requests: u32,
    errors: u32,
    failovers: u32,
    feedback: Feedback,
    /// When these counts arrived (ms since the epoch; 0: never).
    at_ms: u64,
}

/// What one plausible step adds to a worker's totals.
pub(super) struct Step {
    pub requests: u64,
    pub errors: u64,
    pub failovers: u64,
}

impl LastCounts {
    /// The counts of `c`, arrived at `at_ms`.
    pub(super) fn of(c: &WorkerCounts, at_ms: u64) -> Self {
        let feedback = c.feedback.unwrap_or_default();
        Self { requests: c.requests, errors: c.errors, failovers: c.failovers, feedback, at_ms }
    }

    /// Whether these counts can follow `last` in one gateway's reports: every 32-bit count
    /// grew by at most [`MAX_COUNT_STEP`] (a count that went backwards grew by nearly 2^32),
    /// errors by no more than requests, accurate predictions by no more than predictions, the
    /// 64-bit sums never backwards and by at most [`MAX_PER_RESPONSE`] per response counted.
    pub(super) fn follows(&self, last: &LastCounts) -> bool {
        let step = |a: u32, b: u32| b.wrapping_sub(a);
        let (l, n) = (&last.feedback, &self.feedback);
        let steps = [
            step(last.requests, self.requests),
            step(last.errors, self.errors),
            step(last.failovers, self.failovers),
            step(l.predictions, n.predictions),
            step(l.accurate, n.accurate),
            step(l.over, n.over),
            step(l.under, n.under),
            step(l.completions, n.completions),
        ];
        let sum_ok = |a: u64, b: u64, per: u32| b >= a && b - a <= u64::from(per) * MAX_PER_RESPONSE;
        let (predictions, completions) = (step(l.predictions, n.predictions), step(l.completions, n.completions));
        steps.iter().all(|&s| s <= MAX_COUNT_STEP)
            && step(last.errors, self.errors) <= step(last.requests, self.requests)
            && step(l.accurate, n.accurate) <= predictions
            && sum_ok(l.predicted_tokens, n.predicted_tokens, predictions)
            && sum_ok(l.cached_tokens, n.cached_tokens, predictions)
            && sum_ok(l.completion_tokens, n.completion_tokens, completions)
            && sum_ok(l.e2e_latency_ms, n.e2e_latency_ms, completions)
    }

    /// The requests, errors and failovers since `last`, with the engine feedback since then
    /// added to `feedback`.
    pub(super) fn step_since(&self, last: &LastCounts, feedback: &mut FeedbackTotals) -> Step {
        feedback.add(&last.feedback, &self.feedback);
        Step {
            requests: u64::from(self.requests.wrapping_sub(last.requests)),
            errors: u64::from(self.errors.wrapping_sub(last.errors)),
            failovers: u64::from(self.failovers.wrapping_sub(last.failovers)),
        }
    }

    /// The completions since `last`, spread over the time between the two reports (a first
    /// report: over the last second), pushed into `window`.
    pub(super) fn push_completions_since(&self, last: &LastCounts, window: &mut UtilityWindow) {
        let at_ms = self.at_ms;
        let from = if last.at_ms == 0 { at_ms.saturating_sub(1000) } else { last.at_ms };
        window.push_batch(
            from.min(at_ms),
            at_ms,
            u64::from(self.feedback.completions.wrapping_sub(last.feedback.completions)),
            self.feedback.completion_tokens.saturating_sub(last.feedback.completion_tokens),
            self.feedback.e2e_latency_ms.saturating_sub(last.feedback.e2e_latency_ms),
        );
    }
}
