//! The one load generator every router is measured with: a fixed request stream sent over a
//! fixed number of keep-alive HTTP/1.1 connections (closed loop: each connection sends the
//! stream's next request as soon as its previous answer is in; or, for a trace, each request
//! at its time: [`replay`]), latencies in HDR histograms, a progress bar on a terminal. Plain
//! sockets, so the client costs little CPU next to the proxies being compared.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};

/// Latencies are recorded in microseconds, from 1 µs to 10 minutes, 3 significant digits.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("constant, valid bounds")
}

/// How long a run lasts.
#[derive(Clone, Copy, Debug)]
pub enum Stop {
    /// Cycle through the stream for this long, after a warm-up of a tenth of it (not measured).
    For(Duration),
    /// Send every request of the stream once, in order (all measured).
    Once,
}

/// What a run measured.
pub struct Load {
    /// Requests answered or failed, the warm-up included.
    pub sent: u64,
    pub ok: u64,
    pub errors: u64,
    pub elapsed: Duration,
    /// Request to complete answer, µs, successful requests only.
    pub latency: Histogram<u64>,
    /// Request to first body byte (for a stream: the first event), µs.
    pub ttft: Histogram<u64>,
    /// `(seconds since the start, requests done by then)`, sampled every 100 ms from the
    /// first request on, the warm-up included.
    pub timeline: Vec<(f64, u64)>,
}

impl Load {
    pub fn rps(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The latency at quantile `q`, in milliseconds.
    pub fn ms(&self, q: f64) -> f64 {
        self.latency.value_at_quantile(q) as f64 / 1e3
    }

    /// The time to first byte at quantile `q`, in milliseconds.
    pub fn ttft_ms(&self, q: f64) -> f64 {
        self.ttft.value_at_quantile(q) as f64 / 1e3
    }

    /// Seconds from the first request until throughput first reaches 90 % of its steady
    /// rate (the median of the 0.5 s windows of the run's second half); None for a run too
    /// short to say.
    pub fn steady_after(&self) -> Option<f64> {
        steady_after(&self.timeline, 0.5, 0.9)
    }
}

/// `(start, requests per second)` over consecutive windows of `window` seconds.
pub fn window_rates(timeline: &[(f64, u64)], window: f64) -> Vec<(f64, f64)> {
    let mut rates: Vec<(f64, f64)> = Vec::new();
    let mut from = 0usize;
    for (i, &(t, done)) in timeline.iter().enumerate() {
        let (t0, d0) = timeline[from];
        if t - t0 >= window - 1e-9 {
            rates.push((t0, done.saturating_sub(d0) as f64 / (t - t0)));
            from = i;
        }
    }
    rates
}

/// Over `timeline` samples, windows of `window` seconds: the start of the first whose rate is
/// at least `share` of the median rate of the windows in the second half.
pub fn steady_after(timeline: &[(f64, u64)], window: f64, share: f64) -> Option<f64> {
    let end = timeline.last()?.0;
    let rates = window_rates(timeline, window);
    let mut late: Vec<f64> = rates.iter().filter(|(t, _)| *t >= end / 2.0).map(|&(_, r)| r).collect();
    if late.len() < 2 {
        return None;
    }
    late.sort_by(f64::total_cmp);
    let steady = late[late.len() / 2];
    rates.iter().find(|&&(_, r)| r >= share * steady).map(|&(t, _)| t)
}

/// A raw `POST path` request with a JSON body.
pub fn post(path: &str, body: &str) -> Vec<u8> {
    post_with(path, body, &[])
}

/// [`post`] with extra headers.
pub fn post_with(path: &str, body: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    format!(
        "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Reads one response: its status and when its first body byte arrived.
fn read_response(r: &mut BufReader<TcpStream>) -> std::io::Result<(u16, Option<Instant>)> {
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
        let first = (length > 0).then(|| r.fill_buf().map(|_| Instant::now())).transpose()?;
        std::io::copy(&mut r.by_ref().take(length as u64), &mut std::io::sink())?;
        return Ok((status, first));
    }
    let mut first = None;
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
        if size > 0 && first.is_none() {
            first = Some(Instant::now());
        }
        std::io::copy(&mut r.by_ref().take(size as u64 + 2), &mut std::io::sink())?;
        if size == 0 {
            return Ok((status, first));
        }
    }
}

/// The progress bar's look, with `label` before it.
fn style(bar: &ProgressBar, label: &str) {
    bar.set_style(
        ProgressStyle::with_template("    {prefix:>28} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(label.chars().take(28).collect::<String>());
}

/// A keep-alive connection: its writing half and its buffered reading half.
type Conn = (TcpStream, BufReader<TcpStream>);

/// Sends `request` on `conn` (connecting to `target` first when there is none, up to three
/// tries): the status, when it was sent and when its first body byte came.
fn exchange(
    conn: &mut Option<Conn>,
    target: SocketAddr,
    request: &[u8],
) -> std::io::Result<(u16, Instant, Option<Instant>)> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        if conn.is_none() {
            let Ok(s) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
                std::thread::sleep(Duration::from_millis(10));
                if attempt < 3 {
                    continue;
                }
                return Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
            };
            let _ = s.set_nodelay(true);
            let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
            let Ok(r) = s.try_clone() else { continue };
            *conn = Some((s, BufReader::new(r)));
        }
        let Some((w, r)) = conn.as_mut() else { continue };
        let sent = Instant::now();
        return w.write_all(request).and_then(|_| read_response(r)).map(|(s, first)| (s, sent, first));
    }
}

