//! What the shared-store script reads and answers: a decision's spec and what its lease keeps
//! (written straight from the planned call, no JSON tree), and the answers parsed back.

use serde::Serialize;

use super::error::StoreError;
use super::keys::Keys;
use crate::config::{Aimd, Probing};
use crate::engine::probe::{self, StoredProbe};
use crate::engine::{RemoteAnswer, RemoteCall, RemoteScope, StateKey, UpstreamReport};

/// How long an upstream's AIMD cut is remembered when the call does not say (microseconds).
const FORGET_US: f64 = 120e6;
/// The probe schedule's constants as the script gets them (microseconds).
pub(super) const PROBE_LEN_US: f64 = (probe::PROBE_LEN / 1000) as f64;
const PROBE_RAMP_US: f64 = (probe::RAMP / 1000) as f64;
const METER_TAU_US: f64 = (probe::METER_TAU / 1000) as f64;

/// The spec of the part of `call` whose keys are cross-tenant (`cross`) or the tenant's own, and
/// what its lease keeps for the release. `split`: whether the call is split in two parts (a
/// cluster); otherwise one part has it all. Returns the spec, the lease data, the key that routes
/// them and, per layer of the part, its index in the call.
pub(super) fn decide_spec(keys: &Keys, tenant: &str, call: &RemoteCall, part: Part) -> DecideParts {
    let keep = |k: &StateKey| match part {
        Part::All => true,
        Part::Tenant => !k.cross_tenant(),
        Part::Cross => k.cross_tenant(),
    };
    let mut map = Vec::new();
    let mut layers = Vec::new();
    for (i, l) in call.layers.iter().enumerate() {
        if !keep(&l.key) {
            continue;
        }
        map.push(i);
        let (k, fp) = keys.layer(tenant, &l.key);
        layers.push(LayerSpec {
            k,
            fp,
            t: l.t_us,
            b: l.burst,
            n: l.tokens,
            hold: l.hold,
            m: l.aimd
                .as_ref()
                .map_or(String::new(), |m| keys.key(tenant, m)),
            f: l.forget_us,
            pl: PROBE_LEN_US,
            pf: matches!(l.key, StateKey::SharedUpstreamBucket(_)).then(|| promise_field(tenant)),
        });
    }
    let local_index = |global: usize| {
        // 1-based in the part, 0 when the layer is in the other part.
        if global == 0 {
            return 0;
        }
        map.iter()
            .position(|&g| g + 1 == global)
            .map_or(0, |p| p + 1)
    };
    let pen: Vec<PenaltySpec> = call
        .penalties
        .iter()
        .filter(|p| keep(&p.key))
        .map(|p| PenaltySpec {
            k: keys.key(tenant, &p.key),
            layer: local_index(p.layer),
            step: p.step_us,
        })
        .collect();
    let ad: Vec<AdaptiveSpec> = call
        .adaptive
        .iter()
        .filter(|a| keep(&a.key))
        .map(|a| AdaptiveSpec {
            k: keys.key(tenant, &a.key),
            w: a.window_us,
            big_k: a.k,
            min: a.min_requests,
            step: a.step_us,
        })
        .collect();
    let own = part != Part::Cross;
    let conc: Vec<SlotsSpec> = if own {
        call.slots
            .iter()
            .map(|c| SlotsSpec {
                f: Keys::slots_field(&c.key),
                cap: c.cap,
                sub: c.subject,
                // The hint cursor of the scope, in the tenant's hash.
                cursor: if c.subject {
                    format!("cs:{}", call.subject)
                } else {
                    "ct".to_string()
                },
            })
            .collect()
    } else {
        Vec::new()
    };
    let quota: Vec<QuotaSpec> = if own {
        call.quotas
            .iter()
            .map(|q| QuotaSpec {
                k: keys.key(tenant, &q.key),
                q: q.quota,
                sub: q.subject,
            })
            .collect()
    } else {
        Vec::new()
    };
    let spend: Vec<SpendSpec> = if own {
        call.spend
            .iter()
            .map(|s| SpendSpec {
                n: s.estimate,
                b: s.budgets
                    .iter()
                    .map(|b| BudgetSpec {
                        k: keys.key(tenant, &b.key),
                        s: b.size,
                        run: b.idle_us > 0.0,
                        idle: b.idle_us,
                    })
                    .collect(),
                t: s.tally.as_ref().map(|k| keys.key(tenant, k)),
            })
            .collect()
    } else {
        Vec::new()
    };
    let split = part != Part::All;
    let member = lease_member(call.lease, &conc, &call.subject);
    let data = LeaseData {
        subject: &call.subject,
        tool: &call.tool,
        cost: call.cost,
        keys: layers
            .iter()
            .map(|l| [l.k.as_str(), l.fp.as_str()])
            .collect(),
        quotas: quota.iter().map(|q| q.k.as_str()).collect(),
        m: &member,
        spend: call
            .spend
            .iter()
            .zip(&spend)
            .map(|(s, sp)| LeaseSpend {
                u: &s.unit,
                n: s.estimate,
                d: sp
                    .b
                    .iter()
                    .filter(|b| !b.run)
                    .map(|b| b.k.as_str())
                    .chain(sp.t.as_deref())
                    .collect(),
                r: sp
                    .b
                    .iter()
                    .filter(|b| b.run)
                    .map(|b| b.k.as_str())
                    .collect(),
                i: sp.b.iter().find(|b| b.run).map(|b| b.idle),
            })
            .collect(),
        up: call
            .upstreams
            .iter()
            .map(|u| report_spec(keys, tenant, u, split && u.cross_tenant()))
            .collect(),
        x: if part == Part::Tenant {
            cross_layers(keys, tenant, call)
        } else {
            Vec::new()
        },
    };
    let data = serde_json::to_string(&data).unwrap_or_default();
    let spec = DecideSpec {
        own,
        h: keys.hash(tenant),
        z: keys.leases(tenant),
        id: format!("{:016x}", call.lease),
        m: &member,
        subject: &call.subject,
        tool: &call.tool,
        max_wait: call.max_wait_us,
        ttl: call.ttl_us,
        shadow: call.shadow && own,
        returning: call.returning,
        rand: call.rand,
        floor: call.floor_us,
        forget: FORGET_US,
        cost: call.cost,
        pen,
        ad,
        conc,
        quota,
        layers,
        spend: &spend,
        index: if own && call.index {
            keys.key(tenant, &StateKey::SubjectIndex)
        } else {
            String::new()
        },
    };
    let route = match part {
        Part::Cross => format!("{}:route", keys.cross_base()),
        _ => keys.tenant_base(tenant),
    };
    DecideParts {
        spec: serde_json::to_string(&spec).unwrap_or_default(),
        data,
        route,
        map,
    }
}

