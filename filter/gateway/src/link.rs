//! The control-plane link of one VM, as an explicit state machine: who holds the streams
//! (the lease), when to (re)connect (exponential backoff), and when to report.
//!
//! Time comes in as milliseconds and the lease as a boolean the caller read from shared
//! data; the machine answers with what to do, so that its whole life — standby, connecting,
//! connected, closed, backing off, handing over — is unit-tested natively.

/// How long a lease lasts without renewal.
pub const LEASE_MS: u64 = 3_000;
pub const MIN_BACKOFF_MS: u64 = 100;
/// A second at most: after a control-plane restart or a standby's takeover the gateways are
/// back within about a second of it serving (a few hundred streams a second at most to a
/// control plane that is down).
pub const MAX_BACKOFF_MS: u64 = 1_000;
/// In-flight counts go out at least this often even with no new inserts.
pub const COUNTS_EVERY_MS: u64 = 1_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Another VM holds the lease: no streams here.
    Standby,
    /// This VM holds the lease; the streams are closed until `retry_at_ms`.
    Disconnected { retry_at_ms: u64 },
    /// Both streams are open.
    Connected { watch: u32, report: u32, last_report_ms: u64 },
}

/// What the glue must do on a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Nothing,
    /// Open both streams, send the watch request and a full report, then call
    /// [`Link::connected`] (or [`Link::connect_failed`]).
    Connect,
    /// The lease moved to another VM: cancel these streams.
    Close {
        watch: u32,
        report: u32,
    },
    /// Take a report; send it on `report` if it has inserts or `counts_due`, then call
    /// [`Link::reported`].
    Report {
        report: u32,
        counts_due: bool,
    },
}

#[derive(Debug)]
pub struct Link {
    state: State,
    backoff_ms: u64,
    report_interval_ms: u64,
}

impl Link {
    pub fn new(report_interval_ms: u64) -> Self {
        Self { state: State::Standby, backoff_ms: MIN_BACKOFF_MS, report_interval_ms: report_interval_ms.max(1) }
    }

    /// Whether this VM's streams are open.
    pub fn is_connected(&self) -> bool {
        matches!(self.state, State::Connected { .. })
    }

    /// The tokens of the open streams.
    pub fn streams(&self) -> Option<(u32, u32)> {
        match self.state {
            State::Connected { watch, report, .. } => Some((watch, report)),
            _ => None,
        }
    }

    pub fn is_watch(&self, token: u32) -> bool {
        matches!(self.state, State::Connected { watch, .. } if watch == token)
    }

    /// The current backoff (the delay before the next attempt after a failure).
    pub fn backoff_ms(&self) -> u64 {
        self.backoff_ms
    }

    /// One tick at `now_ms`; `holds_lease` says whether this VM took or renewed the lease.
    pub fn tick(&mut self, now_ms: u64, holds_lease: bool) -> Step {
        match (self.state, holds_lease) {
            (State::Standby, false) => Step::Nothing,
            (State::Disconnected { .. }, false) => {
                self.state = State::Standby;
                Step::Nothing
            }
            (State::Connected { watch, report, .. }, false) => {
                self.state = State::Standby;
                Step::Close { watch, report }
            }
            (State::Standby, true) => Step::Connect,
            (State::Disconnected { retry_at_ms }, true) if now_ms >= retry_at_ms => Step::Connect,
            (State::Disconnected { .. }, true) => Step::Nothing,
            (State::Connected { report, last_report_ms, .. }, true) => {
                let since = now_ms.saturating_sub(last_report_ms);
                if since >= self.report_interval_ms {
                    Step::Report { report, counts_due: since >= COUNTS_EVERY_MS }
                } else {
                    Step::Nothing
                }
            }
        }
    }

    /// The streams opened (the full report already went out on `report`).
    pub fn connected(&mut self, watch: u32, report: u32, now_ms: u64) {
        self.state = State::Connected { watch, report, last_report_ms: now_ms };
    }

    /// Opening the streams failed: try again after the backoff.
    pub fn connect_failed(&mut self, now_ms: u64) {
        self.back_off(now_ms);
    }

    /// A report went out at `now_ms`.
    pub fn reported(&mut self, now_ms: u64) {
        if let State::Connected { last_report_ms, .. } = &mut self.state {
            *last_report_ms = now_ms;
        }
    }

    /// A snapshot arrived: the link is healthy, so the next failure starts the backoff anew.
    pub fn snapshot_received(&mut self) {
        self.backoff_ms = MIN_BACKOFF_MS;
    }

