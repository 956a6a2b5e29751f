//! Leases that outlive a call: renewal (a lease's own TTL) and MCP tasks (a lease that lives
//! `[tasks] lease_ttl`, with a poll schedule).
//!
//! A task's worker renews its lease while the work runs; one that dies stops renewing, and the
//! slot frees at the TTL like any lease's. Each `tasks/get` the client sends is checked here against
//! the time the task was told to come back ([`crate::engine::poll`]); polls touch no bucket.
//!
//! What this room adds to a lease lives beside the slab, not in it: a lease is 96 bytes on every
//! call's path, and only renewed leases and tasks need more. An entry whose lease has ended
//! (released, expired, cancelled) is dropped the next time the table is walked, so ending a lease
//! needs no step of its own here.

use super::*;
use crate::engine::poll::{self, PollPolicy};

/// What a renewed lease or a task keeps beyond its lease.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct LeaseExtra {
    /// The lease's own TTL: what a renewal without `ttl_ms` extends it by.
    ttl_ns: u64,
    /// A task's next poll is due then; `None` for a lease that is not a task.
    poll_due: Option<Nanos>,
}

/// The tenant's renewed leases and tasks.
#[derive(Debug, Default)]
pub(super) struct Tasks {
    extra: HashMap<u64, LeaseExtra>,
    /// The tenant's poll cursor (see [`PollPolicy::schedule`]).
    cursor: Nanos,
}

/// What a poll of a task got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollAnswer {
    /// On time: the next poll is due in this many milliseconds.
    Due { interval_ms: u64 },
    /// Too early: due in this many nanoseconds.
    Early { wait_ns: u64 },
}

impl TenantEngine {
    fn poll_policy(&self) -> PollPolicy {
        PollPolicy::new(&self.policy.cfg.tasks)
    }

    /// The lease, if it is live at `now` (a lease past its TTL that no tick has reaped yet is not).
    fn live_lease(&mut self, lease: u64, now: Nanos) -> Result<&mut Lease, UnknownLease> {
        self.leases
            .get_mut(lease)
            .filter(|l| l.expires > now)
            .ok_or(UnknownLease)
    }

    /// Drops what is kept for leases that have ended; returns the tasks still in flight.
    fn live_tasks(&mut self, now: Nanos) -> u64 {
        let leases = &self.leases;
        self.tasks
            .extra
            .retain(|id, _| leases.get(*id).is_some_and(|l| l.expires > now));
        self.tasks
            .extra
            .values()
            .filter(|e| e.poll_due.is_some())
            .count() as u64
    }

    /// Tasks in flight now, dropping what is kept for leases that ended.
    pub fn tasks_in_flight(&mut self, now: Nanos) -> u64 {
        self.live_tasks(now)
    }

    /// Tasks in flight now (for the gauges, which only read).
    pub(super) fn tasks_live(&self, now: Nanos) -> u64 {
        self.tasks
            .extra
            .iter()
            .filter(|(id, e)| {
                e.poll_due.is_some() && self.leases.get(**id).is_some_and(|l| l.expires > now)
            })
            .count() as u64
    }

    /// Sets a lease to end `ttl_ns` after `now` (after its hold, for a held call).
    fn extend(&mut self, lease: u64, ttl_ns: u64, now: Nanos) -> Result<Nanos, UnknownLease> {
        let l = self.live_lease(lease, now)?;
        let from = l.charge.as_ref().map_or(now, |c| c.hold_until.max(now));
        let expires = from.saturating_add(ttl_ns);
        l.expires = expires;
        // The old end stays in the queue and is skipped at its time (its lease ends later now).
        self.expiries.push(expires, lease);
        self.next_expiry = self.next_expiry.min(expires);
        Ok(expires)
    }

