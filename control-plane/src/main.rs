//! `kvmesh-cp`: the kvmesh control plane.
//!
//! Wires the parts: flags and config ([`args`]), the state ([`state`]), the gRPC snapshot
//! service ([`grpc`]), Envoy's endpoint discovery for the workers' cluster ([`eds`]) and what
//! Envoy acknowledged of it ([`endpoint_acks`]), the HTTP admin API ([`admin`]), health checks and load polling
//! ([`probe`]), Kubernetes discovery ([`discovery`], [`inference_pool`]), and the periodic
//! eviction and delta push.

mod adapters;
mod admin;
mod args;
mod auth;
mod capacity;
mod discovery;
mod eds;
mod election;
mod endpoint_acks;
mod feedback;
mod grpc;
mod inference_objective;
mod inference_pool;
mod kv_events;
mod label;
mod models;
mod peer_flags;
mod probe;
mod settings;
mod state;
mod telemetry;
mod urls;
mod worker_ops;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvmesh_proto::eds::endpoint_discovery_service_server::EndpointDiscoveryServiceServer;
use kvmesh_proto::v1::kvmesh_server::KvmeshServer;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let args = match args::Args::parse_from(std::env::args_os()) {
        Ok(a) => a,
        Err(args::ArgsError::Clap(e))
            if e.kind() == clap::error::ErrorKind::DisplayHelp
                || e.kind() == clap::error::ErrorKind::DisplayVersion =>
        {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("kvmesh-cp: {}", e.one_line());
            return ExitCode::from(2);
        }
    };
    let election = match args.leader.config(args.discovery.service_discovery_namespace.as_deref()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvmesh-cp: {e}");
            return ExitCode::from(2);
        }
    };
    let mut settings = match args.load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvmesh-cp: {e}");
            return ExitCode::from(2);
        }
    };
    kv_events::chat::apply(&mut settings);
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvmesh-cp: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let otlp = settings.otlp_endpoint.as_deref();
    let telemetry = match runtime.block_on(async { telemetry::init(&settings.log_level, otlp) }) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvmesh-cp: {e}");
            return ExitCode::from(2);
        }
    };
    let code = match runtime.block_on(run(settings, election)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvmesh-cp: {e:#}");
            ExitCode::FAILURE
        }
    };
    telemetry.shutdown();
    code
}

