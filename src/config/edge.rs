//! `[edge]`: the gateway check (`GET /v1/edge/check`), its file shape, model and validation.
//!
//! The section says how a credential forwarded by nginx or Envoy becomes a `(tenant, subject)`:
//! static API keys, kept only as SHA-256 hashes so the file never holds a key, and JWTs checked
//! against a secret (HS256) or a JWKS file (RS256, ES256). Key material is read here, at load and
//! reload, so a missing secret or an unreadable JWKS is a `FILE:LINE` error of `admitd check`, not a
//! 401 storm after a deploy. Secrets are held in [`Secret`], whose `Debug` prints nothing of them.

use std::time::Duration;

use serde::Deserialize;

use super::raw::S;
use super::units::Rate;
use super::validate::Validator;
use super::ConfigError;

/// The MCP revision that made servers validate the `Mcp-Method` / `Mcp-Name` headers against the
/// body: before it, a client could send one tool name in the header and call another.
pub const DEFAULT_MIN_PROTOCOL_VERSION: &str = "2026-07-28";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEdge {
    min_protocol_version: Option<S<String>>,
    client_address_header: Option<S<String>>,
    budget_methods: Option<S<Vec<String>>>,
    failed_auth_rate: Option<S<String>>,
    failed_auth_burst: Option<S<i64>>,
    api_keys: Option<Vec<S<RawApiKey>>>,
    jwt: Option<S<RawJwt>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApiKey {
    sha256: S<String>,
    tenant: S<String>,
    subject: S<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJwt {
    algorithm: S<String>,
    secret_file: Option<S<String>>,
    secret_env: Option<S<String>>,
    jwks_file: Option<S<String>>,
    issuer: S<String>,
    audience: S<String>,
    tenant_claim: Option<S<String>>,
    subject_claim: Option<S<String>>,
    leeway: Option<S<String>>,
}

/// Key material that must never reach a log line, an error message or a metric.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The validated `[edge]` section. The route answers only when it is present.
#[derive(Debug, Clone, PartialEq)]
pub struct EdgeConfig {
    /// `YYYY-MM-DD`: revisions compare as text.
    pub min_protocol_version: String,
    /// Lower case, as hyper stores header names.
    pub client_address_header: String,
    /// `Mcp-Method` values that spend the tool's budget (`Mcp-Name`); others are authenticated only.
    pub budget_methods: Vec<String>,
    /// Failed authentications allowed per client address: refill and burst.
    pub failed_auth_rate: Rate,
    pub failed_auth_burst: u32,
    pub api_keys: Vec<ApiKey>,
    pub jwt: Option<JwtConfig>,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        EdgeConfig {
            min_protocol_version: DEFAULT_MIN_PROTOCOL_VERSION.to_string(),
            client_address_header: "x-real-ip".to_string(),
            budget_methods: vec!["tools/call".to_string()],
            failed_auth_rate: Rate {
                per_sec: 10.0 / 60.0,
            },
            failed_auth_burst: 5,
            api_keys: Vec::new(),
            jwt: None,
        }
    }
}

/// `[[edge.api_keys]]`: the SHA-256 of a key, and who holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub sha256: [u8; 32],
    pub tenant: String,
    pub subject: String,
}

/// `[edge.jwt]`.
#[derive(Debug, Clone, PartialEq)]
pub struct JwtConfig {
    pub algorithm: jsonwebtoken::Algorithm,
    pub keys: JwtKeys,
    pub issuer: String,
    pub audience: String,
    pub tenant_claim: String,
    pub subject_claim: String,
    pub leeway: Duration,
}

/// What a JWT's signature is checked against.
#[derive(Debug, Clone, PartialEq)]
pub enum JwtKeys {
    /// HS256: the shared secret.
    Hmac(Secret),
    /// RS256 / ES256: the public keys, chosen by the token's `kid` (or the only key, without one).
    Jwks(jsonwebtoken::jwk::JwkSet),
}

fn is_revision(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 10
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            _ => c.is_ascii_digit(),
        })
}

fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn hex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in b.chunks(2).enumerate() {
        let hex = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

impl Validator<'_> {
    /// `[edge]`.
    pub(super) fn edge(&self, raw: RawEdge) -> Result<EdgeConfig, ConfigError> {
        let mut out = EdgeConfig::default();
        if let Some(v) = raw.min_protocol_version {
            if !is_revision(v.get_ref()) {
                return self.err(
                    v.span(),
                    format!(
                        "edge.min_protocol_version must be an MCP revision written YYYY-MM-DD (such as {DEFAULT_MIN_PROTOCOL_VERSION:?}), not {:?}",
                        v.get_ref()
                    ),
                );
            }
            out.min_protocol_version = v.into_inner();
        }
        if let Some(v) = raw.client_address_header {
            let name = v.get_ref().trim().to_ascii_lowercase();
            if !is_header_name(&name) {
                return self.err(
                    v.span(),
                    format!(
                        "edge.client_address_header must be a header name (such as \"x-real-ip\" or \"x-forwarded-for\"), not {:?}",
                        v.get_ref()
                    ),
                );
            }
            out.client_address_header = name;
        }
        if let Some(v) = raw.budget_methods {
            if let Some(bad) = v.get_ref().iter().find(|m| m.is_empty() || m.len() > 128) {
                return self.err(
                    v.span(),
                    format!("edge.budget_methods: {bad:?} is not an MCP method name"),
                );
            }
            out.budget_methods = v.into_inner();
        }
        if let Some(v) = &raw.failed_auth_rate {
            out.failed_auth_rate = self.rate("edge.failed_auth_rate", v)?;
        }
        if let Some(v) = &raw.failed_auth_burst {
            out.failed_auth_burst = self.count("edge.failed_auth_burst", v, 1, 1_000_000)? as u32;
        }
        for key in raw.api_keys.unwrap_or_default() {
            let k = key.get_ref();
            let Some(sha256) = hex32(k.sha256.get_ref()) else {
                return self.err(
                    k.sha256.span(),
                    "edge.api_keys.sha256 must be 64 hex digits: the SHA-256 of the key (`printf %s KEY | sha256sum`), never the key itself",
                );
            };
            if out.api_keys.iter().any(|o| o.sha256 == sha256) {
                return self.err(
                    k.sha256.span(),
                    "edge.api_keys: this sha256 is listed twice; a key maps to one tenant and subject",
                );
            }
            let tenant = self.name("edge.api_keys.tenant", k.tenant.get_ref(), k.tenant.span())?;
            let subject = self.name(
                "edge.api_keys.subject",
                k.subject.get_ref(),
                k.subject.span(),
            )?;
            out.api_keys.push(ApiKey {
                sha256,
                tenant,
                subject,
            });
        }
        if let Some(jwt) = raw.jwt {
            out.jwt = Some(self.jwt(jwt)?);
        }
        Ok(out)
    }

    fn jwt(&self, raw: S<RawJwt>) -> Result<JwtConfig, ConfigError> {
        use jsonwebtoken::Algorithm;
        let span = raw.span();
        let j = raw.into_inner();
        let algorithm = match j.algorithm.get_ref().as_str() {
            "HS256" => Algorithm::HS256,
            "RS256" => Algorithm::RS256,
            "ES256" => Algorithm::ES256,
            other => {
                return self.err(
                    j.algorithm.span(),
                    format!("edge.jwt.algorithm must be HS256, RS256 or ES256, not {other:?}"),
                )
            }
        };
        let keys = if algorithm == Algorithm::HS256 {
            if let Some(v) = &j.jwks_file {
                return self.err(
                    v.span(),
                    "edge.jwt.jwks_file is for RS256 and ES256; HS256 takes secret_file or secret_env",
                );
            }
            JwtKeys::Hmac(self.hmac_secret(&j, span.clone())?)
        } else {
            if let Some(v) = j.secret_file.as_ref().or(j.secret_env.as_ref()) {
                return self.err(
                    v.span(),
                    "edge.jwt.secret_file and secret_env are for HS256; RS256 and ES256 take jwks_file",
                );
            }
            let Some(file) = &j.jwks_file else {
                return self.err(
                    span,
                    format!("edge.jwt: {algorithm:?} needs jwks_file, the public keys as a JWKS (JSON Web Key Set) file"),
                );
            };
            JwtKeys::Jwks(self.jwks(file, algorithm)?)
        };
        let text = |key: &str, v: &S<String>| -> Result<String, ConfigError> {
            let s = v.get_ref().trim();
            if s.is_empty() {
                return self.err(v.span(), format!("edge.jwt.{key} must not be empty"));
            }
            Ok(s.to_string())
        };
        let claim = |key: &str, v: &Option<S<String>>, default: &str| match v {
            Some(v) => text(key, v),
            None => Ok(default.to_string()),
        };
        let leeway = match &j.leeway {
            Some(v) => self.duration("edge.jwt.leeway", v, Duration::from_secs(600))?,
            None => Duration::from_secs(30),
        };
        Ok(JwtConfig {
            algorithm,
            keys,
            issuer: text("issuer", &j.issuer)?,
            audience: text("audience", &j.audience)?,
            tenant_claim: claim("tenant_claim", &j.tenant_claim, "tenant")?,
            subject_claim: claim("subject_claim", &j.subject_claim, "sub")?,
            leeway,
        })
    }

    /// The HS256 secret, from its file or environment variable. A trailing newline (as `echo`
    /// writes) is not part of it.
    fn hmac_secret(&self, j: &RawJwt, span: std::ops::Range<usize>) -> Result<Secret, ConfigError> {
        let (bytes, at) = match (&j.secret_file, &j.secret_env) {
            (Some(f), Some(e)) => {
                let later = if f.span().start > e.span().start { f } else { e };
                return self.err(
                    later.span(),
                    "edge.jwt: give secret_file or secret_env, not both",
                );
            }
            (Some(f), None) => match std::fs::read(f.get_ref()) {
                Ok(b) => (b, f.span()),
                Err(e) => {
                    return self.err(
                        f.span(),
                        format!("edge.jwt.secret_file: cannot read {:?}: {e}", f.get_ref()),
                    )
                }
            },
            (None, Some(e)) => match std::env::var_os(e.get_ref()) {
                Some(v) => (v.into_encoded_bytes(), e.span()),
                None => {
                    return self.err(
                        e.span(),
                        format!(
                            "edge.jwt.secret_env: the environment variable {:?} is not set",
                            e.get_ref()
                        ),
                    )
                }
            },
            (None, None) => {
                return self.err(
                    span,
                    "edge.jwt: HS256 needs secret_file or secret_env (the shared secret is never written in the config)",
                )
            }
        };
        let mut bytes = bytes;
        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            bytes.pop();
        }
        if bytes.len() < 32 {
            return self.err(
                at,
                format!(
                    "edge.jwt: the HS256 secret is {} bytes; use at least 32 random bytes",
                    bytes.len()
                ),
            );
        }
        Ok(Secret(bytes))
    }

    fn jwks(
        &self,
        file: &S<String>,
        algorithm: jsonwebtoken::Algorithm,
    ) -> Result<jsonwebtoken::jwk::JwkSet, ConfigError> {
        let name = file.get_ref();
        let text = std::fs::read_to_string(name).or_else(|e| {
            self.err(
                file.span(),
                format!("edge.jwt.jwks_file: cannot read {name:?}: {e}"),
            )
        })?;
        let set: jsonwebtoken::jwk::JwkSet = serde_json::from_str(&text).or_else(|e| {
            self.err(
                file.span(),
                format!("edge.jwt.jwks_file: {name:?} is not a JWKS ({{\"keys\": [...]}}): {e}"),
            )
        })?;
        if set.keys.is_empty() {
            return self.err(
                file.span(),
                format!("edge.jwt.jwks_file: {name:?} holds no keys"),
            );
        }
        for (i, jwk) in set.keys.iter().enumerate() {
            let kind_fits = matches!(
                (&jwk.algorithm, algorithm),
                (
                    jsonwebtoken::jwk::AlgorithmParameters::RSA(_),
                    jsonwebtoken::Algorithm::RS256
                ) | (
                    jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_),
                    jsonwebtoken::Algorithm::ES256
                )
            );
            if !kind_fits || jsonwebtoken::DecodingKey::from_jwk(jwk).is_err() {
                return self.err(
                    file.span(),
                    format!("edge.jwt.jwks_file: key {i} of {name:?} is not a public key for {algorithm:?}"),
                );
            }
        }
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const KEY_HASH: &str = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse("admitd.toml", text).map_err(|e| e.to_string())
    }

    #[test]
    fn no_section_no_edge_check() {
        assert!(parse("").unwrap().edge.is_none());
        let c = parse("[edge]\n").unwrap();
        let e = c.edge.unwrap();
        assert_eq!(e.min_protocol_version, "2026-07-28");
        assert_eq!(e.client_address_header, "x-real-ip");
        assert_eq!(e.budget_methods, vec!["tools/call"]);
        assert!(e.api_keys.is_empty() && e.jwt.is_none());
    }

    #[test]
    fn api_keys_are_read_as_hashes() {
        let c = parse(&format!(
            "[edge]\nmin_protocol_version = \"2026-09-01\"\nclient_address_header = \"X-Forwarded-For\"\n\
             [[edge.api_keys]]\nsha256 = \"{KEY_HASH}\"\ntenant = \"acme\"\nsubject = \"acme-bot\"\n"
        ))
        .unwrap();
        let e = c.edge.unwrap();
        assert_eq!(e.min_protocol_version, "2026-09-01");
        assert_eq!(e.client_address_header, "x-forwarded-for");
        assert_eq!(e.api_keys.len(), 1);
        assert_eq!(e.api_keys[0].sha256[0], 0x2c);
        assert_eq!(e.api_keys[0].tenant, "acme");
    }

    #[test]
    fn problems_are_named_with_their_line() {
        let cases = [
            ("[edge]\nmin_protocol_version = \"2025-6-18\"\n", "admitd.toml:2: edge.min_protocol_version"),
            ("[edge]\nclient_address_header = \"x real ip\"\n", "admitd.toml:2: edge.client_address_header"),
            ("[edge]\nfailed_auth_rate = \"5/mins\"\n", "admitd.toml:2: edge.failed_auth_rate"),
            ("[edge]\nfailed_auth_burst = 0\n", "admitd.toml:2: edge.failed_auth_burst"),
            ("[edge]\n[[edge.api_keys]]\nsha256 = \"secret-key\"\ntenant = \"a\"\nsubject = \"b\"\n", "admitd.toml:3: edge.api_keys.sha256 must be 64 hex digits"),
            ("[edge]\n[[edge.api_keys]]\nsha256 = \"0000000000000000000000000000000000000000000000000000000000000000\"\ntenant = \"a\"\n", "admitd.toml:2: missing field `subject`"),
            ("[edge]\n[[edge.api_keys]]\nsha256 = \"0000000000000000000000000000000000000000000000000000000000000000\"\ntenant = \"\"\nsubject = \"b\"\n", "admitd.toml:4: edge.api_keys.tenant"),
            ("[edge]\nnope = 1\n", "admitd.toml:2: unknown field `nope`"),
            ("[edge.jwt]\nalgorithm = \"none\"\nissuer = \"i\"\naudience = \"a\"\n", "admitd.toml:2: edge.jwt.algorithm must be HS256, RS256 or ES256"),
            ("[edge.jwt]\nalgorithm = \"HS256\"\nissuer = \"i\"\naudience = \"a\"\nsecret_env = \"ADMITD_TEST_UNSET_SECRET\"\n", "admitd.toml:5: edge.jwt.secret_env"),
            ("[edge.jwt]\nalgorithm = \"HS256\"\nissuer = \"i\"\naudience = \"a\"\nsecret_file = \"/nonexistent/secret\"\n", "admitd.toml:5: edge.jwt.secret_file: cannot read"),
            ("[edge.jwt]\nalgorithm = \"RS256\"\nissuer = \"i\"\naudience = \"a\"\njwks_file = \"/nonexistent/jwks.json\"\n", "admitd.toml:5: edge.jwt.jwks_file: cannot read"),
            ("[edge.jwt]\nalgorithm = \"RS256\"\nissuer = \"i\"\naudience = \"a\"\n", "needs jwks_file"),
        ];
        for (text, want) in cases {
            let got = parse(text).unwrap_err();
            assert!(got.contains(want), "{text}\n got: {got}\nwant: {want}");
        }
        let twice = format!(
            "[edge]\n[[edge.api_keys]]\nsha256 = \"{KEY_HASH}\"\ntenant = \"a\"\nsubject = \"b\"\n\
             [[edge.api_keys]]\nsha256 = \"{KEY_HASH}\"\ntenant = \"a\"\nsubject = \"c\"\n"
        );
        assert!(parse(&twice)
            .unwrap_err()
            .contains("admitd.toml:7: edge.api_keys: this sha256 is listed twice"));
    }

    #[test]
    fn a_short_or_missing_secret_is_refused_and_a_good_one_is_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, "tiny\n").unwrap();
        let text = format!(
            "[edge.jwt]\nalgorithm = \"HS256\"\nissuer = \"i\"\naudience = \"a\"\nsecret_file = {:?}\n",
            short.display().to_string()
        );
        assert!(parse(&text)
            .unwrap_err()
            .contains("admitd.toml:5: edge.jwt: the HS256 secret is 4 bytes"));
        let good = dir.path().join("good");
        std::fs::write(&good, "a-secret-of-at-least-thirty-two-bytes!!\n").unwrap();
        let text = format!(
            "[edge.jwt]\nalgorithm = \"HS256\"\nissuer = \"i\"\naudience = \"a\"\nsecret_file = {:?}\n",
            good.display().to_string()
        );
        let c = parse(&text).unwrap();
        let jwt = c.edge.as_ref().unwrap().jwt.as_ref().unwrap();
        match &jwt.keys {
            super::JwtKeys::Hmac(s) => {
                assert_eq!(s.bytes(), b"a-secret-of-at-least-thirty-two-bytes!!")
            }
            other => panic!("{other:?}"),
        }
        assert!(!format!("{c:?}").contains("thirty-two"));
    }
}