/// Sends `requests` over `connections` connections spread over `targets` (connection `c` to
/// `targets[c % len]`). Requests are taken from the stream in order by whichever connection
/// is free, so every router sees the same stream at the same concurrency.
pub fn run(label: &str, targets: &[SocketAddr], requests: &[Vec<u8>], connections: usize, stop: Stop) -> Load {
    let requests: Arc<Vec<Vec<u8>>> = Arc::new(requests.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let halt = Arc::new(AtomicBool::new(false));
    let began = Instant::now();
    let (measure_from, end) = match stop {
        Stop::For(d) => (began + d / 10, Some(began + d / 10 + d)),
        Stop::Once => (began, None),
    };
    let bar = match stop {
        Stop::For(d) => ProgressBar::new(d.as_millis() as u64 + d.as_millis() as u64 / 10),
        Stop::Once => ProgressBar::new(requests.len() as u64),
    };
    style(&bar, label);
    let threads: Vec<_> = (0..connections.max(1))
        .map(|c| {
            let target = targets[c % targets.len()];
            let (requests, next, done, halt) = (requests.clone(), next.clone(), done.clone(), halt.clone());
            std::thread::spawn(move || worker(target, &requests, &next, &done, &halt, stop, measure_from, end))
        })
        .collect();
    let mut timeline = vec![(0.0, 0)];
    while threads.iter().any(|t| !t.is_finished()) {
        std::thread::sleep(Duration::from_millis(100));
        timeline.push((began.elapsed().as_secs_f64(), done.load(Relaxed)));
        match stop {
            Stop::For(_) => bar.set_position(began.elapsed().as_millis() as u64),
            Stop::Once => bar.set_position(done.load(Relaxed)),
        }
        bar.set_message(format!("{:.0} req/s", done.load(Relaxed) as f64 / began.elapsed().as_secs_f64()));
        // A run that cannot finish (a router that stopped answering) is cut off.
        if began.elapsed() > Duration::from_secs(900) {
            halt.store(true, Relaxed);
        }
    }
    bar.finish_and_clear();
    let elapsed = match stop {
        Stop::For(d) => d,
        Stop::Once => began.elapsed(),
    };
    let mut total =
        Load { sent: done.load(Relaxed), ok: 0, errors: 0, elapsed, latency: histogram(), ttft: histogram(), timeline };
    for t in threads {
        if let Ok(part) = t.join() {
            total.ok += part.ok;
            total.errors += part.errors;
            let _ = total.latency.add(&part.latency);
            let _ = total.ttft.add(&part.ttft);
        }
    }
    total
}

#[allow(clippy::too_many_arguments)]
fn worker(
    target: SocketAddr,
    requests: &[Vec<u8>],
    next: &AtomicUsize,
    done: &AtomicU64,
    halt: &AtomicBool,
    stop: Stop,
    measure_from: Instant,
    end: Option<Instant>,
) -> Load {
    let mut load = Load {
        sent: 0,
        ok: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency: histogram(),
        ttft: histogram(),
        timeline: Vec::new(),
    };
    let mut conn: Option<Conn> = None;
    while !requests.is_empty() && !halt.load(Relaxed) && end.is_none_or(|e| Instant::now() < e) {
        let i = next.fetch_add(1, Relaxed);
        let request = match stop {
            Stop::For(_) => &requests[i % requests.len()],
            Stop::Once if i < requests.len() => &requests[i],
            Stop::Once => break,
        };
        let result = exchange(&mut conn, target, request);
        done.fetch_add(1, Relaxed);
        let measured = Instant::now() >= measure_from;
        match result {
            Ok((200, sent, first)) if measured => {
                load.ok += 1;
                let _ = load.latency.record((sent.elapsed().as_micros() as u64).max(1));
                let first = first.map_or(sent.elapsed(), |f| f.duration_since(sent));
                let _ = load.ttft.record((first.as_micros() as u64).max(1));
            }
            Ok((200, _, _)) => {}
            Ok(_) => {
                if measured {
                    load.errors += 1;
                }
            }
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

/// One request of a timed replay.
pub struct Timed {
    /// When it is due, from the start of the replay.
    pub at: Duration,
    /// The earlier request (its index) it follows: it leaves only once that one is answered.
    pub after: Option<usize>,
    pub request: Vec<u8>,
}

/// What a timed replay measured.
pub struct Replayed {
    pub load: Load,
    /// How late each request left, µs: its send time minus its due time (its time in the
    /// schedule, or the answer to the request it follows when that came later).
    pub lateness: Histogram<u64>,
    /// Follow-ups whose predecessor was answered after their own time in the schedule.
    pub held: u64,
}

impl Replayed {
    /// The lateness at quantile `q`, in milliseconds.
    pub fn late_ms(&self, q: f64) -> f64 {
        self.lateness.value_at_quantile(q) as f64 / 1e3
    }
}

/// Replays `requests` on their schedule (open loop) over at most `connections` connections
/// spread over `targets` as [`run`] spreads them (connection `c` to `targets[c % len]`): each
/// connection takes the next request in order, waits for its due time (and for the answer to
/// the request it follows), sends it and reads the answer. A request finds no free connection
/// when `connections` are busy: it leaves late, and [`Replayed::lateness`] says by how much.
pub fn replay(label: &str, targets: &[SocketAddr], requests: &Arc<Vec<Timed>>, connections: usize) -> Replayed {
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let halt = Arc::new(AtomicBool::new(false));
    // When each request was answered: µs since the start, plus one (0: not yet).
    let answered: Arc<Vec<AtomicU64>> = Arc::new(requests.iter().map(|_| AtomicU64::new(0)).collect());
    let began = Instant::now();
    let bar = ProgressBar::new(requests.len() as u64);
    style(&bar, label);
    let threads: Vec<_> = (0..connections.max(1))
        .map(|c| {
            let target = targets[c % targets.len()];
            let (requests, next, done, halt, answered) =
                (requests.clone(), next.clone(), done.clone(), halt.clone(), answered.clone());
            std::thread::spawn(move || timed_worker(target, &requests, &next, &done, &halt, &answered, began))
        })
        .collect();
    let mut timeline = vec![(0.0, 0)];
    while threads.iter().any(|t| !t.is_finished()) {
        std::thread::sleep(Duration::from_millis(100));
        timeline.push((began.elapsed().as_secs_f64(), done.load(Relaxed)));
        bar.set_position(done.load(Relaxed));
        bar.set_message(format!("{:.0} req/s", done.load(Relaxed) as f64 / began.elapsed().as_secs_f64()));
        if began.elapsed() > Duration::from_secs(900) {
            halt.store(true, Relaxed);
        }
    }
    bar.finish_and_clear();
    let load = Load {
        sent: done.load(Relaxed),
        ok: 0,
        errors: 0,
        elapsed: began.elapsed(),
        latency: histogram(),
        ttft: histogram(),
        timeline,
    };
    let mut total = Replayed { load, lateness: histogram(), held: 0 };
    for t in threads {
        if let Ok(part) = t.join() {
            total.load.ok += part.load.ok;
            total.load.errors += part.load.errors;
            let _ = total.load.latency.add(&part.load.latency);
            let _ = total.load.ttft.add(&part.load.ttft);
            let _ = total.lateness.add(&part.lateness);
            total.held += part.held;
        }
    }
    total
}

fn timed_worker(
    target: SocketAddr,
    requests: &[Timed],
    next: &AtomicUsize,
    done: &AtomicU64,
    halt: &AtomicBool,
    answered: &[AtomicU64],
    began: Instant,
) -> Replayed {
    let load = Load {
        sent: 0,
        ok: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency: histogram(),
        ttft: histogram(),
        timeline: Vec::new(),
    };
    let mut out = Replayed { load, lateness: histogram(), held: 0 };
    let mut conn: Option<Conn> = None;
    while !halt.load(Relaxed) {
        let i = next.fetch_add(1, Relaxed);
        let Some(timed) = requests.get(i) else { break };
        let mut due = began + timed.at;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        if let Some(before) = timed.after.and_then(|p| answered.get(p)) {
            loop {
                let at = before.load(Relaxed);
                if at > 0 {
                    let answer = began + Duration::from_micros(at - 1);
                    if answer > due {
                        due = answer;
                        out.held += 1;
                    }
                    break;
                }
                if halt.load(Relaxed) {
                    return out;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let _ = out.lateness.record((Instant::now().saturating_duration_since(due).as_micros() as u64).max(1));
        let result = exchange(&mut conn, target, &timed.request);
        answered[i].store(began.elapsed().as_micros() as u64 + 1, Relaxed);
        done.fetch_add(1, Relaxed);
        match result {
            Ok((200, sent, first)) => {
                out.load.ok += 1;
                let _ = out.load.latency.record((sent.elapsed().as_micros() as u64).max(1));
                let first = first.map_or(sent.elapsed(), |f| f.duration_since(sent));
                let _ = out.load.ttft.record((first.as_micros() as u64).max(1));
            }
            Ok(_) => out.load.errors += 1,
            Err(_) => {
                out.load.errors += 1;
                conn = None;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::steady_after;

    /// A run at 100 req/s for its first second and 1000 req/s after it.
    fn ramp() -> Vec<(f64, u64)> {
        let mut t = vec![(0.0, 0u64)];
        let mut done = 0;
        for i in 1..=60 {
            done += if i <= 10 { 10 } else { 100 };
            t.push((f64::from(i) / 10.0, done));
        }
        t
    }

    #[test]
    fn steady_state_is_where_throughput_reaches_its_late_median() {
        assert_eq!(steady_after(&ramp(), 0.5, 0.9), Some(1.0));
        let flat: Vec<(f64, u64)> = (0..=60).map(|i| (f64::from(i) / 10.0, u64::from(i as u32) * 50)).collect();
        assert_eq!(steady_after(&flat, 0.5, 0.9), Some(0.0));
        assert_eq!(steady_after(&ramp()[..4], 0.5, 0.9), None, "too short to say");
        assert_eq!(steady_after(&[], 0.5, 0.9), None);
    }
}
