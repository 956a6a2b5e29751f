//! Deciding a call whose state lives in a shared store (several replicas, one budget).
//!
//! The decision is split along the same seam as the in-memory path: [`TenantEngine::plan_remote`]
//! resolves the call and plans its layers exactly as an in-memory decision does (`plan.rs`), and
//! writes what the store must check and spend as plain data ([`RemoteCall`]): which state each step
//! reads, named by [`StateKey`] rather than by any store's key syntax, with every shape in
//! microseconds. The store runs all of it atomically on its own clock and answers a [`RemoteAnswer`];
//! [`TenantEngine::interpret_remote`] turns that into the same [`Decision`] an in-memory decision
//! gives (`interpret.rs`: refusal texts, jitter, rate-limit headers, shadow mode). Nothing here does
//! I/O: the tenant actor carries the call to the store and back.
//!
//! Time crosses the seam as durations and shapes in microseconds; the instants are the store's.

use super::*;

/// A piece of a tenant's state, named independently of the store that keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum StateKey {
    SubjectBucket(Arc<str>),
    SubjectToolBucket(Arc<str>, Arc<str>),
    TenantBucket,
    /// A per-tenant upstream budget.
    UpstreamBucket(Arc<str>),
    /// A `shared = true` upstream's budget (one across tenants).
    SharedUpstreamBucket(Arc<str>),
    /// The global bucket, or a plan's own global bucket.
    GlobalBucket(Option<Arc<str>>),
    SubjectSlots(Arc<str>),
    TenantSlots,
    SubjectQuota(Arc<str>),
    TenantQuota,
    /// An upstream's penalty box (`true`: the shared one).
    Penalty(Arc<str>, bool),
    /// An upstream's AIMD multiplier and adaptive window (`true`: the shared one).
    UpstreamState(Arc<str>, bool),
    Lease(u64),
    /// How long this tenant's calls run, per tool (concurrency hints).
    RunTimes,
    /// The subjects seen lately (for snapshots).
    SubjectIndex,
    /// What a renewed lease or an MCP task keeps beside its lease: its own TTL, a task's next poll.
    LeaseExtra(u64),
    /// The tenant's MCP tasks in flight, by their ends.
    Tasks,
    /// The tenant's poll cursor (see [`crate::engine::poll`]).
    TaskCursor,
    /// A spend unit's use by the whole tenant, per UTC day.
    SpendTenant(Arc<str>),
    /// A spend unit's use by one subject, per UTC day: (subject, unit).
    SpendSubject(Arc<str>, Arc<str>),
    /// A spend unit's use by one agent run: (run, unit). Forgotten `run_idle` after its last call.
    SpendRun(Arc<str>, Arc<str>),
}

impl StateKey {
    /// State shared by every tenant (kept apart from any one tenant's).
    pub fn cross_tenant(&self) -> bool {
        matches!(
            self,
            StateKey::SharedUpstreamBucket(_)
                | StateKey::GlobalBucket(_)
                | StateKey::Penalty(_, true)
                | StateKey::UpstreamState(_, true)
        )
    }
}

/// One bucket layer of a call.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteLayer {
    pub key: StateKey,
    /// Microseconds per token at the configured rate.
    pub t_us: f64,
    pub burst: f64,
    /// Tokens this call takes.
    pub tokens: f64,
    /// Whether the call may be held on this layer.
    pub hold: bool,
    /// The upstream state whose AIMD multiplier scales this layer's rate.
    pub aimd: Option<StateKey>,
    /// How long an AIMD cut lasts without a new 429, in microseconds.
    pub forget_us: f64,
}

/// An upstream penalty box a call must be outside of.
#[derive(Debug, Clone, PartialEq)]
pub struct RemotePenalty {
    pub key: StateKey,
    /// The 1-based index of this upstream's bucket layer in [`RemoteCall::layers`] (0: none): a call
    /// refused by the penalty is promised that bucket's slot after the penalty.
    pub layer: usize,
    /// The refill step of one call, for staggering hints when there is no bucket.
    pub step_us: f64,
}

/// An upstream's adaptive throttle.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteAdaptive {
    pub key: StateKey,
    pub window_us: f64,
    pub k: f64,
    pub min_requests: u64,
    pub step_us: f64,
}

/// A concurrency scope (a sorted set of live leases).
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteSlots {
    pub key: StateKey,
    pub cap: u32,
    pub subject: bool,
}

/// A daily quota.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteQuota {
    pub key: StateKey,
    pub quota: f64,
    pub subject: bool,
}

/// One spend budget a call's estimate must fit.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteBudget {
    pub key: StateKey,
    pub size: f64,
    pub budget: crate::engine::spend::SpendBudget,
    /// A run's: how long it is remembered after its last call, in microseconds (0 for a daily one).
    pub idle_us: f64,
}

/// A call's spend in one unit: its estimate and every budget it applies to, in the order a refusal
/// names them (run, subject's day, tenant's day).
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteSpend {
    pub unit: Arc<str>,
    pub estimate: f64,
    pub budgets: Vec<RemoteBudget>,
    /// The tenant's day figure of the unit when no `tenant_daily` budget keeps it (`None` when one
    /// does): counted all the same, as the memory store counts it, for `/v1/tenants/{tenant}`.
    pub tally: Option<StateKey>,
}

