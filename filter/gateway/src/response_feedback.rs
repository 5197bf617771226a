//! The response side of engine feedback, for one request: the response body is scanned as
//! it passes (each chunk read, never held or changed: the client receives exactly what the
//! worker sent), and when the stream ends the gateway compares the worker's `cached_tokens`
//! with its prediction ([`EngineFeedback::judge`](crate::gateway::EngineFeedback::judge)). The completion metrics count whether or not a
//! prediction was made (PD decode legs, text-blind policies); a response that carries no
//! `e2e_latency` (OpenAI's) is timed by the gateway, from the routing decision to the end of
//! the response.

use kvmesh_core::feedback::Verdict;
use kvmesh_core::usage::UsageScanner;

use crate::gateway::{Gateway, Prediction};
use crate::host::{Metric, StreamHost};

/// One request's feedback in progress.
#[derive(Debug, Default)]
pub struct ResponseFeedback {
    prediction: Option<Prediction>,
    scanner: UsageScanner,
    /// The worker answered 2xx itself (no failover): only then does the answer count.
    counts: bool,
    /// The worker the request was routed to (the one whose answer counts).
    worker: kvmesh_core::WorkerId,
    /// When the request was routed (the host's clock, ms).
    routed_ms: u64,
    /// Bytes of the body Envoy still holds (the filter paused) that were already scanned:
    /// each byte is read once however many chunks it is held over.
    scanned: usize,
}

impl ResponseFeedback {
    pub fn new(prediction: Option<Prediction>, worker: kvmesh_core::WorkerId, routed_ms: u64) -> Self {
        Self { prediction, worker, routed_ms, ..Self::default() }
    }

    /// The response headers: a 2xx from the chosen worker is compared, anything else not.
    pub fn headers(&mut self, status: u16, served_by_chosen: bool) {
        self.counts = (200..300).contains(&status) && served_by_chosen;
    }

    /// A chunk of the response body: Envoy holds `body_size` bytes (those kept while the
    /// filter paused, then the chunk just received); only the new ones are read.
    pub fn body(&mut self, host: &dyn StreamHost, body_size: usize) {
        if self.counts && body_size > self.scanned {
            self.scanner.feed(&host.response_body(self.scanned..body_size));
        }
        self.scanned = body_size;
    }

    /// Envoy passed on what it held: the next chunk starts a new body buffer.
    pub fn flushed(&mut self) {
        self.scanned = 0;
    }

    /// The tokens the worker said it generated, where its answer counts (fair shares).
    pub fn generated(&self) -> Option<u64> {
        self.counts.then(|| self.scanner.usage().completion_tokens).flatten()
    }

