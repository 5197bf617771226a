//! `--leader-elect`: two (or more) kvmesh-cp replicas, one of them the leader, elected on a
//! `coordination.k8s.io/v1` Lease with client-go's algorithm (read the Lease; create it when
//! there is none; take it over when its holder has not renewed it for its lease duration, as
//! seen on this replica's clock since the record last changed; renew it while holding it;
//! every write a replace carrying the `resourceVersion` read, so that of two replicas writing
//! at once the API server refuses one with 409 Conflict).
//!
//! The leader serves the filters' gRPC streams (`Watch`, `Report`, EDS); a standby refuses
//! them with UNAVAILABLE and answers 503 on `/ready`, so that a Service sends the gateways to
//! the leader only. A leader that cannot renew within the renew deadline steps down (ends
//! its streams with UNAVAILABLE and refuses new ones) before another replica may take the
//! lease over. Both replicas run discovery, health checks and load polling all the time, so
//! that a standby holds the workers when it takes over; the filters reconnect and send their
//! full index (see docs/operations.md, "Two control-plane replicas").

use std::pin::Pin;
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

mod elector;

pub use elector::{Attempt, Elector};

/// What a standby (or a replica shutting down) answers the filters' streams with.
pub const STANDBY: &str =
    "kvmesh-cp is not serving the gateways (a standby, or stopping): they reconnect to the leader";

/// The leader-election flags (kvmesh; client-go's defaults).
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct LeaderElectArgs {
    /// Elect a leader among the kvmesh-cp replicas on a Kubernetes Lease (namespace:
    /// --service-discovery-namespace, else the pod's): only the leader serves the gateways; a
    /// standby refuses their streams and answers 503 on /ready (kvmesh). Default off.
    #[arg(long, help_heading = "Leader election")]
    pub leader_elect: bool,
    /// Name of the Lease (kvmesh). Default kvmesh-cp.
    #[arg(long, help_heading = "Leader election")]
    pub leader_elect_lease_name: Option<String>,
    /// This replica's name in the Lease (kvmesh). Default: $HOSTNAME (the pod's name) and a
    /// random suffix.
    #[arg(long, help_heading = "Leader election")]
    pub leader_elect_identity: Option<String>,
    /// Seconds a standby waits after the leader's last renewal before taking the Lease over
    /// (kvmesh). Default 15.
    #[arg(long, help_heading = "Leader election")]
    pub leader_elect_lease_duration_secs: Option<f64>,
    /// Seconds the leader keeps serving without a successful renewal before it steps down;
    /// less than the lease duration (kvmesh). Default 10.
    #[arg(long, help_heading = "Leader election")]
    pub leader_elect_renew_deadline_secs: Option<f64>,
    /// Seconds between two tries to take or renew the Lease; less than the renew deadline
    /// (kvmesh). Default 2.
    #[arg(long, help_heading = "Leader election")]
    pub leader_elect_retry_period_secs: Option<f64>,
}

/// The election kvmesh-cp takes part in.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub lease_name: String,
    /// None: the client's default namespace (in a pod, its own).
    pub namespace: Option<String>,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

