//! admitd: admission control for MCP tool servers.
//!
//! An MCP server asks admitd before it runs a tool (`POST /v1/admit`) and tells it afterwards what
//! happened (`POST /v1/release`). admitd keeps per-subject, per-tool, per-tenant, per-upstream and global
//! budgets, concurrency caps and daily quotas, holds calls briefly when capacity frees soon, and refuses
//! the rest with a retry time and a message the model can act on.
//!
//! Layout: [`engine`] is the pure decision logic; [`actors`] runs one engine per tenant inside an actix
//! actor; [`api`] is the warp HTTP layer; [`config`] reads the TOML file; [`telemetry`] turns decisions
//! into metrics, spans, logs and alerts; [`advice`] proposes limits from the traffic it
//! recorded; [`cli`] is the command line.

pub mod actors;
pub mod advice;
pub mod advise;
pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod engine;
pub mod health;
pub mod names;
mod prefetch;
pub mod server;
pub mod state;
pub mod store;
pub mod telemetry;
pub mod top;
#[cfg(unix)]
pub mod unix_socket;
