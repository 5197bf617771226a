//! The decision of one election round, apart from the API calls: given the Lease as read,
//! create it, take it over or renew it (a replace), or leave it to its holder. A holder's
//! lease runs out `leaseDurationSeconds` after this replica last saw the record change, on
//! this replica's own monotonic clock (client-go's rule: no comparison of two machines'
//! wall clocks).

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

/// What to do with the Lease.
#[derive(Clone, Debug, PartialEq)]
pub enum Attempt {
    /// There is none: create it, held by this replica.
    Create(LeaseSpec),
    /// Renew it (held by this replica) or take it over (free, or its holder's lease ran
    /// out): replace it, guarded by the resourceVersion read.
    Replace(LeaseSpec),
    /// Another replica holds it and its lease runs.
    Held { holder: String },
}

/// One replica's view of the Lease across rounds.
#[derive(Debug)]
pub struct Elector {
    identity: String,
    lease_secs: i32,
    /// The record last seen and when it was first seen so.
    observed: Option<(LeaseSpec, Instant)>,
}

impl Elector {
    pub fn new(identity: &str, lease_duration: Duration) -> Self {
        let lease_secs = i32::try_from(lease_duration.as_secs() + u64::from(lease_duration.subsec_nanos() > 0))
            .unwrap_or(i32::MAX)
            .max(1);
        Self { identity: identity.to_string(), lease_secs, observed: None }
    }

