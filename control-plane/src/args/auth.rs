//! Authentication: the workers' key, the admin API keys, the filters' gRPC token, and what
//! may listen off loopback without them.

use std::path::PathBuf;

use super::{Args, BadArgs};
use crate::settings::{ApiKey, AuthSettings};

/// Keys and tokens.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct AuthFlags {
    /// The key kvmesh-cp sends the workers (`Authorization: Bearer KEY`); default KVMESH_WORKER_API_KEY.
    #[arg(long, help_heading = "Logging and authentication")]
    pub api_key: Option<String>,
    /// Admin API keys: `id:name:role:key` (as SMG) or a bare key; clients send
    /// `Authorization: Bearer KEY`. Role `admin` (and a bare key) may add, remove and administer workers,
    /// other roles may only read. Default: KVMESH_CP_API_KEYS (space or comma separated); none
    /// leaves the admin API open (refused off loopback, see --allow-insecure).
    #[arg(long, num_args = 0.., help_heading = "Logging and authentication")]
    pub control_plane_api_keys: Vec<String>,
    /// File holding the bearer token the filters must present on the gRPC streams (their
    /// `control_plane_token`) (kvmesh). Default: KVMESH_CP_TOKEN; none leaves the streams open
    /// (refused off loopback, see --allow-insecure).
    #[arg(long, help_heading = "Logging and authentication")]
    pub grpc_token_file: Option<PathBuf>,
    /// Read-only admin endpoints (/list_workers, /workers, /snapshot, /metrics) need an API key
    /// too; /health stays open (kvmesh). Default: open (POST /match, which tells which worker
    /// holds a text, needs a key whenever keys are configured).
    #[arg(long, help_heading = "Logging and authentication")]
    pub protect_read_endpoints: bool,
    /// Listen on a non-loopback --host without a gRPC token and API keys: anyone who reaches
    /// kvmesh-cp can then change where prompts go. Logged as a warning at startup (kvmesh).
    #[arg(long, help_heading = "Logging and authentication")]
    pub allow_insecure: bool,
}

impl Args {
    /// The authentication settings; refuses a non-loopback `host` without them unless
    /// `--allow-insecure`.
    pub(super) fn auth_settings(
        &self,
        host: &str,
        http_host: &str,
        warnings: &mut Vec<String>,
    ) -> Result<AuthSettings, BadArgs> {
        let grpc_token = match &self.auth.grpc_token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| self.bad("grpc_token_file", format!("{}: {e}", path.display())))?;
                Some(checked_secret(text.trim()).map_err(|e| self.bad("grpc_token_file", e))?)
            }
            None => match std::env::var("KVMESH_CP_TOKEN") {
                Ok(t) if !t.trim().is_empty() => {
                    Some(checked_secret(t.trim()).map_err(|e| BadArgs(format!("KVMESH_CP_TOKEN: {e}")))?)
                }
                _ => None,
            },
        };
        let (entries, from_env): (Vec<String>, bool) = if self.auth.control_plane_api_keys.is_empty() {
            let env = std::env::var("KVMESH_CP_API_KEYS").unwrap_or_default();
            (
                env.split(|c: char| c == ',' || c.is_whitespace())
                    .filter(|k| !k.is_empty())
                    .map(String::from)
                    .collect(),
                true,
            )
        } else {
            (self.auth.control_plane_api_keys.clone(), false)
        };
        let api_keys = entries
            .iter()
            .enumerate()
            .map(|(n, e)| {
                api_key(n, e).map_err(|why| {
                    if from_env {
                        BadArgs(format!("KVMESH_CP_API_KEYS: {why}"))
                    } else {
                        self.bad("control_plane_api_keys", why)
                    }
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let loopback = |h: &str| {
            h.eq_ignore_ascii_case("localhost") || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
        };
        let http_flag = if self.listen.http_host.is_some() { "http_host" } else { "host" };
        // What would be open off loopback: (flag, address, what).
        let open: Vec<(&str, &str, &str)> = [
            (grpc_token.is_none() && !loopback(host)).then_some((
                "host",
                host,
                "the gRPC streams (--grpc-token-file or KVMESH_CP_TOKEN)",
            )),
            (api_keys.is_empty() && !loopback(http_host)).then_some((
                http_flag,
                http_host,
                "the admin API (--control-plane-api-keys or KVMESH_CP_API_KEYS)",
            )),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let Some(&(flag, address, _)) = open.first() {
            let what = open.iter().map(|o| o.2).collect::<Vec<_>>().join(" and ");
            if !self.auth.allow_insecure {
                return Err(self.bad(
                    flag,
                    format!(
                        "{address} is not a loopback address and {what} would be open to anyone who reaches \
                         it: give a token and API keys, or --allow-insecure"
                    ),
                ));
            }
            warnings.push(format!(
                "INSECURE (--allow-insecure): listening on {address} with {what} unauthenticated; anyone \
                 who reaches kvmesh-cp can read the topology and change where every tenant's prompts go"
            ));
        }
        if self.auth.protect_read_endpoints && api_keys.is_empty() {
            return Err(self.bad("protect_read_endpoints", "needs --control-plane-api-keys"));
        }
        Ok(AuthSettings {
            grpc_token,
            api_keys,
            protect_reads: self.auth.protect_read_endpoints,
            insecure: !open.is_empty(),
            keyless_cache_reads: loopback(http_host) || self.auth.allow_insecure,
        })
    }
}

/// A token or key as it goes into an `authorization` header: visible ASCII, no spaces.
pub(super) fn checked_secret(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("empty".into());
    }
    if text.len() > 4096 || !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be at most 4096 visible ASCII characters, without spaces".into());
    }
    Ok(text.to_string())
}

/// One API key entry: `id:name:role:key` or a bare key (an admin key).
fn api_key(n: usize, entry: &str) -> Result<ApiKey, String> {
    let parts: Vec<&str> = entry.splitn(4, ':').collect();
    let (id, admin, key) = match parts.as_slice() {
        [key] => (format!("key{n}"), true, *key),
        [id, _name, role, key] => (id.to_string(), role.eq_ignore_ascii_case("admin"), *key),
        _ => return Err(format!("`{}` is not id:name:role:key or a bare key", entry.split(':').next().unwrap_or(""))),
    };
    let key = checked_secret(key).map_err(|e| format!("the key of entry {} is {e}", n + 1))?;
    Ok(ApiKey { id, admin, key })
}
