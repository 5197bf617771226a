//! The engines' KV-event streams: where each worker publishes, the topic, and the model's
//! tokenizer that turns event token ids back into text bytes.

use super::{Args, BadArgs};
use crate::settings::{KvEventEndpoints, KvEventSettings};

/// The KV-event flags.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct KvEventFlags {
    /// Every worker's KV-event publisher (ZMQ PUB), `{host}` standing for the worker URL's
    /// host: e.g. `tcp://{host}:5557` (llm-d's `podDiscoveryConfig.socketPort`). A
    /// data-parallel rank r of a `--dp-aware` worker listens on the port + r, as vLLM binds.
    #[arg(long, help_heading = "KV events")]
    pub kv_events_endpoint: Option<String>,
    /// Every worker's replay socket (ZMQ ROUTER; vLLM's and SGLang's `replay_endpoint`),
    /// `{host}` as above. Without one, a gap in the sequence drops the worker's entries.
    #[arg(long, help_heading = "KV events")]
    pub kv_events_replay_endpoint: Option<String>,
    /// One worker's publisher, over the templates: `URL=PUB[,REPLAY]`; repeatable.
    #[arg(long = "kv-events-worker", value_name = "URL=PUB[,REPLAY]", help_heading = "KV events")]
    pub kv_events_worker: Vec<String>,
    /// The topic prefix subscribed to (llm-d's `topicFilter`; the engines' `topic`). Default:
    /// every topic.
    #[arg(long, help_heading = "KV events")]
    pub kv_events_topic: Option<String>,
    /// The served model's `tokenizer.json` (a byte-level BPE): event token ids become the
    /// text bytes the gateways hash. Without it only clears apply.
    #[arg(long, help_heading = "KV events")]
    pub kv_events_tokenizer: Option<String>,
    /// Most engine blocks kept per worker (further stores are refused and counted).
    /// Default 1048576.
    #[arg(long, help_heading = "KV events")]
    pub kv_events_max_blocks: Option<u64>,
}

/// A ZMQ TCP endpoint (`tcp://host:port`, `{host}` allowed in a template).
fn endpoint_ok(e: &str) -> bool {
    e.strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

impl Args {
    /// The KV-event settings, each endpoint checked.
    pub(super) fn kv_event_settings(&self) -> Result<KvEventSettings, BadArgs> {
        let f = &self.kv_events;
        for (name, e) in
            [("kv_events_endpoint", &f.kv_events_endpoint), ("kv_events_replay_endpoint", &f.kv_events_replay_endpoint)]
        {
            if let Some(e) = e.as_deref().filter(|e| !endpoint_ok(e)) {
                return Err(self.bad(name, format!("`{e}` is not tcp://HOST:PORT")));
            }
        }
        let mut workers = Vec::new();
        for entry in &f.kv_events_worker {
            let bad =
                || self.bad("kv_events_worker", format!("`{entry}` is not URL=tcp://HOST:PORT[,tcp://HOST:PORT]"));
            let (url, eps) = entry.split_once('=').ok_or_else(bad)?;
            let (publisher, replay) = match eps.split_once(',') {
                Some((p, r)) => (p, Some(r)),
                None => (eps, None),
            };
            if !endpoint_ok(publisher) || replay.is_some_and(|r| !endpoint_ok(r)) {
                return Err(bad());
            }
            let url = crate::urls::canonical(url).map_err(|e| self.bad("kv_events_worker", e))?;
            workers.push((url, KvEventEndpoints { publisher: publisher.into(), replay: replay.map(Into::into) }));
        }
        Ok(KvEventSettings {
            endpoint: f.kv_events_endpoint.clone(),
            replay_endpoint: f.kv_events_replay_endpoint.clone(),
            workers,
            topic: f.kv_events_topic.clone().unwrap_or_default(),
            tokenizer: f.kv_events_tokenizer.clone(),
            max_blocks: self.positive("kv_events_max_blocks", f.kv_events_max_blocks, 1 << 20)? as usize,
        })
    }
}
