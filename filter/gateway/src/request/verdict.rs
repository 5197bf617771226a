//! What a response says about the worker that was asked, for passive health.

/// What a response says about the worker that was asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The worker answered (`true`: not with a server error).
    Worker(bool),
    /// The worker could not be reached, reset the stream or timed out.
    WorkerFailed,
    /// Envoy answered for reasons that are not the worker's doing (its circuit breakers, no
    /// healthy upstream, a client that went away, the filter's own replies).
    NotTheWorker,
}

impl Verdict {
    pub(super) fn of(status: u16, details: Option<&str>) -> Self {
        match details {
            Some("via_upstream") => Verdict::Worker(status < 500),
            Some(d)
                if d.starts_with("upstream_reset_before_response_started")
                    || d.starts_with("upstream_response_timeout")
                    || d.starts_with("upstream_per_try_timeout") =>
            {
                Verdict::WorkerFailed
            }
            Some(_) => Verdict::NotTheWorker,
            // A host that cannot say: judge by the status alone.
            None => Verdict::Worker(status < 500),
        }
    }

    /// For passive health: `Some(ok)` when this says something about the worker.
    pub(super) fn health(self) -> Option<bool> {
        match self {
            Verdict::Worker(ok) => Some(ok),
            Verdict::WorkerFailed => Some(false),
            Verdict::NotTheWorker => None,
        }
    }
}
