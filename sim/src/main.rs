//! `kvmesh-sim`: a simulated SGLang or vLLM worker.

mod admin;
mod api;
mod bootstrap;
mod bpe;
mod cache;
mod cli;
mod client;
mod dp;
mod engine;
#[cfg(test)]
mod http_tests;
mod kv_events;
mod models;
mod prompt;
mod vllm;

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Args::parse();
    if let Err(msg) = args.validate() {
        eprintln!("kvmesh-sim: {msg}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvmesh-sim: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvmesh-sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: cli::Args) -> anyhow::Result<()> {
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let sglang = args.engine == cli::EngineKind::Sglang;
    let engine_kind = if sglang { "" } else { " vLLM" };
    eprintln!("kvmesh-sim: {:?}{engine_kind} worker listening on http://{addr}", args.role);
    let role = args.role;
    let bootstrap_addr = format!("{}:{}", args.host, args.bootstrap_port);
    let events = match (args.kv_events_port, args.tokenizer.as_deref()) {
        (Some(port), Some(tokenizer)) => Some(
            kv_events::KvEvents::start(
                tokenizer,
                args.kv_events_encoding,
                args.kv_events_page_tokens,
                args.kv_capacity_tokens,
                &args.host,
                port,
                args.kv_events_replay_port,
            )
            .await?,
        ),
        _ => None,
    };
    let engine = Arc::new(engine::Engine::new(args));
    if let Some(events) = events {
        let _ = engine.kv_events.set(events);
    }
    if sglang && role == cli::Role::Prefill {
        let boot = tokio::net::TcpListener::bind(&bootstrap_addr)
            .await
            .with_context(|| format!("cannot listen on bootstrap port {bootstrap_addr}"))?;
        eprintln!("kvmesh-sim: bootstrap server on {bootstrap_addr}");
        let rooms = engine.rooms.clone();
        tokio::spawn(async move { axum::serve(boot, bootstrap::router(rooms)).await });
    }
    // Each event goes out when written: with Nagle's algorithm a stream's first event, written
    // a few ms after its headers, waited for their (delayed, ~40 ms) ACK, so time to first token
    // measured the client's ACK timer rather than the worker.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            eprintln!("kvmesh-sim: TCP_NODELAY not set: {e}");
        }
    });
    axum::serve(listener, api::router(engine.clone()).merge(admin::kv_event_routes(engine)))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("server failed")
}