    /// A stream closed (by the peer or a failed send). If it was one of ours, both are done:
    /// returns the other one's token to cancel (the closed one needs no cancel).
    pub fn stream_closed(&mut self, token: u32, now_ms: u64) -> Option<Option<u32>> {
        let State::Connected { watch, report, .. } = self.state else { return None };
        let other = if token == watch {
            report
        } else if token == report {
            watch
        } else {
            return None;
        };
        self.back_off(now_ms);
        Some(Some(other))
    }

    /// Sending on the streams failed: both must be cancelled; returns their tokens.
    pub fn send_failed(&mut self, now_ms: u64) -> Option<(u32, u32)> {
        let streams = self.streams();
        if streams.is_some() {
            self.back_off(now_ms);
        }
        streams
    }

    fn back_off(&mut self, now_ms: u64) {
        self.state = State::Disconnected { retry_at_ms: now_ms.saturating_add(self.backoff_ms) };
        self.backoff_ms = self.backoff_ms.saturating_mul(2).min(MAX_BACKOFF_MS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standby_until_the_lease_is_held_then_connect() {
        let mut l = Link::new(20);
        assert_eq!(l.tick(0, false), Step::Nothing);
        assert_eq!(l.tick(20, true), Step::Connect);
        l.connected(1, 2, 20);
        assert!(l.is_connected() && l.is_watch(1) && !l.is_watch(2));
        assert_eq!(l.streams(), Some((1, 2)));
    }

    #[test]
    fn reports_follow_the_interval_and_counts_go_out_every_second() {
        let mut l = Link::new(20);
        l.tick(0, true);
        l.connected(1, 2, 0);
        assert_eq!(l.tick(10, true), Step::Nothing);
        assert_eq!(l.tick(20, true), Step::Report { report: 2, counts_due: false });
        // Nothing to send at 20 (no inserts): the glue does not call `reported`.
        assert_eq!(l.tick(999, true), Step::Report { report: 2, counts_due: false });
        assert_eq!(l.tick(1_000, true), Step::Report { report: 2, counts_due: true });
        l.reported(1_000);
        assert_eq!(l.tick(1_010, true), Step::Nothing);
        assert_eq!(l.tick(1_020, true), Step::Report { report: 2, counts_due: false });
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_cap_and_a_snapshot_resets_it() {
        let mut l = Link::new(20);
        let mut now = 0;
        let mut delays = Vec::new();
        for _ in 0..8 {
            assert_eq!(l.tick(now, true), Step::Connect);
            let before = l.backoff_ms();
            l.connect_failed(now);
            assert_eq!(l.tick(now + before - 1, true), Step::Nothing, "waits for the backoff");
            delays.push(before);
            now += before;
        }
        assert_eq!(delays, vec![100, 200, 400, 800, 1000, 1000, 1000, 1000]);
        assert_eq!(l.tick(now, true), Step::Connect);
        l.connected(3, 4, now);
        l.snapshot_received();
        assert_eq!(l.backoff_ms(), MIN_BACKOFF_MS);
    }

    #[test]
    fn a_closed_stream_closes_the_other_and_reconnects_after_backoff() {
        let mut l = Link::new(20);
        l.tick(0, true);
        l.connected(5, 6, 0);
        assert_eq!(l.stream_closed(9, 10), None, "not ours");
        assert_eq!(l.stream_closed(5, 10), Some(Some(6)));
        assert!(!l.is_connected());
        assert_eq!(l.stream_closed(6, 11), None, "already handled");
        assert_eq!(l.tick(109, true), Step::Nothing);
        assert_eq!(l.tick(110, true), Step::Connect);
    }

    #[test]
    fn a_failed_send_cancels_both() {
        let mut l = Link::new(20);
        l.tick(0, true);
        l.connected(5, 6, 0);
        assert_eq!(l.send_failed(30), Some((5, 6)));
        assert_eq!(l.send_failed(31), None);
        assert_eq!(l.tick(129, true), Step::Nothing);
        assert_eq!(l.tick(130, true), Step::Connect);
    }

    #[test]
    fn losing_the_lease_closes_the_streams_and_waits_in_standby() {
        let mut l = Link::new(20);
        l.tick(0, true);
        l.connected(5, 6, 0);
        assert_eq!(l.tick(20, false), Step::Close { watch: 5, report: 6 });
        assert!(!l.is_connected());
        assert_eq!(l.tick(40, false), Step::Nothing);
        // A VM backing off that loses the lease stops trying.
        let mut m = Link::new(20);
        m.tick(0, true);
        m.connect_failed(0);
        assert_eq!(m.tick(50, false), Step::Nothing);
        assert_eq!(m.tick(60, true), Step::Connect, "lease regained: connects at once");
    }
}
