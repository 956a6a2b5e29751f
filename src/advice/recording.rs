//! The recording: every call admitd decided over the last `[advice] keep`, as 32 bytes each, and the
//! names those calls refer to, in a fixed budget.
//!
//! Plain data driven by `now` (monotonic nanoseconds), fed by the metrics actor on the telemetry
//! thread ([`crate::telemetry::advice`]), never by the admission path itself.
//!
//! Memory is bounded by the config, whatever the traffic:
//! - calls: at most `max_calls` of 32 bytes (a ring; the oldest goes first, and calls older than
//!   `keep` are dropped as new ones arrive). Under heavy traffic this bounds the period an advice
//!   can cover; the advice says which period it covered.
//! - names: at most `max_subjects` (tenant, subject) keys and as many tenants, and
//!   [`MAX_NAMES`] tools and upstreams, each a name of at most 128 bytes plus about 40 bytes.
//!   A name leaves once no kept call refers to it (idle subjects fall out of the period); past a
//!   cap, new names fold into `__other__`, as metric labels do.
//! - releases: the leases still open, to date their end, at most [`MAX_OPEN`] (about 50 bytes
//!   each with the table's overhead: 3.2 MB).
//!
//! With the defaults (500 000 calls, 10 000 subjects) that is at most 16 MB of calls, about 4 MB of
//! names and 3.2 MB of open leases.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use hashbrown::HashTable;
use serde::{Deserialize, Serialize};

use crate::clock::{Nanos, NS_PER_MS};
use crate::config::AdviceConfig;

/// What a folded name reads as.
pub const OTHER: &str = "__other__";
/// Tools, and upstreams, named at most (as the engine's per-worker name sets).
pub const MAX_NAMES: usize = 4096;
/// Open leases whose release the recording waits for, at most; past it, further calls are kept
/// without an end (as if never released).
pub const MAX_OPEN: usize = 65_536;
/// `upstream` of a call that names none.
const NO_UPSTREAM: u16 = u16::MAX;
/// `held_ms` / `ran_ms` not known.
const UNKNOWN: u32 = u32::MAX;

/// The budget, from `[advice]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub keep_ms: u64,
    pub max_calls: usize,
    pub max_subjects: usize,
}

impl Budget {
    pub fn of(c: &AdviceConfig) -> Self {
        Budget {
            keep_ms: u64::try_from(c.keep.as_millis()).unwrap_or(u64::MAX),
            max_calls: c.max_calls.max(1),
            max_subjects: c.max_subjects.max(1),
        }
    }
}

/// One recorded call: 32 bytes.
#[derive(Debug, Clone, Copy)]
struct Call {
    at_ms: u64,
    tenant: u32,
    /// The (tenant, subject) key; 0 when folded.
    key: u32,
    tool: u16,
    upstream: u16,
    cost: f32,
    /// From the decision to the release, as this recording saw them.
    held_ms: u32,
    /// The run the caller reported at release (`duration_ms`).
    ran_ms: u32,
}

/// One decision, as the recording reads it.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub tenant: &'a str,
    pub subject: &'a str,
    pub tool: &'a str,
    pub upstream: Option<&'a str>,
    pub cost: f64,
    /// The lease of an admitted call (also a call admitted in shadow mode), to find its release.
    pub lease: Option<u64>,
}

/// Interned names with the time each was last used, bounded; id 0 is [`OTHER`].
struct Names {
    hasher: foldhash::fast::FixedState,
    index: HashTable<u32>,
    entries: Vec<Entry>,
    free: Vec<u32>,
    live: usize,
    cap: usize,
    /// A sweep before the oldest kept call is this recent frees nothing.
    no_sweep_before: u64,
    /// The id found last: consecutive calls often name the same tool, upstream or tenant, and a
    /// comparison costs less than hashing.
    last: u32,
}

struct Entry {
    /// The tenant a subject key belongs to (0 for tenants, tools and upstreams).
    scope: u32,
    name: Box<str>,
    last_ms: u64,
    live: bool,
}

impl Names {
    fn new(cap: usize) -> Self {
        let mut n = Names {
            hasher: foldhash::fast::FixedState::with_seed(0x00ad_71ce),
            index: HashTable::new(),
            entries: Vec::new(),
            free: Vec::new(),
            live: 0,
            cap: cap.max(1),
            no_sweep_before: 0,
            last: 0,
        };
        n.entries.push(Entry {
            scope: 0,
            name: OTHER.into(),
            last_ms: u64::MAX,
            live: true,
        });
        n
    }

    fn hash(&self, scope: u32, name: &str) -> u64 {
        self.hasher.hash_one((scope, name))
    }