pub(super) fn report_spec<'a>(
    keys: &Keys,
    tenant: &str,
    u: &'a UpstreamReport,
    cross_part: bool,
) -> ReportSpec<'a> {
    ReportSpec {
        n: &u.name,
        p: keys.key(tenant, &u.penalty),
        s: keys.key(tenant, &u.state),
        aw: u.adaptive_window_us,
        forget: u.forget_us,
        x: cross_part,
        af: u.aimd.map(|a| a.0),
        afl: u.aimd.map(|a| a.1),
        ar: u.aimd.map(|a| a.2),
        q: u.probe.as_ref().map(|p| p.units),
        pr: u
            .probe
            .as_ref()
            .filter(|_| u.aimd.is_some())
            .map(|p| ProbeSpec {
                h: p.probing.hold,
                e: p.probing.every.as_micros() as f64,
                sp: p.probing.step,
                pl: PROBE_LEN_US,
                rp: PROBE_RAMP_US,
                tau: METER_TAU_US,
            }),
    }
}

/// A probed upstream's constants, as the script reads them (see `probe_answer` in the script) and
/// hands them back with the state it counted.
#[derive(Serialize, serde::Deserialize, Debug, Clone, Copy, PartialEq)]
pub(super) struct ProbeSpec {
    /// `probe_hold`, `probe_every` (microseconds) and `probe_step`.
    h: f64,
    e: f64,
    sp: f64,
    pl: f64,
    rp: f64,
    tau: f64,
}

/// What the script answered about a probed upstream: the report it was given back, and the state
/// it counted.
#[derive(serde::Deserialize)]
struct ProbeAnswer {
    u: ProbeAnswerReport,
    st: std::collections::HashMap<String, f64>,
}

