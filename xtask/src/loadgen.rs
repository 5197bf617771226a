//! A closed-loop HTTP/1.1 load generator: N keep-alive connections, each sending the next
//! prepared request as soon as the previous answer is in. Plain sockets, so the client
//! costs little CPU next to the proxies being compared.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

pub struct Load {
    pub ok: u64,
    pub errors: u64,
    pub elapsed: Duration,
    /// Latency of every successful request, sorted.
    pub latencies: Vec<Duration>,
}

impl Load {
    pub fn rps(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }

    pub fn quantile(&self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() - 1) as f64 * q).round() as usize;
        self.latencies[i]
    }
}

/// A raw `POST path` request with a JSON body.
pub fn post(path: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Reads one response; returns its status.
fn read_response(r: &mut BufReader<TcpStream>) -> std::io::Result<u16> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or(std::io::ErrorKind::InvalidData)?;
    let (mut length, mut chunked) = (0usize, false);
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((name, value)) = l.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            } else if name.eq_ignore_ascii_case("transfer-encoding") && value.to_ascii_lowercase().contains("chunked") {
                chunked = true;
            }
        }
    }
    if !chunked {
        std::io::copy(&mut r.by_ref().take(length as u64), &mut std::io::sink())?;
        return Ok(status);
    }
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
        std::io::copy(&mut r.by_ref().take(size as u64 + 2), &mut std::io::sink())?;
        if size == 0 {
            return Ok(status);
        }
    }
}

/// Sends `requests` round-robin over `connections` connections to `targets` for `duration`
/// (after a warm-up of a tenth of it).
pub fn run(targets: &[SocketAddr], requests: &[Vec<u8>], connections: usize, duration: Duration) -> Load {
    let warmup = duration / 10;
    let start = Instant::now() + warmup;
    let end = start + duration;
    let threads: Vec<_> = (0..connections)
        .map(|c| {
            let target = targets[c % targets.len()];
            let requests: Vec<Vec<u8>> = requests.iter().skip(c).step_by(connections).cloned().collect();
            std::thread::spawn(move || worker(target, &requests, start, end))
        })
        .collect();
    let mut total = Load { ok: 0, errors: 0, elapsed: duration, latencies: Vec::new() };
    for t in threads {
        if let Ok(part) = t.join() {
            total.ok += part.ok;
            total.errors += part.errors;
            total.latencies.extend(part.latencies);
        }
    }
    total.latencies.sort_unstable();
    total
}

fn worker(target: SocketAddr, requests: &[Vec<u8>], start: Instant, end: Instant) -> Load {
    let mut load = Load { ok: 0, errors: 0, elapsed: Duration::ZERO, latencies: Vec::new() };
    let mut conn: Option<(TcpStream, BufReader<TcpStream>)> = None;
    let mut i = 0usize;
    while Instant::now() < end && !requests.is_empty() {
        if conn.is_none() {
            let Ok(s) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
                load.errors += 1;
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            let _ = s.set_nodelay(true);
            let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
            let Ok(r) = s.try_clone() else { continue };
            conn = Some((s, BufReader::new(r)));
        }
        let Some((w, r)) = conn.as_mut() else { continue };
        let sent = Instant::now();
        let result = w.write_all(&requests[i % requests.len()]).and_then(|_| read_response(r));
        i += 1;
        let measured = sent >= start;
        match result {
            Ok(200) if measured => {
                load.ok += 1;
                load.latencies.push(sent.elapsed());
            }
            Ok(200) => {}
            Ok(_) if measured => load.errors += 1,
            Ok(_) => {}
            Err(_) => {
                if measured {
                    load.errors += 1;
                }
                conn = None;
            }
        }
    }
    load
}