async fn run(settings: settings::Settings, election: Option<election::Config>) -> anyhow::Result<()> {
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    if settings.worker_key().is_some() && settings.auth.grpc_token.is_none() {
        tracing::warn!(
            "the gRPC streams take no token (--grpc-token-file): any client that can open one receives the workers' --api-key"
        );
    }
    if settings.auth.insecure {
        eprintln!(
            "\n********************************************************************************\n\
             kvmesh-cp: INSECURE: --allow-insecure (gRPC on {}, admin API on {}):\n\
             unauthenticated clients can change where every prompt goes.\n\
             Give --grpc-token-file and --control-plane-api-keys.\n\
             ********************************************************************************\n",
            settings.host, settings.http_host
        );
    }
    let stop = CancellationToken::new();
    on_signals(stop.clone())?;
    let grpc_addr = format!("{}:{}", settings.host, settings.grpc_port);
    let http_addr = format!("{}:{}", settings.http_host, settings.http_port);
    let state = state::State::open(settings).map_err(anyhow::Error::msg)?;
    state.publish();

    let http =
        tokio::net::TcpListener::bind(&http_addr).await.with_context(|| format!("cannot listen on {http_addr}"))?;
    let grpc =
        tokio::net::TcpListener::bind(&grpc_addr).await.with_context(|| format!("cannot listen on {grpc_addr}"))?;
    tracing::info!(%grpc_addr, %http_addr, workers = state.workers().len(), "kvmesh-cp serving");

    let kv_events = kv_events::KvEvents::new(&state.settings.kv_events, state.settings.block_size)
        .context("--kv-events-tokenizer")?;
    tokio::spawn(kv_events.clone().run(state.clone()));
    let metrics = admin::Metrics::new(state.clone(), &kv_events);
    if let Some(port) = state.settings.prometheus_port {
        let addr = format!("{}:{port}", state.settings.prometheus_host);
        let listener =
            tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let metrics = metrics.clone();
        let state = state.clone();
        tokio::spawn(async move { axum::serve(listener, admin::metrics_router(metrics, state)).await });
    }
    if state.settings.health_checks {
        tokio::spawn(probe::health_loop(state.clone()));
    }
    tokio::spawn(probe::load_loop(state.clone()));
    if !state.settings.lora_adapters.is_empty() {
        tokio::spawn(adapters::keep_loaded(state.clone(), state.settings.lora_adapters.clone()));
    }
    tokio::spawn(push_loop(state.clone()));
    if let Some(cfg) = state.settings.discovery.clone() {
        let discovery_state = state.clone();
        tokio::spawn(async move {
            let run = match cfg.inference_pool.clone() {
                Some(pool) => inference_pool::run(discovery_state, cfg, pool).await,
                None => discovery::run(discovery_state, cfg).await,
            };
            if let Err(e) = run {
                tracing::error!("service discovery stopped: {e:#}");
            }
        });
    }
    tokio::spawn(eviction_loop(state.clone()));
    // Whether this replica serves the gateways: the election says (with --leader-elect),
    // else always until shutdown; either way it stops serving on SIGTERM or SIGINT.
    let (leading, leadership) = election::Leadership::elected();
    let election_task = match election {
        None => {
            leading.send_replace(true);
            let stop = stop.clone();
            tokio::spawn(async move {
                stop.cancelled().await;
                leading.send_replace(false);
            })
        }
        Some(cfg) => {
            let stop = stop.clone();
            tokio::spawn(async move {
                if let Err(e) = election::run(cfg, leading, stop).await {
                    tracing::error!("leader election stopped (this replica stays a standby): {e:#}");
                }
            })
        }
    };

    // A table naming a worker goes to the filters once Envoy's EDS lists it (bounded wait).
    let acks = endpoint_acks::EndpointAcks::new(
        Duration::from_millis(state.settings.eds_wait_ms),
        state.counters.tables_held.clone(),
    );
    // Filters send their full index in chunks well under this limit.
    let service = tonic::service::interceptor::InterceptedService::new(
        KvmeshServer::new(grpc::Service { state: state.clone(), acks: acks.clone(), leadership: leadership.clone() })
            .max_decoding_message_size(state.settings.limits.max_message_bytes),
        auth::GrpcAuth { state: state.clone() },
    );
    // Envoy's EDS client for the workers' cluster, behind the same token.
    let eds = tonic::service::interceptor::InterceptedService::new(
        EndpointDiscoveryServiceServer::new(eds::Service {
            state: state.clone(),
            acks,
            leadership: leadership.clone(),
        }),
        auth::GrpcAuth { state: state.clone() },
    );
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc);
    let grpc_server = tonic::transport::Server::builder()
        .add_service(service)
        .add_service(eds)
        .serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned());
    let http_server =
        axum::serve(http, admin::router(state, metrics, kv_events).merge(election::ready_router(leadership)))
            .with_graceful_shutdown(stop.clone().cancelled_owned());
    // The streams end as this replica stops leading; a connection that lingers after that
    // does not hold the exit up for long.
    let drained = async {
        stop.cancelled().await;
        tokio::time::sleep(DRAIN).await;
    };
    tokio::select! {
        (g, h) = async { tokio::join!(grpc_server, http_server) } => {
            g.context("gRPC server failed")?;
            h.context("HTTP server failed")?;
        }
        () = drained => tracing::warn!("connections still open {DRAIN:?} after the shutdown began: closing them"),
    }
    // With --leader-elect: the Lease released (or given up on after DRAIN).
    if tokio::time::timeout(DRAIN, election_task).await.is_err() {
        tracing::warn!("the leader election did not finish within {DRAIN:?}");
    }
    tracing::info!("kvmesh-cp stopped");
    Ok(())
}

/// How long a shutdown waits for the servers to drain, and then for the Lease's release.
const DRAIN: Duration = Duration::from_secs(5);

/// Cancels `stop` on the first SIGTERM (Kubernetes stopping the pod) or SIGINT.
fn on_signals(stop: CancellationToken) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{name}: stopping (streams end, the Lease is released)");
        stop.cancel();
    });
    Ok(())
}

/// Pushes a delta whenever something changed, every `push_interval_ms`.
async fn push_loop(state: Arc<state::State>) {
    let mut tick = tokio::time::interval(Duration::from_millis(state.settings.push_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_prune = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        if last_prune.elapsed() >= Duration::from_secs(1) {
            last_prune = tokio::time::Instant::now();
            state.prune_gateways(std::time::Instant::now());
        }
        state.publish();
    }
}

async fn eviction_loop(state: Arc<state::State>) {
    let mut tick = tokio::time::interval(Duration::from_secs(state.settings.eviction_interval_secs));
    tick.tick().await;
    loop {
        tick.tick().await;
        let n = state.evict();
        if n > 0 {
            let (blocks, _) = state.index_stats();
            tracing::info!(evicted = n, blocks, "index evicted to max_tree_size");
        }
    }
}