#[derive(serde::Deserialize)]
struct ProbeAnswerReport {
    s: String,
    af: f64,
    afl: f64,
    ar: f64,
    pr: ProbeSpec,
    forget: f64,
    #[serde(default)]
    aw: f64,
    #[serde(default)]
    q: f64,
}

/// The `probe` operation to send after an answer the script counted (`answer`: the probe part of
/// its reply), when the schedule moves; `None` when nothing moves (or the part is empty or
/// unreadable).
pub(super) fn probe_write(answer: &str, limited: bool) -> Option<(String, String)> {
    let a: ProbeAnswer = serde_json::from_str(answer).ok()?;
    let now = (a.st.get("now").copied()?.max(0.0) as u64).saturating_mul(1000);
    let mut stored = StoredProbe::from_fields(|k| a.st.get(k).copied());
    stored.unit = a.u.q;
    let aimd = Aimd {
        factor: a.u.af,
        floor: a.u.afl,
        recover: a.u.ar,
    };
    let probing = Probing {
        every: std::time::Duration::from_micros(a.u.pr.e.max(1e6) as u64),
        step: a.u.pr.sp,
        hold: a.u.pr.h,
    };
    if !stored.answered(now, limited, &aimd, &probing) {
        return None;
    }
    let mut f = Vec::new();
    for (k, v) in stored.fields() {
        f.push(serde_json::Value::from(k));
        f.push(serde_json::Value::from(fmt_num(v)));
    }
    let spec = serde_json::json!({
        "s": a.u.s,
        "v": stored.version,
        "f": f,
        "keep": a.u.forget.max(a.u.aw) + 1e6,
    });
    Some((a.u.s, spec.to_string()))
}

/// A number as the script writes it: integers without a fraction.
fn fmt_num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 9e15 {
        format!("{}", x as i64)
    } else {
        format!("{x:.17e}")
    }
}

/// A decision's part, as the script gets it.
pub(super) struct DecideParts {
    pub(super) spec: String,
    pub(super) data: String,
    pub(super) route: String,
    /// Per layer of the part, its index in the call.
    pub(super) map: Vec<usize>,
}

// The script's `decide` spec, written straight from the call (the names are the script's).
#[derive(Serialize)]
struct DecideSpec<'a> {
    /// Whether this part holds the tenant's own state (its lease, slots and quotas).
    own: bool,
    /// The tenant's hash and lease set.
    h: String,
    z: String,
    id: String,
    /// The lease's member in the lease set.
    m: &'a str,
    subject: &'a str,
    tool: &'a str,
    cost: f64,
    max_wait: f64,
    ttl: f64,
    shadow: bool,
    returning: bool,
    rand: f64,
    floor: f64,
    forget: f64,
    pen: Vec<PenaltySpec>,
    ad: Vec<AdaptiveSpec>,
    conc: Vec<SlotsSpec>,
    quota: Vec<QuotaSpec>,
    layers: Vec<LayerSpec>,
    /// Spend units, each with its estimate and budgets (absent without `[spend.*]`).
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    spend: &'a [SpendSpec],
    index: String,
}

#[derive(Serialize)]
struct SpendSpec {
    /// The call's estimate in this unit.
    n: f64,
    b: Vec<BudgetSpec>,
    /// The tenant's day figure of the unit, counted without a budget (no `tenant_daily` keeps it).
    #[serde(skip_serializing_if = "Option::is_none")]
    t: Option<String>,
}

#[derive(Serialize)]
struct BudgetSpec {
    k: String,
    /// The budget's size.
    s: f64,
    /// A run's budget (a plain counter that expires `idle` microseconds after the run's last call),
    /// else a daily one (a hash by UTC day, like a quota).
    run: bool,
    idle: f64,
}

/// A spend unit's reservation, as the release settles it.
#[derive(Serialize)]
struct LeaseSpend<'a> {
    u: &'a str,
    n: f64,
    /// Daily budgets' keys (and the tenant's day figure kept without a budget).
    d: Vec<&'a str>,
    /// Run budgets' keys.
    r: Vec<&'a str>,
    /// How long the run is remembered after its last call (microseconds), when it has a budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    i: Option<f64>,
}

