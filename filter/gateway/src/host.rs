//! The seam between the filter's logic and Envoy, in three traits by who asks: [`VmHost`]
//! (shared data, clock, stats: every plugin), [`LinkHost`] (the control-plane gRPC streams: the
//! plugin holding them) and [`StreamHost`] (one HTTP stream: headers, bodies, local replies,
//! resuming, callouts). The `.wasm`'s glue implements all three over `proxy_wasm::hostcalls`;
//! the native build's worker threads [`StreamHost`], its ticker [`LinkHost`];
//! [`mock::MockHost`] all three in memory for native tests, so the request, PD and
//! control-plane logic runs under `cargo test`.

use crate::headers::Headers;
use std::time::Duration;

use crate::shared::SharedStore;

/// What a callback tells the host: go on, or hold the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// The filter's stats (Envoy's `/stats`, `/stats/prometheus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    /// Counter: requests routed (each PD leg counts).
    Requests,
    /// Counter: requests answered by the filter itself.
    LocalReplies,
    /// Counter: requests routed to a worker believed to hold part of the prompt.
    CacheHits,
    /// Histogram: nanoseconds from the whole body to a routing decision.
    DecisionNs,
    /// Gauge: blocks in this VM's prefix index.
    IndexBlocks,
    /// Gauge: the last control-plane snapshot version applied.
    SnapshotVersion,
    /// Gauge: requests in flight through this Envoy (all its VMs), updated on the tick.
    InFlight,
    /// Counter: requests that Envoy failed over to another worker than the one chosen.
    Failovers,
    /// Gauge: requests waiting in this Envoy's admission queue, updated on the tick.
    Queued,
    /// Counter: `/abort_request` calls sent for prefill legs whose request ended first.
    PrefillAborts,
    /// Counter: vLLM requests whose prefill leg gave no KV transfer, run on the decode worker
    /// alone.
    PrefillFallbacks,
    /// Counter: responses whose `cached_tokens` was compared with the prediction.
    Predictions,
    /// Counter: of those, predicted within one index block.
    PredictionsAccurate,
    /// Counter: of those, the worker held less than predicted (the rest was dropped).
    PredictionsOver,
    /// Counter: of those, the worker held more than predicted.
    PredictionsUnder,
    /// PD requests whose prefill worker was believed to hold more than `cache_threshold` of
    /// the prompt, and the others (named and counted as sglang-router's).
    PdCacheHits,
    PdCacheMisses,
    /// Histogram: each VM's linear memory in bytes, recorded once a second (the largest
    /// value is the largest VM).
    VmMemory,
}

/// Counters with one label: per model (`model`, the pool's name a request routed by, for
/// deployments serving several models), per priority class (`class`, four values) and per
/// tenant (`tenant`, issue 47). Model and tenant labels are bounded per Envoy
/// ([`MAX_LABEL_SERIES`], then `other`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LabelledMetric {
    /// Requests routed for the model.
    ModelRequests,
    /// Of those, routed to a worker believed to hold part of the prompt.
    ModelCacheHits,
    /// Under the concurrency limit: requests of the class given a slot (at once or from the
    /// queue).
    ClassAdmitted,
    /// Requests of the class that waited in the queue.
    ClassQueued,
    /// Requests of the class refused at once as sheddable (503 `shed`).
    ClassShed,
    /// Requests of the class refused because the queue was full (429) or they waited past
    /// their timeout (408).
    ClassRefused,
    /// Requests of the tenant (tenants configured).
    TenantRequests,
    /// Of those, refused by the tenant's requests-per-second limit (429).
    TenantLimited,
    /// Of those, waited in the admission queue.
    TenantQueued,
    /// Of those, refused as sheddable.
    TenantShed,
}

