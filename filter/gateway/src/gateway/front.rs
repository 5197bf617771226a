//! What a request meets before its decision, read from one VM's configuration and table:
//! the request line, the body limit, the routing key, how the destination headers are
//! written, and which worker an upstream address names. Reads only: nothing here changes
//! the gateway.

use kvmesh_core::breaker::BreakerState;
use kvmesh_core::paths::{self, PathClass};
use kvmesh_core::policy::PolicyKind;
use kvmesh_core::request::RequestError;
use kvmesh_core::WorkerId;

use super::plan::Destination;
use super::reply::Reply;
use super::view::RoutingView;
use crate::headers::Headers;
use crate::now::Now;

/// A read-only look at a [`super::Gateway`] for the request path ([`super::Gateway::front`]).
pub struct Front<'a> {
    pub(super) view: &'a RoutingView,
}

impl Front<'_> {
    /// What the gateway does with `method` on `path`.
    pub fn classify(&self, method: &str, path: &str) -> PathClass {
        paths::classify(method, path, &self.view.config.passthrough_paths)
    }

    /// The body size limit (`max_payload_size`), the one place it is read: a request whose
    /// declared `content-length` exceeds it is refused before its body is read.
    pub fn check_length(&self, content_length: Option<u64>) -> Option<Reply> {
        let limit = self.view.config.max_payload_size;
        content_length.filter(|&len| len > limit).map(|_| Reply::request(&RequestError::TooLarge { limit }))
    }

    /// Whether a body of `len` bytes is over the limit (a body that grows past it while
    /// buffering is refused with [`Front::too_large`]).
    pub fn over_limit(&self, len: usize) -> bool {
        len as u64 > self.view.config.max_payload_size
    }

    /// A body that grew past the limit while buffering.
    pub fn too_large(&self) -> Reply {
        Reply::request(&RequestError::TooLarge { limit: self.view.config.max_payload_size })
    }

    /// An LLM request that arrived with no body at all.
    pub fn empty_body(&self) -> Reply {
        Reply::request(&RequestError::EmptyBody)
    }

    /// Whether a policy in force hashes on a routing key (its headers are then looked up).
    pub fn wants_key(&self) -> bool {
        self.view.uses(PolicyKind::ConsistentHashing)
    }

    /// See [`RoutingView::routing_key`].
    pub fn routing_key(&self, headers: &Headers) -> Option<String> {
        self.view.routing_key(headers)
    }

    /// How a routed request's destination headers are written (its timeout also bounds the
    /// prefill leg).
    pub fn destination(&self) -> Destination {
        let config = &self.view.config;
        Destination {
            timeout_secs: config.request_timeout_secs,
            original_dst: config.original_dst_header,
            authorization: config.worker_authorization.clone(),
        }
    }

    /// The Envoy cluster the prefill callouts go through.
    pub fn upstream_cluster(&self) -> &str {
        &self.view.config.upstream_cluster
    }

    /// Whether completion metrics (tokens, latency) of responses go anywhere: to the control
    /// plane, in reports. Without one, a response with no prediction to judge is not scanned.
    pub fn reports_usage(&self) -> bool {
        self.view.config.control_plane_cluster.is_some()
    }

    /// The worker at `addr` (`ip:port`, as Envoy reports the upstream it used) of
    /// data-parallel rank `rank` (none: a worker that is one target).
    pub fn worker_at(&self, addr: &str, rank: Option<u32>) -> Option<WorkerId> {
        self.view.worker_at(addr, rank)
    }

    /// The workers the control plane found hung (answering none of its probes).
    pub fn hung_workers(&self) -> Vec<WorkerId> {
        self.view.table.workers.iter().filter(|w| w.unresponsive).map(|w| w.id).collect()
    }

    /// `worker`'s circuit breaker at `now`, as this VM sees it.
    pub fn breaker_state(&self, worker: WorkerId, now: Now) -> BreakerState {
        self.view.health.state(worker, now)
    }
}
