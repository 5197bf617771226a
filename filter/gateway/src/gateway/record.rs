//! The decision record: one short line per routed LLM request saying what the filter decided,
//! written once (one host call) as the decision commits, into Envoy's per-request filter state,
//! where access logs (`%FILTER_STATE(wasm.kvmesh.decision:PLAIN)%`) and tracing read it.
//!
//! The format is `key=value` pairs joined by `;`, always in this order, a pair left out when it
//! does not apply:
//!
//! | key | value |
//! | --- | --- |
//! | `policy` | the policy that chose `worker` (in PD mode the decode policy) |
//! | `worker` | `ip:port` of the worker the request was sent to (the decode worker in PD mode) |
//! | `cached_bytes` | bytes of the routing text the prefix index believed that worker held (0 for text-blind policies) |
//! | `decider` | PD mode: `split` (a prefill leg ran) or `decode_only` (the decider kept it on the decode worker) |
//! | `prefill` | PD split: `ip:port` of the prefill worker |
//! | `prefill_policy` | PD split: the prefill policy |
//! | `prefill_cached_bytes` | PD split: as `cached_bytes`, for the prefill worker |
//! | `rid` | SGLang PD split: the `rid` the gateway gave the request (a batch's first item; the others end in their own index) |
//! | `model` | the model pool the request was routed in, when workers name their models |
//! | `class` | its priority class (`sheddable`, `default`, `interactive`, `system`), under a concurrency limit |
//! | `tenant` | its tenant id (`anonymous` when it names none), where tenants are configured |
//!
//! e.g. `policy=cache_aware;worker=10.0.0.7:8000;cached_bytes=1536;model=llama-3-8b`. When
//! Envoy fails the request over to another worker, a second key, [`FAILOVER_KEY`], names the
//! worker that answered (the record keeps the filter's choice).

use std::fmt::Write;

use kvmesh_core::pd::PdDecision;
use kvmesh_core::policy::PolicyKind;
use kvmesh_core::{Config, Decision};

use super::plan::Chosen;

/// The filter-state name of the decision record (Envoy's key: `wasm.kvmesh.decision`).
pub const DECISION_KEY: &str = "kvmesh.decision";
/// The filter-state name of the worker Envoy failed the request over to, set only then (Envoy's
/// key: `wasm.kvmesh.failover`).
pub const FAILOVER_KEY: &str = "kvmesh.failover";

/// Bytes of the routing text the index believed `d`'s worker held (what engine feedback judges
/// its answer against, see `RoutingView::prediction`).
fn cached_bytes(d: &Decision, block_size: usize) -> usize {
    d.held_blocks.saturating_mul(block_size).max(d.matched_bytes)
}

/// `value` as a record value: visible ASCII other than the record's own separators and quotes
/// (access-log lines stay one field), anything else as `_`.
fn push_clean(out: &mut String, value: &str) {
    out.extend(value.chars().map(|c| match c {
        ';' | '=' | '"' | '\\' => '_',
        c if c.is_ascii_graphic() => c,
        _ => '_',
    }));
}

/// Adds the `class` and `tenant` pairs (those given) to a record (issue 47).
pub fn push_who(out: &mut String, class: Option<&str>, tenant: Option<&str>) {
    if let Some(class) = class {
        out.push_str(";class=");
        push_clean(out, class);
    }
    if let Some(tenant) = tenant {
        out.push_str(";tenant=");
        push_clean(out, tenant);
    }
}

