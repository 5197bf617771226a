//! Who may talk to kvmesh-cp: a bearer token on the gRPC streams (checked by a tonic
//! interceptor before `Watch` or `Report` run) and API keys on the admin API (an axum
//! middleware: mutating endpoints need an `admin` key; `/match`, which reveals what the
//! caches hold, any key; the other read-only ones any key when `--protect-read-endpoints` is
//! set; `/health` is always open).

use std::sync::Arc;

use axum::extract::{Request, State as Axum};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::settings::AuthSettings;
use crate::state::State;

/// Compares two secrets in time independent of where they differ.
pub fn secret_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The credential of an `authorization: Bearer <credential>` value.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, credential) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| credential.trim())
}

/// The gRPC interceptor: with a token configured, a stream without `authorization: Bearer
/// <token>` in its initial metadata is refused with UNAUTHENTICATED.
#[derive(Clone)]
pub struct GrpcAuth {
    pub state: Arc<State>,
}

impl tonic::service::Interceptor for GrpcAuth {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(token) = &self.state.settings.auth.grpc_token else { return Ok(request) };
        let presented = request.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(bearer);
        match presented {
            Some(p) if secret_eq(p.as_bytes(), token.as_bytes()) => Ok(request),
            _ => {
                self.state.counters.auth_failures.inc();
                tracing::warn!(peer = ?request.remote_addr(), "gRPC stream refused: missing or wrong bearer token");
                Err(tonic::Status::unauthenticated(
                    "kvmesh-cp needs `authorization: Bearer <token>` (control_plane_token)",
                ))
            }
        }
    }
}

/// What an admin endpoint needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Adds or removes workers.
    Admin,
    /// Reads (open unless `--protect-read-endpoints`).
    Read,
    /// Reads that reveal prompts or what the caches hold (`/match`): any key when keys are
    /// configured; without keys only on a loopback admin address or under `--allow-insecure`.
    CacheContents,
}

/// Whether `authorization` grants `access` under `auth`: `Ok`, or the status to answer.
pub fn check(auth: &AuthSettings, access: Access, authorization: Option<&str>) -> Result<(), StatusCode> {
    if auth.api_keys.is_empty() {
        if access == Access::CacheContents && !auth.keyless_cache_reads {
            return Err(StatusCode::FORBIDDEN);
        }
        return Ok(());
    }
    if access == Access::Read && !auth.protect_reads {
        return Ok(());
    }
    let presented = authorization.and_then(bearer).ok_or(StatusCode::UNAUTHORIZED)?;
    let key = auth
        .api_keys
        .iter()
        .find(|k| secret_eq(k.key.as_bytes(), presented.as_bytes()))
        .ok_or(StatusCode::UNAUTHORIZED)?;
    if access == Access::Admin && !key.admin {
        return Err(StatusCode::FORBIDDEN);
    }
    Ok(())
}

async fn guard(state: Arc<State>, access: Access, request: Request, next: Next) -> Response {
    let authorization = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match check(&state.settings.auth, access, authorization) {
        Ok(()) => next.run(request).await,
        Err(status) => {
            state.counters.auth_failures.inc();
            tracing::warn!(path = %request.uri().path(), %status, "admin request refused");
            let why = if status == StatusCode::FORBIDDEN && access == Access::CacheContents {
                "this endpoint reveals what the caches hold: configure API keys (--control-plane-api-keys)"
            } else if status == StatusCode::FORBIDDEN {
                "this API key may only read; adding and removing workers needs a key with role admin"
            } else {
                "missing or unknown API key: send `Authorization: Bearer <key>` (--control-plane-api-keys)"
            };
            (status, [(header::WWW_AUTHENTICATE, "Bearer")], why).into_response()
        }
    }
}

/// Middleware for endpoints that change workers.
pub async fn admin(Axum(state): Axum<Arc<State>>, request: Request, next: Next) -> Response {
    guard(state, Access::Admin, request, next).await
}

/// Middleware for read-only endpoints.
pub async fn read(Axum(state): Axum<Arc<State>>, request: Request, next: Next) -> Response {
    guard(state, Access::Read, request, next).await
}

/// Middleware for endpoints that reveal prompts or cache contents.
pub async fn cache_contents(Axum(state): Axum<Arc<State>>, request: Request, next: Next) -> Response {
    guard(state, Access::CacheContents, request, next).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::ApiKey;

    fn keys(protect_reads: bool) -> AuthSettings {
        AuthSettings {
            grpc_token: None,
            api_keys: vec![
                ApiKey { id: "ops".into(), admin: true, key: "admin-secret".into() },
                ApiKey { id: "dash".into(), admin: false, key: "reader-secret".into() },
            ],
            protect_reads,
            insecure: false,
            keyless_cache_reads: false,
        }
    }

    #[test]
    fn mutating_endpoints_need_an_admin_key() {
        let a = keys(false);
        assert_eq!(check(&a, Access::Admin, None), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(check(&a, Access::Admin, Some("Bearer wrong")), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(check(&a, Access::Admin, Some("admin-secret")), Err(StatusCode::UNAUTHORIZED), "no scheme");
        assert_eq!(check(&a, Access::Admin, Some("Basic admin-secret")), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(check(&a, Access::Admin, Some("Bearer reader-secret")), Err(StatusCode::FORBIDDEN));
        assert_eq!(check(&a, Access::Admin, Some("Bearer admin-secret")), Ok(()));
        assert_eq!(check(&a, Access::Admin, Some("bearer admin-secret")), Ok(()));
    }

    #[test]
    fn reads_are_open_unless_protected() {
        assert_eq!(check(&keys(false), Access::Read, None), Ok(()));
        let p = keys(true);
        assert_eq!(check(&p, Access::Read, None), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(check(&p, Access::Read, Some("Bearer reader-secret")), Ok(()));
        assert_eq!(check(&p, Access::Read, Some("Bearer admin-secret")), Ok(()));
    }

    #[test]
    fn cache_contents_need_a_key_of_any_role_whenever_there_are_keys() {
        for a in [keys(false), keys(true)] {
            assert_eq!(check(&a, Access::CacheContents, None), Err(StatusCode::UNAUTHORIZED));
            assert_eq!(check(&a, Access::CacheContents, Some("Bearer wrong")), Err(StatusCode::UNAUTHORIZED));
            assert_eq!(check(&a, Access::CacheContents, Some("Bearer reader-secret")), Ok(()));
            assert_eq!(check(&a, Access::CacheContents, Some("Bearer admin-secret")), Ok(()));
        }
    }

    #[test]
    fn without_keys_everything_is_open_on_loopback() {
        let open = AuthSettings { keyless_cache_reads: true, ..Default::default() };
        assert_eq!(check(&open, Access::Admin, None), Ok(()));
        assert_eq!(check(&open, Access::Read, None), Ok(()));
        assert_eq!(check(&open, Access::CacheContents, None), Ok(()));
        let off_loopback = AuthSettings::default();
        assert_eq!(check(&off_loopback, Access::CacheContents, None), Err(StatusCode::FORBIDDEN));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(secret_eq(b"abc", b"abc"));
        assert!(!secret_eq(b"abc", b"abd"));
        assert!(!secret_eq(b"abc", b"abcd"));
        assert!(!secret_eq(b"", b"a"));
        assert_eq!(bearer("Bearer  tok "), Some("tok"));
        assert_eq!(bearer("Bearertok"), None);
    }
}
