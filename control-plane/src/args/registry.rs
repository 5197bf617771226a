//! What every worker passes and keeps, whatever its source: the URL policy, the state file,
//! KV capacities.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::workers::Workers;
use super::{Args, BadArgs};
use crate::settings::WorkerPolicy;
use crate::urls::Cidr;

/// The URL policy, the state file, KV capacities.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct RegistryFlags {
    /// Networks workers must be in (CIDR ...; e.g. 10.0.0.0/8), whatever their source: flags,
    /// /add_worker or discovery (kvmesh). Default: any address but unspecified, link-local
    /// (cloud metadata) and multicast ones, which are always refused.
    #[arg(long, num_args = 1.., help_heading = "Workers: health, load, discovery")]
    pub worker_cidrs: Vec<String>,
    /// JSON file keeping the workers added through the API and every worker's id across
    /// restarts (written on each change) (kvmesh). Default: none, API workers are forgotten.
    #[arg(long, help_heading = "Workers: health, load, discovery")]
    pub state_file: Option<PathBuf>,
    /// A worker's KV capacity in tokens, `URL=TOKENS`, for engines that do not report
    /// `max_total_num_tokens` in `/get_server_info` (or to override it); repeatable. The
    /// worker's part of the prefix index is kept within it (kvmesh).
    #[arg(long, value_name = "URL=TOKENS", help_heading = "Workers: health, load, discovery")]
    pub worker_kv_capacity: Vec<String>,
}

impl Args {
    /// `--worker-cidrs`, which every worker given on the command line must already pass; and
    /// those workers under their canonical URLs (regular, prefill, decode), each once (a
    /// warning names a second spelling of one).
    pub(super) fn worker_policy(
        &self,
        prefill: Vec<(String, Option<u16>)>,
        warnings: &mut Vec<String>,
    ) -> Result<(WorkerPolicy, Workers), BadArgs> {
        let worker_policy = WorkerPolicy {
            cidrs: self
                .registry
                .worker_cidrs
                .iter()
                .map(|c| Cidr::parse(c).map_err(|e| self.bad("worker_cidrs", e)))
                .collect::<Result<_, _>>()?,
        };
        let mut seen = BTreeMap::new();
        let mut canonical = |flag: &str, url: &String| -> Result<Option<String>, BadArgs> {
            let c = crate::urls::check(url, &worker_policy).map_err(|e| self.bad(flag, e))?;
            match seen.get(&c) {
                Some(first) => {
                    warnings.push(format!(
                        "--{}: {url} is {c} again (given as {first}): registered once",
                        flag.replace('_', "-")
                    ));
                    Ok(None)
                }
                None => {
                    seen.insert(c.clone(), url.clone());
                    Ok(Some(c))
                }
            }
        };
        let mut workers = Workers::default();
        for url in &self.workers.worker_urls {
            workers.regular.extend(canonical("worker_urls", url)?);
        }
        let mut decode = Vec::new();
        for url in &self.workers.decode {
            decode.extend(canonical("decode", url)?);
        }
        for (url, port) in prefill {
            workers.prefill.extend(canonical("prefill", &url)?.map(|c| (c, port)));
        }
        workers.decode = decode;
        Ok((worker_policy, workers))
    }

    /// `--worker-kv-capacity`: tokens by worker URL.
    pub(super) fn kv_capacity(&self) -> Result<BTreeMap<String, u64>, BadArgs> {
        let mut kv_capacity = BTreeMap::new();
        for entry in &self.registry.worker_kv_capacity {
            let (url, tokens) = kv_capacity_entry(entry).map_err(|e| self.bad("worker_kv_capacity", e))?;
            kv_capacity.insert(url, tokens);
        }
        Ok(kv_capacity)
    }
}

/// One `--worker-kv-capacity` entry: `URL=TOKENS`.
pub(super) fn kv_capacity_entry(entry: &str) -> Result<(String, u64), String> {
    let (url, tokens) = entry.rsplit_once('=').ok_or_else(|| format!("`{entry}` is not URL=TOKENS"))?;
    let tokens: u64 = tokens.trim().parse().map_err(|_| format!("`{tokens}` is not a number of tokens"))?;
    if tokens == 0 {
        return Err(format!("`{entry}`: the capacity must be at least 1 token"));
    }
    Ok((crate::urls::canonical(url.trim())?, tokens))
}