    /// The round's decision for the Lease as read at `now` (`wall`: the time to record).
    pub fn attempt(&mut self, current: Option<&LeaseSpec>, now: Instant, wall: MicroTime) -> Attempt {
        let Some(spec) = current else {
            self.observed = None;
            return Attempt::Create(LeaseSpec {
                holder_identity: Some(self.identity.clone()),
                lease_duration_seconds: Some(self.lease_secs),
                acquire_time: Some(wall.clone()),
                renew_time: Some(wall),
                lease_transitions: Some(0),
                ..Default::default()
            });
        };
        let observed_at = match &self.observed {
            Some((seen, at)) if seen == spec => *at,
            _ => {
                self.observed = Some((spec.clone(), now));
                now
            }
        };
        let holder = spec.holder_identity.as_deref().unwrap_or_default();
        let mine = holder == self.identity;
        let secs = spec.lease_duration_seconds.filter(|s| *s > 0).unwrap_or(self.lease_secs);
        let expires = observed_at + Duration::from_secs(u64::try_from(secs).unwrap_or(0));
        if !holder.is_empty() && !mine && now < expires {
            return Attempt::Held { holder: holder.to_string() };
        }
        let transitions = spec.lease_transitions.unwrap_or(0);
        Attempt::Replace(LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.lease_secs),
            acquire_time: if mine { spec.acquire_time.clone() } else { Some(wall.clone()) },
            renew_time: Some(wall),
            lease_transitions: Some(if mine { transitions } else { transitions.saturating_add(1) }),
            ..Default::default()
        })
    }

    /// Giving the Lease up (this replica is stopping), as client-go's `ReleaseOnCancel` does:
    /// the record `current` replaced by one with no holder, a one-second lease and the same
    /// transitions, which a standby takes over on its next round; None when another replica
    /// holds it (nothing to give up).
    pub fn release(&self, current: &LeaseSpec, wall: MicroTime) -> Option<LeaseSpec> {
        if current.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return None;
        }
        Some(LeaseSpec {
            holder_identity: Some(String::new()),
            lease_duration_seconds: Some(1),
            acquire_time: Some(wall.clone()),
            renew_time: Some(wall),
            lease_transitions: current.lease_transitions,
            ..Default::default()
        })
    }

    /// The write of `spec` succeeded at `now`: it is the record last seen.
    pub fn wrote(&mut self, spec: LeaseSpec, now: Instant) {
        self.observed = Some((spec, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn wall(secs: i64) -> MicroTime {
        MicroTime(Timestamp::from_second(1_700_000_000 + secs).unwrap())
    }

    fn holder(a: &Attempt) -> Option<&str> {
        match a {
            Attempt::Create(s) | Attempt::Replace(s) => s.holder_identity.as_deref(),
            Attempt::Held { .. } => None,
        }
    }

    #[test]
    fn a_missing_lease_is_created_held_by_this_replica() {
        let mut e = Elector::new("a", Duration::from_millis(1500));
        let Attempt::Create(spec) = e.attempt(None, Instant::now(), wall(0)) else { panic!("create") };
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_duration_seconds, Some(2), "whole seconds, rounded up");
        assert_eq!(spec.lease_transitions, Some(0));
        assert_eq!(spec.acquire_time, Some(wall(0)));
    }

    #[test]
    fn another_holders_lease_runs_for_its_duration_from_when_this_replica_saw_it_change() {
        let t0 = Instant::now();
        let mut b = Elector::new("b", Duration::from_secs(2));
        let held = LeaseSpec {
            holder_identity: Some("a".into()),
            lease_duration_seconds: Some(2),
            renew_time: Some(wall(-3600)), // another clock: never compared with this one
            lease_transitions: Some(4),
            ..Default::default()
        };
        assert_eq!(b.attempt(Some(&held), t0, wall(0)), Attempt::Held { holder: "a".into() });
        assert_eq!(
            b.attempt(Some(&held), t0 + Duration::from_millis(1900), wall(1)),
            Attempt::Held { holder: "a".into() }
        );
        // A renewal seen restarts the wait.
        let renewed = LeaseSpec { renew_time: Some(wall(-3599)), ..held.clone() };
        let t1 = t0 + Duration::from_millis(1950);
        assert!(matches!(b.attempt(Some(&renewed), t1, wall(2)), Attempt::Held { .. }));
        assert!(matches!(b.attempt(Some(&renewed), t1 + Duration::from_millis(1999), wall(3)), Attempt::Held { .. }));
        // Unchanged for the whole duration: taken over, one more transition.
        let Attempt::Replace(spec) = b.attempt(Some(&renewed), t1 + Duration::from_secs(2), wall(4)) else {
            panic!("take over")
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("b"));
        assert_eq!(spec.lease_transitions, Some(5));
        assert_eq!(spec.acquire_time, Some(wall(4)));
        assert_eq!(spec.renew_time, Some(wall(4)));
    }

    #[test]
    fn the_holder_renews_keeping_its_acquire_time_and_transitions() {
        let mut a = Elector::new("a", Duration::from_secs(15));
        let mine = LeaseSpec {
            holder_identity: Some("a".into()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(wall(0)),
            renew_time: Some(wall(0)),
            lease_transitions: Some(2),
            ..Default::default()
        };
        let Attempt::Replace(spec) = a.attempt(Some(&mine), Instant::now(), wall(2)) else { panic!("renew") };
        assert_eq!(spec.acquire_time, Some(wall(0)));
        assert_eq!(spec.renew_time, Some(wall(2)));
        assert_eq!(spec.lease_transitions, Some(2));
        a.wrote(spec, Instant::now());
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let mut b = Elector::new("b", Duration::from_secs(15));
        let free = LeaseSpec { lease_duration_seconds: Some(15), lease_transitions: Some(1), ..Default::default() };
        let a = b.attempt(Some(&free), Instant::now(), wall(0));
        assert_eq!(holder(&a), Some("b"));
        assert!(matches!(a, Attempt::Replace(_)));
    }

    #[test]
    fn the_holder_releases_to_no_holder_and_a_standby_takes_it_on_its_next_round() {
        let a = Elector::new("a", Duration::from_secs(15));
        let mine = LeaseSpec {
            holder_identity: Some("a".into()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(wall(0)),
            renew_time: Some(wall(5)),
            lease_transitions: Some(3),
            ..Default::default()
        };
        let theirs = LeaseSpec { holder_identity: Some("b".into()), ..mine.clone() };
        assert_eq!(a.release(&theirs, wall(6)), None, "not ours to give up");
        let released = a.release(&mine, wall(6)).unwrap();
        assert_eq!(released.holder_identity.as_deref(), Some(""));
        assert_eq!((released.lease_duration_seconds, released.lease_transitions), (Some(1), Some(3)));
        assert_eq!((released.acquire_time.clone(), released.renew_time.clone()), (Some(wall(6)), Some(wall(6))));
        // A standby that has just seen a's fresh renewal still takes the released record at once.
        let mut b = Elector::new("b", Duration::from_secs(15));
        let t0 = Instant::now();
        assert!(matches!(b.attempt(Some(&mine), t0, wall(5)), Attempt::Held { .. }));
        let taken = b.attempt(Some(&released), t0 + Duration::from_millis(1), wall(6));
        assert_eq!(holder(&taken), Some("b"));
        let Attempt::Replace(spec) = taken else { panic!("take over") };
        assert_eq!(spec.lease_transitions, Some(4));
    }

    /// Two standbys that both see the lease run out both try to replace it: only the API
    /// server's resourceVersion check (409 for the second) keeps one leader, and the loser's
    /// next round sees the winner's fresh record as held.
    #[test]
    fn after_a_lost_race_the_winners_record_is_held() {
        let t0 = Instant::now();
        let mut c = Elector::new("c", Duration::from_secs(2));
        let old =
            LeaseSpec { holder_identity: Some("a".into()), lease_duration_seconds: Some(2), ..Default::default() };
        c.attempt(Some(&old), t0, wall(0));
        assert_eq!(holder(&c.attempt(Some(&old), t0 + Duration::from_secs(3), wall(3))), Some("c"));
        let won_by_b = LeaseSpec {
            holder_identity: Some("b".into()),
            lease_duration_seconds: Some(2),
            renew_time: Some(wall(3)),
            lease_transitions: Some(1),
            ..Default::default()
        };
        assert_eq!(
            c.attempt(Some(&won_by_b), t0 + Duration::from_millis(3100), wall(3)),
            Attempt::Held { holder: "b".into() }
        );
    }
}
