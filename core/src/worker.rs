//! The workers the policies choose from: plain data, replaced as a whole when the worker set
//! changes (from the plugin configuration today, from control-plane snapshots later).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use crate::pd_protocol::PdProtocol;

/// A worker's stable identity within one worker table lineage (index keys refer to it).
pub type WorkerId = u32;

/// A worker's identity for consistent hashing: its URL (without a trailing `/`), hashed.
pub fn affinity_of(url: &str) -> u64 {
    xxh3_64(url.trim_end_matches('/').as_bytes())
}

#[derive(Debug, Error, PartialEq)]
pub enum AddrError {
    #[error("worker URL `{0}` must start with http://")]
    Scheme(String),
    #[error("worker URL `{0}` must name an IP address (or localhost) and a port")]
    Host(String),
}

/// One model name a worker serves, as its `/v1/models` lists it (see [`crate::models`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServedModel {
    pub id: String,
    /// A LoRA adapter's base model (none for a base model).
    pub parent: Option<String>,
    /// The card's `owned_by` (`sglang`, `vllm`, ...), as the worker said.
    pub owned_by: String,
}

/// What a worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Regular,
    /// Runs the prefill of disaggregated requests and serves their KV on its bootstrap port.
    Prefill,
    /// Fetches the KV from the prefill worker and decodes.
    Decode,
    /// Either of the two (llm-d's `both`): the prefill worker of one request, the decode
    /// worker of another, never both for the same request (it then runs it alone).
    Both,
}

impl Role {
    /// Whether a worker of this role can be chosen for `role`: its own, or either PD role
    /// for [`Role::Both`].
    pub fn serves(self, role: Role) -> bool {
        self == role || (self == Role::Both && matches!(role, Role::Prefill | Role::Decode))
    }
}

/// One worker as the router sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Worker {
    pub id: WorkerId,
    /// As configured, e.g. `http://10.0.0.7:30000`.
    pub url: String,
    /// `ip:port` (`[v6]:port`), the value Envoy's ORIGINAL_DST cluster connects to.
    pub addr: String,
    /// The URL's host as written (`bootstrap_host` of a prefill worker).
    pub host: String,
    pub role: Role,
    /// A prefill worker's bootstrap port; `None` is sglang-router's `none` (JSON null).
    pub bootstrap_port: Option<u16>,
    pub healthy: bool,
    /// Load reported from outside this gateway (the control plane's load table).
    pub load: u64,
    /// Requests waiting in the worker's queue and the fraction of its KV cache in use, as the
    /// control plane polled them (None: unknown).
    pub waiting: Option<u64>,
    pub kv_usage: Option<f64>,
    /// Its identity for consistent hashing (a hash of the URL).
    pub affinity: u64,
    /// `marginal_utility`'s score from the control plane (none: no trend yet).
    pub utility: Option<f64>,
    /// The model names it serves (none known: empty; see [`crate::models`]).
    pub models: Vec<ServedModel>,
    /// The PD protocol it speaks when not the deployment's (a pod's `kvmesh.io/pd-protocol`).
    pub pd_protocol: Option<PdProtocol>,
    /// Hung: it answers none of the control plane's probes (not merely busy).
    pub unresponsive: bool,
    /// One data-parallel rank of the worker at `addr` (`--dp-aware`): a routing target of its
    /// own, sharing the address with the other ranks; the body it gets names the rank
    /// (`data_parallel_rank`). None: the worker is one target.
    pub dp_rank: Option<u32>,
}

impl Worker {
    pub fn from_url(id: WorkerId, url: &str) -> Result<Self, AddrError> {
        Ok(Self {
            id,
            url: url.to_string(),
            addr: socket_addr(url)?.to_string(),
            host: url_host(url).to_string(),
            role: Role::Regular,
            bootstrap_port: None,
            healthy: true,
            load: 0,
            waiting: None,
            kv_usage: None,
            affinity: affinity_of(url),
            utility: None,
            models: Vec::new(),
            pd_protocol: None,
            unresponsive: false,
            dp_rank: None,
        })
    }

    /// Rank `rank` of the worker at `url` (see [`Worker::dp_rank`]): its own affinity (the
    /// ranks of one worker are distinct targets for consistent hashing).
    pub fn with_dp_rank(mut self, rank: Option<u32>) -> Self {
        self.dp_rank = rank;
        if let Some(r) = rank {
            self.affinity = affinity_of(&format!("{}@{r}", self.url.trim_end_matches('/')));
        }
        self
    }

    /// Whether `addr` and `rank` name this routing target (an address alone is ambiguous
    /// between the ranks of one worker).
    pub fn is_at(&self, addr: &str, rank: Option<u32>) -> bool {
        self.addr == addr && self.dp_rank == rank
    }

    /// Whether the worker is past an overload threshold: more than `max_waiting` requests in
    /// its queue, or more than `max_kv_usage` of its KV cache in use (0 turns either off).
    pub fn overloaded(&self, max_waiting: u64, max_kv_usage: f64) -> bool {
        (max_waiting > 0 && self.waiting.is_some_and(|n| n > max_waiting))
            || (max_kv_usage > 0.0 && self.kv_usage.is_some_and(|u| u > max_kv_usage))
    }

    /// The PD protocol it speaks in a deployment whose protocol is `default`.
    pub fn protocol(&self, default: PdProtocol) -> PdProtocol {
        self.pd_protocol.unwrap_or(default)
    }
}

