//! The config file: TOML text in, validated policy out.
//!
//! Parsing happens in two steps. Serde reads the file into `Raw*` structs that keep the byte span of every
//! value (`toml::Spanned`) and refuse unknown keys; validation then turns them into the typed [`Config`]
//! the engine uses. Every error — TOML syntax, an unknown key, a value out of range, a dangling plan name
//! — is reported as `FILE:LINE: message` for the first problem (the one on the lowest line, whatever
//! section it is in), so an operator can fix it without guessing. The same path serves `admitd check`,
//! startup and reload, so a file that passes `check` is exactly a file the daemon accepts.
//!
//! The rooms: `model.rs` holds the validated types, `raw.rs` the file's shape as serde reads it,
//! `units.rs` the rate and duration syntax, `validate.rs` the checks that turn one into the other,
//! and `lint.rs` the warnings of `admitd check` about names that look like typos of declared ones.
//! Names in the file obey the same rule as names in requests ([`check_name`], in `crate::names`,
//! below both the config and the API).
//!
//! A new section lives in its own file under `config/`: its `Raw*` struct (with `deny_unknown_fields`
//! and `Spanned` values) plus one field in `raw::RawConfig`, its model type plus one field in
//! [`Config`], and a `Validator` method that checks it with the shared helpers (`rate`, `duration`,
//! `count`, `err`) and is called from `Validator::config`.

mod advice;
mod edge;
mod lint;
pub mod listen;
mod model;
mod raw;
pub mod server_auth;
mod spend;
mod state;
pub mod store;
mod tasks;
pub mod units;
mod validate;

use std::fmt;
use std::path::Path;

pub use crate::names::check_name;
pub use advice::AdviceConfig;
pub use edge::{ApiKey, EdgeConfig, JwtConfig, JwtKeys, Secret};
pub use lint::near_misses;
pub use listen::{ListenAddr, SocketOptions};
pub use model::*;
pub use server_auth::{IdentityKey, ServerAuth};
pub use spend::{
    valid_unit_name, SpendBudgets, SpendConfig, SpendUnit, DEFAULT_RUN_IDLE, MAX_SPEND_UNITS,
};
pub use state::{OverloadConfig, StateConfig};
pub use store::{OnError, StoreConfig, StoreKind};
pub use tasks::TasksConfig;
pub use units::{parse_duration, parse_rate, Rate};
pub use validate::MAX_REFILL_YEARS;

use raw::{blank_line, line_of, reader_message, RawConfig, RECHECKS};
use validate::Validator;

/// A config error located in its file.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub file: String,
    /// 1-based line of the offending key or value, when known.
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.file, line, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            line: None,
            message: format!("cannot read the config file: {e}"),
        })?;
        let mut cfg = Config::parse(&file, &text)?;
        cfg.path = Some(file);
        Ok(cfg)
    }

    /// Validates config text; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Config, ConfigError> {
        Self::parse_within(file, text, RECHECKS)
    }

    /// [`Config::parse`]. A line the TOML reader refuses (bad syntax, an unknown key, a value of the
    /// wrong type) stops it before validation, but validation might find a problem on an earlier
    /// line: the refused line is blanked and the file checked again (`rechecks` more times at
    /// most), and whichever problem comes first in the file is the one reported.
    fn parse_within(file: &str, text: &str, rechecks: u32) -> Result<Config, ConfigError> {
        let raw: RawConfig = match toml::from_str(text) {
            Ok(raw) => raw,
            Err(e) => {
                let line = e.span().map(|s| line_of(text, s.start));
                let err = ConfigError {
                    file: file.to_string(),
                    line,
                    message: reader_message(&e, text),
                };
                if let (Some(line), true) = (line, rechecks > 0) {
                    let rest = Self::parse_within(file, &blank_line(text, line), rechecks - 1);
                    if let Err(earlier) = rest {
                        if earlier.line.is_some_and(|l| l < line) {
                            return Err(earlier);
                        }
                    }
                }
                return Err(err);
            }
        };
        let v = Validator { file, text };
        v.config(raw)
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod upstream_config_tests;
