//! The subjects' table: each subject's state (bucket, slots, per-tool buckets, quota), kept in one cache
//! line and found by its name, and the metric label each subject was given.

use super::*;

/// What a subject's state keeps besides its bucket and slot count, needed only with per-tool
/// buckets, a daily quota or concurrency refusals: boxed, so the state every call reads fits in one
/// cache line.
#[derive(Debug, Default)]
pub(super) struct SubjectExtra {
    /// Per-tool buckets (only tools that configure a rate); few per subject, so a vector beats a map.
    pub(super) tools: Vec<(Arc<str>, Bucket)>,
    pub(super) quota: QuotaCounter,
    /// Slots promised to calls refused for want of this subject's concurrency slots (see
    /// [`super::super::slots`]), in time order.
    pub(super) slot_promises: Vec<SlotPromise>,
}

/// One subject's state: one cache line (see the `subject_state` tests), found by its name.
///
/// What the layout assumes: every admission and every lease end reads a subject's state, most often
/// out of cache, so what every call reads (its name, bucket, slot count, keep time, label flag) fits
/// 64 aligned bytes and the rest (per-tool buckets, quota, slot promises) is boxed in
/// [`SubjectExtra`], made only for subjects that use it. What it bought: last-level read misses per
/// admission and expiry 14.0 → 10.7 (callgrind on `engine/admit_across_1000_tenants`, the command in
/// docs/BENCHMARKS.md), memory per idle subject 860 → 696 B (`scripts/bench.sh`).
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct SubjectState {
    /// The subject's name, shared with its calls (see [`TenantEngine::subject_names`]); also the
    /// key it is found by.
    pub(super) name: Arc<str>,
    pub(super) bucket: Bucket,
    pub(super) inflight: u32,
    /// Kept until then (whole seconds of the monotonic clock) even once at rest: set to
    /// [`KEEP_SUBJECT_SECS`] after the subject's last call gave back its slot.
    pub(super) keep_until_s: u32,
    /// The label caps' generation its metric label was decided under.
    pub(super) label_gen: u64,
    /// Its metric label is `__other__` (past the label caps), not its name. A label is one of the
    /// two, so a flag stands for it, as in a lease.
    pub(super) label_folded: bool,
    pub(super) extra: Option<Box<SubjectExtra>>,
}

/// How long a subject's state outlives its last call once it is at rest. Without it, a subject that
/// calls every few seconds (an agent's loop, or any steady caller among many) had its state dropped
/// at every prune and built again at its next call: a new name copy, a label decided under the
/// labels' shared lock, a map insertion and later a removal, for state that was needed again
/// moments later. Memory still follows the subjects active in the last few seconds.
pub(super) const KEEP_SUBJECT_SECS: u32 = 10;

pub(super) fn whole_secs(t: Nanos) -> u32 {
    u32::try_from(t / 1_000_000_000).unwrap_or(u32::MAX)
}

impl SubjectState {
    pub(super) fn new(name: Arc<str>, label_folded: bool, label_gen: u64) -> Self {
        SubjectState {
            name,
            bucket: Bucket::default(),
            inflight: 0,
            keep_until_s: 0,
            label_gen,
            label_folded,
            extra: None,
        }
    }

    /// Its metric label; `labels` are the engine's.
    pub(super) fn label(&self, labels: Option<&SubjectLabels>) -> Arc<str> {
        match (self.label_folded, labels) {
            (true, Some(l)) => l.other().clone(),
            _ => self.name.clone(),
        }
    }

    pub(super) fn extra_mut(&mut self) -> &mut SubjectExtra {
        self.extra.get_or_insert_with(Box::default)
    }

    pub(super) fn tools(&self) -> &[(Arc<str>, Bucket)] {
        self.extra.as_ref().map_or(&[], |e| &e.tools)
    }

    pub(super) fn quota_used_on(&self, day: i64) -> f64 {
        self.extra.as_ref().map_or(0.0, |e| e.quota.used_on(day))
    }