impl LabelledMetric {
    pub const ALL: [LabelledMetric; 10] = [
        LabelledMetric::ModelRequests,
        LabelledMetric::ModelCacheHits,
        LabelledMetric::ClassAdmitted,
        LabelledMetric::ClassQueued,
        LabelledMetric::ClassShed,
        LabelledMetric::ClassRefused,
        LabelledMetric::TenantRequests,
        LabelledMetric::TenantLimited,
        LabelledMetric::TenantQueued,
        LabelledMetric::TenantShed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LabelledMetric::ModelRequests => "kvmesh_model_requests_total",
            LabelledMetric::ModelCacheHits => "kvmesh_model_cache_hits_total",
            LabelledMetric::ClassAdmitted => "kvmesh_class_admitted_total",
            LabelledMetric::ClassQueued => "kvmesh_class_queued_total",
            LabelledMetric::ClassShed => "kvmesh_class_shed_total",
            LabelledMetric::ClassRefused => "kvmesh_class_refused_total",
            LabelledMetric::TenantRequests => "kvmesh_tenant_requests_total",
            LabelledMetric::TenantLimited => "kvmesh_tenant_limited_total",
            LabelledMetric::TenantQueued => "kvmesh_tenant_queued_total",
            LabelledMetric::TenantShed => "kvmesh_tenant_shed_total",
        }
    }

    /// The label's name (the tag Envoy extracts from the name, [`tagged_name`]).
    pub fn label(self) -> &'static str {
        match self {
            LabelledMetric::ModelRequests | LabelledMetric::ModelCacheHits => "model",
            LabelledMetric::ClassAdmitted
            | LabelledMetric::ClassQueued
            | LabelledMetric::ClassShed
            | LabelledMetric::ClassRefused => "class",
            LabelledMetric::TenantRequests
            | LabelledMetric::TenantLimited
            | LabelledMetric::TenantQueued
            | LabelledMetric::TenantShed => "tenant",
        }
    }
}

/// The most model names (and, apart, tenant ids) one Envoy keeps series for; the others
/// count under `other`.
pub const MAX_LABEL_SERIES: usize = 64;

/// The label values of one kind a VM has given out: a value with every character but
/// letters, digits and `-._/:@+` as `_` (Envoy's tag extraction reserves `;` and `=`; quotes,
/// backslashes and line ends would reach the Prometheus page), up to [`MAX_LABEL_SERIES`] of
/// them for the whole Envoy (counted in shared data under the kind's key,
/// [`crate::shared::series`]), then `other`.
#[derive(Debug, Default)]
pub struct Labels {
    given: std::collections::HashSet<String>,
    /// Labels the Envoy had no room for (they stay without: given labels are never taken back).
    refused: std::collections::HashSet<String>,
}

/// Most refusals a VM remembers (past them, it asks shared data again).
const MAX_REFUSED: usize = 1024;

impl Labels {
    /// `value`'s label; `shared`: the store the Envoy's VMs count their labels in and the key
    /// (none: this one counts for the Envoy, as the native build's single set does).
    pub fn label(&mut self, value: &str, shared: Option<(&dyn crate::shared::SharedStore, &str)>) -> String {
        let clean: String = value
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '/' | ':' | '@' | '+') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if self.given.contains(&clean) {
            return clean;
        }
        if self.given.len() >= MAX_LABEL_SERIES || self.refused.contains(&clean) {
            return "other".to_string();
        }
        let admitted =
            shared.is_none_or(|(store, key)| crate::shared::series::admit(store, key, &clean, MAX_LABEL_SERIES));
        if admitted {
            self.given.insert(clean.clone());
            return clean;
        }
        if self.refused.len() < MAX_REFUSED {
            self.refused.insert(clean);
        }
        "other".to_string()
    }
}

/// A VM's (or the native build's) labels of every kind: models and tenants bounded, each
/// under its own shared-data key; class names as they are (four of them).
#[derive(Debug, Default)]
pub struct LabelSets {
    models: Labels,
    tenants: Labels,
}

impl LabelSets {
    /// The label `metric`'s series for `value` is kept under (see [`Labels::label`]).
    pub fn label(
        &mut self,
        metric: LabelledMetric,
        value: &str,
        shared: Option<&dyn crate::shared::SharedStore>,
    ) -> String {
        use crate::shared::series::{MODEL_SERIES_KEY, TENANT_SERIES_KEY};
        match metric.label() {
            "model" => self.models.label(value, shared.map(|s| (s, MODEL_SERIES_KEY))),
            "tenant" => self.tenants.label(value, shared.map(|s| (s, TENANT_SERIES_KEY))),
            _ => kvmesh_core::priority::Class::parse(value).map_or("other", |c| c.name()).to_string(),
        }
    }
}

/// A labelled counter's name for hosts that extract tags from names (Envoy's Wasm stats, with
/// the `stats_tags` regexes the shipped configurations carry, e.g. `(model=\.=(.*?);\.;)`,
/// which is also what Istio's `extraStatTags: [model]` adds).
pub fn tagged_name(metric: LabelledMetric, label: &str) -> String {
    format!("{}=.={label};.;{}", metric.label(), metric.name())
}

/// How Envoy keeps a metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