    /// The stream ended (`complete`: the worker's answer arrived whole).
    pub fn finish(self, gateway: &mut Gateway, host: &dyn StreamHost, complete: bool) {
        if !self.counts || !complete {
            return;
        }
        let mut usage = self.scanner.usage();
        if usage.e2e_latency.is_none() {
            let ms = crate::host::now_ms(host).saturating_sub(self.routed_ms);
            usage.e2e_latency = Some(ms as f64 / 1000.0);
        }
        let Some(prediction) = self.prediction else {
            if usage.completion_tokens.is_some() {
                // No prediction (a batch, a blind policy): the completion metrics still count
                // (only an answer of the chosen worker counts at all: no need to ask which).
                gateway.feedback().count(self.worker, &usage);
            }
            return;
        };
        let Some(judged) = gateway.feedback().judge(host, &prediction, &usage) else { return };
        host.increment(Metric::Predictions);
        host.increment(match judged.verdict {
            Verdict::Accurate => Metric::PredictionsAccurate,
            Verdict::Over => Metric::PredictionsOver,
            Verdict::Under => Metric::PredictionsUnder,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use kvmesh_core::Config;

    use crate::gateway::Gateway;
    use crate::host::mock::MockHost;
    use crate::host::{Action, Metric, StreamHost};
    use crate::request::{RequestFilter, DST_HEADER};

    const TWO: &str = r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002"]}"#;

    /// One request through the filter, answered by its worker with `chunks` (the response
    /// body as Envoy passes it on); returns the worker chosen.
    fn exchange(host: &MockHost, gw: &Rc<RefCell<Gateway>>, prompt: &str, chunks: &[&str]) -> String {
        let body = serde_json::json!({ "text": prompt }).to_string();
        host.request("POST", "/generate", &[("content-length", &body.len().to_string())], body.as_bytes());
        let mut f = RequestFilter::new(Some(Rc::clone(gw)));
        assert_eq!(f.on_request_headers(host, false), Action::Pause);
        assert_eq!(f.on_request_body(host, body.len(), true), Action::Continue);
        let dst = host.request_header(DST_HEADER).unwrap();
        host.set_response(200, b"");
        f.on_response_headers(host);
        for (i, chunk) in chunks.iter().enumerate() {
            *host.response_body.borrow_mut() = chunk.as_bytes().to_vec();
            assert_eq!(f.on_response_body(host, chunk.len(), i + 1 == chunks.len()), Action::Continue);
            assert_eq!(&*host.response_body.borrow(), chunk.as_bytes(), "the client gets the bytes as sent");
        }
        f.on_log(host);
        dst
    }

    #[test]
    fn a_worker_that_no_longer_holds_a_prefix_makes_the_next_request_choose_by_load() {
        let host = MockHost::new();
        let gw = Rc::new(RefCell::new(Gateway::new(Config::from_json(TWO.as_bytes()).unwrap(), &host, 9)));
        let prompt = "s".repeat(640); // 20 blocks, 160 tokens
        let first = exchange(&host, &gw, &prompt, &[r#"{"text":"x","meta_info":{"cached_"#, r#"tokens":0}}"#]);
        assert_eq!(host.metric_sum(Metric::PredictionsAccurate), 1, "a miss predicted, a miss found");
        // Predicted: 160 tokens on the same worker. The worker says it had none (it evicted them).
        let second =
            exchange(&host, &gw, &prompt, &[r#"data: {"meta_info":{"cached_tokens":0}}"#, "\n\ndata: [DONE]\n\n"]);
        assert_eq!(second, first, "sticky while the index believes it");
        assert_eq!(host.metric_sum(Metric::CacheHits), 1);
        assert_eq!(host.metric_sum(Metric::PredictionsOver), 1);
        // The next request with that prefix is no cache hit any more: chosen by load.
        exchange(
            &host,
            &gw,
            &prompt,
            &[r#"{"meta_info":{"cached_tokens":160,"completion_tokens":3,"e2e_latency":0.5}}"#],
        );
        assert_eq!(host.metric_sum(Metric::CacheHits), 1, "the stale prefix attracts no traffic");
        assert_eq!(host.metric_sum(Metric::Predictions), 3);
        assert!(crate::shared::feedback::read(&host).is_empty(), "counted on the tick, not per response");
        gw.borrow_mut().feedback().flush(&host);
        let counts = crate::shared::feedback::read(&host);
        let total: u32 = counts.iter().map(|(_, f)| f.predictions).sum();
        let completions: u64 = counts.iter().map(|(_, f)| f.completion_tokens).sum();
        assert_eq!((total, completions), (3, 3));
    }

    #[test]
    fn a_stale_prefix_is_dropped_with_the_rest_of_the_request_that_found_it() {
        let host = MockHost::new();
        let gw = Rc::new(RefCell::new(Gateway::new(Config::from_json(TWO.as_bytes()).unwrap(), &host, 9)));
        let prompt = "s".repeat(640); // 20 blocks
        let miss = r#"{"meta_info":{"cached_tokens":0}}"#;
        // Questions longer than the prompt: a search over the request's blocks would start in them.
        let question = "q".repeat(1000);
        let first = exchange(&host, &gw, &format!("{prompt} question one: {question}"), &[miss]);
        // The prefix was indexed for that worker, which no longer holds it when asked again.
        let again = format!("{prompt} question two: {question}");
        assert_eq!(exchange(&host, &gw, &again, &[miss]), first);
        assert_eq!(host.metric_sum(Metric::PredictionsOver), 1);
        // Every block of that request is gone for the worker, its question's too: what the
        // worker holds stays a run of leading blocks, and the same text again is no cache hit.
        let blocks = kvmesh_core::blocks::block_hashes(again.as_bytes(), 32);
        assert_eq!(gw.borrow().regular_index().unwrap().deepest(&blocks).0, 0, "no block of it is indexed");
        exchange(&host, &gw, &again, &[miss]);
        assert_eq!(host.metric_sum(Metric::CacheHits), 1, "only the second request was a hit");
    }

    #[test]
    fn a_response_without_e2e_latency_is_timed_by_the_gateway() {
        let host = MockHost::new();
        let gw = Rc::new(RefCell::new(Gateway::new(
            // A control plane receives completion metrics (without one they are not read).
            Config::from_json(
                br#"{"policy":"round_robin","worker_urls":["http://127.0.0.1:30001"],"control_plane_cluster":"cp"}"#,
            )
            .unwrap(),
            &host,
            9,
        )));
        host.now_ms.set(10_000);
        let body = r#"{"text":"hi"}"#;
        host.request("POST", "/generate", &[("content-length", &body.len().to_string())], body.as_bytes());
        let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
        f.on_request_headers(&host, false);
        f.on_request_body(&host, body.len(), true);
        host.set_response(200, b"");
        *host.upstream.borrow_mut() = Some("127.0.0.1:30001".into());
        f.on_response_headers(&host);
        host.now_ms.set(10_250);
        let chunk = r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}"#;
        *host.response_body.borrow_mut() = chunk.as_bytes().to_vec();
        f.on_response_body(&host, chunk.len(), true);
        f.on_log(&host);
        gw.borrow_mut().feedback().flush(&host); // the tick's part
        let counts = crate::shared::feedback::read(&host);
        let f = counts[0].1;
        assert_eq!((f.completions, f.completion_tokens, f.e2e_latency_ms), (1, 7, 250));
    }

    #[test]
    fn failed_or_failed_over_answers_and_cut_streams_are_not_judged() {
        let host = MockHost::new();
        let gw = Rc::new(RefCell::new(Gateway::new(Config::from_json(TWO.as_bytes()).unwrap(), &host, 9)));
        let body = r#"{"text":"hello hello hello hello hello hello hello"}"#;
        for (status, upstream, end) in [(500, None, true), (200, Some("127.0.0.9:1"), true), (200, None, false)] {
            host.request("POST", "/generate", &[("content-length", &body.len().to_string())], body.as_bytes());
            let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
            f.on_request_headers(&host, false);
            f.on_request_body(&host, body.len(), true);
            host.set_response(status, br#"{"meta_info":{"cached_tokens":0}}"#);
            *host.upstream.borrow_mut() = upstream.map(String::from);
            f.on_response_headers(&host);
            f.on_response_body(&host, host.response_body(0..1 << 20).len(), end);
            f.on_log(&host);
        }
        assert_eq!(host.metric_sum(Metric::Predictions), 0);
    }
}