/// What a release or feedback reports to an upstream's state.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamReport {
    pub name: Arc<str>,
    pub penalty: StateKey,
    pub state: StateKey,
    /// AIMD factor, floor and recovery (upstreams with a budget).
    pub aimd: Option<(f64, f64, f64)>,
    /// The adaptive window in microseconds (0: off).
    pub adaptive_window_us: f64,
    pub forget_us: f64,
    /// How the rate of a shared upstream with a budget is held and probed (see
    /// [`crate::engine::probe`]); `None` for the others, whose rate follows plain AIMD.
    pub probe: Option<ProbeReport>,
}

/// What the store needs to count an answer towards a probed rate, and admitd to plan the next probe.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeReport {
    pub probing: crate::config::Probing,
    /// What one healthy answer is worth, in multiplier-seconds: its budget tokens over the
    /// configured rate per second.
    pub units: f64,
}

impl UpstreamReport {
    pub fn cross_tenant(&self) -> bool {
        self.state.cross_tenant()
    }
}

/// Everything a store checks and spends for one call, all or nothing.
#[derive(Clone)]
pub struct RemoteCall {
    pub lease: u64,
    pub subject: Arc<str>,
    pub tool: Arc<str>,
    pub cost: f64,
    pub max_wait_us: f64,
    pub ttl_us: f64,
    pub shadow: bool,
    pub returning: bool,
    /// A uniform number in [0, 1) for the adaptive throttle's draw.
    pub rand: f64,
    /// The shortest concurrency hint, in microseconds.
    pub floor_us: f64,
    pub penalties: Vec<RemotePenalty>,
    pub adaptive: Vec<RemoteAdaptive>,
    pub slots: Vec<RemoteSlots>,
    pub quotas: Vec<RemoteQuota>,
    pub layers: Vec<RemoteLayer>,
    /// The call's primary upstream first: what its release reports.
    pub upstreams: Vec<UpstreamReport>,
    /// Each configured spend unit's estimate and budgets (empty without `[spend.*]`).
    pub spend: Vec<RemoteSpend>,
    /// The call waited for a concurrency slot and asks again.
    pub asked_again: bool,
    /// Record the subject in the tenant's subject index (what `/v1/tenants/{tenant}` lists). A
    /// replica that recorded it recently leaves it out (see `actors::remote`).
    pub index: bool,
    resolved: Resolved,
    plan: Vec<LayerPlan>,
}

impl std::fmt::Debug for RemoteCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteCall")
            .field("lease", &self.lease)
            .field("subject", &self.subject)
            .field("tool", &self.tool)
            .field("cost", &self.cost)
            .field("layers", &self.layers)
            .finish_non_exhaustive()
    }
}

/// Why the store refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteScope {
    Penalty,
    Adaptive,
    Concurrency,
    DailyQuota,
    /// The bucket layer at this 0-based index of [`RemoteCall::layers`].
    Layer(usize),
    /// A spend budget: (0-based unit in [`RemoteCall::spend`], 0-based budget in its `budgets`).
    Spend(usize, usize),
}

/// The store's answer to a [`RemoteCall`].
#[derive(Debug, Clone, PartialEq)]
pub enum RemoteAnswer {
    /// Spent; hold this long before running. Every layer's whole tokens left and microseconds until
    /// full, in the order of [`RemoteCall::layers`].
    Admitted {
        hold_us: f64,
        layers: Vec<(u64, f64)>,
        /// What each spend budget of the call has left after it, in the order of
        /// [`RemoteCall::spend`] and their `budgets`.
        spend: Vec<f64>,
    },
    Refused {
        scope: RemoteScope,
        wait_us: f64,
        /// Every slot up to the promise horizon is promised: the wait is the first past it.
        booked: bool,
        account_wide: bool,
        layers: Vec<(u64, f64)>,
        /// The refusing layer's AIMD multiplier (1 when not cut).
        multiplier: f64,
        /// A spend budget's refusal: what that budget has left (0 otherwise).
        spend_left: f64,
    },
    /// No concurrency slot free, and the call may wait: ask again (the first slot is expected in
    /// this many microseconds).
    Busy { wait_us: f64 },
}

/// What the engine makes of an answer. The large variant is the common one (as with the
/// in-memory [`AdmitResult`]).
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum RemoteOutcome {
    Decided(Decision),
    /// Ask the store again, no later than this many nanoseconds from now.
    Busy(u64),
}

const US_PER_NS: f64 = 1e-3;