    fn find(&self, scope: u32, name: &str) -> Option<u32> {
        let h = self.hash(scope, name);
        self.index
            .find(h, |&id| {
                let e = &self.entries[id as usize];
                e.scope == scope && &*e.name == name
            })
            .copied()
    }

    /// The id of `name` in `scope`, used at `now_ms`; a new name past the cap is [`OTHER`] (0),
    /// unless names no kept call refers to (last used before `oldest_ms`) can make room.
    fn intern(&mut self, scope: u32, name: &str, now_ms: u64, oldest_ms: u64) -> u32 {
        let last = &mut self.entries[self.last as usize];
        if self.last != 0 && last.live && last.scope == scope && *last.name == *name {
            last.last_ms = now_ms;
            return self.last;
        }
        if let Some(id) = self.find(scope, name) {
            self.last = id;
            if let Some(e) = self.entries.get_mut(id as usize).filter(|_| id != 0) {
                e.last_ms = now_ms;
            }
            return id;
        }
        if self.live >= self.cap && !self.sweep(oldest_ms, now_ms) {
            return 0;
        }
        let entry = Entry {
            scope,
            name: name.into(),
            last_ms: now_ms,
            live: true,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.entries[id as usize] = entry;
                id
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        let h = self.hash(scope, name);
        let (entries, hasher) = (&self.entries, &self.hasher);
        self.index.insert_unique(h, id, |&i| {
            let e = &entries[i as usize];
            hasher.hash_one((e.scope, &*e.name))
        });
        self.live += 1;
        id
    }

    /// Drops the names no kept call refers to; whether that made room.
    fn sweep(&mut self, oldest_ms: u64, now_ms: u64) -> bool {
        if oldest_ms < self.no_sweep_before {
            return false;
        }
        let mut earliest = u64::MAX;
        for (id, e) in self.entries.iter_mut().enumerate().skip(1) {
            if !e.live {
                continue;
            }
            if e.last_ms < oldest_ms {
                e.live = false;
                e.name = "".into();
                self.free.push(id as u32);
                self.live -= 1;
            } else {
                earliest = earliest.min(e.last_ms);
            }
        }
        let entries = &self.entries;
        self.index.retain(|id| entries[*id as usize].live);
        // Nothing can be dropped until the oldest kept call is newer than the least recently used
        // name: until then a full table folds new names without scanning again. And a scan frees
        // a worthwhile share or waits: at most 16 scans while the kept calls turn over once, so a
        // table churned by many subjects costs a bounded share of the calls.
        let span = now_ms.saturating_sub(oldest_ms.min(now_ms));
        self.no_sweep_before = earliest
            .saturating_add(1)
            .max(oldest_ms.saturating_add((span / 16).max(1000)));
        self.live < self.cap
    }

    fn name(&self, id: u32) -> &str {
        self.entries.get(id as usize).map_or(OTHER, |e| &e.name)
    }

    /// Bytes held, roughly: for the memory-bound test and the docs.
    fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.entries.iter().map(|e| e.name.len()).sum::<usize>()
            + self.index.capacity() * 8
            + self.free.capacity() * 4
    }
}

/// The recording itself.
pub struct Recording {
    budget: Budget,
    calls: VecDeque<Call>,
    /// Sequence number of `calls[0]`.
    first_seq: u64,
    tenants: Names,
    keys: Names,
    tools: Names,
    upstreams: Names,
    /// Open leases: (tenant id, lease) -> the call's sequence number.
    open: hashbrown::HashMap<(u32, u64), u64, foldhash::fast::FixedState>,
    started_ms: u64,
    /// Calls have been dropped to stay within `max_calls` (not only for age) since this was last
    /// false: the period covered then starts at the oldest kept call.
    full: bool,
}

/// The calls of a period, as handed out (`GET /v1/advice?format=raw`) and merged across replicas.
/// Times are milliseconds from the period's start; names are indices into `names`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Period {
    /// How long the period is, in milliseconds; it ends when it was taken.
    pub over_ms: u64,
    pub names: Vec<String>,
    pub calls: Vec<PeriodCall>,
}

/// One call of a period: `[at_ms, tenant, subject, tool, upstream, cost, held_ms, ran_ms]` (a JSON
/// array, for size). `subject` names [`OTHER`] when the subject was folded; `held_ms` is `null`
/// for a call not released in the period, `ran_ms` when the caller reported no duration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PeriodCall(
    pub u64,
    pub u32,
    pub u32,
    pub u32,
    pub Option<u32>,
    pub f32,
    pub Option<u32>,
    pub Option<u32>,
);

