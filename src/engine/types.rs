//! The vocabulary of admission decisions, shared by the engine, the actors, the HTTP layer and telemetry.

use std::sync::Arc;

use crate::config::Mode;

/// Why a call was refused (the `scope` of API.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    Subject,
    SubjectTool,
    Tenant,
    TenantUpstream,
    Global,
    Concurrency,
    DailyQuota,
    UpstreamPenalty,
    Adaptive,
    Oversized,
    /// An MCP task's status was polled sooner than it was told (`POST /v1/tasks/poll`).
    TaskPoll,
    /// A spend budget (money, tokens, ...) cannot hold the call's estimate.
    Spend,
}

impl Scope {
    pub const ALL: [Scope; 12] = [
        Scope::Subject,
        Scope::SubjectTool,
        Scope::Tenant,
        Scope::TenantUpstream,
        Scope::Global,
        Scope::Concurrency,
        Scope::DailyQuota,
        Scope::UpstreamPenalty,
        Scope::Adaptive,
        Scope::Oversized,
        Scope::TaskPoll,
        Scope::Spend,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Subject => "subject",
            Scope::SubjectTool => "subject_tool",
            Scope::Tenant => "tenant",
            Scope::TenantUpstream => "tenant_upstream",
            Scope::Global => "global",
            Scope::Concurrency => "concurrency",
            Scope::DailyQuota => "daily_quota",
            Scope::UpstreamPenalty => "upstream_penalty",
            Scope::Adaptive => "adaptive",
            Scope::Oversized => "oversized",
            Scope::TaskPoll => "task_poll",
            Scope::Spend => "spend",
        }
    }
}

/// A token-bucket layer, in the order the engine checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layer {
    Subject,
    SubjectTool,
    Tenant,
    TenantUpstream,
    Global,
}

impl Layer {
    pub fn as_str(self) -> &'static str {
        self.scope().as_str()
    }

    pub fn scope(self) -> Scope {
        match self {
            Layer::Subject => Scope::Subject,
            Layer::SubjectTool => Scope::SubjectTool,
            Layer::Tenant => Scope::Tenant,
            Layer::TenantUpstream => Scope::TenantUpstream,
            Layer::Global => Scope::Global,
        }
    }
}

/// One bucket layer that applied to a call: its shape (for `RateLimit-Policy`) and its state after the
/// decision (for `RateLimit` and the `remaining`/`limit`/`reset_ms` fields).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerState {
    pub layer: Layer,
    /// The name in the `RateLimit` headers: the layer's scope, or `tenant_upstream:<name>` when a call
    /// spends several upstreams (so each has its own entry).
    pub name: std::borrow::Cow<'static, str>,
    /// Burst, the `q` of the policy.
    pub burst: f64,
    /// Seconds a full refill takes, rounded up (`w`).
    pub window_secs: u64,
    /// Whole tokens left.
    pub remaining: u64,
    /// Nanoseconds until full again.
    pub reset_ns: u64,
}

/// What a call resolved to once tool defaults were applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub subject: Arc<str>,
    /// The subject's metric label: its name, or `__other__` past the label caps.
    pub subject_label: Arc<str>,
    pub tool: Arc<str>,
    /// The primary upstream (the one the call spends most of), for metrics and messages.
    pub upstream: Option<Arc<str>>,
    /// Every upstream the call spends, with the units it charges per unit of cost.
    pub upstreams: Vec<(Arc<str>, f64)>,
    pub cost: f64,
    /// The call's run and estimate per spend unit; `None` when no `[spend.*]` is configured.
    pub spend: Option<Box<ResolvedSpend>>,
}

/// A call's spend once the estimates were resolved (the call's own, else its tool's, else the
/// unit's), one per configured unit.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedSpend {
    /// Kept inline when short (the usual run id): no allocation per call. The ledger keeps its
    /// own shared copy of each run it knows.
    pub run: Option<compact_str::CompactString>,
    pub estimates: super::spend::Figures,
}

/// Which spend budget refused a call, for the refusal's `unit`, `budget` and `remaining`.
#[derive(Debug, Clone, PartialEq)]
pub struct SpendRefusal {
    pub unit: Arc<str>,
    pub budget: super::spend::SpendBudget,
    pub remaining: f64,
}

impl Resolved {
    /// Whether the subject's label is the folded `__other__` rather than its own name: a label is
    /// one of the two, so leases and subject states keep this flag instead of a second string. (A
    /// subject literally named `__other__` reads the same either way.)
    pub fn label_folded(&self) -> bool {
        !(Arc::ptr_eq(&self.subject_label, &self.subject) || self.subject_label == self.subject)
    }
}

/// A refusal.
#[derive(Debug, Clone, PartialEq)]
pub struct Shed {
    pub scope: Scope,
    /// When to retry, in milliseconds (0 when not retryable).
    pub retry_after_ms: u64,
    pub retryable: bool,
    /// A short reason for operators and the JSON body.
    pub reason: String,
    /// Text for the model (the MCP tool result).
    pub message: String,
    /// For a refusal by a spend budget (`scope: "spend"`): which one.
    pub spend: Option<Box<SpendRefusal>>,
}

/// An admission.
#[derive(Debug, Clone, PartialEq)]
pub struct Admitted {
    /// The lease's number inside this tenant (the HTTP layer adds the tenant to make the lease id).
    pub lease: u64,
    /// Nanoseconds the caller must still hold before running the tool.
    pub hold_ns: u64,
    /// Nanoseconds the call already spent queued for a concurrency slot.
    pub queued_ns: u64,
    pub mode: Mode,
    /// In shadow mode, the refusal that enforce mode would have given.
    pub would_shed: Option<Shed>,
    /// Admitted without any check: the shared store did not answer and `on_error = "fail_open"`.
    pub unchecked: bool,
    /// What the call reserved per spend unit and what is left (`None` without `[spend.*]`).
    /// Boxed behind one thin pointer: a decision is moved several times on its way out.
    pub spend: Option<Box<super::spend::SpendViews>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Admitted(Admitted),
    Shed(Shed),
}

/// A decision with everything the HTTP layer and telemetry need to report it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    pub resolved: Resolved,
    /// Every bucket layer that applied, in check order.
    pub layers: Vec<LayerState>,
}

/// The tightest of some layers: the fewest whole tokens left (ties go to the earlier layer).
pub fn tightest(layers: &[LayerState]) -> Option<&LayerState> {
    layers.iter().reduce(|best, l| {
        if l.remaining < best.remaining {
            l
        } else {
            best
        }
    })
}

impl Decision {
    /// The tightest layer: the fewest whole tokens left (ties go to the earlier layer).
    pub fn tightest(&self) -> Option<&LayerState> {
        tightest(&self.layers)
    }

    pub fn is_admitted(&self) -> bool {
        matches!(self.verdict, Verdict::Admitted(_))
    }
}

/// How a tool call ended, as reported on release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
    UpstreamRateLimited,
    Cancelled,
}

impl Outcome {
    pub fn parse(s: &str) -> Option<Outcome> {
        Some(match s {
            "ok" => Outcome::Ok,
            "error" => Outcome::Error,
            "upstream_rate_limited" => Outcome::UpstreamRateLimited,
            "cancelled" => Outcome::Cancelled,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::UpstreamRateLimited => "upstream_rate_limited",
            Outcome::Cancelled => "cancelled",
        }
    }
}