impl TenantEngine {
    /// Plans a call for a shared store, or decides it at once when no state can change the answer
    /// (a cost larger than some layer can ever hold). The decision is the rare case; it is returned
    /// as is, like every other decision.
    #[allow(clippy::result_large_err)]
    pub fn plan_remote(&mut self, req: &AdmitRequest, now: Nanos) -> Result<RemoteCall, Decision> {
        self.last_active = now;
        let r = self.resolve(req);
        let cfg = Arc::clone(&self.policy.cfg);
        let configs = upstream_configs(&cfg, &r);
        let plan = self.plan_for(&r, &configs);
        if let Some(shed) = self.oversized(&r, &plan) {
            return Err(self.refuse(r, &plan, shed, now));
        }
        let shared_up = |up: &str| cfg.upstreams.get(up).is_some_and(|u| u.shared);
        let plan_name = cfg.tenant_global(&self.tenant).0.map(Arc::<str>::from);
        let layers: Vec<RemoteLayer> = plan
            .iter()
            .map(|lp| {
                let up = lp.upstream.clone().unwrap_or_else(|| Arc::from(""));
                let key = match lp.layer {
                    Layer::Subject => StateKey::SubjectBucket(r.subject.clone()),
                    Layer::SubjectTool => {
                        StateKey::SubjectToolBucket(r.subject.clone(), r.tool.clone())
                    }
                    Layer::Tenant => StateKey::TenantBucket,
                    Layer::TenantUpstream if lp.shared.is_some() => {
                        StateKey::SharedUpstreamBucket(up.clone())
                    }
                    Layer::TenantUpstream => StateKey::UpstreamBucket(up.clone()),
                    Layer::Global => StateKey::GlobalBucket(plan_name.clone()),
                };
                let upstream_layer = lp.layer == Layer::TenantUpstream;
                let window = cfg.upstreams.get(&*up).map_or(0, adaptive_window);
                RemoteLayer {
                    key,
                    // The configured shape: the store applies its own AIMD multiplier.
                    t_us: lp.g.t * lp.multiplier * US_PER_NS,
                    burst: lp.g.burst,
                    tokens: r.cost * lp.units,
                    hold: lp.hold_ok,
                    aimd: upstream_layer
                        .then(|| StateKey::UpstreamState(up.clone(), shared_up(&up))),
                    forget_us: forget_after(window) as f64 * US_PER_NS,
                }
            })
            .collect();
        let layer_of = |up: &Arc<str>| {
            plan.iter()
                .position(|lp| {
                    lp.layer == Layer::TenantUpstream && lp.upstream.as_ref() == Some(up)
                })
                .map_or(0, |i| i + 1)
        };
        let mut penalties = Vec::new();
        let mut adaptive = Vec::new();
        for ((up, _), c) in r.upstreams.iter().zip(&configs) {
            let shared = shared_up(up);
            let step_us = self.retry_step(&r, up, None) as f64 * US_PER_NS;
            penalties.push(RemotePenalty {
                key: StateKey::Penalty(up.clone(), shared),
                layer: layer_of(up),
                step_us,
            });
            if let Some(a) = c.and_then(|c| c.adaptive) {
                adaptive.push(RemoteAdaptive {
                    key: StateKey::UpstreamState(up.clone(), shared),
                    window_us: a.window.as_micros() as f64,
                    k: a.k,
                    min_requests: a.min_requests,
                    step_us,
                });
            }
        }
        let limits = &self.policy.limits;
        let mut slots = Vec::new();
        if let Some(cap) = limits.subject.concurrency {
            slots.push(RemoteSlots {
                key: StateKey::SubjectSlots(r.subject.clone()),
                cap,
                subject: true,
            });
        }
        // The tenant's leases are always kept, capped or not: they are its calls in flight.
        slots.push(RemoteSlots {
            key: StateKey::TenantSlots,
            cap: limits.tenant.concurrency.unwrap_or(u32::MAX),
            subject: false,
        });
        let mut quotas = Vec::new();
        if let Some(q) = limits.subject.daily_quota {
            quotas.push(RemoteQuota {
                key: StateKey::SubjectQuota(r.subject.clone()),
                quota: q,
                subject: true,
            });
        }
        if let Some(q) = limits.tenant.daily_quota {
            quotas.push(RemoteQuota {
                key: StateKey::TenantQuota,
                quota: q,
                subject: false,
            });
        }
        let upstreams = r
            .upstream
            .iter()
            .map(|up| {
                let mut report = self.upstream_report(up);
                // A served answer of this call is worth its tokens on the upstream's budget.
                let units = r
                    .upstreams
                    .iter()
                    .find(|(u, _)| u == up)
                    .map_or(1.0, |(_, n)| *n);
                if let Some(p) = &mut report.probe {
                    p.units *= (r.cost * units).max(0.0);
                }
                report
            })
            .collect();
        let spend = self.remote_spend(&r);
        let run = self.run_times.estimate(&r.subject, &r.tool);
        let lease = self.rng.next_u64();
        Ok(RemoteCall {
            lease,
            subject: r.subject.clone(),
            tool: r.tool.clone(),
            cost: r.cost,
            max_wait_us: req.max_wait_ns as f64 * US_PER_NS,
            ttl_us: cfg.server.lease_ttl.as_micros() as f64,
            shadow: cfg.server.mode == Mode::Shadow,
            returning: req.returning,
            rand: self.rng.unit(),
            floor_us: slots::floor(run) as f64 * US_PER_NS,
            penalties,
            adaptive,
            slots,
            quotas,
            layers,
            upstreams,
            spend,
            asked_again: false,
            index: true,
            resolved: r,
            plan,
        })
    }