    /// Makes an admitted call's lease a task: it lives `[tasks] lease_ttl` from now, and its first
    /// poll is scheduled. Returns the poll interval in milliseconds.
    pub fn start_task(&mut self, lease: u64, now: Nanos) -> Result<u64, UnknownLease> {
        let ttl_ns = self.policy.cfg.tasks.lease_ttl.as_nanos() as u64;
        self.extend(lease, ttl_ns, now)?;
        self.last_active = now;
        let in_flight = self.live_tasks(now) + 1;
        let due = self
            .poll_policy()
            .schedule(&mut self.tasks.cursor, in_flight, now);
        self.tasks.extra.insert(
            lease,
            LeaseExtra {
                ttl_ns,
                poll_due: Some(due),
            },
        );
        Ok(poll::interval_ms(due, now))
    }

    /// A `tasks/get` for the task of `lease`: on time, it is admitted and told when to come next
    /// (the interval follows the tenant's load now); early, it is told the time left and the
    /// schedule stays. A lease that is not a task, or has ended, is unknown.
    pub fn poll_task(&mut self, lease: u64, now: Nanos) -> Result<PollAnswer, UnknownLease> {
        self.live_lease(lease, now)?;
        let in_flight = self.live_tasks(now);
        let policy = self.poll_policy();
        let Tasks { extra, cursor } = &mut self.tasks;
        let task = extra.get_mut(&lease).ok_or(UnknownLease)?;
        let due = task.poll_due.ok_or(UnknownLease)?;
        self.last_active = now;
        if let Err(wait_ns) = poll::check(due, now) {
            return Ok(PollAnswer::Early { wait_ns });
        }
        let next = policy.schedule(cursor, in_flight, now);
        task.poll_due = Some(next);
        Ok(PollAnswer::Due {
            interval_ms: poll::interval_ms(next, now),
        })
    }

