//! What the shared-store script reads and answers: a decision's and a release's spec and what a
//! lease keeps (MessagePack written straight from the planned call, read by the script by position;
//! the operations off the decision path take JSON), and the answers parsed back.

use serde::Serialize;

use super::error::StoreError;
use super::keys::{cat, hash_tag, hex16, Keys};
use super::pack::Pack;
use crate::config::{Aimd, Probing};
use crate::engine::probe::{self, StoredProbe};
use crate::engine::{
    RemoteAnswer, RemoteCall, RemoteQuota, RemoteScope, RemoteSlots, StateKey, UpstreamReport,
};

/// How long an upstream's AIMD cut is remembered when the call does not say (microseconds).
const FORGET_US: f64 = 120e6;
/// The probe schedule's constants as the script gets them (microseconds).
pub(super) const PROBE_LEN_US: f64 = (probe::PROBE_LEN / 1000) as f64;
const PROBE_RAMP_US: f64 = (probe::RAMP / 1000) as f64;
const METER_TAU_US: f64 = (probe::METER_TAU / 1000) as f64;

/// The spec of a part of `call` (the tenant's own keys, or the cross-tenant keys of one hash tag;
/// or, on one server, all of them), and what its lease keeps for the release. Returns the spec, the
/// lease data, the key that routes them and, per layer of the part, its index in the call.
///
/// The spec is MessagePack scalars in the order the script's `op_decide` reads them (its header
/// comment lists them): the script decodes no JSON and parses no number from text, which was a
/// fifth of its work per decision, and admitd builds no JSON tree.
pub(super) fn decide_spec(
    keys: &Keys,
    tenant: &str,
    call: &RemoteCall,
    part: Part<'_>,
) -> DecideParts {
    let keep = |k: &StateKey| match part {
        Part::All => true,
        Part::Tenant => !k.cross_tenant(),
        Part::Cross(tag) => k.cross_tenant() && hash_tag(&keys.key(tenant, k)) == tag,
    };
    let own = !matches!(part, Part::Cross(_));
    let hash = keys.hash(tenant);
    let mut map = Vec::new();
    // Each layer of the part: its hash, the prefix of its fields, and the layer.
    let mut layers = Vec::new();
    for (i, l) in call.layers.iter().enumerate() {
        if keep(&l.key) {
            map.push(i);
            let (k, fp) = keys.layer(tenant, &l.key);
            layers.push((k, fp, l));
        }
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
    let slots: &[RemoteSlots] = if own { &call.slots } else { &[] };
    let quotas: Vec<(String, &RemoteQuota)> = if own {
        call.quotas
            .iter()
            .map(|q| (keys.key(tenant, &q.key), q))
            .collect()
    } else {
        Vec::new()
    };
    // Each spend unit's budget keys and its day figure's key.
    let spend: Vec<(Vec<String>, Option<String>)> = if own {
        call.spend
            .iter()
            .map(|s| {
                let b = s.budgets.iter().map(|b| keys.key(tenant, &b.key)).collect();
                (b, s.tally.as_ref().map(|k| keys.key(tenant, k)))
            })
            .collect()
    } else {
        Vec::new()
    };
    let member = lease_member(call.lease, slots, &call.subject);
    let split = part != Part::All;
    let data = LeaseData {
        subject: &call.subject,
        tool: &call.tool,
        cost: call.cost,
        keys: layers
            .iter()
            .map(|(k, fp, _)| [k.as_deref().unwrap_or(&hash), fp.as_str()])
            .collect(),
        quotas: quotas.iter().map(|(k, _)| k.as_str()).collect(),
        m: &member,
        spend: call
            .spend
            .iter()
            .zip(&spend)
            .map(|(s, (b, t))| {
                let run = |r: bool| {
                    s.budgets
                        .iter()
                        .zip(b)
                        .filter(move |(x, _)| (x.idle_us > 0.0) == r)
                        .map(|(_, k)| k.as_str())
                };
                LeaseSpend {
                    u: &s.unit,
                    n: s.estimate,
                    d: run(false).chain(t.as_deref()).collect(),
                    r: run(true).collect(),
                    i: s.budgets
                        .iter()
                        .find(|b| b.idle_us > 0.0)
                        .map(|b| b.idle_us),
                }
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
    let data = data.pack();

    let mut p = Pack::sized();
    p.bool(own);
    p.str(&hash);
    p.str(&keys.leases(tenant));
    p.str_parts(&["l:", hex16(call.lease).as_str()]);
    p.str(&member);
    p.str(&call.subject);
    p.str(&call.tool);
    for x in [call.cost, call.max_wait_us, call.ttl_us] {
        p.num(x);
    }
    p.bool(call.shadow && own);
    p.bool(call.returning);
    for x in [call.rand, call.floor_us, FORGET_US] {
        p.num(x);
    }
    p.opt_str(
        (own && call.index)
            .then(|| keys.key(tenant, &StateKey::SubjectIndex))
            .as_deref(),
    );
    // What each layer takes, as the lease keeps it, when no layer's rate moves with an AIMD
    // multiplier (the script computes the same `floor(n * T)`): the script formats no number for it.
    if layers.iter().all(|(_, _, l)| l.aimd.is_none()) {
        let mut incs = String::with_capacity(2 + 12 * layers.len());
        incs.push('[');
        for (i, (_, _, l)) in layers.iter().enumerate() {
            if i > 0 {
                incs.push(',');
            }
            push_num(&mut incs, (l.tokens * l.t_us).floor());
        }
        incs.push(']');
        p.str(&incs);
    } else {
        p.nil();
    }
    // The lease set is swept on one call in 64 and the subject index trimmed on one in 16, chosen
    // by the lease id's last digits.
    p.bool(call.lease & 0xff < 4);
    p.bool(call.lease & 0xf == 0);
    p.num(layers.len() as f64);
    for (k, fp, l) in &layers {
        // The tenant's own hash is named once, in the header.
        p.opt_str(k.as_deref());
        p.str_parts(&[fp, "tat"]);
        // The promise cursor's field: the script names the usual one (`{fp}p`) itself.
        match &l.key {
            StateKey::SharedUpstreamBucket(_) => p.str(&format!("{fp}{}", promise_field(tenant))),
            _ => p.nil(),
        }
        for x in [l.t_us, l.burst, l.tokens] {
            p.num(x);
        }
        p.bool(l.hold);
        match &l.aimd {
            Some(m) => p.str(&keys.key(tenant, m)),
            None => p.nil(),
        }
        p.num(l.forget_us);
        p.num(PROBE_LEN_US);
        // The layer's state, set by the script in place.
        for _ in 0..7 {
            p.num(0.0);
        }
    }
    p.num(slots.len() as f64);
    for c in slots {
        p.str(&Keys::slots_field(&c.key));
        p.num(f64::from(c.cap));
        p.bool(c.subject);
        // The hint cursor of the scope, in the tenant's hash: the script names it (`cs:SUBJECT`
        // or `ct`), on a refusal.
        p.nil();
        p.num(0.0);
    }
    let penalties: Vec<_> = call.penalties.iter().filter(|x| keep(&x.key)).collect();
    p.num(penalties.len() as f64);
    for x in penalties {
        p.str(&keys.key(tenant, &x.key));
        p.num(local_index(x.layer) as f64);
        p.num(x.step_us);
    }
    let adaptive: Vec<_> = call.adaptive.iter().filter(|a| keep(&a.key)).collect();
    p.num(adaptive.len() as f64);
    for a in adaptive {
        p.str(&keys.key(tenant, &a.key));
        p.num(a.window_us);
        p.num(a.k);
        p.num(a.min_requests as f64);
        p.num(a.step_us);
    }
    p.num(quotas.len() as f64);
    for (k, q) in &quotas {
        p.str(k);
        p.num(q.quota);
        p.bool(q.subject);
    }
    p.num(spend.len() as f64);
    for (s, (b, t)) in call.spend.iter().zip(&spend) {
        p.num(s.estimate);
        p.opt_str(t.as_deref());
        p.num(b.len() as f64);
        for (budget, k) in s.budgets.iter().zip(b) {
            p.str(k);
            p.num(budget.size);
            // A run's budget (a plain counter that expires `idle` microseconds after the run's
            // last call), else a daily one (a hash by UTC day, like a quota).
            p.bool(budget.idle_us > 0.0);
            p.num(budget.idle_us);
        }
    }
    let route = match part {
        // A key of the tag: every key of the part shares it.
        Part::Cross(tag) => keys.tag_base(tag),
        _ => keys.tenant_base(tenant),
    };
    DecideParts {
        spec: p.0,
        data,
        route,
        map,
    }
}

/// What a release tells the script besides its lease (see `release_spec` in the script).
pub(super) struct ReleaseSpec<'a> {
    /// `always`, `never` or `hold`.
    pub(super) refund: &'static str,
    pub(super) report: bool,
    pub(super) limited: bool,
    /// Microseconds; -1 when none.
    pub(super) retry_after: f64,
    pub(super) default_penalty: f64,
    pub(super) duration: f64,
    pub(super) cancel: bool,
    /// Whether the upstream's answer counts as accepted (adaptive throttling) and as healthy (AIMD
    /// recovery), as the engine decides it (`ReleaseInfo::accepted`, `ReleaseInfo::healthy`).
    pub(super) ok: bool,
    pub(super) healthy: bool,
    /// What the call actually spent, per spend unit and in cost units.
    pub(super) settle: Option<&'a crate::engine::Settlement>,
}

/// A release's spec: MessagePack scalars in the order the script's `release_spec` reads them.
pub(super) fn release_spec(keys: &Keys, tenant: &str, lease: u64, r: ReleaseSpec) -> Vec<u8> {
    let mut p = Pack::default();
    p.str(&keys.hash(tenant));
    p.str(&keys.leases(tenant));
    p.str(hex16(lease).as_str());
    p.str(r.refund);
    p.bool(r.report);
    p.bool(r.limited);
    p.num(r.retry_after);
    p.num(r.default_penalty);
    p.num(r.duration);
    p.bool(r.cancel);
    // The actual cost in cost units, when the release reports one (else the admission's stands).
    match r.settle.and_then(|s| s.cost) {
        Some(cost) => p.num(cost),
        None => p.nil(),
    }
    p.bool(r.ok);
    p.bool(r.healthy);
    let spent: Vec<_> = r.settle.iter().flat_map(|s| s.spent.iter()).collect();
    p.num(spent.len() as f64);
    for (unit, x) in spent {
        p.str(unit);
        p.num(*x);
    }
    p.0
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

/// Appends a number as the script writes it: integers without a fraction.
fn push_num(out: &mut String, x: f64) {
    if whole(x) {
        out.push_str(itoa::Buffer::new().format(x as i64));
    } else {
        out.push_str(&fmt_num(x));
    }
}

/// Whether `x` is a whole number below 9e15 in size, asked of the cast back rather than of
/// `f64::fract` (a call into libm on x86-64's baseline).
fn whole(x: f64) -> bool {
    x.abs() < 9e15 && (x as i64) as f64 == x
}

/// A number as the script writes it: integers without a fraction.
fn fmt_num(x: f64) -> String {
    if whole(x) {
        format!("{}", x as i64)
    } else {
        format!("{x:.17e}")
    }
}

/// A decision's part, as the script gets it.
pub(super) struct DecideParts {
    pub(super) spec: Vec<u8>,
    pub(super) data: Vec<u8>,
    pub(super) route: String,
    /// Per layer of the part, its index in the call.
    pub(super) map: Vec<usize>,
}

/// A spend unit's reservation, as the release settles it.
struct LeaseSpend<'a> {
    u: &'a str,
    n: f64,
    /// Daily budgets' keys (and the tenant's day figure kept without a budget).
    d: Vec<&'a str>,
    /// Run budgets' keys.
    r: Vec<&'a str>,
    /// How long the run is remembered after its last call (microseconds), when it has a budget.
    i: Option<f64>,
}

/// The promise cursor of `tenant` on a shared upstream's bucket: one per tenant, as in the in-memory
/// engine, so the refusals of a tenant that loops on a shared budget book the slots its own callers
/// are told and never the ones another tenant's calls wait for. Every other bucket keeps one cursor
/// (`p`): a tenant's own, and the global buckets, whose slices (a Redis Cluster) are taken only
/// while no refused caller holds a promise on that one cursor.
pub(super) fn promise_field(tenant: &str) -> String {
    format!("p:{tenant}")
}

/// A lease's member in its tenant's lease set: its id, the scopes whose counts it is in (`t`
/// tenant, `s` subject, `b` both, `-` none) and the subject, so that a sweep of an ended lease
/// knows which counts to take it out of without reading anything else.
fn lease_member(lease: u64, conc: &[RemoteSlots], subject: &str) -> String {
    let tenant = conc.iter().any(|c| !c.subject);
    let subj = conc.iter().any(|c| c.subject);
    let scopes = match (tenant, subj) {
        (true, true) => 'b',
        (true, false) => 't',
        (false, true) => 's',
        (false, false) => '-',
    };
    let mut scope = [0u8; 4];
    cat(&[
        hex16(lease).as_str(),
        scopes.encode_utf8(&mut scope),
        subject,
    ])
}

/// What a lease keeps for its release (the end of its field `l:ID`), stored as admitd writes it: a
/// MessagePack map (the script's release reads it with `cmsgpack.unpack`, a fraction of what
/// decoding the same JSON cost it).
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
    /// Absent when empty.
    spend: Vec<LeaseSpend<'a>>,
    up: Vec<ReportSpec<'a>>,
    /// In a cluster, the call's cross-tenant bucket layers, decided apart (on their own shard, or
    /// from this replica's slices), which a release's `cost` settles after the script call.
    /// Absent when empty.
    x: Vec<CrossLayer>,
}

/// A cross-tenant bucket layer as a release settles it: its key, the tokens the call took, the
/// microseconds a token is worth, and whether it may be spent from slices (a global bucket's or a
/// shared upstream's; a lease written before shared upstreams were sliced says false for theirs).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub(super) struct CrossLayer(pub String, pub f64, pub f64, pub bool);

/// The `slice` operation's spec for the cross-tenant bucket layer `i` of `call` (`size` whole tokens
/// at most). A shared upstream's slice also reads what else decides the upstream's calls: its AIMD
/// multiplier (the slice is taken at the rate after any cut), its penalty and its adaptive throttle
/// (no slice while either would refuse a call; both are answered).
pub(super) fn slice_spec(
    keys: &Keys,
    tenant: &str,
    call: &RemoteCall,
    i: usize,
    size: f64,
) -> String {
    let l = &call.layers[i];
    let mut spec = serde_json::json!({
        "k": keys.key(tenant, &l.key), "T": l.t_us, "b": l.burst, "n": size,
    });
    if let StateKey::SharedUpstreamBucket(u) = &l.key {
        if let Some(m) = &l.aimd {
            spec["m"] = keys.key(tenant, m).into();
            spec["forget"] = l.forget_us.into();
            spec["pl"] = PROBE_LEN_US.into();
        }
        let penalty = StateKey::Penalty(u.clone(), true);
        if call.penalties.iter().any(|p| p.key == penalty) {
            spec["pk"] = keys.key(tenant, &penalty).into();
        }
        let state = StateKey::UpstreamState(u.clone(), true);
        if let Some(a) = call.adaptive.iter().find(|a| a.key == state) {
            spec["a"] = keys.key(tenant, &state).into();
            spec["aw"] = a.window_us.into();
            spec["K"] = a.k.into();
            spec["min"] = (a.min_requests as f64).into();
        }
    }
    spec.to_string()
}

/// The call's cross-tenant bucket layers, for the lease of its tenant's part.
fn cross_layers(keys: &Keys, tenant: &str, call: &RemoteCall) -> Vec<CrossLayer> {
    call.layers
        .iter()
        .filter(|l| l.key.cross_tenant())
        .map(|l| {
            let sliced = matches!(
                l.key,
                StateKey::GlobalBucket(_) | StateKey::SharedUpstreamBucket(_)
            );
            CrossLayer(keys.key(tenant, &l.key), l.tokens, l.t_us, sliced)
        })
        .collect()
}

impl LeaseData<'_> {
    fn pack(&self) -> Vec<u8> {
        let mut p = Pack::sized();
        p.map(7 + usize::from(!self.spend.is_empty()) + usize::from(!self.x.is_empty()));
        p.str("subject");
        p.str(self.subject);
        p.str("tool");
        p.str(self.tool);
        p.str("cost");
        p.num(self.cost);
        p.str("keys");
        p.array(self.keys.len());
        for [k, fp] in &self.keys {
            p.array(2);
            p.str(k);
            p.str(fp);
        }
        p.str("quotas");
        p.strs(&self.quotas);
        p.str("m");
        p.str(self.m);
        if !self.spend.is_empty() {
            p.str("spend");
            p.array(self.spend.len());
            for s in &self.spend {
                p.map(4 + usize::from(s.i.is_some()));
                p.str("u");
                p.str(s.u);
                p.str("n");
                p.num(s.n);
                p.str("d");
                p.strs(&s.d);
                p.str("r");
                p.strs(&s.r);
                if let Some(i) = s.i {
                    p.str("i");
                    p.num(i);
                }
            }
        }
        p.str("up");
        p.array(self.up.len());
        for u in &self.up {
            u.pack(&mut p);
        }
        if !self.x.is_empty() {
            p.str("x");
            p.array(self.x.len());
            for CrossLayer(key, tokens, t_us, global) in &self.x {
                p.array(4);
                p.str(key);
                p.num(*tokens);
                p.num(*t_us);
                p.bool(*global);
            }
        }
        p.0
    }
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

impl ReportSpec<'_> {
    /// The same map as its JSON, in MessagePack (what a lease keeps).
    fn pack(&self, p: &mut Pack) {
        let opts = [
            ("af", self.af),
            ("afl", self.afl),
            ("ar", self.ar),
            ("q", self.q),
        ];
        let n = opts.iter().filter(|(_, v)| v.is_some()).count();
        p.map(6 + n + usize::from(self.pr.is_some()));
        p.str("n");
        p.str(self.n);
        p.str("p");
        p.str(&self.p);
        p.str("s");
        p.str(&self.s);
        p.str("aw");
        p.num(self.aw);
        p.str("forget");
        p.num(self.forget);
        p.str("x");
        p.bool(self.x);
        for (k, v) in opts {
            if let Some(v) = v {
                p.str(k);
                p.num(v);
            }
        }
        if let Some(pr) = &self.pr {
            p.str("pr");
            p.map(6);
            for (k, v) in [
                ("h", pr.h),
                ("e", pr.e),
                ("sp", pr.sp),
                ("pl", pr.pl),
                ("rp", pr.rp),
                ("tau", pr.tau),
            ] {
                p.str(k);
                p.num(v);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part<'a> {
    /// Every key of the call (one server).
    All,
    /// The tenant's own keys (a cluster: on the tenant's shard).
    Tenant,
    /// The cross-tenant keys of one hash tag (a cluster: `x` for the global buckets, `u:NAME` for a
    /// shared upstream's state).
    Cross(&'a str),
}

/// The hash tags of `call`'s cross-tenant state, each once, in the order a cluster decides them:
/// shared upstreams' (their penalties and adaptive windows first: the likelier refusals) before the
/// global buckets'.
pub(super) fn cross_tags(keys: &Keys, tenant: &str, call: &RemoteCall) -> Vec<String> {
    let mut tags: Vec<String> = Vec::new();
    let all = call
        .penalties
        .iter()
        .map(|p| &p.key)
        .chain(call.adaptive.iter().map(|a| &a.key))
        .chain(call.layers.iter().map(|l| &l.key))
        .filter(|k| k.cross_tenant());
    for k in all {
        let tag = hash_tag(&keys.key(tenant, k)).to_string();
        if !tags.contains(&tag) {
            tags.push(tag);
        }
    }
    // The global buckets' tag last.
    if let Some(i) = tags.iter().position(|t| t == "x") {
        let x = tags.remove(i);
        tags.push(x);
    }
    tags
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

/// A number of a script's answer: an integer (a Lua number), or a number written as text.
fn value_num(v: &redis::Value) -> Option<f64> {
    match v {
        redis::Value::Int(i) => Some(*i as f64),
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        redis::Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn value_str(v: Option<&redis::Value>) -> Option<&str> {
    match v? {
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok(),
        redis::Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

/// Parses the script's answer to `decide`, read in place (no string is made of its parts). Layer
/// reports are placed at their index in the call (`map`); the layers of the other part are marked
/// with a negative reset.
pub(super) fn parse_decide(
    v: Result<redis::Value, StoreError>,
    map: &[usize],
    n: usize,
) -> Result<RemoteAnswer, StoreError> {
    let parts = match v? {
        redis::Value::Array(parts) => parts,
        other => return Err(StoreError::Script(format!("unexpected answer {other:?}"))),
    };
    let bad = || StoreError::Script(format!("unexpected answer {parts:?}"));
    let num =
        |i: usize| -> Result<f64, StoreError> { parts.get(i).and_then(value_num).ok_or_else(bad) };
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
    match value_str(parts.first()) {
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
            let scope = match value_str(parts.get(1)) {
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
    fn answers_read_integers_and_text_alike() {
        // The script answers a layer's figures as Lua numbers (integers on the wire).
        let a = parse_decide(
            Ok(redis::Value::Array(vec![
                redis::Value::BulkString(b"ok".to_vec()),
                redis::Value::BulkString(b"0".to_vec()),
                redis::Value::Int(19),
                redis::Value::Int(500),
            ])),
            &[0],
            1,
        )
        .unwrap();
        assert_eq!(
            a,
            RemoteAnswer::Admitted {
                hold_us: 0.0,
                layers: vec![(19, 500.0)],
                spend: vec![],
            }
        );
        assert!(parse_decide(Ok(redis::Value::Int(1)), &[], 0).is_err());
    }

    #[test]
    fn packed_scalars_are_messagepack() {
        let mut p = Pack::default();
        p.nil();
        p.bool(true);
        p.bool(false);
        p.num(5.0);
        p.num(127.0);
        p.num(128.0);
        p.num(-1.0);
        p.num(0.5);
        p.str("ab");
        p.opt_str(None);
        let mut want = vec![0xc0, 0xc3, 0xc2, 5, 127];
        for x in [128.0f64, -1.0, 0.5] {
            want.push(0xcb);
            want.extend_from_slice(&x.to_be_bytes());
        }
        want.extend_from_slice(&[0xa2, b'a', b'b', 0xc0]);
        assert_eq!(p.0, want);
        // Longer strings carry their length in one, two or four bytes.
        for (n, head) in [
            (31, vec![0xbf]),
            (32, vec![0xd9, 32]),
            (300, vec![0xda, 1, 44]),
            (70_000, vec![0xdb, 0, 1, 0x11, 0x70]),
        ] {
            let mut p = Pack::default();
            p.str(&"x".repeat(n));
            assert_eq!(&p.0[..head.len()], &head[..], "length {n}");
            assert_eq!(p.0.len(), head.len() + n);
        }
    }

    #[test]
    fn merged_reports_take_each_layer_from_the_part_that_has_it() {
        let a = vec![(3, 10.0), (0, -1.0)];
        let b = vec![(0, -1.0), (7, 20.0)];
        assert_eq!(merge(a, b), vec![(3, 10.0), (7, 20.0)]);
    }

    #[test]
    fn a_cross_tenant_part_is_one_hash_tag_and_the_global_buckets_come_last() {
        use crate::engine::test_support::{call, harness, SEC};
        use crate::engine::TenantEngine;
        let (_clock, cfg, shared) = harness(
            "[limits.global]\nrate = \"10/s\"\nburst = 10\n\
             [upstreams.crm]\nrate = \"5/s\"\nburst = 5\nshared = true\n\
             [upstreams.mail]\nrate = \"5/s\"\nburst = 5\nshared = true\nadaptive_k = 2\n\
             [tools.sync]\nupstreams = { crm = 1, mail = 2 }\n",
            0,
        );
        let mut engine = TenantEngine::new(std::sync::Arc::from("acme"), cfg, shared, 7);
        let call = engine
            .plan_remote(&call("bot", "sync"), SEC)
            .expect("planned for the store");
        let keys = Keys::new("admitd");
        let tags = cross_tags(&keys, "acme", &call);
        assert_eq!(tags, ["u:crm", "u:mail", "x"]);
        for tag in &tags {
            let p = decide_spec(&keys, "acme", &call, Part::Cross(tag));
            assert_eq!(hash_tag(&p.route), tag);
            // Each layer of the part is of the tag.
            assert_eq!(p.map.len(), 1, "{tag}");
            let layer = &call.layers[p.map[0]];
            assert_eq!(hash_tag(&keys.key("acme", &layer.key)), tag);
        }
        // The tenant's part has none of them.
        let p = decide_spec(&keys, "acme", &call, Part::Tenant);
        assert!(p.map.iter().all(|&i| !call.layers[i].key.cross_tenant()));
        assert_eq!(hash_tag(&p.route), "t:acme");
    }
}