    /// The call's spend units with their budgets, as [`crate::engine::spend::SpendLedger`] checks
    /// them in memory.
    fn remote_spend(&self, r: &Resolved) -> Vec<RemoteSpend> {
        use crate::engine::spend::SpendBudget;
        let Some(sp) = r.spend.as_deref() else {
            return Vec::new();
        };
        let units = &self.policy.cfg.spend.units;
        units
            .iter()
            .zip(&self.policy.spend)
            .zip(&self.policy.spend_names)
            .enumerate()
            .map(|(i, ((u, b), name))| {
                let mut budgets = Vec::new();
                if let (Some(size), Some(run)) = (b.run, &sp.run) {
                    budgets.push(RemoteBudget {
                        key: StateKey::SpendRun(Arc::from(run.as_str()), name.clone()),
                        size,
                        budget: SpendBudget::Run,
                        idle_us: u.run_idle.as_micros() as f64,
                    });
                }
                if let Some(size) = b.subject_daily {
                    budgets.push(RemoteBudget {
                        key: StateKey::SpendSubject(r.subject.clone(), name.clone()),
                        size,
                        budget: SpendBudget::SubjectDaily,
                        idle_us: 0.0,
                    });
                }
                if let Some(size) = b.tenant_daily {
                    budgets.push(RemoteBudget {
                        key: StateKey::SpendTenant(name.clone()),
                        size,
                        budget: SpendBudget::TenantDaily,
                        idle_us: 0.0,
                    });
                }
                RemoteSpend {
                    unit: name.clone(),
                    estimate: sp.estimates.get(i).copied().unwrap_or(0.0),
                    budgets,
                    tally: b
                        .tenant_daily
                        .is_none()
                        .then(|| StateKey::SpendTenant(name.clone())),
                }
            })
            .collect()
    }

    /// The answer's spend: per unit what was reserved and the least any budget has left.
    fn remote_views(call: &RemoteCall, left: &[f64]) -> Option<Box<SpendViews>> {
        if call.spend.is_empty() {
            return None;
        }
        let mut left = left.iter();
        let views = call.spend.iter().map(|s| {
            let mut least: Option<(f64, crate::engine::spend::SpendBudget)> = None;
            for b in &s.budgets {
                let l = left.next().copied().unwrap_or(b.size - s.estimate);
                if least.is_none_or(|(x, _)| l < x - 1e-9) {
                    least = Some((l, b.budget));
                }
            }
            SpendView {
                unit: s.unit.clone(),
                reserved: s.estimate,
                remaining: least,
            }
        });
        Some(Box::new(views.collect()))
    }

    /// What an answer from `upstream` changes in the store, as this tenant's config says.
    pub fn upstream_report(&self, upstream: &Arc<str>) -> UpstreamReport {
        let cfg = self.policy.upstream(upstream);
        let shared = cfg.is_some_and(|c| c.shared);
        let window = cfg.map_or(0, adaptive_window);
        UpstreamReport {
            name: upstream.clone(),
            penalty: StateKey::Penalty(upstream.clone(), shared),
            state: StateKey::UpstreamState(upstream.clone(), shared),
            aimd: cfg
                .filter(|c| c.bucket.is_some())
                .map(|c| (c.aimd.factor, c.aimd.floor, c.aimd.recover)),
            adaptive_window_us: window as f64 * US_PER_NS,
            forget_us: forget_after(window) as f64 * US_PER_NS,
            probe: cfg
                .filter(|c| c.shared)
                .and_then(|c| c.bucket.map(|b| (c, b.rate.per_sec)))
                .filter(|(_, per_sec)| *per_sec > 0.0)
                .map(|(c, per_sec)| ProbeReport {
                    probing: c.probe,
                    units: 1.0 / per_sec,
                }),
        }
    }

    /// Turns the store's answer into the decision an in-memory decision would give.
    pub fn interpret_remote(&mut self, call: &RemoteCall, answer: RemoteAnswer) -> RemoteOutcome {
        let several = several_upstreams(&call.plan);
        let states = |layers: &[(u64, f64)]| -> Vec<LayerState> {
            call.plan
                .iter()
                .zip(layers.iter().chain(std::iter::repeat(&(0, 0.0))))
                .map(|(lp, (left, reset_us))| {
                    layer_state(lp, several, *left, (reset_us * 1e3) as u64)
                })
                .collect()
        };
        let r = call.resolved.clone();
        let mode = self.policy.cfg.server.mode;
        match answer {
            RemoteAnswer::Busy { wait_us } => RemoteOutcome::Busy((wait_us * 1e3) as u64),
            RemoteAnswer::Admitted {
                hold_us,
                layers,
                spend,
            } => {
                let layers = states(&layers);
                RemoteOutcome::Decided(Decision {
                    verdict: Verdict::Admitted(Admitted {
                        lease: call.lease,
                        hold_ns: (hold_us * 1e3) as u64,
                        queued_ns: 0,
                        mode,
                        would_shed: None,
                        unchecked: false,
                        spend: Self::remote_views(call, &spend),
                    }),
                    resolved: r,
                    layers,
                })
            }
            RemoteAnswer::Refused {
                scope,
                wait_us,
                booked,
                account_wide,
                layers,
                multiplier,
                spend_left,
            } => {
                let mut wait = (wait_us.max(0.0) * 1e3) as u64;
                if let RemoteScope::Spend(u, b) = scope {
                    let shed = self.remote_spend_shed(call, u, b, spend_left, wait);
                    let layers = states(&layers);
                    return RemoteOutcome::Decided(self.remote_refusal(call, r, shed, layers));
                }
                let (scope, upstream) = match scope {
                    RemoteScope::Penalty => (Scope::UpstreamPenalty, r.upstream.clone()),
                    RemoteScope::Adaptive => (Scope::Adaptive, r.upstream.clone()),
                    RemoteScope::Concurrency => (Scope::Concurrency, r.upstream.clone()),
                    RemoteScope::DailyQuota => (Scope::DailyQuota, r.upstream.clone()),
                    RemoteScope::Spend(..) => (Scope::Spend, None),
                    RemoteScope::Layer(i) => {
                        let lp = call.plan.get(i);
                        (
                            lp.map_or(Scope::Tenant, |lp| lp.layer.scope()),
                            lp.and_then(|lp| lp.upstream.clone())
                                .or_else(|| r.upstream.clone()),
                        )
                    }
                };
                if booked {
                    wait = self.spread_booked(wait);
                }
                // The store gives each caller refused for a slot a time of its own, one after the
                // other as slots free: jitter would make a caller late for the next one's slot.
                let jitter = scope != Scope::Concurrency;
                let mut shed =
                    self.shed_jittered(&r, upstream.as_deref(), scope, wait, account_wide, jitter);
                if booked {
                    shed.message.push_str(refusal::LONG_WAIT);
                }
                if scope == Scope::TenantUpstream && multiplier < 1.0 {
                    shed.reason = format!(
                        "rate limit reached (the upstream answered 429, so its budget is cut to {:.0}%)",
                        multiplier * 100.0
                    );
                }
                let layers = states(&layers);
                RemoteOutcome::Decided(self.remote_refusal(call, r, shed, layers))
            }
        }
    }