#[derive(Serialize)]
struct LayerSpec {
    k: String,
    /// The prefix of the layer's fields in its hash.
    fp: String,
    #[serde(rename = "T")]
    t: f64,
    b: f64,
    n: f64,
    hold: bool,
    m: String,
    f: f64,
    /// How long a probe lasts (microseconds), for a state hash that holds a probe schedule.
    pl: f64,
    /// The field of the bucket's hash that holds the caller's promise cursor, when not `p`: see
    /// [`promise_field`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pf: Option<String>,
}

/// The promise cursor of `tenant` on a shared upstream's bucket: one per tenant, as in the in-memory
/// engine, so the refusals of a tenant that loops on a shared budget book the slots its own callers
/// are told and never the ones another tenant's calls wait for. Every other bucket keeps one cursor
/// (`p`): a tenant's own, and the global buckets, whose slices (a Redis Cluster) are taken only
/// while no refused caller holds a promise on that one cursor.
pub(super) fn promise_field(tenant: &str) -> String {
    format!("p:{tenant}")
}

#[derive(Serialize)]
struct PenaltySpec {
    k: String,
    layer: usize,
    step: f64,
}

#[derive(Serialize)]
struct AdaptiveSpec {
    k: String,
    w: f64,
    #[serde(rename = "K")]
    big_k: f64,
    min: u64,
    step: f64,
}

#[derive(Serialize)]
struct SlotsSpec {
    /// The field of the tenant's hash that counts the scope's leases.
    f: String,
    cap: u32,
    sub: bool,
    cursor: String,
}

/// A lease's member in its tenant's lease set: its id, the scopes whose counts it is in (`t`
/// tenant, `s` subject, `b` both, `-` none) and the subject, so that a sweep of an ended lease
/// knows which counts to take it out of without reading anything else.
fn lease_member(lease: u64, conc: &[SlotsSpec], subject: &str) -> String {
    let tenant = conc.iter().any(|c| !c.sub);
    let subj = conc.iter().any(|c| c.sub);
    let scopes = match (tenant, subj) {
        (true, true) => 'b',
        (true, false) => 't',
        (false, true) => 's',
        (false, false) => '-',
    };
    format!("{lease:016x}{scopes}{subject}")
}

#[derive(Serialize)]
struct QuotaSpec {
    k: String,
    q: f64,
    sub: bool,
}

/// What a lease keeps for its release (the hash field `d`), stored as admitd writes it.
#[derive(Serialize)]
struct LeaseData<'a> {
    subject: &'a str,
    tool: &'a str,
    cost: f64,
    /// The bucket layers' hashes and field prefixes, in the order of the tokens the script
    /// records beside them.
    keys: Vec<[&'a str; 2]>,
    quotas: Vec<&'a str>,
    /// The lease's member in its tenant's lease set.
    m: &'a str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    spend: Vec<LeaseSpend<'a>>,
    up: Vec<ReportSpec<'a>>,
    /// In a cluster, the call's cross-tenant bucket layers, decided apart (on their own shard, or
    /// from this replica's slices), which a release's `cost` settles after the script call.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    x: Vec<CrossLayer>,
}

/// A cross-tenant bucket layer as a release settles it: its key, the tokens the call took, the
/// microseconds a token is worth, and whether it is a global bucket (spent from slices).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub(super) struct CrossLayer(pub String, pub f64, pub f64, pub bool);

/// The call's cross-tenant bucket layers, for the lease of its tenant's part.
fn cross_layers(keys: &Keys, tenant: &str, call: &RemoteCall) -> Vec<CrossLayer> {
    call.layers
        .iter()
        .filter(|l| l.key.cross_tenant())
        .map(|l| {
            let global = matches!(l.key, StateKey::GlobalBucket(_));
            CrossLayer(keys.key(tenant, &l.key), l.tokens, l.t_us, global)
        })
        .collect()
}

/// An upstream as the script reads it to take its answer (penalty, AIMD, adaptive window).
#[derive(Serialize)]
pub(super) struct ReportSpec<'a> {
    n: &'a str,
    p: String,
    s: String,
    aw: f64,
    forget: f64,
    x: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    af: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    afl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ar: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    q: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pr: Option<ProbeSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    All,
    Tenant,
    Cross,
}

