//! A small blocking HTTP client for tests: every status is a response, never an error.

use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

use anyhow::Context;

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("not JSON (status {}): {}", self.status, self.text()))
    }
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(60)).build()
}

fn finish(result: Result<ureq::Response, ureq::Error>) -> anyhow::Result<ureq::Response> {
    match result {
        Ok(r) | Err(ureq::Error::Status(_, r)) => Ok(r),
        Err(e) => Err(e.into()),
    }
}

fn collect(r: ureq::Response) -> anyhow::Result<Response> {
    let status = r.status();
    let headers = r.headers_names().into_iter().filter_map(|n| Some((n.clone(), r.header(&n)?.to_string()))).collect();
    let mut body = Vec::new();
    r.into_reader().read_to_end(&mut body)?;
    Ok(Response { status, headers, body })
}

pub fn get(url: &str) -> anyhow::Result<Response> {
    collect(finish(agent().get(url).call())?)
}

/// GETs `url` with extra `headers`.
pub fn get_with(url: &str, headers: &[(&str, &str)]) -> anyhow::Result<Response> {
    let mut req = agent().get(url);
    for (n, v) in headers {
        req = req.set(n, v);
    }
    collect(finish(req.call())?)
}

/// POSTs `body` as JSON with extra `headers`.
pub fn post(url: &str, body: &[u8], headers: &[(&str, &str)]) -> anyhow::Result<Response> {
    let mut req = agent().post(url).set("content-type", "application/json");
    for (n, v) in headers {
        req = req.set(n, v);
    }
    collect(finish(req.send_bytes(body))?)
}

pub fn post_json(url: &str, body: &serde_json::Value) -> anyhow::Result<Response> {
    post(url, body.to_string().as_bytes(), &[])
}

/// POSTs `body` as JSON, giving up (an error) after `limit`: for a test that counts a request
/// nobody answers as lost instead of waiting a minute for it.
pub fn post_json_within(url: &str, body: &serde_json::Value, limit: Duration) -> anyhow::Result<Response> {
    let agent = ureq::AgentBuilder::new().timeout(limit).build();
    let req = agent.post(url).set("content-type", "application/json");
    collect(finish(req.send_bytes(body.to_string().as_bytes()))?)
}

/// A response whose body is still being received.
pub struct Streaming {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<Box<dyn Read + Send + Sync>>,
}

/// One server-sent event's data and when it arrived.
pub struct Event {
    pub data: String,
    pub at: Instant,
}

impl Streaming {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Reads the next `data:` line; `None` at the end of the stream.
    pub fn next_event(&mut self) -> anyhow::Result<Option<Event>> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                return Ok(None);
            }
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                return Ok(Some(Event { data: data.trim_start().to_string(), at: Instant::now() }));
            }
        }
    }

    /// Reads every remaining event.
    pub fn events(&mut self) -> anyhow::Result<Vec<Event>> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event()? {
            out.push(e);
        }
        Ok(out)
    }
}

/// POSTs JSON and returns as soon as the response headers are in.
pub fn post_streaming(url: &str, body: &serde_json::Value) -> anyhow::Result<Streaming> {
    let r = finish(agent().post(url).set("content-type", "application/json").send_string(&body.to_string()))?;
    let status = r.status();
    let headers = r.headers_names().into_iter().filter_map(|n| Some((n.clone(), r.header(&n)?.to_string()))).collect();
    Ok(Streaming { status, headers, reader: BufReader::new(r.into_reader()) })
}