impl Metric {
    pub fn kind(self) -> MetricKind {
        match self {
            Metric::Requests
            | Metric::LocalReplies
            | Metric::CacheHits
            | Metric::Failovers
            | Metric::PrefillAborts
            | Metric::PrefillFallbacks
            | Metric::Predictions
            | Metric::PredictionsAccurate
            | Metric::PredictionsOver
            | Metric::PredictionsUnder
            | Metric::PdCacheHits
            | Metric::PdCacheMisses => MetricKind::Counter,
            Metric::DecisionNs | Metric::VmMemory => MetricKind::Histogram,
            Metric::IndexBlocks | Metric::SnapshotVersion | Metric::InFlight | Metric::Queued => MetricKind::Gauge,
        }
    }

    pub const ALL: [Metric; 18] = [
        Metric::Requests,
        Metric::LocalReplies,
        Metric::CacheHits,
        Metric::DecisionNs,
        Metric::IndexBlocks,
        Metric::SnapshotVersion,
        Metric::InFlight,
        Metric::Failovers,
        Metric::Queued,
        Metric::PrefillAborts,
        Metric::PrefillFallbacks,
        Metric::Predictions,
        Metric::PredictionsAccurate,
        Metric::PredictionsOver,
        Metric::PredictionsUnder,
        Metric::PdCacheHits,
        Metric::PdCacheMisses,
        Metric::VmMemory,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::Requests => "kvmesh_requests_total",
            Metric::LocalReplies => "kvmesh_local_replies_total",
            Metric::CacheHits => "kvmesh_cache_hits_total",
            Metric::DecisionNs => "kvmesh_route_decision_ns",
            Metric::IndexBlocks => "kvmesh_index_blocks",
            Metric::SnapshotVersion => "kvmesh_snapshot_version",
            Metric::InFlight => "kvmesh_in_flight",
            Metric::Failovers => "kvmesh_failovers_total",
            Metric::Queued => "kvmesh_queued",
            Metric::PrefillAborts => "kvmesh_prefill_aborts_total",
            Metric::PrefillFallbacks => "kvmesh_prefill_fallbacks_total",
            Metric::Predictions => "kvmesh_predictions_total",
            Metric::PredictionsAccurate => "kvmesh_predictions_accurate_total",
            Metric::PredictionsOver => "kvmesh_predictions_over_total",
            Metric::PredictionsUnder => "kvmesh_predictions_under_total",
            Metric::PdCacheHits => "sgl_router_pd_cache_hits_total",
            Metric::PdCacheMisses => "sgl_router_pd_cache_misses_total",
            Metric::VmMemory => "kvmesh_vm_memory_bytes",
        }
    }
}

/// Why the host refused a call (the host's status, for logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostError(pub String);

impl std::fmt::Display for HostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An HTTP callout.
#[derive(Clone, Copy, Debug)]
pub struct Callout<'a> {
    pub cluster: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub body: &'a [u8],
    pub timeout: Duration,
}

/// What a VM asks of Envoy whatever it is running for: shared data (the supertrait), the
/// clock, stats, and facts about the process. A plugin's tick needs no more (the native build's
/// worker threads and its ticker implement this and no request calls).
pub trait VmHost: SharedStore {
    /// Nanoseconds since the epoch (0 if the host cannot say).
    fn now_nanos(&self) -> u64;
    /// Envoy's node id, if set.
    fn node_id(&self) -> Option<String>;
    /// The size of this VM's linear memory in bytes (not a host call; 0 for a native build).
    fn vm_memory_bytes(&self) -> u64;
    fn increment(&self, metric: Metric);
    fn record(&self, metric: Metric, value: u64);
    /// Adds one to `metric`'s series for `value` (a host without labelled stats keeps none).
    fn increment_labelled(&self, _metric: LabelledMetric, _value: &str) {}
    /// Whether the plugin's tick comes on a timer, also while its streams are idle (a Wasm
    /// VM's does; the native build's worker threads tick only on their streams' hooks).
    fn has_timer(&self) -> bool {
        true
    }
}