/// The record of a decision under `config`: `chosen`, sent to `worker` (and `prefill`'s
/// address on a split, with the `rid` it can be aborted by), in the pool of `model`.
pub(super) fn decision_record(
    config: &Config,
    chosen: &Chosen,
    worker: &str,
    prefill: Option<&str>,
    rid: Option<&str>,
    model: Option<&str>,
) -> String {
    let (main_policy, prefill_policy) = match &config.pd {
        Some(pd) => (pd.decode_policy, pd.prefill_policy),
        None => (config.policy, config.policy),
    };
    let (main, split, decider) = match chosen {
        Chosen::Regular(d) => (d, None, None),
        Chosen::Pd(PdDecision::DecodeOnly(d)) => (d, None, Some("decode_only")),
        Chosen::Pd(PdDecision::Split { prefill, decode }) => (decode, Some(prefill), Some("split")),
    };
    let mut out = String::with_capacity(96 + worker.len() + prefill.map_or(0, str::len) + model.map_or(0, str::len));
    let _ = write!(out, "policy={};worker=", PolicyKind::name(main_policy));
    push_clean(&mut out, worker);
    let _ = write!(out, ";cached_bytes={}", cached_bytes(main, config.block_size));
    if let Some(decider) = decider {
        let _ = write!(out, ";decider={decider}");
    }
    if let (Some(p), Some(addr)) = (split, prefill) {
        out.push_str(";prefill=");
        push_clean(&mut out, addr);
        let _ = write!(
            out,
            ";prefill_policy={};prefill_cached_bytes={}",
            prefill_policy.name(),
            cached_bytes(p, config.block_size)
        );
    }
    if let Some(rid) = rid {
        out.push_str(";rid=");
        push_clean(&mut out, rid);
    }
    if let Some(model) = model {
        out.push_str(";model=");
        push_clean(&mut out, model);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::config::{Decider, PdConfig};
    use kvmesh_core::WorkerId;

    fn decision(worker: u32, matched: usize, held: usize) -> Decision {
        Decision { worker: worker as WorkerId, matched_bytes: matched, held_blocks: held, blocks: vec![1, 2, 3] }
    }

    fn config(pd: bool) -> Config {
        let mut c = Config { block_size: 64, ..Config::default() };
        if pd {
            c.pd = Some(PdConfig {
                prefill_policy: PolicyKind::CacheAware,
                decode_policy: PolicyKind::PowerOfTwo,
                decider: Decider::Always,
                protocol: kvmesh_core::settings::PdProtocol::Sglang,
                prefill_fallback: true,
            });
        }
        c
    }

    #[test]
    fn a_regular_decision_names_policy_worker_cached_bytes_and_model() {
        let c = Config { policy: PolicyKind::CacheAware, ..config(false) };
        let chosen = Chosen::Regular(decision(1, 100, 3));
        let r = decision_record(&c, &chosen, "10.0.0.1:30001", None, None, Some("llama"));
        // Three blocks of 64 bytes held beat the 100 bytes matched.
        assert_eq!(r, "policy=cache_aware;worker=10.0.0.1:30001;cached_bytes=192;model=llama");
        assert_eq!(
            decision_record(&c, &chosen, "10.0.0.1:30001", None, None, None),
            "policy=cache_aware;worker=10.0.0.1:30001;cached_bytes=192"
        );
    }

    #[test]
    fn a_pd_decision_names_both_legs_and_the_deciders_outcome() {
        let c = config(true);
        let split = Chosen::Pd(PdDecision::Split { prefill: decision(2, 640, 0), decode: decision(1, 0, 0) });
        assert_eq!(
            decision_record(
                &c,
                &split,
                "10.0.0.1:8000",
                Some("10.0.0.2:8000"),
                Some("kvmesh-0000000000000abc-0000"),
                None
            ),
            "policy=power_of_two;worker=10.0.0.1:8000;cached_bytes=0;decider=split;prefill=10.0.0.2:8000;\
             prefill_policy=cache_aware;prefill_cached_bytes=640;rid=kvmesh-0000000000000abc-0000"
        );
        let alone = Chosen::Pd(PdDecision::DecodeOnly(decision(1, 64, 1)));
        assert_eq!(
            decision_record(&c, &alone, "10.0.0.1:8000", None, None, Some("m")),
            "policy=power_of_two;worker=10.0.0.1:8000;cached_bytes=64;decider=decode_only;model=m"
        );
    }

    #[test]
    fn values_cannot_break_the_record_or_the_log_line() {
        let c = config(false);
        let chosen = Chosen::Regular(decision(1, 0, 0));
        let r = decision_record(&c, &chosen, "a;b", None, None, Some("x=y \"z\"\n;é"));
        assert_eq!(r, "policy=cache_aware;worker=a_b;cached_bytes=0;model=x_y__z____");
    }
}