impl PeriodCall {
    pub fn at_ms(&self) -> u64 {
        self.0
    }
    pub fn tenant(&self) -> u32 {
        self.1
    }
    pub fn subject(&self) -> u32 {
        self.2
    }
    pub fn tool(&self) -> u32 {
        self.3
    }
    pub fn upstream(&self) -> Option<u32> {
        self.4
    }
    pub fn cost(&self) -> f64 {
        f64::from(self.5)
    }
    pub fn held_ms(&self) -> Option<u32> {
        self.6
    }
    /// How long the call ran: what its caller reported, else how long it held its lease.
    pub fn duration_ms(&self) -> Option<u32> {
        self.7.or(self.6)
    }
}

fn ms(now: Nanos) -> u64 {
    now / NS_PER_MS
}

impl Recording {
    pub fn new(budget: Budget, now: Nanos) -> Self {
        Recording {
            budget,
            calls: VecDeque::new(),
            first_seq: 0,
            tenants: Names::new(budget.max_subjects),
            keys: Names::new(budget.max_subjects),
            tools: Names::new(MAX_NAMES),
            upstreams: Names::new(MAX_NAMES),
            open: hashbrown::HashMap::default(),
            started_ms: ms(now),
            full: false,
        }
    }

    /// A new budget (a reload): kept calls past it go at once.
    pub fn set_budget(&mut self, budget: Budget, now: Nanos) {
        self.budget = budget;
        self.tenants.cap = budget.max_subjects;
        self.keys.cap = budget.max_subjects;
        self.trim(ms(now));
    }

    fn oldest_ms(&self) -> u64 {
        self.calls.front().map_or(u64::MAX, |c| c.at_ms)
    }

    fn pop(&mut self) {
        if self.calls.pop_front().is_some() {
            self.first_seq += 1;
        }
    }

    /// Drops calls older than `keep` and past `max_calls`.
    fn trim(&mut self, now_ms: u64) {
        while self
            .calls
            .front()
            .is_some_and(|c| c.at_ms.saturating_add(self.budget.keep_ms) < now_ms)
        {
            self.pop();
        }
        if self.calls.len() >= self.budget.max_calls {
            self.full = true;
        }
        while self.calls.len() >= self.budget.max_calls {
            self.pop();
        }
    }

    /// Records one decision at `now`.
    pub fn record(&mut self, s: &Seen<'_>, now: Nanos) {
        let now_ms = ms(now);
        self.trim(now_ms);
        let oldest = self.oldest_ms();
        let tenant = self.tenants.intern(0, s.tenant, now_ms, oldest);
        let key = if tenant == 0 {
            0
        } else {
            self.keys.intern(tenant, s.subject, now_ms, oldest)
        };
        let tool = self.tools.intern(0, s.tool, now_ms, oldest) as u16;
        let upstream = s.upstream.map_or(NO_UPSTREAM, |u| {
            self.upstreams.intern(0, u, now_ms, oldest) as u16
        });
        let seq = self.first_seq + self.calls.len() as u64;
        if self.calls.len() == self.calls.capacity() {
            // Doubling, but never past the budget (a plain push could double past it).
            let room = self
                .calls
                .len()
                .max(1024)
                .min(self.budget.max_calls - self.calls.len());
            self.calls.reserve_exact(room.max(1));
        }
        self.calls.push_back(Call {
            at_ms: now_ms,
            tenant,
            key,
            tool,
            upstream,
            cost: s.cost as f32,
            held_ms: UNKNOWN,
            ran_ms: UNKNOWN,
        });
        if let Some(lease) = s.lease {
            if self.open.len() >= MAX_OPEN {
                self.forget_oldest_leases();
            }
            self.open.insert((tenant, lease), seq);
        }
    }

    /// Makes room among the open leases: those whose call is no longer kept go, and if that is
    /// not a quarter of them, the older half goes too (a lease that old was most likely never
    /// released and expired). Its call then keeps no end, as if never released. Each scan frees a
    /// quarter at least, so its cost spreads over the calls that fill that room again.
    fn forget_oldest_leases(&mut self) {
        let first = self.first_seq;
        self.open.retain(|_, seq| *seq >= first);
        if self.open.len() > MAX_OPEN / 4 * 3 {
            let mut seqs: Vec<u64> = self.open.values().copied().collect();
            let mid = seqs.len() / 2;
            let (_, median, _) = seqs.select_nth_unstable(mid);
            let median = *median;
            self.open.retain(|_, seq| *seq >= median);
        }
    }