fn seconds(flag: &str, v: Option<f64>, default: f64) -> Result<Duration, String> {
    let v = v.unwrap_or(default);
    if !(v.is_finite() && v > 0.0 && v < 86_400.0) {
        return Err(format!("--{flag}: {v} is not a positive number of seconds under a day"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// A name unique to this process: `$HOSTNAME` (a pod's name) and a random suffix, as
/// Kubernetes' own controllers do (two processes on one host never share it).
fn default_identity() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "kvmesh-cp".into());
    format!("{host}_{:016x}", h.finish())
}

impl LeaderElectArgs {
    /// The election the flags ask for (None: off); `namespace` is discovery's.
    pub fn config(&self, namespace: Option<&str>) -> Result<Option<Config>, String> {
        let given = self.leader_elect_lease_name.is_some()
            || self.leader_elect_identity.is_some()
            || self.leader_elect_lease_duration_secs.is_some()
            || self.leader_elect_renew_deadline_secs.is_some()
            || self.leader_elect_retry_period_secs.is_some();
        if !self.leader_elect {
            return if given { Err("the --leader-elect-* flags need --leader-elect".into()) } else { Ok(None) };
        }
        let lease_duration = seconds("leader-elect-lease-duration-secs", self.leader_elect_lease_duration_secs, 15.0)?;
        let renew_deadline = seconds("leader-elect-renew-deadline-secs", self.leader_elect_renew_deadline_secs, 10.0)?;
        let retry_period = seconds("leader-elect-retry-period-secs", self.leader_elect_retry_period_secs, 2.0)?;
        if renew_deadline >= lease_duration {
            return Err("--leader-elect-renew-deadline-secs must be less than --leader-elect-lease-duration-secs \
                        (the leader steps down before a standby may take over)"
                .into());
        }
        if retry_period >= renew_deadline {
            return Err("--leader-elect-retry-period-secs must be less than --leader-elect-renew-deadline-secs".into());
        }
        let name = self.leader_elect_lease_name.clone().unwrap_or_else(|| "kvmesh-cp".into());
        if name.is_empty() || name.contains('/') {
            return Err(format!("--leader-elect-lease-name: `{name}` is not a Lease name"));
        }
        Ok(Some(Config {
            lease_name: name,
            namespace: namespace.map(str::to_string),
            identity: self.leader_elect_identity.clone().filter(|i| !i.is_empty()).unwrap_or_else(default_identity),
            lease_duration,
            renew_deadline,
            retry_period,
        }))
    }
}

/// Whether this replica leads now: always, without `--leader-elect`.
#[derive(Clone, Debug)]
pub struct Leadership(watch::Receiver<bool>);

impl Leadership {
    /// The leadership of a replica that takes part in no election and never stops.
    #[cfg(test)]
    pub fn always() -> Self {
        Self(watch::channel(true).1)
    }

    /// A leadership set through the returned sender (false until it says otherwise).
    pub fn elected() -> (watch::Sender<bool>, Self) {
        let (tx, rx) = watch::channel(false);
        (tx, Self(rx))
    }

    pub fn is_leader(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once this replica does not lead (at once on a standby).
    pub async fn lost(&self) {
        let mut rx = self.0.clone();
        if rx.wait_for(|leads| !leads).await.is_err() && *rx.borrow() {
            // Nothing will change it any more: a leader for good.
            std::future::pending::<()>().await;
        }
    }

    /// The refusal of a gRPC call on a standby.
    pub fn check(&self) -> Result<(), tonic::Status> {
        if self.is_leader() {
            Ok(())
        } else {
            Err(tonic::Status::unavailable(STANDBY))
        }
    }

    /// `stream`, ended with UNAVAILABLE when this replica stops leading.
    pub fn guard<T: Send + 'static>(
        &self,
        mut stream: Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>,
    ) -> Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>> {
        let leadership = self.clone();
        Box::pin(async_stream::stream! {
            let lost = leadership.lost();
            tokio::pin!(lost);
            loop {
                tokio::select! {
                    item = stream.next() => match item {
                        Some(item) => yield item,
                        None => break,
                    },
                    () = &mut lost => {
                        yield Err(tonic::Status::unavailable(STANDBY));
                        break;
                    }
                }
            }
        })
    }
}

/// `/ready`: 200 on the leader, 503 on a standby (the readiness probe: a Service then sends
/// the gateways to the leader only). `/health` stays 200 on both (liveness).
pub fn ready_router(leadership: Leadership) -> axum::Router {
    use axum::http::StatusCode;
    axum::Router::new().route(
        "/ready",
        axum::routing::get(move || {
            let leads = leadership.is_leader();
            async move {
                if leads {
                    (StatusCode::OK, "leader")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "standby")
                }
            }
        }),
    )
}

/// What went wrong talking to the API server.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error("Lease API: {0}")]
    Api(#[from] kube::Error),
    #[error("the Lease changed under this write (409 Conflict)")]
    Conflict,
}

/// One try to take or renew the Lease: Ok(None) when this replica holds it now, Ok(Some(the
/// holder)) when another does.
async fn try_acquire_or_renew(
    api: &Api<Lease>,
    cfg: &Config,
    elector: &mut Elector,
) -> Result<Option<String>, ElectionError> {
    let current = api.get_opt(&cfg.lease_name).await?;
    let now = Instant::now();
    let wall = MicroTime(Timestamp::now());
    let spec = current.as_ref().map(|l| l.spec.clone().unwrap_or_default());
    let written = match elector.attempt(spec.as_ref(), now, wall) {
        Attempt::Held { holder } => return Ok(Some(holder)),
        Attempt::Create(spec) => {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(cfg.lease_name.clone()), ..Default::default() },
                spec: Some(spec),
            };
            api.create(&PostParams::default(), &lease).await
        }
        Attempt::Replace(spec) => {
            let mut lease = current.unwrap_or_default();
            lease.spec = Some(spec);
            api.replace(&cfg.lease_name, &PostParams::default(), &lease).await
        }
    };
    match written {
        Ok(lease) => {
            elector.wrote(lease.spec.unwrap_or_default(), now);
            Ok(None)
        }
        Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => Err(ElectionError::Conflict),
        Err(e) => Err(e.into()),
    }
}