    /// A refusal from the store as a decision: a shed, or in shadow mode an admission that carries
    /// it (the store wrote its lease, which holds nothing).
    fn remote_refusal(
        &self,
        call: &RemoteCall,
        r: Resolved,
        shed: Shed,
        layers: Vec<LayerState>,
    ) -> Decision {
        let mode = self.policy.cfg.server.mode;
        let verdict = match mode {
            Mode::Enforce => Verdict::Shed(shed),
            Mode::Shadow => Verdict::Admitted(Admitted {
                lease: call.lease,
                hold_ns: 0,
                queued_ns: 0,
                mode,
                would_shed: Some(shed),
                unchecked: false,
                spend: None,
            }),
        };
        Decision {
            verdict,
            resolved: r,
            layers,
        }
    }

    /// The refusal of spend budget `b` of unit `u` of the call, with what it has left and the wait
    /// the store gave (until its UTC midnight for a daily budget, none for a run's).
    fn remote_spend_shed(
        &self,
        call: &RemoteCall,
        u: usize,
        b: usize,
        left: f64,
        wait_ns: u64,
    ) -> Shed {
        let s = call.spend.get(u);
        let budget = s.and_then(|s| s.budgets.get(b));
        let short = crate::engine::spend::SpendShort {
            unit: self
                .policy
                .spend_names
                .iter()
                .position(|n| Some(n) == s.map(|s| &s.unit))
                .unwrap_or(usize::MAX),
            budget: budget.map_or(crate::engine::spend::SpendBudget::Run, |b| b.budget),
            remaining: left,
            estimate: s.map_or(0.0, |s| s.estimate),
            size: budget.map_or(0.0, |b| b.size),
        };
        self.spend_shed_after(&short, ceil_ms(wait_ns).max(1))
    }

    /// An admission made without the store (its `on_error = "fail_open"`): nothing is checked or
    /// spent, and the lease is this process's alone.
    pub fn admit_unchecked(&mut self, req: &AdmitRequest) -> Decision {
        let r = self.resolve(req);
        Decision {
            verdict: Verdict::Admitted(Admitted {
                lease: self.rng.next_u64(),
                hold_ns: 0,
                queued_ns: 0,
                mode: self.policy.cfg.server.mode,
                would_shed: None,
                unchecked: true,
                spend: None,
            }),
            resolved: r,
            layers: Vec::new(),
        }
    }

    /// Records how long a call ran (a release's `duration_ms`), for concurrency hints.
    pub fn note_run_time(&mut self, subject: &str, tool: &str, run_ns: u64) {
        self.run_times.record(subject, tool, run_ns);
    }

    /// What the snapshot of a tenant kept in a store reads, and the config it is shown with.
    pub fn remote_snapshot_plan(&self) -> RemoteSnapshotPlan {
        let cfg = &self.policy.cfg;
        let mut upstreams: Vec<(Arc<str>, bool, Option<f64>)> = cfg
            .upstreams
            .iter()
            .map(|(n, u)| {
                (
                    Arc::<str>::from(n.as_str()),
                    u.shared,
                    u.bucket.map(|b| b.rate.per_sec),
                )
            })
            .collect();
        upstreams.sort_by(|a, b| a.0.cmp(&b.0));
        RemoteSnapshotPlan {
            tenant: self.tenant.clone(),
            plan: cfg.tenants.get(&*self.tenant).and_then(|t| t.plan.clone()),
            mode: cfg.server.mode.as_str(),
            subject_g: self.policy.subject_g,
            tenant_g: self.policy.tenant_g,
            daily_quota: self.policy.limits.tenant.daily_quota,
            subject_daily_quota: self.policy.limits.subject.daily_quota,
            upstreams,
            spend: self
                .policy
                .spend_names
                .iter()
                .zip(&self.policy.spend)
                .map(|(name, b)| (name.clone(), *b))
                .collect(),
        }
    }
}