    /// Extends a live lease by `ttl_ns` from now, or by its own TTL (a task's `[tasks] lease_ttl`,
    /// the last TTL it was renewed with, else `[server] lease_ttl`). The TTL given becomes the
    /// lease's own. Returns how long it now has to live.
    pub fn renew(
        &mut self,
        lease: u64,
        ttl_ns: Option<u64>,
        now: Nanos,
    ) -> Result<u64, UnknownLease> {
        self.live_lease(lease, now)?;
        self.live_tasks(now);
        let server_ttl = self.policy.cfg.server.lease_ttl.as_nanos() as u64;
        let own = self.tasks.extra.get(&lease).map(|e| e.ttl_ns);
        let ttl_ns = ttl_ns.or(own).unwrap_or(server_ttl);
        let expires = self.extend(lease, ttl_ns, now)?;
        self.last_active = now;
        self.tasks
            .extra
            .entry(lease)
            .or_insert(LeaseExtra {
                ttl_ns,
                poll_due: None,
            })
            .ttl_ns = ttl_ns;
        Ok(expires - now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_support::{call, harness};
    use crate::engine::Outcome;

    const SEC: Nanos = NS_PER_SEC;

    fn engine(toml: &str) -> TenantEngine {
        let (_clock, cfg, shared) = harness(toml, 0);
        TenantEngine::new(Arc::from("acme"), cfg, shared, 1)
    }

    fn admit(e: &mut TenantEngine, now: Nanos) -> u64 {
        match e.admit(&call("worker", "export"), now, 0) {
            AdmitResult::Decided(Decision {
                verdict: Verdict::Admitted(a),
                ..
            }) => a.lease,
            other => panic!("expected an admission, got {other:?}"),
        }
    }

    fn refused(e: &mut TenantEngine, now: Nanos) -> bool {
        matches!(e.admit(&call("worker", "export"), now, 0), AdmitResult::Decided(d) if !d.is_admitted())
    }

    const TASKS: &str = "[server]\nlease_ttl = \"30s\"\n[limits.tenant]\nconcurrency = 1\n\
        [limits.subject]\nrate = \"1000/s\"\nburst = 1000\n\
        [tasks]\npoll_interval = \"2s\"\npoll_rate = \"2/s\"\nmax_poll_interval = \"1m\"\nlease_ttl = \"10m\"\n";

    fn ok() -> ReleaseInfo {
        ReleaseInfo {
            outcome: Outcome::Ok,
            upstream_status: None,
            retry_after: None,
            duration_ms: None,
        }
    }

    #[test]
    fn a_task_lease_lives_the_task_ttl_and_frees_its_slot_there() {
        let mut e = engine(TASKS);
        let t = admit(&mut e, 0);
        assert_eq!(e.start_task(t, 0), Ok(2_000));
        // Past the call TTL the task still holds the tenant's only slot.
        let (expired, _) = e.expire_leases(31 * SEC, 0);
        assert!(expired.is_empty());
        assert!(refused(&mut e, 31 * SEC));
        // At the task TTL its worker has not renewed: the slot frees.
        let (expired, _) = e.expire_leases(600 * SEC, 0);
        assert_eq!(expired.len(), 1);
        assert_eq!(e.poll_task(t, 600 * SEC), Err(UnknownLease));
        assert_eq!(e.renew(t, None, 600 * SEC), Err(UnknownLease));
        admit(&mut e, 600 * SEC);
    }

    #[test]
    fn a_renewed_task_keeps_its_slot_past_the_ttl() {
        let mut e = engine(TASKS);
        let t = admit(&mut e, 0);
        e.start_task(t, 0).unwrap();
        // Renewed every 5 minutes by its worker, for an hour: never expires.
        for i in 1..=12 {
            let now = i * 300 * SEC;
            assert_eq!(
                e.renew(t, None, now),
                Ok(600 * SEC),
                "default: the task TTL"
            );
            e.expire_leases(now, 0);
            assert!(refused(&mut e, now));
        }
        // A renewal with its own TTL makes that the lease's TTL from then on.
        let now = 3_700 * SEC;
        assert_eq!(e.renew(t, Some(20 * SEC), now), Ok(20 * SEC));
        assert_eq!(e.renew(t, None, now + SEC), Ok(20 * SEC));
        e.expire_leases(now + 21 * SEC, 0);
        assert!(!refused(&mut e, now + 21 * SEC), "its slot is free");
    }

    #[test]
    fn a_call_lease_is_renewed_by_the_server_ttl() {
        let mut e = engine(TASKS);
        let c = admit(&mut e, 0);
        assert_eq!(e.renew(c, None, 20 * SEC), Ok(30 * SEC));
        let (expired, _) = e.expire_leases(31 * SEC, 0);
        assert!(expired.is_empty(), "renewed at 20 s, it lives until 50 s");
        assert_eq!(e.poll_task(c, 31 * SEC), Err(UnknownLease), "not a task");
        let (expired, _) = e.expire_leases(50 * SEC, 0);
        assert_eq!(expired.len(), 1);
    }

    #[test]
    fn ten_tasks_at_two_per_second_poll_every_five_seconds_staggered() {
        let mut e = engine(
            "[limits.tenant]\nconcurrency = 100\n[limits.subject]\nconcurrency = 100\nrate = \"1000/s\"\nburst = 1000\n\
             [tasks]\npoll_rate = \"2/s\"\n",
        );
        let tasks: Vec<u64> = (0..10).map(|_| admit(&mut e, 0)).collect();
        let told: Vec<u64> = tasks.iter().map(|&t| e.start_task(t, 0).unwrap()).collect();
        // The tenth is told 5 s at least (10 tasks / 2 per second); no two are told the same time.
        assert!(told[9] >= 5_000, "{told:?}");
        let mut sorted = told.clone();
        sorted.dedup();
        assert_eq!(sorted.len(), 10, "staggered: {told:?}");
        assert!(told.iter().all(|&ms| ms >= 2_000), "{told:?}");
        // Each polls when due: admitted, and told at least 5 s from then on.
        let mut due: Vec<Nanos> = told.iter().map(|ms| ms * NS_PER_MS).collect();
        for _round in 0..3 {
            for (t, d) in tasks.iter().zip(due.iter_mut()) {
                match e.poll_task(*t, *d) {
                    Ok(PollAnswer::Due { interval_ms }) => {
                        assert!(interval_ms >= 5_000, "{interval_ms}");
                        assert!(interval_ms <= 10_000, "{interval_ms}");
                        *d += interval_ms * NS_PER_MS;
                    }
                    other => panic!("an on-time poll is admitted: {other:?}"),
                }
            }
        }
        assert_eq!(e.tasks_in_flight(0), 10);
    }

    #[test]
    fn an_early_poll_is_told_the_time_left_and_moves_nothing() {
        let mut e = engine(TASKS);
        let t = admit(&mut e, 0);
        assert_eq!(e.start_task(t, 0), Ok(2_000));
        assert_eq!(
            e.poll_task(t, SEC / 2),
            Ok(PollAnswer::Early {
                wait_ns: 3 * SEC / 2
            })
        );
        assert_eq!(
            e.poll_task(t, SEC),
            Ok(PollAnswer::Early { wait_ns: SEC }),
            "an early poll does not push the due time"
        );
        // Within the grace counts as on time.
        assert_eq!(
            e.poll_task(t, 2 * SEC - 10 * NS_PER_MS),
            Ok(PollAnswer::Due { interval_ms: 2_000 })
        );
        // A second poll at once is early again.
        assert!(matches!(
            e.poll_task(t, 2 * SEC),
            Ok(PollAnswer::Early { .. })
        ));
    }

    #[test]
    fn polls_spend_no_tool_budget() {
        let mut e = engine(
            "[limits.subject]\nrate = \"1/min\"\nburst = 1\n[tasks]\npoll_interval = \"100ms\"\npoll_rate = \"100/s\"\n",
        );
        let t = admit(&mut e, 0);
        e.start_task(t, 0).unwrap();
        let mut now = 0;
        for _ in 0..50 {
            now += SEC;
            assert!(matches!(e.poll_task(t, now), Ok(PollAnswer::Due { .. })));
        }
        // The subject's one token per minute went to the task itself; polls took none.
        assert!(
            refused(&mut e, now),
            "the bucket refills on its own schedule only"
        );
        assert!(!refused(&mut e, 61 * SEC));
    }

    #[test]
    fn a_released_task_is_unknown_and_no_longer_counts() {
        let mut e = engine(TASKS.replace("concurrency = 1", "concurrency = 5").as_str());
        let a = admit(&mut e, 0);
        let b = admit(&mut e, 0);
        e.start_task(a, 0).unwrap();
        e.start_task(b, 0).unwrap();
        assert_eq!(e.tasks_in_flight(0), 2);
        e.release(a, &ok(), SEC, 0).unwrap();
        assert_eq!(e.poll_task(a, 10 * SEC), Err(UnknownLease));
        assert_eq!(e.renew(a, None, 10 * SEC), Err(UnknownLease));
        assert_eq!(e.tasks_in_flight(10 * SEC), 1);
        // A new lease in the released one's slot is not the task.
        let c = admit(&mut e, 11 * SEC);
        assert_eq!(e.poll_task(c, 20 * SEC), Err(UnknownLease));
        assert_eq!(e.tasks.extra.len(), 1);
    }

    #[test]
    fn a_held_task_lives_its_ttl_from_the_end_of_its_hold() {
        let mut e =
            engine("[limits.subject]\nrate = \"1/s\"\nburst = 1\n[tasks]\nlease_ttl = \"10s\"\n");
        admit(&mut e, 0);
        let held = e.admit(
            &crate::engine::test_support::Req::wait_ms(call("worker", "export"), 2_000),
            0,
            0,
        );
        let AdmitResult::Decided(Decision {
            verdict: Verdict::Admitted(a),
            ..
        }) = held
        else {
            panic!("expected a held admission");
        };
        assert_eq!(a.hold_ns, SEC);
        e.start_task(a.lease, 0).unwrap();
        let (expired, _) = e.expire_leases(10 * SEC + SEC / 2, 0);
        assert!(expired.is_empty());
        let (expired, _) = e.expire_leases(11 * SEC, 0);
        assert_eq!(expired.len(), 1);
    }
}
