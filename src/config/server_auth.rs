//! Who may call: the caller, admin and metrics tokens of `[server]`, and the key that turns identities
//! into keyed hashes in logs and spans (`[telemetry] hash_identities`).
//!
//! Tokens are configured as SHA-256 digests (64 hex digits), never as the tokens themselves, so the
//! config file (often world-readable, kept in version control or a `ConfigMap`) holds nothing a caller
//! could present. The identity key is secret and comes from a file or the environment, never from the
//! config text; it is read when the config is loaded, so `admitd check` reports a missing key.

use std::fmt;

use super::raw::{RawServer, RawTelemetry, S};
use super::validate::Validator;
use super::ConfigError;

/// A SHA-256 digest of a token.
pub type TokenDigest = [u8; 32];

/// `[server] api_tokens_sha256`, `admin_token_sha256`, `metrics_token_sha256`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerAuth {
    /// Callers of `/v1/admit`, `/v1/release`, `/v1/feedback` and `/v1/tenants/*` present one of
    /// these (as `Authorization: Bearer TOKEN`); empty: those routes are open.
    pub api_tokens: Vec<TokenDigest>,
    /// `/v1/admin/*`. Without it the admin routes answer 403, unless the daemon listens on a Unix
    /// socket only (whose file permissions then decide who may reload).
    pub admin_token: Option<TokenDigest>,
    /// `/metrics` and `/v1/alerts`; open when absent.
    pub metrics_token: Option<TokenDigest>,
}

impl ServerAuth {
    /// Whether any caller token is configured.
    pub fn callers_need_token(&self) -> bool {
        !self.api_tokens.is_empty()
    }
}

/// The secret key of the identity hashes; its bytes never appear in `Debug` output.
#[derive(Clone, PartialEq, Eq)]
pub struct IdentityKey(pub Vec<u8>);

impl fmt::Debug for IdentityKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdentityKey({} bytes)", self.0.len())
    }
}

/// The shortest identity key accepted: 128 bits.
pub const MIN_IDENTITY_KEY: usize = 16;

/// Parses 64 hex digits into a digest.
pub fn parse_digest(text: &str) -> Option<TokenDigest> {
    let t = text.trim().as_bytes();
    if t.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in t.chunks(2).enumerate() {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        out[i] = (hi * 16 + lo) as u8;
    }
    Some(out)
}