/// What a snapshot of a tenant kept in a store reads (see [`TenantEngine::remote_snapshot_plan`]).
#[derive(Debug, Clone)]
pub struct RemoteSnapshotPlan {
    pub tenant: Arc<str>,
    pub plan: Option<String>,
    pub mode: &'static str,
    pub subject_g: Gcra,
    pub tenant_g: Gcra,
    pub daily_quota: Option<f64>,
    pub subject_daily_quota: Option<f64>,
    /// Every configured upstream: name, shared, configured rate.
    pub upstreams: Vec<(Arc<str>, bool, Option<f64>)>,
    /// Every configured spend unit with its budgets after the tenant's plan (the tenant's day
    /// figure of each is [`StateKey::SpendTenant`]).
    pub spend: Vec<(Arc<str>, crate::config::SpendBudgets)>,
}

/// What the store read for a snapshot, in microseconds of its own clock.
#[derive(Debug, Clone, Default)]
pub struct RemoteSnapshotState {
    pub now_us: f64,
    pub tenant_tat_us: f64,
    pub tenant_inflight: u32,
    pub tenant_quota_used: f64,
    pub day_ends_us: f64,
    /// (subject, bucket full at, in flight, quota used today), most recent first.
    pub subjects: Vec<(String, f64, u32, f64)>,
    /// Per configured upstream, in the plan's order: penalty until, AIMD multiplier.
    pub upstreams: Vec<(f64, f64)>,
    /// Per spend unit, in the plan's order: what the tenant reserved and settled today.
    pub spend: Vec<f64>,
}