/// Layer reports of two parts, in the call's order (a layer is in exactly one of them).
pub(super) fn merge(a: Vec<(u64, f64)>, b: Vec<(u64, f64)>) -> Vec<(u64, f64)> {
    a.into_iter()
        .zip(b)
        .map(|(x, y)| if x.1 < 0.0 { y } else { x })
        .collect()
}

pub(super) fn strings(v: redis::Value) -> Result<Vec<String>, StoreError> {
    redis::from_redis_value(v).map_err(|e| StoreError::Script(e.to_string()))
}

/// Parses the script's answer to `decide`. Layer reports are placed at their index in the call
/// (`map`); the layers of the other part are marked with a negative reset.
pub(super) fn parse_decide(
    v: Result<redis::Value, StoreError>,
    map: &[usize],
    n: usize,
) -> Result<RemoteAnswer, StoreError> {
    let parts = strings(v?)?;
    let bad = || StoreError::Script(format!("unexpected answer {parts:?}"));
    let num = |i: usize| -> Result<f64, StoreError> {
        parts.get(i).and_then(|s| s.parse().ok()).ok_or_else(bad)
    };
    let layers_from = |start: usize| -> Result<Vec<(u64, f64)>, StoreError> {
        let mut out = vec![(0u64, -1.0f64); n];
        for (j, &g) in map.iter().enumerate() {
            let left = num(start + 2 * j)? as u64;
            let reset = num(start + 2 * j + 1)?;
            if let Some(slot) = out.get_mut(g) {
                *slot = (left, reset);
            }
        }
        Ok(out)
    };
    match parts.first().map(String::as_str) {
        Some("ok") => Ok(RemoteAnswer::Admitted {
            hold_us: num(1)?,
            layers: layers_from(2)?,
            // What each spend budget has left follows the layers.
            spend: (2 + 2 * map.len()..parts.len())
                .map(num)
                .collect::<Result<_, _>>()?,
        }),
        Some("busy") => Ok(RemoteAnswer::Busy { wait_us: num(1)? }),
        Some("shed") => {
            let scope = match parts.get(1).map(String::as_str) {
                Some("upstream_penalty") => RemoteScope::Penalty,
                Some("adaptive") => RemoteScope::Adaptive,
                Some("concurrency") => RemoteScope::Concurrency,
                Some("daily_quota") => RemoteScope::DailyQuota,
                Some("spend") => {
                    // 1-based unit, then after the layers the 1-based budget and what it has left.
                    let unit = (num(5)? as usize).checked_sub(1).ok_or_else(bad)?;
                    let budget = (num(6 + 2 * map.len())? as usize)
                        .checked_sub(1)
                        .ok_or_else(bad)?;
                    RemoteScope::Spend(unit, budget)
                }
                Some("layer") => {
                    let local = num(5)? as usize;
                    let global = local
                        .checked_sub(1)
                        .and_then(|l| map.get(l).copied())
                        .ok_or_else(bad)?;
                    RemoteScope::Layer(global)
                }
                _ => return Err(bad()),
            };
            let layers = layers_from(6)?;
            let multiplier =
                if scope == RemoteScope::Penalty || !matches!(scope, RemoteScope::Layer(_)) {
                    1.0
                } else {
                    num(6 + 2 * map.len()).unwrap_or(1.0)
                };
            let spend_left = match scope {
                RemoteScope::Spend(..) => num(7 + 2 * map.len())?,
                _ => 0.0,
            };
            Ok(RemoteAnswer::Refused {
                scope,
                wait_us: num(2)?,
                booked: num(3)? > 0.0,
                account_wide: num(4)? > 0.0,
                layers,
                multiplier,
                spend_left,
            })
        }
        _ => Err(bad()),
    }
}

/// What the script's `task`, `poll` and `renew` operations read: the lease and the keys beside it,
/// the TTL to extend it by (`ttl`, -1: its own, else `dttl`), and the poll schedule's bounds, all
/// in microseconds.
#[derive(Serialize)]
pub(super) struct TaskSpec {
    /// The tenant's hash (the lease is its field `l:ID`) and lease set.
    h: String,
    z: String,
    /// The lease's own key beside it (its TTL, a task's next poll).
    x: String,
    id: String,
    tasks: String,
    cur: String,
    ttl: f64,
    dttl: f64,
    min: f64,
    spacing: f64,
    max: f64,
    grace: f64,
}

