//! The command line: `admitd serve` and `admitd check`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Config, ListenAddr};

/// Admission control for MCP tool servers: per-tenant rate limits, concurrency caps and quotas for AI
/// agent traffic, with refusals a model can act on.
#[derive(Parser, Debug)]
#[command(name = "admitd", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon (built-in defaults when no --config is given).
    Serve {
        /// TOML config file (every key is described in docs/configuration.md).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Address to listen on (`HOST:PORT` or `unix:/PATH`). Wins over `listen` in the config's
        /// `[server]` section, and says so in the log when the two differ.
        #[arg(long, value_name = "ADDR")]
        listen: Option<ListenAddr>,
    },
    /// Validate a config file and exit: 0 when valid, 1 with FILE:LINE: message otherwise.
    Check {
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("ADMITD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_current_span(false)
        .try_init();
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config } => match Config::load(&config) {
            Ok(c) => {
                println!(
                    "{}: ok ({} plans, {} tenants, {} tools, {} upstreams; mode {})",
                    config.display(),
                    c.plans.len(),
                    c.tenants.len(),
                    c.tools.len(),
                    c.upstreams.len(),
                    c.server.mode.as_str()
                );
                for finding in crate::engine::lint::never_fitting_tools(&std::sync::Arc::new(c)) {
                    eprintln!("{}: {}", config.display(), finding.warning());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(1)
            }
        },
        Command::Serve { config, listen } => {
            let mut cfg = match config {
                Some(path) => match Config::load(&path) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::from(2);
                    }
                },
                None => Config::default(),
            };
            // The file's own `listen`, before the command line replaces it.
            let from_file = cfg.server.listen_in_file.then(|| cfg.server.listen.clone());
            if let Some(addr) = listen {
                cfg.server.listen = addr.clone();
                cfg.listen_override = Some(addr);
            }
            init_logging();
            if let (Some(file_addr), Some(addr)) = (from_file, &cfg.listen_override) {
                if &file_addr != addr {
                    tracing::warn!(
                        listen = %addr,
                        config_listen = %file_addr,
                        "--listen overrides server.listen of the config file"
                    );
                }
            }
            match crate::server::serve(cfg) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("admitd: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}