impl RemoteSnapshotPlan {
    /// The snapshot in the shape `GET /v1/tenants/{tenant}` shows for an in-memory tenant.
    pub fn render(&self, s: &RemoteSnapshotState) -> TenantSnapshot {
        let ns = |at_us: f64| ((at_us - s.now_us).max(0.0) * 1e3) as u64;
        let bucket = |layer: &'static str, key: String, g: &Gcra, tat_us: f64| {
            let reset = ns(tat_us);
            let tokens = (g.burst - reset as f64 / g.t).max(0.0);
            BucketSnapshot {
                layer,
                key,
                tokens: (tokens + g.burst * 1e-12) as u64,
                burst: g.burst,
                rate_per_sec: NS_PER_SEC as f64 / g.t,
                reset_ms: ceil_ms(reset),
            }
        };
        let mut buckets = vec![bucket(
            "tenant",
            self.tenant.to_string(),
            &self.tenant_g,
            s.tenant_tat_us,
        )];
        let mut subjects = Vec::new();
        for (name, tat, inflight, used) in &s.subjects {
            buckets.push(bucket("subject", name.clone(), &self.subject_g, *tat));
            subjects.push(SubjectSnapshot {
                subject: name.clone(),
                inflight: *inflight,
                quota_used: *used,
            });
        }
        let mut penalties = Vec::new();
        let mut upstreams = Vec::new();
        for ((name, shared, rate), (until, m)) in self.upstreams.iter().zip(&s.upstreams) {
            let left = ns(*until);
            if left > 0 {
                penalties.push(PenaltySnapshot {
                    upstream: name.to_string(),
                    shared: *shared,
                    retry_after_ms: ceil_ms(left),
                });
            }
            upstreams.push(UpstreamSnapshot {
                upstream: name.to_string(),
                shared: *shared,
                published_limit: None,
                reserved_for_batch: None,
                configured_rate: *rate,
                effective_rate: rate.map(|r| r * m),
                multiplier: *m,
                throttle_probability: 0.0,
                requests: 0,
                accepts: 0,
                fair_share: None,
            });
        }
        TenantSnapshot {
            tenant: self.tenant.to_string(),
            plan: self.plan.clone(),
            mode: self.mode,
            inflight: s.tenant_inflight,
            waiting: 0,
            leases: s.tenant_inflight as usize,
            quota: QuotaSnapshot {
                day_used: s.tenant_quota_used,
                daily_quota: self.daily_quota,
                subject_daily_quota: self.subject_daily_quota,
                resets_in_ms: ceil_ms(ns(s.day_ends_us)),
            },
            buckets,
            subjects,
            penalties,
            upstreams,
            spend: self
                .spend
                .iter()
                .enumerate()
                .map(|(i, (unit, b))| {
                    SpendSnapshot::of_day(unit, s.spend.get(i).copied().unwrap_or(0.0), b)
                })
                .collect(),
            spend_runs: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_support::{call, harness, Req, MS, SEC};

    const CONFIG: &str =
        "[limits.subject]\nrate = \"2/s\"\nburst = 4\nconcurrency = 3\ndaily_quota = 100\n\
        [limits.tenant]\nrate = \"10/s\"\nburst = 50\n\
        [tools.crm_read]\nupstream = \"crm\"\nrate = \"1/s\"\nburst = 2\n\
        [tools.pay]\nupstream = \"stripe\"\n\
        [upstreams.crm]\nrate = \"5/s\"\nburst = 5\n\
        [upstreams.stripe]\nrate = \"20/s\"\nburst = 20\nshared = true\n";

    fn engine(toml: &str) -> TenantEngine {
        let (_clock, cfg, shared) = harness(toml, 0);
        TenantEngine::new(Arc::from("acme"), cfg, shared, 7)
    }

    fn plan(e: &mut TenantEngine, req: AdmitRequest) -> RemoteCall {
        e.plan_remote(&req, SEC).expect("planned for the store")
    }

    #[test]
    fn a_call_is_planned_as_every_layer_it_passes_named_by_state() {
        let mut e = engine(CONFIG);
        let c = plan(&mut e, call("bot", "crm_read").wait_ms(250));
        let keys: Vec<&StateKey> = c.layers.iter().map(|l| &l.key).collect();
        let s: Arc<str> = Arc::from("bot");
        let crm: Arc<str> = Arc::from("crm");
        assert_eq!(
            keys,
            [
                &StateKey::SubjectBucket(s.clone()),
                &StateKey::SubjectToolBucket(s.clone(), Arc::from("crm_read")),
                &StateKey::TenantBucket,
                &StateKey::UpstreamBucket(crm.clone()),
                &StateKey::GlobalBucket(None),
            ]
        );
        // Shapes in microseconds at the configured rate; the store applies the AIMD multiplier.
        assert_eq!(c.layers[0].t_us, 500_000.0);
        assert_eq!(c.layers[0].burst, 4.0);
        assert_eq!(c.layers[3].t_us, 200_000.0);
        assert_eq!(
            c.layers[3].aimd,
            Some(StateKey::UpstreamState(crm.clone(), false))
        );
        assert_eq!(c.layers[0].aimd, None);
        assert_eq!(c.max_wait_us, 250_000.0);
        // The penalty is promised the upstream bucket's slot after it (the 4th layer, 1-based).
        assert_eq!(c.penalties.len(), 1);
        assert_eq!(c.penalties[0].key, StateKey::Penalty(crm.clone(), false));
        assert_eq!(c.penalties[0].layer, 4);
        // Concurrency: the subject's cap and the tenant's (the default 32).
        assert_eq!(c.slots.len(), 2);
        assert_eq!((c.slots[0].cap, c.slots[0].subject), (3, true));
        assert_eq!((c.slots[1].cap, c.slots[1].subject), (32, false));
        assert_eq!(c.quotas.len(), 1);
        assert_eq!(c.quotas[0].key, StateKey::SubjectQuota(s));
        assert_eq!(c.upstreams[0].name, crm);
        assert_eq!(c.upstreams[0].aimd, Some((0.5, 0.1, 0.05)));
        assert!(!c.layers.iter().any(|l| l.key == StateKey::TenantQuota));
    }

    #[test]
    fn the_tenants_day_of_a_unit_is_kept_with_or_without_its_budget_and_shown() {
        let mut e = engine(
            "[spend.usd]\nestimate = 0.5\ntenant_daily = 10\nrun = 2\n\
            [spend.tokens]\nestimate = 100\nsubject_daily = 1000\n",
        );
        let mut req = call("bot", "search");
        req.spend = Some(Default::default());
        let c = plan(&mut e, req);
        let unit = |name: &str| c.spend.iter().find(|s| &*s.unit == name).unwrap();
        // The tenant_daily budget keeps usd's day; tokens' is kept beside its budgets.
        assert_eq!(unit("usd").tally, None);
        assert!(unit("usd")
            .budgets
            .iter()
            .any(|b| b.key == StateKey::SpendTenant(Arc::from("usd"))));
        assert_eq!(
            unit("tokens").tally,
            Some(StateKey::SpendTenant(Arc::from("tokens")))
        );
        let plan = e.remote_snapshot_plan();
        let figures: Vec<f64> = plan
            .spend
            .iter()
            .map(|(u, _)| if &**u == "usd" { 12.5 } else { 140.0 })
            .collect();
        let snap = plan.render(&RemoteSnapshotState {
            spend: figures,
            ..Default::default()
        });
        let shown = |name: &str| snap.spend.iter().find(|s| s.unit == name).unwrap();
        let usd = shown("usd");
        assert_eq!(
            (usd.day_spent, usd.tenant_daily, usd.day_remaining),
            (12.5, Some(10.0), Some(-2.5))
        );
        assert_eq!((usd.subject_daily, usd.run), (None, Some(2.0)));
        let tokens = shown("tokens");
        assert_eq!((tokens.day_spent, tokens.day_remaining), (140.0, None));
        assert_eq!(tokens.subject_daily, Some(1000.0));
    }

    #[test]
    fn the_tenants_leases_are_kept_even_without_a_cap() {
        let mut e = engine("[limits.tenant]\nrate = \"10/s\"\n");
        let mut cfg = (**e.config()).clone();
        cfg.limits.tenant.concurrency = None;
        e.set_config(Arc::new(cfg), SEC);
        let c = plan(&mut e, call("bot", "search"));
        let tenant = c
            .slots
            .iter()
            .find(|s| !s.subject)
            .expect("the tenant's leases");
        assert_eq!(tenant.cap, u32::MAX);
        assert_eq!(tenant.key, StateKey::TenantSlots);
    }

    #[test]
    fn a_shared_upstream_and_the_global_bucket_are_cross_tenant_state() {
        let mut e = engine(CONFIG);
        let c = plan(&mut e, call("bot", "pay"));
        let stripe = c
            .layers
            .iter()
            .find(|l| l.key == StateKey::SharedUpstreamBucket(Arc::from("stripe")))
            .expect("the shared budget");
        assert!(stripe.key.cross_tenant());
        assert_eq!(
            stripe.aimd,
            Some(StateKey::UpstreamState(Arc::from("stripe"), true))
        );
        assert!(c.penalties[0].key.cross_tenant());
        assert!(c.upstreams[0].cross_tenant());
        assert!(c.layers.last().unwrap().key.cross_tenant());
        assert!(!c.layers[0].key.cross_tenant());
    }

    #[test]
    fn an_oversized_call_is_decided_without_the_store() {
        let mut e = engine(CONFIG);
        let d = e
            .plan_remote(&call("bot", "search").cost(10.0), SEC)
            .expect_err("decided here");
        match d.verdict {
            Verdict::Shed(s) => {
                assert_eq!(s.scope, Scope::Oversized);
                assert!(!s.retryable);
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn an_admission_reads_the_layers_the_store_reported() {
        let mut e = engine(CONFIG);
        let c = plan(&mut e, call("bot", "search"));
        let answer = RemoteAnswer::Admitted {
            hold_us: 1500.0,
            layers: vec![(3, 500_000.0), (49, 100_000.0), (4999, 200.0)],
            spend: vec![],
        };
        let RemoteOutcome::Decided(d) = e.interpret_remote(&c, answer) else {
            panic!("decided")
        };
        let a = match &d.verdict {
            Verdict::Admitted(a) => a,
            v => panic!("{v:?}"),
        };
        assert_eq!(a.lease, c.lease);
        assert_eq!(a.hold_ns, 1_500_000);
        assert_eq!(d.layers.len(), 3);
        assert_eq!(d.tightest().unwrap().layer, Layer::Subject);
        assert_eq!(d.layers[0].remaining, 3);
        assert_eq!(d.layers[0].reset_ns, 500 * MS);
        assert_eq!(d.layers[0].window_secs, 2);
    }

    #[test]
    fn a_refusal_names_its_layer_and_says_when_to_come_back() {
        let mut e = engine(CONFIG);
        let c = plan(&mut e, call("bot", "crm_read"));
        let refused = |e: &mut TenantEngine, booked: bool, multiplier: f64| {
            let answer = RemoteAnswer::Refused {
                scope: RemoteScope::Layer(3),
                wait_us: 2_400_000.0,
                booked,
                account_wide: false,
                layers: vec![(0, 0.0); 5],
                multiplier,
                spend_left: 0.0,
            };
            match e.interpret_remote(&c, answer) {
                RemoteOutcome::Decided(Decision {
                    verdict: Verdict::Shed(s),
                    ..
                }) => s,
                o => panic!("{o:?}"),
            }
        };
        let s = refused(&mut e, false, 1.0);
        assert_eq!(s.scope, Scope::TenantUpstream);
        // 2.4 s plus at most 5% of jitter, never into the next whole second.
        assert!(
            (2_400..=2_520).contains(&s.retry_after_ms),
            "{}",
            s.retry_after_ms
        );
        assert!(s.message.contains("Wait 3 seconds"), "{}", s.message);
        assert!(s.message.contains("crm"), "{}", s.message);
        assert!(!s.message.contains(refusal::LONG_WAIT));
        let cut = refused(&mut e, false, 0.25);
        assert!(cut.reason.contains("cut to 25%"), "{}", cut.reason);
        let booked = refused(&mut e, true, 1.0);
        assert!(
            booked.message.ends_with(refusal::LONG_WAIT),
            "{}",
            booked.message
        );
        assert!(booked.retry_after_ms >= 2_400);
    }

    #[test]
    fn shadow_mode_admits_what_the_store_refused_and_says_so() {
        let mut e = engine("[server]\nmode = \"shadow\"\n");
        let c = plan(&mut e, call("bot", "search"));
        assert!(c.shadow);
        let answer = RemoteAnswer::Refused {
            scope: RemoteScope::Concurrency,
            wait_us: 100_000.0,
            booked: false,
            account_wide: true,
            layers: Vec::new(),
            multiplier: 1.0,
            spend_left: 0.0,
        };
        let RemoteOutcome::Decided(d) = e.interpret_remote(&c, answer) else {
            panic!("decided")
        };
        match d.verdict {
            Verdict::Admitted(a) => {
                assert_eq!(a.mode, Mode::Shadow);
                assert_eq!(a.lease, c.lease);
                let w = a.would_shed.expect("the refusal enforce mode gives");
                assert_eq!(w.scope, Scope::Concurrency);
            }
            v => panic!("{v:?}"),
        }
        // Layers the store did not report read as full-empty placeholders, one per plan layer.
        assert_eq!(d.layers.len(), 3);
    }

    #[test]
    fn a_call_that_finds_no_slot_asks_again() {
        let mut e = engine(CONFIG);
        let c = plan(&mut e, call("bot", "search").wait_ms(500));
        assert_eq!(
            e.interpret_remote(&c, RemoteAnswer::Busy { wait_us: 80_000.0 }),
            RemoteOutcome::Busy(80 * MS)
        );
    }
}