    pub(super) fn tool_bucket(&mut self, tool: &Arc<str>) -> &mut Bucket {
        let tools = &mut self.extra_mut().tools;
        let i = if let Some(i) = tools.iter().position(|(t, _)| t == tool) {
            i
        } else {
            tools.push((tool.clone(), Bucket::default()));
            tools.len() - 1
        };
        &mut tools[i].1
    }

    pub(super) fn is_resting(&self, now: Nanos, day: i64) -> bool {
        self.inflight == 0
            && self.bucket.is_resting(now)
            && self.extra.as_ref().is_none_or(|e| {
                e.tools.iter().all(|(_, b)| b.is_resting(now)) && e.quota.is_resting(day)
            })
    }
}

/// A tenant's subjects' states, found by name. A state holds its name, so finding a subject reads
/// the table's control bytes, the state's one line and the name's allocation, which the call shares
/// anyway. (With a separate copy of the name as the key, an entry took 144 bytes over three lines.)
#[derive(Default)]
pub(super) struct Subjects {
    pub(super) table: hashbrown::HashTable<SubjectState>,
    pub(super) hasher: foldhash::fast::RandomState,
}

impl Subjects {
    pub(super) fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    pub(super) fn get(&self, name: &str) -> Option<&SubjectState> {
        self.table.find(self.hash(name), |s| *s.name == *name)
    }

    pub(super) fn get_mut(&mut self, name: &str) -> Option<&mut SubjectState> {
        let hash = self.hash(name);
        self.table.find_mut(hash, |s| *s.name == *name)
    }

    /// The state of `name`, made by `new` if it has none.
    pub(super) fn get_or_insert_with(
        &mut self,
        name: &str,
        new: impl FnOnce() -> SubjectState,
    ) -> &mut SubjectState {
        let hash = self.hash(name);
        let hasher = &self.hasher;
        self.table
            .entry(hash, |s| *s.name == *name, |s| hasher.hash_one(&*s.name))
            .or_insert_with(new)
            .into_mut()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &SubjectState> {
        self.table.iter()
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut SubjectState> {
        self.table.iter_mut()
    }

    pub(super) fn retain(&mut self, keep: impl FnMut(&mut SubjectState) -> bool) {
        self.table.retain(keep);
    }

    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

impl TenantEngine {
    pub(super) fn subject_mut(&mut self, r: &Resolved) -> &mut SubjectState {
        // The owned key is made only when the subject is new.
        let labels = &self.labels;
        self.subjects.get_or_insert_with(&r.subject, || {
            let label_gen = labels.as_ref().map_or(0, |l| l.generation());
            SubjectState::new(r.subject.clone(), r.label_folded(), label_gen)
        })
    }

    /// The shared copy of a subject's name and its metric label, kept in its state: a subject's
    /// calls, leases and telemetry events share one copy instead of one per call. A subject without
    /// state gets a new copy and a label decided now, which become the state's if the call spends
    /// anything (a call refused before it spends leaves no state behind). Labels are decided in the
    /// order calls reach this tenant, so the first subjects to call are the ones named.
    pub(super) fn subject_names(&mut self, subject: &str) -> (Arc<str>, Arc<str>) {
        if let Some(s) = self.subjects.get_mut(subject) {
            if let Some(l) = &self.labels {
                // Folded under caps that have changed since: there may be room now.
                if s.label_folded && s.label_gen != l.generation() {
                    s.label_gen = l.generation();
                    s.label_folded = l.is_other(&l.label(&self.tenant, &s.name));
                }
            }
            return (s.name.clone(), s.label(self.labels.as_deref()));
        }
        let name: Arc<str> = Arc::from(subject);
        let label = match &self.labels {
            Some(l) => l.label(&self.tenant, &name),
            None => name.clone(),
        };
        (name, label)
    }

    /// Where subjects get their metric labels (none: every subject is labelled by its name).
    pub fn set_subject_labels(&mut self, labels: Option<Arc<SubjectLabels>>) {
        self.labels = labels;
    }
}