pub(super) fn task_spec(
    keys: &Keys,
    tenant: &str,
    lease: u64,
    ttl_us: Option<f64>,
    default_ttl_us: f64,
    poll: &crate::engine::poll::PollPolicy,
) -> TaskSpec {
    let us = |ns: u64| ns as f64 / 1e3;
    TaskSpec {
        h: keys.hash(tenant),
        z: keys.leases(tenant),
        x: keys.key(tenant, &StateKey::LeaseExtra(lease)),
        id: format!("{lease:016x}"),
        tasks: keys.key(tenant, &StateKey::Tasks),
        cur: keys.key(tenant, &StateKey::TaskCursor),
        ttl: ttl_us.unwrap_or(-1.0),
        dttl: default_ttl_us,
        min: us(poll.min_ns),
        spacing: us(poll.spacing_ns),
        max: us(poll.max_ns),
        grace: us(crate::engine::poll::POLL_GRACE_NS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(items: &[&str]) -> Result<redis::Value, StoreError> {
        Ok(redis::Value::Array(
            items
                .iter()
                .map(|s| redis::Value::BulkString(s.as_bytes().to_vec()))
                .collect(),
        ))
    }

    #[test]
    fn answers_are_placed_at_their_layers_in_the_call() {
        // Two of three layers in this part: the call's 0 and 2.
        let a = parse_decide(v(&["ok", "250", "19", "500", "4", "100"]), &[0, 2], 3).unwrap();
        assert_eq!(
            a,
            RemoteAnswer::Admitted {
                hold_us: 250.0,
                layers: vec![(19, 500.0), (0, -1.0), (4, 100.0)],
                spend: vec![],
            }
        );
        let s = parse_decide(
            v(&[
                "shed", "layer", "1000", "0", "0", "2", "19", "500", "0", "900", "0.5",
            ]),
            &[0, 2],
            3,
        )
        .unwrap();
        assert_eq!(
            s,
            RemoteAnswer::Refused {
                scope: RemoteScope::Layer(2),
                wait_us: 1000.0,
                booked: false,
                account_wide: false,
                layers: vec![(19, 500.0), (0, -1.0), (0, 900.0)],
                multiplier: 0.5,
                spend_left: 0.0,
            }
        );
        assert_eq!(
            parse_decide(v(&["busy", "1500"]), &[], 0).unwrap(),
            RemoteAnswer::Busy { wait_us: 1500.0 }
        );
        assert!(matches!(
            parse_decide(v(&["what"]), &[], 0),
            Err(StoreError::Script(_))
        ));
        assert!(matches!(
            parse_decide(v(&["shed", "layer", "1", "0", "0", "9"]), &[0], 1),
            Err(StoreError::Script(_))
        ));
    }

    #[test]
    fn spend_figures_follow_the_layers() {
        let a = parse_decide(v(&["ok", "0", "19", "500", "0.93", "4.5"]), &[0], 1).unwrap();
        assert_eq!(
            a,
            RemoteAnswer::Admitted {
                hold_us: 0.0,
                layers: vec![(19, 500.0)],
                spend: vec![0.93, 4.5],
            }
        );
        // Unit 2, budget 1 (1-based), overspent by 0.25.
        let s = parse_decide(
            v(&[
                "shed", "spend", "0", "0", "0", "2", "19", "500", "1", "-0.25",
            ]),
            &[0],
            1,
        )
        .unwrap();
        assert!(matches!(
            s,
            RemoteAnswer::Refused { scope: RemoteScope::Spend(1, 0), spend_left, .. } if spend_left == -0.25
        ));
        assert!(parse_decide(
            v(&["shed", "spend", "0", "0", "0", "0", "19", "500"]),
            &[0],
            1
        )
        .is_err());
    }

    #[test]
    fn merged_reports_take_each_layer_from_the_part_that_has_it() {
        let a = vec![(3, 10.0), (0, -1.0)];
        let b = vec![(0, -1.0), (7, 20.0)];
        assert_eq!(merge(a, b), vec![(3, 10.0), (7, 20.0)]);
    }
}
