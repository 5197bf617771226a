//! A request's tenant (issue 47): its id, from the configured header or the caller's SPIFFE id
//! (the header then removed), and the per-tenant limits, Envoy-wide: requests per second
//! (`crate::shared::tenants`) and tokens per minute (`crate::shared::tenant_tokens`), each
//! with the rest of the fleet's use as kvmesh-cp last shipped it.
//! Nothing here runs unless a tenant setting is configured.

use kvmesh_core::tenant::{reset_text, valid_tenant, xfcc_uri, TenantParams, XFCC_HEADER};

use crate::gateway::Reply;
use crate::headers::Headers;
use crate::host::{LabelledMetric, StreamHost};
use crate::shared::{tenant_requests, tenant_tokens, tenants};

/// The id requests that name no tenant are counted under.
pub const ANONYMOUS: &str = "anonymous";

/// OpenAI's `x-ratelimit-*` headers for a response, as the tenant's limits stood when its
/// request was admitted.
pub(super) type RateHeaders = Vec<(&'static str, String)>;

/// The tenant of a request with `headers` (`anonymous` when it names none), counted in its
/// series, and what its limits say: the response's `x-ratelimit-*` headers, or the 429.
pub(super) fn admit(
    host: &dyn StreamHost,
    params: &TenantParams,
    headers: &Headers,
) -> (String, Result<RateHeaders, Reply>) {
    let id = tenant_of(host, params, headers).unwrap_or_else(|| ANONYMOUS.to_string());
    host.increment_labelled(LabelledMetric::TenantRequests, &id);
    // The minute's tokens first (read only): a request it refuses is not counted in the second.
    let verdict = check_tokens(host, params, &id).and_then(|mut rate| {
        rate.extend(check_limit(host, params, Some(&id))?);
        Ok(rate)
    });
    if verdict.is_err() {
        host.increment_labelled(LabelledMetric::TenantLimited, &id);
    }
    (id, verdict)
}

/// The tenant of a request with `headers` (none: it names none, or not a usable id). With the
/// identity source, the client's tenant header is removed, so no worker or log reads it.
fn tenant_of(host: &dyn StreamHost, params: &TenantParams, headers: &Headers) -> Option<String> {
    if params.xfcc {
        let [forged, xfcc] = headers.lookup([params.header.as_str(), XFCC_HEADER]);
        if forged.is_some() {
            let _ = host.set_request_header(&params.header, None);
        }
        return xfcc.and_then(xfcc_uri).map(str::to_string);
    }
    headers.get(&params.header).map(str::trim).filter(|v| valid_tenant(v)).map(str::to_string)
}

/// Counts the request against its tenant's limit: its `x-ratelimit-*-requests` headers, or
/// past the limit a JSON 429 with them and `retry-after`.
fn check_limit(host: &dyn StreamHost, params: &TenantParams, tenant: Option<&str>) -> Result<RateHeaders, Reply> {
    let Some(limit) = params.requests_per_second else { return Ok(Vec::new()) };
    let id = tenant.unwrap_or(ANONYMOUS);
    let now_ms = crate::host::now_ms(host);
    // The rest of the fleet's requests this second, estimated from what kvmesh-cp shipped.
    let elsewhere = kvmesh_core::fleet::per_second(tenant_requests::rest(host).get(id, now_ms));
    let Some((verdict, _)) = tenants::hit(host, id, limit, elsewhere, params.max_tenants, now_ms) else {
        return Ok(Vec::new());
    };
    let headers = vec![
        ("x-ratelimit-limit-requests", limit.to_string()),
        ("x-ratelimit-remaining-requests", verdict.remaining.to_string()),
        ("x-ratelimit-reset-requests", reset_text(verdict.reset_ms)),
    ];
    if verdict.allowed {
        return Ok(headers);
    }
    let msg = format!("tenant {id} is over its limit of {limit} requests per second");
    let mut reply = Reply::error(429, "rate_limit_exceeded", &msg);
    reply.retry_after = Some(u32::try_from(verdict.reset_ms.div_ceil(1000)).unwrap_or(1).max(1));
    reply.headers = headers;
    Err(reply)
}

/// The tenant's tokens-per-minute limit: its `x-ratelimit-*-tokens` headers, or once its
/// minute reached the limit a JSON 429 with them and `retry-after`.
fn check_tokens(host: &dyn StreamHost, params: &TenantParams, id: &str) -> Result<RateHeaders, Reply> {
    let Some(limit) = params.tokens_per_minute else { return Ok(Vec::new()) };
    let verdict = tenant_tokens::verdict(host, id, limit, params.max_tenants, crate::host::now_ms(host));
    let headers = vec![
        ("x-ratelimit-limit-tokens", limit.to_string()),
        ("x-ratelimit-remaining-tokens", verdict.remaining.to_string()),
        ("x-ratelimit-reset-tokens", reset_text(verdict.reset_ms)),
    ];
    if verdict.allowed {
        return Ok(headers);
    }
    let msg = format!("tenant {id} is over its limit of {limit} tokens per minute");
    let mut reply = Reply::error(429, "rate_limit_exceeded", &msg);
    reply.retry_after = Some(u32::try_from(verdict.reset_ms.div_ceil(1000)).unwrap_or(60).max(1));
    reply.headers = headers;
    Err(reply)
}
