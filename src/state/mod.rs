//! The state file (memory mode): what the tenant engines and the shared budgets would lose in a
//! restart, written to disk every `[state] interval` and at shutdown, read back at start.
//!
//! This module owns the file: its format, reading it at start (and what to do when it is missing,
//! damaged or from a newer admitd), and writing it so that a crash at any moment leaves either the
//! old file or the new one, never half of one (temporary file, fsync, rename, fsync of the
//! directory). What goes into it is the engine's plain data ([`crate::engine::durable`]); the
//! engine itself does no I/O.
//!
//! Reading is strict about the envelope and forgiving about the content: a file that is not an
//! admitd state file, or does not parse, is set aside as `<path>.corrupt` and the daemon starts
//! fresh (a crash loop over a damaged file would take the limiter away altogether); a file from a
//! newer format version stops the start with an error, because starting fresh would overwrite state
//! the newer admitd can still use. Entries whose names could not have been written by admitd are
//! skipped.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::actors::{ExportDurable, ImportDurable, Shared};
use crate::config::check_name;
use crate::engine::durable::{Instants, TenantDurable, UpstreamDurable};

/// What the file says it is.
pub const FORMAT: &str = "admitd-state";
/// The format version this admitd writes and the newest it reads.
pub const VERSION: u64 = 1;

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateFile {
    pub format: String,
    pub version: u64,
    /// When it was written, milliseconds since the Unix epoch.
    pub written_ms: i64,
    #[serde(default)]
    pub tenants: Vec<TenantDurable>,
    /// Upstreams with `shared = true` (one penalty, rate and window for all tenants).
    #[serde(default)]
    pub shared_upstreams: Vec<UpstreamDurable>,
}

/// Why a file's content could not be used.
#[derive(Debug, Clone, PartialEq)]
pub enum ReadError {
    /// Not a state file admitd wrote, or damaged: set aside, start fresh.
    Corrupt(String),
    /// Written by a newer admitd: refuse to start.
    Newer(u64),
}

/// Just the envelope, read first so that a newer version is recognised whatever its content.
#[derive(Deserialize)]
struct Envelope {
    format: Option<String>,
    version: Option<u64>,
}

/// Parses a state file's bytes.
pub fn parse(bytes: &[u8]) -> Result<StateFile, ReadError> {
    let corrupt = |why: String| Err(ReadError::Corrupt(why));
    let envelope: Envelope = match serde_json::from_slice(bytes) {
        Ok(e) => e,
        Err(e) if e.is_eof() => return corrupt(format!("it ends early ({e})")),
        Err(e) => return corrupt(format!("it is not JSON ({e})")),
    };
    if envelope.format.as_deref() != Some(FORMAT) {
        return corrupt(format!("it does not say \"format\": \"{FORMAT}\""));
    }
    match envelope.version {
        Some(v) if v > VERSION => return Err(ReadError::Newer(v)),
        Some(v) if v >= 1 => {}
        _ => return corrupt("it has no valid \"version\"".to_string()),
    }
    let mut file: StateFile = match serde_json::from_slice(bytes) {
        Ok(f) => f,
        Err(e) => return corrupt(format!("its content does not fit the format ({e})")),
    };
    sanitize(&mut file);
    Ok(file)
}

/// Drops the entries admitd could not have written (names it refuses in requests).
fn sanitize(file: &mut StateFile) {
    let ok = |n: &str| check_name(n).is_ok();
    file.tenants.retain(|t| ok(&t.tenant));
    for t in &mut file.tenants {
        t.subjects.retain(|s| ok(&s.subject));
        t.upstreams.retain(|u| ok(&u.upstream));
    }
    file.shared_upstreams.retain(|u| ok(&u.upstream));
}