impl Validator<'_> {
    fn digest(&self, key: &str, v: &S<String>) -> Result<TokenDigest, ConfigError> {
        parse_digest(v.get_ref()).map_or_else(
            // The value is not echoed: it may be a token pasted in by mistake.
            || {
                self.err(
                    v.span(),
                    format!("{key} must be the SHA-256 of the token as 64 hex digits (printf %s \"$TOKEN\" | sha256sum)"),
                )
            },
            Ok,
        )
    }

    /// The token keys of `[server]`.
    pub(super) fn server_auth(
        &self,
        s: &RawServer,
        out: &mut ServerAuth,
    ) -> Result<(), ConfigError> {
        if let Some(list) = &s.api_tokens_sha256 {
            out.api_tokens = list
                .get_ref()
                .iter()
                .map(|v| self.digest("server.api_tokens_sha256", v))
                .collect::<Result<_, _>>()?;
        }
        if let Some(v) = &s.admin_token_sha256 {
            let d = self.digest("server.admin_token_sha256", v)?;
            if out.api_tokens.contains(&d) {
                return self.err(
                    v.span(),
                    "server.admin_token_sha256 is also a caller token: give the admin routes a token of their own",
                );
            }
            out.admin_token = Some(d);
        }
        if let Some(v) = &s.metrics_token_sha256 {
            out.metrics_token = Some(self.digest("server.metrics_token_sha256", v)?);
        }
        Ok(())
    }

    /// `[telemetry] hash_identities`, `hash_key_file`, `hash_key_env`.
    pub(super) fn identity_key(
        &self,
        t: &RawTelemetry,
    ) -> Result<Option<IdentityKey>, ConfigError> {
        let on = t.hash_identities.as_ref().is_some_and(|v| *v.get_ref());
        let source = match (&t.hash_key_file, &t.hash_key_env) {
            (Some(f), Some(e)) => {
                let later = if f.span().start > e.span().start {
                    f.span()
                } else {
                    e.span()
                };
                return self.err(
                    later,
                    "telemetry: set one of hash_key_file and hash_key_env, not both",
                );
            }
            (Some(f), None) => Some((f, true)),
            (None, Some(e)) => Some((e, false)),
            (None, None) => None,
        };
        let Some((v, from_file)) = source else {
            if let Some(flag) = t.hash_identities.as_ref().filter(|_| on) {
                return self.err(
                    flag.span(),
                    "telemetry.hash_identities needs a secret key: set hash_key_file (a file holding at least 16 bytes) or hash_key_env (the environment variable holding it)",
                );
            }
            return Ok(None);
        };
        if !on {
            return self.err(
                v.span(),
                "a hash key is set but telemetry.hash_identities is not true",
            );
        }
        let name = v.get_ref().trim();
        let key = if from_file {
            std::fs::read(name).or_else(|e| {
                self.err(
                    v.span(),
                    format!("telemetry.hash_key_file: cannot read {name:?}: {e}"),
                )
            })?
        } else {
            match std::env::var_os(name) {
                Some(k) => k.into_encoded_bytes(),
                None => {
                    return self.err(
                        v.span(),
                        format!(
                            "telemetry.hash_key_env: the environment variable {name:?} is not set"
                        ),
                    )
                }
            }
        };
        // A key file written by `echo` ends in a newline that is not part of the key.
        let mut key = key;
        while key.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            key.pop();
        }
        if key.len() < MIN_IDENTITY_KEY {
            let key_name = if from_file {
                "hash_key_file"
            } else {
                "hash_key_env"
            };
            return self.err(
                v.span(),
                format!("telemetry.{key_name}: the key is {} bytes; it must be at least {MIN_IDENTITY_KEY}", key.len()),
            );
        }
        Ok(Some(IdentityKey(key)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const DIGEST: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn digests_are_64_hex_digits() {
        let d = parse_digest(DIGEST).unwrap();
        assert_eq!(d[0], 0x9f);
        assert_eq!(d[31], 0x08);
        assert_eq!(parse_digest(&DIGEST.to_uppercase()), Some(d));
        assert_eq!(parse_digest(&DIGEST[..63]), None);
        assert_eq!(parse_digest(&format!("{}g", &DIGEST[..63])), None);
        assert_eq!(parse_digest("é".repeat(32).as_str()), None);
    }

    #[test]
    fn tokens_are_read_and_a_bad_one_is_refused_without_echoing_it() {
        let c = Config::parse(
            "t.toml",
            &format!(
                "[server]\napi_tokens_sha256 = [\"{DIGEST}\"]\nmetrics_token_sha256 = \"{}\"\n",
                "0".repeat(64)
            ),
        )
        .unwrap();
        assert_eq!(c.server.auth.api_tokens.len(), 1);
        assert_eq!(c.server.auth.metrics_token, Some([0; 32]));
        assert_eq!(c.server.auth.admin_token, None);
        let e = Config::parse(
            "t.toml",
            "[server]\nmode = \"enforce\"\napi_tokens_sha256 = [\"s3cr3t-token\"]\n",
        )
        .unwrap_err();
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("64 hex digits"), "{}", e.message);
        assert!(!e.message.contains("s3cr3t"), "{}", e.message);
        let e = Config::parse(
            "t.toml",
            &format!(
                "[server]\napi_tokens_sha256 = [\"{DIGEST}\"]\nadmin_token_sha256 = \"{DIGEST}\"\n"
            ),
        )
        .unwrap_err();
        assert!(e.message.contains("token of their own"), "{}", e.message);
    }

    #[test]
    fn the_identity_key_comes_from_a_file_or_the_environment() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, b"0123456789abcdef-key\n").unwrap();
        let path = f.path().display().to_string();
        let c = Config::parse(
            "t.toml",
            &format!("[telemetry]\nhash_identities = true\nhash_key_file = {path:?}\n"),
        )
        .unwrap();
        assert_eq!(
            c.telemetry.identity_key,
            Some(IdentityKey(b"0123456789abcdef-key".to_vec()))
        );
        assert!(!format!("{:?}", c.telemetry.identity_key).contains("0123"));
        std::env::set_var("ADMITD_TEST_IDENTITY_KEY_OK", "another-sixteen-bytes");
        let c = Config::parse(
            "t.toml",
            "[telemetry]\nhash_identities = true\nhash_key_env = \"ADMITD_TEST_IDENTITY_KEY_OK\"\n",
        )
        .unwrap();
        assert_eq!(
            c.telemetry.identity_key.unwrap().0,
            b"another-sixteen-bytes"
        );
        let err = |text: &str| Config::parse("t.toml", text).unwrap_err();
        let e = err("[telemetry]\nhash_identities = true\n");
        assert_eq!(e.line, Some(2));
        assert!(e.message.contains("needs a secret key"), "{}", e.message);
        let e =
            err("[telemetry]\nhash_identities = true\nhash_key_env = \"ADMITD_TEST_UNSET_KEY\"\n");
        assert!(e.message.contains("is not set"), "{}", e.message);
        std::env::set_var("ADMITD_TEST_IDENTITY_KEY_SHORT", "short");
        let e = err("[telemetry]\nhash_identities = true\nhash_key_env = \"ADMITD_TEST_IDENTITY_KEY_SHORT\"\n");
        assert!(e.message.contains("at least 16"), "{}", e.message);
        let e = err("[telemetry]\nhash_key_env = \"X\"\n");
        assert!(e.message.contains("not true"), "{}", e.message);
        let e = err("[telemetry]\nhash_identities = true\nhash_key_file = \"/nonexistent/key\"\n");
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("cannot read"), "{}", e.message);
        assert_eq!(
            Config::parse("t.toml", "[telemetry]\nhash_identities = false\n")
                .unwrap()
                .telemetry
                .identity_key,
            None
        );
    }
}
