//! Engine feedback summed over the gateways, per worker: how often the gateways' prediction of
//! a worker's cached prefix matched what the worker reported (`cached_tokens`), and the
//! completion metrics of its responses. Gateways report cumulative, wrapping counts
//! (`WorkerCounts.feedback`); the differences are added here, as for the request counts.

use std::sync::atomic::AtomicU64;

use kvmesh_proto::v1::Feedback;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};

use prometheus_client::encoding::EncodeLabelSet;

use crate::label::LabelValue;

/// The labels of every per-worker `/metrics` series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker: LabelValue,
    pub role: LabelValue,
}

/// One worker's totals over every gateway.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FeedbackTotals {
    pub predictions: u64,
    pub accurate: u64,
    pub over: u64,
    pub under: u64,
    pub predicted_tokens: u64,
    pub cached_tokens: u64,
    pub completions: u64,
    pub completion_tokens: u64,
    pub e2e_latency_ms: u64,
}

impl FeedbackTotals {
    /// Adds what one gateway's cumulative counts grew by since `last`.
    pub fn add(&mut self, last: &Feedback, now: &Feedback) {
        // Totals saturate: no report can wrap them (reports.rs bounds what one may add).
        let d32 = |total: &mut u64, a: u32, b: u32| *total = total.saturating_add(u64::from(b.wrapping_sub(a)));
        d32(&mut self.predictions, last.predictions, now.predictions);
        d32(&mut self.accurate, last.accurate, now.accurate);
        d32(&mut self.over, last.over, now.over);
        d32(&mut self.under, last.under, now.under);
        d32(&mut self.completions, last.completions, now.completions);
        // 64-bit sums do not wrap in practice; a gateway that restarted counts anew.
        let d64 = |total: &mut u64, a: u64, b: u64| *total = total.saturating_add(b.saturating_sub(a));
        d64(&mut self.predicted_tokens, last.predicted_tokens, now.predicted_tokens);
        d64(&mut self.cached_tokens, last.cached_tokens, now.cached_tokens);
        d64(&mut self.completion_tokens, last.completion_tokens, now.completion_tokens);
        d64(&mut self.e2e_latency_ms, last.e2e_latency_ms, now.e2e_latency_ms);
    }

    /// Hit-prediction accuracy: the share of compared responses whose cached prefix was
    /// predicted within one block (none compared: unknown).
    pub fn accuracy(&self) -> Option<f64> {
        (self.predictions > 0).then(|| self.accurate as f64 / self.predictions as f64)
    }

    /// The `/workers` view.
    pub fn json(&self) -> Value {
        json!({
            "predictions": self.predictions,
            "accurate": self.accurate,
            "over": self.over,
            "under": self.under,
            "accuracy": self.accuracy(),
            "predicted_tokens": self.predicted_tokens,
            "cached_tokens": self.cached_tokens,
            "completions": self.completions,
            "completion_tokens": self.completion_tokens,
            "e2e_latency_ms": self.e2e_latency_ms,
        })
    }
}

/// The per-worker `/metrics` families of the capacity model and of engine feedback.
#[derive(Default)]
pub struct CacheMetrics {
    capacity: Family<WorkerLabels, Gauge>,
    index_tokens: Family<WorkerLabels, Gauge>,
    accuracy: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    /// In [`FeedbackTotals`] field order.
    counters: [Family<WorkerLabels, Counter>; 9],
}

/// Counter names (the exposition adds `_total`) and help, in [`FeedbackTotals`] field order.
const COUNTERS: [(&str, &str); 9] = [
    ("kvmesh_worker_predictions", "Responses whose cached_tokens was compared with the gateway's prediction"),
    ("kvmesh_worker_predictions_accurate", "Of those, predicted within one index block"),
    ("kvmesh_worker_predictions_over", "Of those, the worker held less than predicted (the rest was dropped)"),
    ("kvmesh_worker_predictions_under", "Of those, the worker held more than predicted"),
    ("kvmesh_worker_predicted_cached_tokens", "Tokens the gateways predicted cached, over the compared responses"),
    ("kvmesh_worker_cached_tokens", "Tokens the worker reported cached, over the compared responses"),
    ("kvmesh_worker_completions", "Responses that carried completion metrics"),
    ("kvmesh_worker_completion_tokens", "completion_tokens the worker reported"),
    ("kvmesh_worker_e2e_latency_ms", "The worker's own e2e_latency, summed, in milliseconds"),
];

impl CacheMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvmesh_worker_kv_capacity_tokens",
            "The worker's KV capacity in tokens (reported in /get_server_info, or --worker-kv-capacity)",
            self.capacity.clone(),
        );
        registry.register(
            "kvmesh_worker_index_tokens",
            "Tokens' worth of the worker's blocks in the global prefix index (kept within its capacity)",
            self.index_tokens.clone(),
        );
        registry.register(
            "kvmesh_worker_prediction_accuracy",
            "Share of compared responses whose cached prefix the gateways predicted within one block",
            self.accuracy.clone(),
        );
        for ((name, help), family) in COUNTERS.iter().zip(&self.counters) {
            registry.register(*name, *help, family.clone());
        }
    }

    /// Brings one worker's series up to date.
    pub fn update(&self, labels: &WorkerLabels, capacity: Option<u64>, index_tokens: u64, f: &FeedbackTotals) {
        match capacity {
            Some(c) => {
                self.capacity.get_or_create(labels).set(i64::try_from(c).unwrap_or(i64::MAX));
            }
            None => {
                self.capacity.remove(labels);
            }
        }
        self.index_tokens.get_or_create(labels).set(i64::try_from(index_tokens).unwrap_or(i64::MAX));
        match f.accuracy() {
            Some(a) => {
                self.accuracy.get_or_create(labels).set(a);
            }
            None => {
                self.accuracy.remove(labels);
            }
        }
        let totals = [
            f.predictions,
            f.accurate,
            f.over,
            f.under,
            f.predicted_tokens,
            f.cached_tokens,
            f.completions,
            f.completion_tokens,
            f.e2e_latency_ms,
        ];
        for (family, total) in self.counters.iter().zip(totals) {
            let counter = family.get_or_create(labels);
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// A worker that left.
    pub fn remove(&self, labels: &WorkerLabels) {
        self.capacity.remove(labels);
        self.index_tokens.remove(labels);
        self.accuracy.remove(labels);
        for family in &self.counters {
            family.remove(labels);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_are_added_across_wraps_and_accuracy_is_a_share() {
        let mut t = FeedbackTotals::default();
        assert_eq!(t.accuracy(), None);
        let a = Feedback { predictions: u32::MAX - 1, accurate: u32::MAX - 1, ..Default::default() };
        let b = Feedback { predictions: 2, accurate: 1, over: 1, cached_tokens: 64, ..Default::default() };
        t.add(&a, &b);
        assert_eq!((t.predictions, t.accurate, t.over, t.cached_tokens), (4, 3, 1, 64));
        assert_eq!(t.accuracy(), Some(0.75));
        assert_eq!(t.json()["accuracy"], 0.75);
    }
}