/// The directory a state file lives in.
fn directory(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Reads the state file at start. `Ok(None)`: start fresh (no file yet, or a damaged one, set
/// aside and logged). `Err`: the daemon must not start (the message says what to do).
pub fn load(path: &Path) -> Result<Option<StateFile>, String> {
    let dir = directory(path);
    if !dir.is_dir() {
        return Err(format!(
            "state.path {}: the directory {} does not exist; create it, writable by the user \
             admitd runs as, or change [state] path",
            path.display(),
            dir.display()
        ));
    }
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(path = %path.display(), "no state file yet: starting fresh");
            return Ok(None);
        }
        Err(e) => {
            return Err(format!(
                "cannot read the state file {}: {e}",
                path.display()
            ))
        }
    };
    match parse(&bytes) {
        Ok(f) => Ok(Some(f)),
        Err(ReadError::Newer(v)) => Err(format!(
            "the state file {} has format version {v}, newer than this admitd reads ({VERSION}): \
             it was written by a newer admitd. Run that version, or move the file away to start \
             with fresh quotas and penalties",
            path.display()
        )),
        Err(ReadError::Corrupt(why)) => {
            let aside = with_suffix(path, ".corrupt");
            let kept = std::fs::rename(path, &aside).is_ok();
            tracing::error!(
                path = %path.display(),
                reason = %why,
                kept_as = %if kept { aside.display().to_string() } else { "-".into() },
                "the state file cannot be read: starting fresh (quotas, penalties and adaptive \
                 rates from before this start are lost)"
            );
            Ok(None)
        }
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Writes `file` to `path` atomically: a reader (or the next start after a crash) sees the old file
/// or the new one. The file is readable by its owner only: it names tenants and subjects.
pub fn write(path: &Path, file: &StateFile) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(file).map_err(std::io::Error::other)?;
    let tmp = with_suffix(path, ".tmp");
    {
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut f = options.open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    // The rename is durable once the directory is.
    #[cfg(unix)]
    std::fs::File::open(directory(path))?.sync_all()?;
    Ok(())
}

/// Collects the state of every tenant actor and of the shared budgets, now.
pub async fn collect(shared: &Arc<Shared>) -> StateFile {
    let asks = shared
        .tenant_actors()
        .into_iter()
        .map(|a| a.send(ExportDurable));
    let mut tenants: Vec<TenantDurable> = futures_util::future::join_all(asks)
        .await
        .into_iter()
        .filter_map(|r| r.ok().flatten())
        .collect();
    tenants.sort_by(|a, b| a.tenant.cmp(&b.tenant));
    let at = Instants {
        now: shared.clock.mono(),
        wall_ms: shared.clock.wall_ms(),
    };
    StateFile {
        format: FORMAT.to_string(),
        version: VERSION,
        written_ms: at.wall_ms,
        shared_upstreams: shared.budgets.export_durable(&shared.config.load(), at),
        tenants,
    }
}

/// Hands a read state file to the shared budgets and the tenant actors (started for it); returns
/// how many tenants it restored.
pub async fn restore(shared: &Arc<Shared>, file: StateFile) -> usize {
    let at = Instants {
        now: shared.clock.mono(),
        wall_ms: shared.clock.wall_ms(),
    };
    shared
        .budgets
        .import_durable(&shared.config.load(), &file.shared_upstreams, at);
    let mut restored = 0;
    for t in file.tenants {
        let (_, addr) = shared.tenant_or_start(&t.tenant);
        if addr.send(ImportDurable(Arc::new(t))).await.is_ok() {
            restored += 1;
        }
    }
    restored
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::durable::{QuotaUse, SubjectDurable};

    fn sample() -> StateFile {
        StateFile {
            format: FORMAT.into(),
            version: VERSION,
            written_ms: 1_700_000_000_000,
            tenants: vec![TenantDurable {
                tenant: "acme".into(),
                quota: Some(QuotaUse { day: 1, used: 3.0 }),
                subjects: vec![SubjectDurable {
                    subject: "bot".into(),
                    quota: QuotaUse { day: 1, used: 2.0 },
                }],
                upstreams: vec![],
                spend: Default::default(),
            }],
            shared_upstreams: vec![],
        }
    }

    #[test]
    fn a_written_file_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        write(&path, &sample()).unwrap();
        assert_eq!(load(&path).unwrap(), Some(sample()));
        assert!(
            !with_suffix(&path, ".tmp").exists(),
            "the temporary file is renamed"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn damaged_files_are_corrupt_and_a_newer_version_is_refused() {
        let good = serde_json::to_vec(&sample()).unwrap();
        let truncated = &good[..good.len() / 2];
        assert!(matches!(parse(truncated), Err(ReadError::Corrupt(m)) if m.contains("ends early")));
        assert!(
            matches!(parse(b"\x00\xffgarbage"), Err(ReadError::Corrupt(m)) if m.contains("not JSON"))
        );
        assert!(matches!(parse(b"{}"), Err(ReadError::Corrupt(m)) if m.contains("format")));
        assert!(matches!(
            parse(br#"{"format":"admitd-state","version":0}"#),
            Err(ReadError::Corrupt(_))
        ));
        assert!(matches!(
            parse(br#"{"format":"admitd-state","version":1,"tenants":7}"#),
            Err(ReadError::Corrupt(m)) if m.contains("does not fit")
        ));
        // A newer version is recognised from its envelope alone, whatever else it holds.
        assert_eq!(
            parse(br#"{"format":"admitd-state","version":2,"anything":[1]}"#),
            Err(ReadError::Newer(2))
        );
    }

    #[test]
    fn entries_with_names_admitd_refuses_are_dropped() {
        let mut f = sample();
        f.tenants.push(TenantDurable {
            tenant: "bad\nname".into(),
            ..Default::default()
        });
        f.tenants[0].subjects.push(SubjectDurable {
            subject: "x".repeat(200),
            quota: QuotaUse { day: 1, used: 1.0 },
        });
        let parsed = parse(&serde_json::to_vec(&f).unwrap()).unwrap();
        assert_eq!(parsed, sample());
    }

    #[test]
    fn load_sets_a_damaged_file_aside_and_names_a_missing_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        assert_eq!(load(&path).unwrap(), None, "no file yet: fresh");
        std::fs::write(&path, b"{\"format\":\"admitd-st").unwrap();
        assert_eq!(load(&path).unwrap(), None);
        assert!(with_suffix(&path, ".corrupt").exists());
        assert!(!path.exists());
        std::fs::write(&path, br#"{"format":"admitd-state","version":9}"#).unwrap();
        let e = load(&path).unwrap_err();
        assert!(e.contains("format version 9, newer"), "{e}");
        let e = load(&dir.path().join("missing/state")).unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
    }
}