    /// Records the release of `tenant`'s `lease` at `now`, with the run its caller reported.
    pub fn release(&mut self, tenant: &str, lease: u64, ran_ms: Option<u64>, now: Nanos) {
        let Some(t) = self.tenants.find(0, tenant) else {
            return;
        };
        let Some(seq) = self.open.remove(&(t, lease)) else {
            return;
        };
        let Some(i) = seq.checked_sub(self.first_seq) else {
            return;
        };
        if let Some(c) = self.calls.get_mut(i as usize) {
            let held = ms(now).saturating_sub(c.at_ms);
            c.held_ms = u32::try_from(held).unwrap_or(UNKNOWN - 1);
            c.ran_ms = ran_ms.map_or(UNKNOWN, |r| u32::try_from(r).unwrap_or(UNKNOWN - 1));
        }
    }

    /// The longest period that can be asked for at `now`, in milliseconds.
    pub fn covered_ms(&self, now: Nanos) -> u64 {
        let now_ms = ms(now);
        let mut covered = now_ms
            .saturating_sub(self.started_ms)
            .min(self.budget.keep_ms);
        if self.full {
            covered = covered.min(now_ms.saturating_sub(self.oldest_ms()));
        }
        covered
    }

    /// The calls of the last `over_ms` (at most what is covered) before `now`.
    pub fn period(&self, over_ms: u64, now: Nanos) -> Period {
        let now_ms = ms(now);
        let over_ms = over_ms.min(self.covered_ms(now));
        let start = now_ms.saturating_sub(over_ms);
        let mut names: Vec<String> = Vec::new();
        let mut ids: hashbrown::HashMap<(u8, u32), u32> = hashbrown::HashMap::new();
        let mut name_of = |table: u8, id: u32, text: &str| {
            *ids.entry((table, id)).or_insert_with(|| {
                names.push(text.to_string());
                (names.len() - 1) as u32
            })
        };
        let first = self.calls.partition_point(|c| c.at_ms < start);
        let mut calls = Vec::with_capacity(self.calls.len() - first);
        for c in self.calls.range(first..) {
            let tenant = name_of(0, c.tenant, self.tenants.name(c.tenant));
            let subject = name_of(1, c.key, self.keys.name(c.key));
            let tool = name_of(2, u32::from(c.tool), self.tools.name(u32::from(c.tool)));
            let upstream = (c.upstream != NO_UPSTREAM).then(|| {
                let u = u32::from(c.upstream);
                name_of(3, u, self.upstreams.name(u))
            });
            let known = |v: u32| (v != UNKNOWN).then_some(v);
            calls.push(PeriodCall(
                c.at_ms - start,
                tenant,
                subject,
                tool,
                upstream,
                c.cost,
                known(c.held_ms),
                known(c.ran_ms),
            ));
        }
        Period {
            over_ms,
            names,
            calls,
        }
    }

    /// Leases whose release is awaited.
    pub fn open_leases(&self) -> usize {
        self.open.len()
    }

    /// Calls kept now.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Bytes held, roughly (calls, names, open leases).
    pub fn bytes(&self) -> usize {
        self.calls.capacity() * std::mem::size_of::<Call>()
            + self.tenants.bytes()
            + self.keys.bytes()
            + self.tools.bytes()
            + self.upstreams.bytes()
            + self.open.capacity() * 24
    }
}

impl Period {
    /// One period of the calls several replicas saw, each taken at (about) the same moment: they
    /// are aligned at their ends, and the merged period is the longest of them.
    pub fn merge(periods: &[Period]) -> Period {
        let over_ms = periods.iter().map(|p| p.over_ms).max().unwrap_or(0);
        let mut names: Vec<String> = Vec::new();
        let mut index: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
        let mut calls = Vec::new();
        for p in periods {
            let shift = over_ms - p.over_ms;
            let map: Vec<u32> = p
                .names
                .iter()
                .map(|n| {
                    *index.entry(n.clone()).or_insert_with(|| {
                        names.push(n.clone());
                        (names.len() - 1) as u32
                    })
                })
                .collect();
            let at = |i: u32| map.get(i as usize).copied().unwrap_or(0);
            for c in &p.calls {
                let mut m = *c;
                m.0 += shift;
                m.1 = at(c.1);
                m.2 = at(c.2);
                m.3 = at(c.3);
                m.4 = c.4.map(at);
                calls.push(m);
            }
        }
        calls.sort_by_key(PeriodCall::at_ms);
        Period {
            over_ms,
            names,
            calls,
        }
    }

    /// Whether every name index in the period points into `names` (a period read from elsewhere).
    pub fn is_consistent(&self) -> bool {
        let n = self.names.len() as u32;
        self.calls
            .iter()
            .all(|c| c.1 < n && c.2 < n && c.3 < n && c.4.is_none_or(|u| u < n))
    }

    pub fn name(&self, id: u32) -> &str {
        self.names.get(id as usize).map_or(OTHER, String::as_str)
    }
}
