//! Keeps the local stack's processes running the way a Kubernetes Deployment would: a process
//! that exits is reported on the console and started again (with a growing delay if it keeps
//! dying), while everything else keeps serving.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use kvmesh_testkit::Proc;

/// The first delay before a restart; it doubles while the process keeps dying, up to
/// [`MAX_DELAY`], and starts over once it has stayed up for [`STABLE`].
const FIRST_DELAY: Duration = Duration::from_millis(500);
const MAX_DELAY: Duration = Duration::from_secs(10);
const STABLE: Duration = Duration::from_secs(30);

/// One supervised process: a handle `T` (a sim, the control plane, an Envoy) and how to
/// start it again.
pub struct Supervised<T> {
    pub name: String,
    pub item: Option<T>,
    start: Box<dyn FnMut() -> anyhow::Result<T>>,
    proc_of: fn(&mut T) -> &mut Proc,
    delay: Duration,
    restart_at: Option<Instant>,
    started: Instant,
    pub restarts: u32,
}

impl<T> Supervised<T> {
    pub fn new(
        name: impl Into<String>,
        item: T,
        proc_of: fn(&mut T) -> &mut Proc,
        start: impl FnMut() -> anyhow::Result<T> + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            item: Some(item),
            start: Box::new(start),
            proc_of,
            delay: FIRST_DELAY,
            restart_at: None,
            started: Instant::now(),
            restarts: 0,
        }
    }

    /// Checks the process at `now`: reports an exit and schedules a restart; restarts when
    /// due. Returns what happened, for the console.
    pub fn check(&mut self, now: Instant) -> Option<String> {
        if let Some(item) = self.item.as_mut() {
            let status: Option<ExitStatus> = (self.proc_of)(item).exited();
            let status = status?;
            let tail = (self.proc_of)(item).log_tail();
            self.item = None;
            if now.duration_since(self.started) >= STABLE {
                self.delay = FIRST_DELAY;
            }
            self.restart_at = Some(now + self.delay);
            let msg = format!(
                "{} exited ({status}); restarting it in {:?}, the rest keeps serving\n{}",
                self.name,
                self.delay,
                tail.trim_end()
            );
            self.delay = (self.delay * 2).min(MAX_DELAY);
            return Some(msg);
        }
        if self.restart_at.is_some_and(|at| now >= at) {
            match (self.start)() {
                Ok(item) => {
                    self.item = Some(item);
                    self.restart_at = None;
                    self.started = now;
                    self.restarts += 1;
                    return Some(format!("{} restarted", self.name));
                }
                Err(e) => {
                    self.restart_at = Some(now + self.delay);
                    let msg = format!("{} could not be restarted ({e:#}); trying again in {:?}", self.name, self.delay);
                    self.delay = (self.delay * 2).min(MAX_DELAY);
                    return Some(msg);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    fn sleeper(secs: &str) -> anyhow::Result<Proc> {
        let mut cmd = Command::new("sleep");
        cmd.arg(secs);
        Proc::spawn("sleep", cmd)
    }

    #[test]
    fn an_exited_process_is_reported_then_restarted_after_a_growing_delay() {
        let mut s = Supervised::new("sleeper", sleeper("0").unwrap(), |p| p, || sleeper("0"));
        let t0 = Instant::now();
        // `sleep 0` exits at once: the first check that sees it reports it.
        let mut msg = None;
        for _ in 0..200 {
            msg = s.check(t0);
            if msg.is_some() {
                break;
            }
            std::thread::yield_now();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(msg.unwrap().contains("exited"));
        assert!(s.item.is_none());
        assert_eq!(s.check(t0 + FIRST_DELAY / 2), None, "not before its delay");
        assert_eq!(s.check(t0 + FIRST_DELAY).as_deref(), Some("sleeper restarted"));
        assert_eq!(s.restarts, 1);
        // It dies again at once: the next delay is twice as long.
        let t1 = t0 + FIRST_DELAY;
        let mut seen = None;
        for _ in 0..200 {
            seen = s.check(t1);
            if seen.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(seen.unwrap().contains(&format!("{:?}", FIRST_DELAY * 2)));
    }

    #[test]
    fn a_running_process_is_left_alone() {
        let mut s = Supervised::new("sleeper", sleeper("30").unwrap(), |p| p, || sleeper("30"));
        assert_eq!(s.check(Instant::now()), None);
        assert!(s.item.is_some());
    }
}
