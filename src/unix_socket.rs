//! The Unix domain socket the daemon can listen on: created with the configured file mode and group,
//! a stale socket file of an earlier run replaced, a live one (another daemon) left alone.
//!
//! The file permissions are the access control: a process can connect only with write permission on
//! the socket file, so `socket_mode = "0660"` with `socket_group = "mcp"` admits the daemon's user and
//! the members of `mcp`. The socket is created under a umask that leaves it reachable by its owner
//! only, then given its mode and group, so there is no moment when anyone else can connect.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use crate::config::SocketOptions;

/// Binds the socket at `path` with the given mode and group.
pub fn bind(path: &Path, opts: &SocketOptions) -> Result<UnixListener, String> {
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(format!(
                    "cannot listen on unix:{shown}: another process is listening on it"
                ));
            }
            // Left behind by a daemon that did not shut down cleanly.
            std::fs::remove_file(path)
                .map_err(|e| format!("cannot remove the stale socket unix:{shown}: {e}"))?;
        }
        Ok(_) => {
            return Err(format!(
                "cannot listen on unix:{shown}: the path exists and is not a socket"
            ))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot listen on unix:{shown}: {e}")),
    }
    let gid = opts.group.as_deref().map(group_id).transpose()?;
    let listener = with_umask(0o177, || UnixListener::bind(path))
        .map_err(|e| format!("cannot listen on unix:{shown}: {e}"))?;
    let configure = || -> Result<(), String> {
        if let Some(gid) = gid {
            chown_group(path, gid)
                .map_err(|e| format!("cannot give unix:{shown} the group {gid}: {e}"))?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(opts.mode))
            .map_err(|e| format!("cannot set the mode of unix:{shown}: {e}"))
    };
    if let Err(e) = configure() {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(listener)
}

/// Removes the socket file at shutdown.
pub fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove the socket file");
        }
    }
}

/// Runs `f` with the process umask set to `mask`, then puts the old one back. Called while the
/// daemon starts, before any thread that creates files runs.
fn with_umask<T>(mask: libc::mode_t, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask only swaps the process's file-creation mask; it cannot fail.
    let old = unsafe { libc::umask(mask) };
    let out = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    out
}

fn chown_group(path: &Path, gid: libc::gid_t) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, None, Some(gid))
}

/// A group name or number as a group id.
fn group_id(group: &str) -> Result<libc::gid_t, String> {
    if let Ok(n) = group.parse::<libc::gid_t>() {
        return Ok(n);
    }
    let name = std::ffi::CString::new(group)
        .map_err(|_| format!("server.socket_group {group:?} is not a group name"))?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: a zeroed `group` is a valid value for getgrnam_r to fill in.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call, and `buf` outlives the use of `grp` below.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &raw mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &raw mut found,
        )
    };
    if rc != 0 || found.is_null() {
        return Err(format!(
            "server.socket_group {group:?}: no such group on this system"
        ));
    }
    Ok(grp.gr_gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_gets_its_mode_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let opts = SocketOptions {
            mode: 0o600,
            group: None,
        };
        let l = bind(&path, &opts).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A second daemon on the same path is refused while the first listens.
        let e = bind(&path, &opts).unwrap_err();
        assert!(e.contains("another process"), "{e}");
        drop(l);
        // The file is left behind, nobody listens: it is replaced.
        assert!(path.exists());
        let _l = bind(&path, &SocketOptions::default()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
    }

    #[test]
    fn a_path_that_is_not_a_socket_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, "x").unwrap();
        let e = bind(&path, &SocketOptions::default()).unwrap_err();
        assert!(e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "x");
    }

    #[test]
    fn groups_are_looked_up_by_name_or_number() {
        assert_eq!(group_id("0"), Ok(0));
        assert_eq!(group_id("root"), Ok(0));
        assert!(group_id("no-such-group-admitd")
            .unwrap_err()
            .contains("no such group"));
    }
}
