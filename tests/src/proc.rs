//! Child processes that die with their handle, free ports, and bounded waiting on conditions.

use std::fs::File;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A child process, killed (and reaped) on drop. Its output goes to a log file in
/// `$TMPDIR/kvmesh-logs`, removed when it stops unless [`keep_logs`] was called.
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command) -> anyhow::Result<Proc> {
        let dir = std::env::temp_dir().join("kvmesh-logs");
        std::fs::create_dir_all(&dir)?;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let log = dir.join(format!("{name}-{}-{n}.log", std::process::id()));
        let out = File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        Ok(Proc { name: name.to_string(), child, log })
    }

    /// The last lines of the process's output, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        format!("{} output ({}):\n{tail}", self.name, self.log.display())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `Some(exit status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (what Kubernetes sends a pod it stops) and waits up to `limit` for the
    /// process to exit: its exit status.
    pub fn terminate(&mut self, limit: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let sent = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status().context("cannot run kill")?;
        if !sent.success() {
            bail!("kill -TERM {} failed ({sent})", self.pid());
        }
        let mut status = None;
        wait_until(&format!("{} to exit after SIGTERM", self.name), limit, || {
            status = self.exited();
            status.is_some()
        })
        .map_err(|e| e.context(self.log_tail()))?;
        status.context("no exit status")
    }
}

impl Drop for Proc {
    /// Stops the process; its log goes with it unless the test is failing by a panic or logs
    /// are kept ([`keep_logs`], `KVMESH_KEEP_LOGS`). A test that fails by returning an error
    /// already carries the log's tail in its message.
    fn drop(&mut self) {
        self.kill();
        let keep = KEEP_LOGS.load(Ordering::Relaxed) || std::env::var_os("KVMESH_KEEP_LOGS").is_some();
        if !keep && !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

static KEEP_LOGS: AtomicBool = AtomicBool::new(false);

/// Keeps every process's log after it stops (`cargo xtask up`: its console names the log
/// of a process that exited).
pub fn keep_logs() {
    KEEP_LOGS.store(true, Ordering::Relaxed);
}

/// A port that is free on 127.0.0.1 now, for a child process to listen on.
///
/// Ports come from below the kernel's ephemeral range (`ip_local_port_range`), never from
/// it: a port the kernel hands out for `bind(0)` is also what it hands out as the local
/// port of outgoing connections, so between this function releasing such a port and the
/// child binding it, any client, Envoy upstream connection or other test could take it
/// (CI failed on `cannot bind ...: Address already in use` that way). Below the range only
/// explicit binds compete: a process-wide cursor keeps this process's tests apart, its
/// start depends on the pid so consecutive test binaries start apart, and each candidate
/// is checked by binding it. Falls back to `bind(0)` when the ephemeral range leaves no
/// room below it.
pub fn free_port() -> anyhow::Result<u16> {
    let (low, high) = fixed_port_range();
    if high <= low {
        return Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
    }
    let span = usize::from(high - low);
    let start = CURSOR.get_or_init(|| AtomicUsize::new((std::process::id() as usize).wrapping_mul(7919) % span));
    for _ in 0..span {
        let offset = start.fetch_add(1, Ordering::Relaxed) % span;
        let port = low + offset as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port on 127.0.0.1 in {low}..{high}")
}

static CURSOR: std::sync::OnceLock<AtomicUsize> = std::sync::OnceLock::new();

/// `[low, high)`: from 10000 up to the start of the ephemeral range (Linux default 32768).
fn fixed_port_range() -> (u16, u16) {
    const LOW: u16 = 10_000;
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32_768);
    (LOW, ephemeral_start)
}

/// Polls `cond` every 20 ms until it holds, for at most `limit`.
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        if cond() {
            return Ok(());
        }
        if start.elapsed() > limit {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let (low, high) = fixed_port_range();
        let ports: Vec<u16> = (0..64).map(|_| free_port().unwrap()).collect();
        let distinct: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        for port in ports {
            if high > low {
                assert!((low..high).contains(&port), "{port} is not in {low}..{high}");
            }
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }
}
