//! The probe schedule on a fake clock: where the rate holds, how far and how often it probes, what a
//! 429 during a probe changes, and how a raised limit is found again.

use std::time::Duration;

use super::*;

const S: Nanos = NS_PER_SEC;
const MS: Nanos = NS_PER_MS;

fn aimd() -> Aimd {
    Aimd {
        factor: 0.5,
        floor: 0.1,
        recover: 0.05,
    }
}

fn probing() -> Probing {
    Probing {
        every: Duration::from_secs(10),
        step: 0.05,
        hold: 0.9,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// A probe that learned a ceiling of 1/3 (20/s of 60/s) at `t`, recovered to its hold.
fn learned_at(t: Nanos) -> Probe {
    let (a, p) = (aimd(), probing());
    let mut probe = Probe::default();
    assert!(probe.refused(t, Some(1.0 / 3.0), &a, &p));
    assert!(close(probe.ceiling, 1.0 / 3.0), "{probe:?}");
    // cut to half of the rate in force, then healthy answers win it back up to the hold, no further
    assert!(close(probe.m, 0.3), "{probe:?}");
    probe
}

/// Healthy answers at `rate` (a multiplier) from `from` to `to`, one every 10 ms.
fn serve(probe: &mut Probe, from: Nanos, to: Nanos, rate: f64) {
    let (a, p) = (aimd(), probing());
    let mut t = from;
    while t < to {
        probe.served(t, rate * 0.01, &a, &p);
        t += 10 * MS;
    }
}

#[test]
fn nothing_learned_means_the_configured_rate_and_no_probe() {
    let (a, p) = (aimd(), probing());
    let mut probe = Probe::default();
    assert!(!probe.learned());
    assert_eq!(probe.multiplier(5 * S), 1.0);
    assert!(!probe.served(5 * S, 0.01, &a, &p));
    assert_eq!(probe.next_change(5 * S), Nanos::MAX);
}

#[test]
fn a_429_learns_a_ceiling_and_the_rate_holds_below_it_until_the_first_probe() {
    let (a, p) = (aimd(), probing());
    let t = 100 * S;
    let mut probe = Probe::default();
    // The rate in force was the configured one; what was served says 20 of 60.
    probe.refused(t, Some(1.0 / 3.0), &a, &p);
    // a cut to at most the hold, 90% of the ceiling
    assert!(close(probe.multiplier(t), 0.3));
    assert!(close(probe.hold(&p), 0.3));
    // Without a served rate, the cut is aimd_factor of the rate in force and the ceiling is that rate.
    let mut blind = Probe::default();
    blind.refused(t, None, &a, &p);
    assert_eq!((blind.ceiling, blind.m), (1.0, 0.5));
    for i in 0..8 {
        blind.served(t + i * MS, 0.0, &a, &p);
    }
    assert!(
        close(blind.m, 0.9),
        "recovers to the hold, no further: {}",
        blind.m
    );
    // The first probe is planned probe_every later, 5% above the ceiling, and lasts 3 s.
    assert_eq!(probe.at, t + 10 * S);
    assert!(close(probe.target, 0.35));
    assert_eq!(probe.next_change(t), t + 10 * S);
    assert!(close(probe.multiplier(t + 10 * S - 1), 0.3));
    assert!(close(probe.multiplier(t + 10 * S), 0.35));
    assert!(close(probe.multiplier(t + 13 * S - 1), 0.35));
    assert_eq!(probe.next_change(t + 11 * S), t + 13 * S);
    assert!(close(probe.multiplier(t + 13 * S), 0.3));
}

#[test]
fn a_429_during_a_probe_keeps_the_ceiling_cuts_and_widens_the_wait() {
    let (a, p) = (aimd(), probing());
    let t = 100 * S;
    let mut probe = learned_at(t);
    serve(&mut probe, t, t + 10 * S, 0.3);
    // The probe starts at t + 10 s; the upstream refuses 1.5 s into it. It had served 21/s.
    serve(&mut probe, t + 10 * S, t + 11_500 * MS, 0.35);
    assert!(probe.refused(t + 11_500 * MS, Some(0.35), &a, &p));
    assert!(
        close(probe.ceiling, 1.0 / 3.0),
        "the ceiling stands: {probe:?}"
    );
    assert!(
        close(probe.m, 0.175),
        "half of the probe's rate: {}",
        probe.m
    );
    // The next probe waits twice as long, as far as the first.
    assert_eq!(probe.interval, 20 * S);
    assert_eq!(probe.at, t + 31_500 * MS);
    assert!(close(probe.target, 0.35));
    // More 429s of the same episode (sent before the cut) move nothing.
    assert!(!probe.refused(t + 12 * S, Some(0.35), &a, &p));
    assert_eq!(probe.at, t + 31_500 * MS);
    // Each failed probe doubles the wait, up to three times probe_every.
    let mut at = probe.at;
    for expected in [30, 30] {
        serve(&mut probe, at, at + S, 0.35);
        probe.refused(at + S, None, &a, &p);
        assert_eq!(probe.interval, expected * S);
        at = probe.at;
    }
    // A 429 that arrives just after the probe ended was sent during it: it fails the probe too.
    serve(&mut probe, at, at + 3 * S + 100 * MS, 0.35);
    assert!(probe.refused(at + 3 * S + 100 * MS, None, &a, &p));
    assert!(close(probe.ceiling, 1.0 / 3.0), "{probe:?}");
}

#[test]
fn a_429_while_holding_learns_a_lower_ceiling_from_what_was_served_and_probes_soon() {
    let (a, p) = (aimd(), probing());
    let t = 100 * S;
    let mut probe = learned_at(t);
    serve(&mut probe, t, t + 5 * S, 0.3);
    // The upstream now takes 15 of 60: a 429 at the hold, with 15/s served.
    assert!(probe.refused(t + 5 * S, Some(0.25), &a, &p));
    assert!(close(probe.ceiling, 0.25));
    assert!(close(probe.m, 0.15), "half the hold: {}", probe.m);
    // It probes again after probe_every: a ceiling that bunched calls pulled too low is soon
    // found again (a probe that draws a 429 widens the wait, one at the hold does not).
    assert_eq!(probe.interval, 10 * S);
    assert_eq!(probe.at, t + 15 * S);
    serve(&mut probe, t + 5 * S, t + 6 * S, 0.15);
    assert!(close(probe.m, 0.225), "back at the new hold: {}", probe.m);
}

#[test]
fn clean_probes_raise_the_ceiling_and_come_sooner_and_further() {
    let t = 100 * S;
    let mut probe = learned_at(t);
    serve(&mut probe, t, t + 10 * S, 0.3);
    // The upstream's limit rose: each probe is served in full, without a 429.
    let mut ceilings = Vec::new();
    let mut starts = vec![probe.at];
    while probe.learned() && ceilings.len() < 10 {
        let at = probe.at;
        let target = probe.target;
        serve(&mut probe, at, at + PROBE_LEN, target);
        // judged at the first answer after the probe and its grace
        let held = probe.m;
        serve(
            &mut probe,
            at + PROBE_LEN,
            at + PROBE_LEN + GRACE + 10 * MS,
            held,
        );
        ceilings.push(probe.ceiling);
        starts.push(probe.at);
    }
    // 5%, 10%, 20%, 40%, 80% above the ceiling, 1 s after each probe's verdict, until the
    // configured rate itself was served: then nothing is left to learn.
    let expected = [0.35, 0.385, 0.462, 0.6468, 1.0];
    assert_eq!(ceilings.len(), expected.len(), "{ceilings:?}");
    for (c, e) in ceilings.iter().zip(expected) {
        assert!((c - e).abs() < 1e-3, "{ceilings:?}");
    }
    for w in starts.windows(2).take(expected.len() - 1) {
        assert_eq!(w[1] - w[0], PROBE_LEN + GRACE + AFTER_CLEAN, "{starts:?}");
    }
    assert!(!probe.learned());
    assert_eq!(probe.multiplier(starts[4] + 10 * S), 1.0);
}

#[test]
fn a_clean_probe_holds_below_its_new_ceiling_and_a_failure_after_it_starts_small_again() {
    let (a, p) = (aimd(), probing());
    let t = 100 * S;
    let mut probe = learned_at(t);
    let at = probe.at;
    serve(&mut probe, t, at, 0.3);
    serve(&mut probe, at, at + PROBE_LEN + GRACE + 10 * MS, 0.35);
    assert!(close(probe.ceiling, 0.35));
    assert!(
        close(probe.m, 0.315),
        "the hold below the new ceiling: {}",
        probe.m
    );
    assert!(close(probe.step, 0.1));
    assert_eq!(probe.interval, 10 * S);
    // The next probe (10% further) draws a 429: the step is back to 5%, the wait doubles.
    let at = probe.at;
    assert!(close(probe.target, 0.385));
    probe.refused(at + S, Some(0.37), &a, &p);
    assert!(close(probe.ceiling, 0.35));
    assert!(close(probe.step, 0.05));
    assert_eq!(probe.interval, 20 * S);
}

#[test]
fn a_probe_without_the_demand_to_fill_it_tells_nothing() {
    let (a, p) = (aimd(), probing());
    let t = 100 * S;
    let mut probe = learned_at(t);
    let at = probe.at;
    serve(&mut probe, t, at, 0.2);
    // Only 12 of 60/s are asked for during the probe: no 429, and no verdict either.
    serve(&mut probe, at, at + PROBE_LEN + GRACE + 10 * MS, 0.2);
    assert!(close(probe.ceiling, 1.0 / 3.0));
    assert!(close(probe.step, 0.05));
    assert_eq!(probe.interval, 10 * S);
    assert_eq!(probe.at, at + PROBE_LEN + GRACE + 10 * S);
    // Answers that arrive in the probe's first second are not counted (the shares ramp up).
    let mut q = learned_at(t);
    let at = q.at;
    q.served(at + 500 * MS, 1.0, &a, &p);
    assert_eq!(q.units, 0.0);
    q.served(at + 1500 * MS, 1.0, &a, &p);
    assert_eq!(q.units, 1.0);
}

#[test]
fn with_cuts_switched_off_nothing_is_probed() {
    let p = probing();
    let off = Aimd {
        factor: 1.0,
        ..aimd()
    };
    let mut probe = Probe::default();
    assert!(!probe.refused(5 * S, Some(0.3), &off, &p));
    assert_eq!(probe.multiplier(5 * S), 1.0);
    assert!(!probe.learned());
}

#[test]
fn a_hold_taken_back_from_a_state_file_probes_after_probe_every() {
    let p = probing();
    let probe = Probe::holding(0.3, 50 * S, &p);
    assert!(close(probe.ceiling, 1.0 / 3.0));
    assert_eq!(probe.multiplier(50 * S), 0.3);
    assert_eq!(probe.at, 60 * S);
    assert_eq!(Probe::holding(1.0, 50 * S, &p), Probe::default());
}