/// The control-plane streams, for the plugin that holds them: gRPC streams opened, written and
/// cancelled, and the message that arrived read in its callback.
pub trait LinkHost: VmHost {
    /// Opens a gRPC stream with `metadata` as its initial metadata (e.g. `authorization`).
    fn open_grpc_stream(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError>;
    fn send_grpc(&self, token: u32, message: &[u8], end_of_stream: bool) -> Result<(), HostError>;
    fn cancel_grpc(&self, token: u32);
    /// The message that arrived on a stream (in `on_grpc_stream_message`).
    fn grpc_message(&self, size: usize) -> Vec<u8>;
}

/// What one HTTP stream asks of Envoy: its request and response, local replies, resuming,
/// and HTTP callouts. Calls that concern "the" request or response act on the stream whose
/// callback is running (or the one a tick entered); callout answers are read in their
/// callbacks.
pub trait StreamHost: VmHost {
    // The request.
    /// All request headers, in one host call.
    fn request_headers(&self) -> Headers;
    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError>;
    /// Several writes at once (the route is matched again once, after the last).
    fn set_request_headers(&self, headers: &[(&str, Option<&str>)]) -> Result<(), HostError> {
        headers.iter().try_for_each(|(name, value)| self.set_request_header(name, *value))
    }
    /// The first `size` bytes of the buffered request body.
    fn request_body(&self, size: usize) -> Vec<u8>;
    /// Replaces the first `size` bytes of the buffered request body.
    fn set_request_body(&self, size: usize, body: &[u8]) -> Result<(), HostError>;

    // The response.
    /// All response headers, in one host call.
    fn response_headers(&self) -> Headers;
    /// The first value of each of `names` (lower case) among the response headers, if UTF-8,
    /// in order. By default one read of the whole map: under Wasm every host call that returns
    /// bytes is costly, so two lookups would cost more than one listing. A host that looks
    /// headers up in place (the native build) does one lookup each.
    fn response_header_values(&self, names: &[&str]) -> Vec<Option<String>> {
        let headers = self.response_headers();
        names.iter().map(|name| headers.get(name).map(str::to_string)).collect()
    }
    fn set_response_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError>;
    /// Bytes `range` of the response body Envoy holds (what it kept while the filter paused,
    /// then the chunk just received).
    fn response_body(&self, range: std::ops::Range<usize>) -> Vec<u8>;
    /// Envoy's response code details: `via_upstream` when the worker answered, else why Envoy
    /// answered itself (`upstream_reset_before_response_started{...}`, `overflow`, ...).
    fn response_code_details(&self) -> Option<String>;
    fn set_response_body(&self, size: usize, body: &[u8]) -> Result<(), HostError>;
    /// The `ip:port` of the worker that answered (Envoy's `upstream.address`: after a
    /// failover, the last one tried).
    fn upstream_address(&self) -> Option<String>;
    /// Answers the client locally (Envoy resets the upstream, if any).
    fn send_reply(&self, status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostError>;
    /// Sets a value of the request's filter state, where Envoy's access logs
    /// (`%FILTER_STATE(wasm.<key>:PLAIN)%`) and tracing read it: a property under Wasm, which
    /// Envoy keeps as `wasm.<key>`; the native build writes the same `wasm.<key>` so that one
    /// access-log format fits both builds. Each key is set at most once per request (Envoy keeps
    /// a dynamic module's filter state read-only).
    fn set_filter_state(&self, key: &str, value: &str) -> Result<(), HostError>;
    /// Lets a held response go on.
    fn resume_response(&self) -> Result<(), HostError>;
    /// Lets a held request go on (one the filter paused while it waited in the queue).
    fn resume_request(&self) -> Result<(), HostError>;
    /// Makes `context_id`'s stream "the" request and response of the calls that follow (for
    /// work done from the root context's tick on a request's behalf).
    fn enter_context(&self, context_id: u32) -> Result<(), HostError>;

    // HTTP callouts: the answer arrives in `on_http_call_response`.
    fn dispatch(&self, callout: Callout<'_>) -> Result<u32, HostError>;
    /// Sends a callout whose answer nobody awaits and that must run to its end even when the
    /// running stream ends first. A proxy-wasm callout belongs to the VM, not to a stream, so
    /// this is [`StreamHost::dispatch`] there; the native build hands it to the main thread.
    fn dispatch_detached(&self, callout: Callout<'_>) -> Result<(), HostError> {
        self.dispatch(callout).map(|_| ())
    }
    /// The `:status` of the callout that answered (None: no response at all).
    fn callout_status(&self) -> Option<u16>;
    fn callout_body(&self, size: usize) -> Vec<u8>;
}

/// Milliseconds since the epoch.
pub fn now_ms(host: &dyn VmHost) -> u64 {
    host.now_nanos() / 1_000_000
}

#[cfg(test)]
pub mod mock;
