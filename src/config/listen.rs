//! Where the daemon listens: a TCP address, or a Unix domain socket (`unix:/run/admitd/admitd.sock`)
//! with the file mode and group the socket is given, so that only local users in that group can ask.
//!
//! The address is parsed here for `[server] listen` and for `admitd serve --listen` alike, so both
//! accept exactly the same forms.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use super::raw::{RawServer, S};
use super::validate::Validator;
use super::{ConfigError, ServerConfig};

/// The prefix that marks a Unix domain socket path in `listen`.
pub const UNIX_PREFIX: &str = "unix:";

/// The longest socket path the kernel accepts (`sun_path` holds 108 bytes with its terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// `[server] listen` (or `--listen`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    /// An absolute path; the socket file is created at start and removed at shutdown.
    Unix(PathBuf),
}

impl ListenAddr {
    /// Whether only this machine can reach the address: a loopback IP, or a Unix socket.
    pub fn is_local(&self) -> bool {
        match self {
            ListenAddr::Tcp(a) => a.ip().is_loopback(),
            ListenAddr::Unix(_) => true,
        }
    }

    pub fn is_unix(&self) -> bool {
        matches!(self, ListenAddr::Unix(_))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "{UNIX_PREFIX}{}", p.display()),
        }
    }
}

impl From<SocketAddr> for ListenAddr {
    fn from(a: SocketAddr) -> Self {
        ListenAddr::Tcp(a)
    }
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix(UNIX_PREFIX) {
            if !path.starts_with('/') {
                return Err(format!(
                    "{s:?}: a Unix socket needs an absolute path, such as \"unix:/run/admitd/admitd.sock\""
                ));
            }
            if path.ends_with('/') {
                return Err(format!("{s:?}: the socket path names a directory"));
            }
            if path.len() > MAX_SOCKET_PATH {
                return Err(format!(
                    "{s:?}: a Unix socket path is at most {MAX_SOCKET_PATH} bytes long"
                ));
            }
            if path.bytes().any(|b| b == 0) {
                return Err(format!("{s:?}: the socket path contains a NUL byte"));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        s.parse::<SocketAddr>().map(ListenAddr::Tcp).map_err(|_| {
            format!(
                "{s:?} is not an address such as \"127.0.0.1:9470\" or \"unix:/run/admitd/admitd.sock\""
            )
        })
    }
}

/// The Unix socket's file mode and group (used only when `listen` is a Unix socket).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketOptions {
    /// Permission bits of the socket file; connecting needs write permission.
    pub mode: u32,
    /// Group the socket file is given (a name or a numeric id); `None` keeps the daemon's group.
    pub group: Option<String>,
}

impl Default for SocketOptions {
    fn default() -> Self {
        SocketOptions {
            mode: 0o660,
            group: None,
        }
    }
}

impl Validator<'_> {
    /// `[server] listen`, `socket_mode` and `socket_group`.
    pub(super) fn listen(&self, s: &RawServer, out: &mut ServerConfig) -> Result<(), ConfigError> {
        if let Some(v) = &s.listen {
            out.listen = match v.get_ref().parse() {
                Ok(a) => a,
                Err(e) => return self.err(v.span(), format!("server.listen: {e}")),
            };
            out.listen_in_file = true;
        }
        if let Some(v) = &s.socket_mode {
            out.socket.mode = self.socket_mode(v)?;
        }
        if let Some(v) = &s.socket_group {
            let g = v.get_ref().trim();
            if g.is_empty() || g.len() > 64 || g.chars().any(|c| c.is_control() || c == ':') {
                return self.err(
                    v.span(),
                    format!("server.socket_group {g:?} is not a group name or number"),
                );
            }
            out.socket.group = Some(g.to_string());
        }
        Ok(())
    }

    fn socket_mode(&self, v: &S<String>) -> Result<u32, ConfigError> {
        let text = v.get_ref().trim();
        let digits = text.strip_prefix("0o").unwrap_or(text);
        match u32::from_str_radix(digits, 8) {
            Ok(m) if m <= 0o777 && !digits.is_empty() => Ok(m),
            _ => self.err(
                v.span(),
                format!("server.socket_mode must be octal permission bits such as \"0660\", not {text:?}"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn tcp_and_unix_addresses_parse_and_print_back() {
        for text in [
            "127.0.0.1:9470",
            "[::1]:9470",
            "unix:/run/admitd/admitd.sock",
        ] {
            let a: ListenAddr = text.parse().unwrap();
            assert_eq!(a.to_string(), text);
        }
        assert!("unix:/run/a.sock".parse::<ListenAddr>().unwrap().is_unix());
        assert!("127.0.0.1:1".parse::<ListenAddr>().unwrap().is_local());
        assert!(!"0.0.0.0:1".parse::<ListenAddr>().unwrap().is_local());
        assert!("unix:/x".parse::<ListenAddr>().unwrap().is_local());
    }

    #[test]
    fn bad_socket_paths_are_refused_with_the_reason() {
        let e = |s: &str| s.parse::<ListenAddr>().unwrap_err();
        assert!(e("unix:run/a.sock").contains("absolute path"));
        assert!(e("unix:").contains("absolute path"));
        assert!(e("unix:/run/").contains("directory"));
        assert!(e(&format!("unix:/{}", "a".repeat(120))).contains("at most 107 bytes"));
        assert!(e("localhost:9470").contains("not an address"));
    }

    #[test]
    fn socket_mode_and_group_are_read_and_checked() {
        let c = Config::parse(
            "t.toml",
            "[server]\nlisten = \"unix:/run/admitd.sock\"\nsocket_mode = \"0600\"\nsocket_group = \"mcp\"\n",
        )
        .unwrap();
        assert_eq!(
            c.server.listen,
            ListenAddr::Unix(PathBuf::from("/run/admitd.sock"))
        );
        assert_eq!(c.server.socket.mode, 0o600);
        assert_eq!(c.server.socket.group.as_deref(), Some("mcp"));
        assert_eq!(Config::default().server.socket.mode, 0o660);
        let e = Config::parse("t.toml", "[server]\n\nsocket_mode = \"0999\"\n").unwrap_err();
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("octal"), "{}", e.message);
        let e = Config::parse("t.toml", "[server]\nsocket_mode = \"01777\"\n").unwrap_err();
        assert!(e.message.contains("octal"), "{}", e.message);
        let e = Config::parse("t.toml", "[server]\nsocket_group = \"a:b\"\n").unwrap_err();
        assert!(e.message.contains("socket_group"), "{}", e.message);
        let e = Config::parse("t.toml", "[server]\nlisten = \"unix:x.sock\"\n").unwrap_err();
        assert_eq!(e.line, Some(2));
        assert!(e.message.starts_with("server.listen:"), "{}", e.message);
    }
}