/// Gives the Lease up if this replica holds it (see [`Elector::release`]): Ok(true) when it did.
async fn release(api: &Api<Lease>, cfg: &Config, elector: &Elector) -> Result<bool, ElectionError> {
    let Some(mut lease) = api.get_opt(&cfg.lease_name).await? else { return Ok(false) };
    let current = lease.spec.clone().unwrap_or_default();
    let Some(released) = elector.release(&current, MicroTime(Timestamp::now())) else { return Ok(false) };
    lease.spec = Some(released);
    match api.replace(&cfg.lease_name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_conflict() => Err(ElectionError::Conflict),
        Err(e) => Err(e.into()),
    }
}

/// Takes part in the election until `stop`: publishes on `leading` whether this replica
/// leads. On `stop` it steps down (the streams end, `/ready` answers 503) and then releases
/// the Lease, so that a standby takes over on its next round instead of after the lease
/// duration (client-go's `ReleaseOnCancel`).
pub async fn run(cfg: Config, leading: watch::Sender<bool>, stop: CancellationToken) -> anyhow::Result<()> {
    let client = Client::try_default().await.map_err(|e| anyhow::anyhow!("cannot reach the Kubernetes API: {e}"))?;
    let namespace = cfg.namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    tracing::info!(
        lease = %cfg.lease_name, %namespace, identity = %cfg.identity,
        lease_duration = ?cfg.lease_duration, renew_deadline = ?cfg.renew_deadline, retry_period = ?cfg.retry_period,
        "leader election: standby until this replica holds the Lease"
    );
    let mut elector = Elector::new(&cfg.identity, cfg.lease_duration);
    // While leading: when the Lease was last renewed.
    let mut renewed: Option<Instant> = None;
    let mut last_holder = String::new();
    let step_down = |why: &str, renewed: &mut Option<Instant>| {
        if renewed.take().is_some() {
            tracing::warn!(lease = %cfg.lease_name, "stepping down: {why}; refusing the gateways' streams");
            leading.send_replace(false);
        }
    };
    while !stop.is_cancelled() {
        let deadline = renewed.map(|r| r + cfg.renew_deadline);
        if deadline.is_some_and(|d| Instant::now() >= d) {
            step_down("no renewal within the renew deadline", &mut renewed);
        }
        let limit = deadline.unwrap_or_else(|| Instant::now() + cfg.renew_deadline);
        let attempt = tokio::time::timeout_at(limit.into(), try_acquire_or_renew(&api, &cfg, &mut elector));
        let Some(attempt) = stop.run_until_cancelled(attempt).await else { break };
        match attempt {
            Ok(Ok(None)) => {
                if renewed.is_none() {
                    tracing::info!(lease = %cfg.lease_name, identity = %cfg.identity, "leading: serving the gateways");
                    leading.send_replace(true);
                }
                renewed = Some(Instant::now());
            }
            Ok(Ok(Some(holder))) => {
                step_down(&format!("{holder} holds the Lease"), &mut renewed);
                if holder != last_holder {
                    tracing::info!(lease = %cfg.lease_name, leader = %holder, "standby: another replica leads");
                    last_holder = holder;
                }
            }
            Ok(Err(e)) => tracing::warn!(lease = %cfg.lease_name, "leader election: {e}"),
            Err(_) => tracing::warn!(lease = %cfg.lease_name, "leader election: the API server did not answer in time"),
        }
        let mut pause = cfg.retry_period;
        if let Some(d) = renewed.map(|r| r + cfg.renew_deadline) {
            pause = pause.min(d.saturating_duration_since(Instant::now()));
        }
        stop.run_until_cancelled(tokio::time::sleep(pause)).await;
    }
    // Stopping: no more serving, then the Lease goes back (whatever this replica believed,
    // a write it had in flight may have renewed it: `release` reads it first).
    step_down("shutting down", &mut renewed);
    leading.send_replace(false);
    match tokio::time::timeout(cfg.renew_deadline, release(&api, &cfg, &elector)).await {
        Ok(Ok(true)) => tracing::info!(lease = %cfg.lease_name, "released the Lease: a standby takes it over now"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => tracing::warn!(lease = %cfg.lease_name, "cannot release the Lease: {e}"),
        Err(_) => {
            tracing::warn!(lease = %cfg.lease_name, "cannot release the Lease: the API server did not answer in time")
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        leader: LeaderElectArgs,
    }

    fn config(argv: &[&str]) -> Result<Option<Config>, String> {
        let flags = Flags::try_parse_from(std::iter::once("kvmesh-cp").chain(argv.iter().copied())).unwrap();
        flags.leader.config(Some("kvmesh"))
    }

    #[test]
    fn off_by_default_with_client_gos_timings_when_on() {
        assert_eq!(config(&[]), Ok(None));
        let c = config(&["--leader-elect"]).unwrap().unwrap();
        assert_eq!(c.lease_name, "kvmesh-cp");
        assert_eq!(c.namespace.as_deref(), Some("kvmesh"));
        assert_eq!(
            (c.lease_duration, c.renew_deadline, c.retry_period),
            (Duration::from_secs(15), Duration::from_secs(10), Duration::from_secs(2))
        );
        // Two processes never share an identity, whatever $HOSTNAME says.
        assert_ne!(c.identity, config(&["--leader-elect"]).unwrap().unwrap().identity);
        let c = config(&[
            "--leader-elect",
            "--leader-elect-identity",
            "a",
            "--leader-elect-lease-duration-secs",
            "2",
            "--leader-elect-renew-deadline-secs",
            "1.5",
            "--leader-elect-retry-period-secs",
            "0.25",
        ])
        .unwrap()
        .unwrap();
        assert_eq!((c.identity.as_str(), c.retry_period), ("a", Duration::from_millis(250)));
    }

    #[test]
    fn timings_that_could_run_two_leaders_are_refused() {
        assert!(config(&["--leader-elect-lease-name", "x"]).unwrap_err().contains("need --leader-elect"));
        let e = config(&["--leader-elect", "--leader-elect-renew-deadline-secs", "15"]).unwrap_err();
        assert!(e.contains("less than --leader-elect-lease-duration-secs"), "{e}");
        let e = config(&["--leader-elect", "--leader-elect-retry-period-secs", "10"]).unwrap_err();
        assert!(e.contains("less than --leader-elect-renew-deadline-secs"), "{e}");
        assert!(config(&["--leader-elect", "--leader-elect-retry-period-secs", "0"]).is_err());
    }

    #[tokio::test]
    async fn a_standby_refuses_and_a_leader_that_steps_down_ends_its_streams() {
        assert!(Leadership::always().check().is_ok());
        let (leading, leadership) = Leadership::elected();
        assert_eq!(leadership.check().unwrap_err().code(), tonic::Code::Unavailable);
        leading.send_replace(true);
        assert!(leadership.check().is_ok());
        let endless: Pin<Box<dyn Stream<Item = Result<u32, tonic::Status>> + Send>> =
            Box::pin(futures_util::stream::iter(0..).map(Ok).then(|i| async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                i
            }));
        let mut guarded = leadership.guard(endless);
        assert_eq!(guarded.next().await.unwrap().unwrap(), 0);
        leading.send_replace(false);
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match guarded.next().await {
                    Some(Ok(_)) => {}
                    Some(Err(status)) => break status.code(),
                    None => panic!("ended without a status"),
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(ended, tonic::Code::Unavailable);
        assert!(guarded.next().await.is_none());
        // Leadership that nothing can change any more stays as it was.
        drop(leading);
        let always = Leadership::always();
        let mut lost = std::pin::pin!(always.lost());
        for _ in 0..16 {
            // Polled again after every other task had its turn: still pending.
            assert!(futures_util::FutureExt::now_or_never(&mut lost).is_none());
            tokio::task::yield_now().await;
        }
    }

    /// Against the in-process API server: the first replica creates the Lease, the second
    /// sees it held, and a write carrying a resourceVersion that is no longer current (a
    /// replica that read before another wrote) is refused with 409; the holder releases it
    /// and the second takes it without waiting for the lease duration.
    #[tokio::test]
    async fn one_replica_holds_the_lease_a_stale_write_is_refused_and_a_release_hands_it_over() {
        let kube = kvmesh_testkit::kube_fake::FakeKube::start().unwrap();
        let url = format!("http://127.0.0.1:{}", kube.port).parse().unwrap();
        let api: Api<Lease> = Api::namespaced(Client::try_from(kube::Config::new(url)).unwrap(), "kvmesh");
        let cfg = |identity: &str| Config {
            lease_name: "kvmesh-cp".into(),
            namespace: Some("kvmesh".into()),
            identity: identity.into(),
            lease_duration: Duration::from_secs(2),
            renew_deadline: Duration::from_millis(1500),
            retry_period: Duration::from_millis(250),
        };
        let (a, b) = (cfg("a"), cfg("b"));
        let (mut ea, mut eb) = (Elector::new("a", a.lease_duration), Elector::new("b", b.lease_duration));
        assert_eq!(try_acquire_or_renew(&api, &a, &mut ea).await.unwrap(), None, "created");
        assert_eq!(try_acquire_or_renew(&api, &b, &mut eb).await.unwrap(), Some("a".into()));
        let read = api.get("kvmesh-cp").await.unwrap();
        assert_eq!(try_acquire_or_renew(&api, &a, &mut ea).await.unwrap(), None, "renewed");
        let mut stale = read;
        stale.spec.as_mut().unwrap().holder_identity = Some("b".into());
        match api.replace("kvmesh-cp", &PostParams::default(), &stale).await {
            Err(kube::Error::Api(s)) if s.is_conflict() => {}
            other => panic!("a stale write went through: {other:?}"),
        }
        assert_eq!(kube.leases.conflicts(), 1);
        assert_eq!(kube.leases.holder("kvmesh", "kvmesh-cp").as_deref(), Some("a"));
        let spec = kube.leases.get("kvmesh", "kvmesh-cp").unwrap().spec.unwrap();
        assert_eq!((spec.lease_duration_seconds, spec.lease_transitions), (Some(2), Some(0)));
        // Stopping: only the holder gives the Lease up, and the other replica takes it at once.
        assert!(!release(&api, &b, &eb).await.unwrap(), "b holds nothing to release");
        assert!(release(&api, &a, &ea).await.unwrap());
        assert_eq!(kube.leases.holder("kvmesh", "kvmesh-cp"), None, "no holder");
        assert_eq!(try_acquire_or_renew(&api, &b, &mut eb).await.unwrap(), None, "taken at once");
        let spec = kube.leases.get("kvmesh", "kvmesh-cp").unwrap().spec.unwrap();
        assert_eq!((spec.holder_identity.as_deref(), spec.lease_transitions), (Some("b"), Some(1)));
    }
}