/// The host of an URL as written: no scheme, no port, no path (IPv6 keeps its brackets).
pub fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if authority.starts_with('[') {
        return authority.split_once(']').map_or(authority, |(h, _)| authority.get(..h.len() + 1).unwrap_or(authority));
    }
    authority.split(':').next().unwrap_or(authority)
}

/// Parses `http://host:port[/...]` into a socket address; `localhost` means 127.0.0.1.
pub fn socket_addr(url: &str) -> Result<SocketAddr, AddrError> {
    let rest = url.strip_prefix("http://").ok_or_else(|| AddrError::Scheme(url.to_string()))?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let bad = || AddrError::Host(url.to_string());
    let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = if host.eq_ignore_ascii_case("localhost") {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        host.parse().map_err(|_| bad())?
    };
    Ok(SocketAddr::new(ip, port))
}

/// The current worker set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerTable {
    pub version: u64,
    pub workers: Vec<Worker>,
}

impl WorkerTable {
    /// A static table (version 0) of healthy workers with ids 0.. in the order given.
    pub fn from_urls<S: AsRef<str>>(urls: &[S]) -> Result<Self, AddrError> {
        let workers = urls
            .iter()
            .enumerate()
            .map(|(i, u)| Worker::from_url(i as WorkerId, u.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { version: 0, workers })
    }

    /// A static table for PD mode: prefill workers (with bootstrap ports) then decode workers.
    pub fn pd<S: AsRef<str>>(prefill: &[(S, Option<u16>)], decode: &[S]) -> Result<Self, AddrError> {
        let mut workers = Vec::with_capacity(prefill.len() + decode.len());
        for (url, port) in prefill {
            let mut w = Worker::from_url(workers.len() as WorkerId, url.as_ref())?;
            w.role = Role::Prefill;
            w.bootstrap_port = *port;
            workers.push(w);
        }
        for url in decode {
            let mut w = Worker::from_url(workers.len() as WorkerId, url.as_ref())?;
            w.role = Role::Decode;
            workers.push(w);
        }
        Ok(Self { version: 0, workers })
    }

    pub fn healthy(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter().filter(|w| w.healthy)
    }

    /// Healthy workers that can serve `role` (a [`Role::Both`] worker serves either PD role).
    pub fn healthy_with(&self, role: Role) -> impl Iterator<Item = &Worker> {
        self.healthy().filter(move |w| w.role.serves(role))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter()
    }

    pub fn get(&self, id: WorkerId) -> Option<&Worker> {
        self.workers.iter().find(|w| w.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_from_urls() {
        assert_eq!(socket_addr("http://127.0.0.1:30001").unwrap().to_string(), "127.0.0.1:30001");
        assert_eq!(socket_addr("http://localhost:8000/").unwrap().to_string(), "127.0.0.1:8000");
        assert_eq!(socket_addr("http://[::1]:9000").unwrap().to_string(), "[::1]:9000");
        assert_eq!(socket_addr("https://1.2.3.4:5"), Err(AddrError::Scheme("https://1.2.3.4:5".into())));
        assert!(socket_addr("http://1.2.3.4").is_err());
        assert!(socket_addr("http://worker-0.svc:8000").is_err());
        assert!(socket_addr("http://1.2.3.4:99999").is_err());
    }

    #[test]
    fn hosts_as_written() {
        assert_eq!(url_host("http://localhost:30001"), "localhost");
        assert_eq!(url_host("http://10.1.2.3:30001/x"), "10.1.2.3");
        assert_eq!(url_host("http://[::1]:30001"), "[::1]");
        assert_eq!(url_host("prefill-0.svc"), "prefill-0.svc");
    }

    #[test]
    fn pd_table_has_roles_and_ports() {
        let t = WorkerTable::pd(
            &[("http://127.0.0.1:1", Some(8998)), ("http://127.0.0.1:2", None)],
            &["http://127.0.0.1:3"],
        )
        .unwrap();
        assert_eq!(t.healthy_with(Role::Prefill).count(), 2);
        assert_eq!(t.workers[1].bootstrap_port, None);
        assert_eq!(t.workers[2].role, Role::Decode);
        assert_eq!(t.workers[2].id, 2);
    }

    #[test]
    fn both_serves_either_pd_role_and_nothing_else() {
        let mut t = WorkerTable::pd(&[("http://127.0.0.1:1", None)], &["http://127.0.0.1:2"]).unwrap();
        let mut both = Worker::from_url(2, "http://127.0.0.1:3").unwrap();
        both.role = Role::Both;
        t.workers.push(both);
        let ids = |role| t.healthy_with(role).map(|w| w.id).collect::<Vec<_>>();
        assert_eq!(ids(Role::Prefill), [0, 2]);
        assert_eq!(ids(Role::Decode), [1, 2]);
        assert!(ids(Role::Regular).is_empty());
        assert!(!Role::Prefill.serves(Role::Decode) && !Role::Decode.serves(Role::Prefill));
    }

    #[test]
    fn table_assigns_ids_in_order() {
        let t = WorkerTable::from_urls(&["http://127.0.0.1:1", "http://127.0.0.1:2"]).unwrap();
        assert_eq!(t.workers[1].id, 1);
        assert_eq!(t.get(1).map(|w| w.addr.as_str()), Some("127.0.0.1:2"));
        assert_eq!(t.healthy().count(), 2);
    }
}
