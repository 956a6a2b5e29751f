//! The command line: `admitd serve`, `admitd check`, `admitd health`, `admitd advise` and
//! `admitd top`.

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
    /// Ask a running daemon's /healthz (or /readyz with --ready): exit 0 on 200, 1 otherwise. For
    /// container health checks: no HTTP client needed.
    Health {
        /// Config file whose `[server] listen` names the daemon (only that key is read).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Address of the daemon (`HOST:PORT` or `unix:/PATH`); wins over the config's `listen`.
        /// A wildcard address (0.0.0.0, [::]) is probed on loopback.
        #[arg(long, value_name = "ADDR")]
        listen: Option<ListenAddr>,
        /// Probe /readyz instead of /healthz.
        #[arg(long)]
        ready: bool,
        /// Give up after this long (e.g. 2s, 500ms).
        #[arg(long, value_name = "DURATION", default_value = "2s")]
        timeout: String,
    },
    /// Propose limits from the traffic running daemons saw, and replay it against the current
    /// config and the proposal; prints the proposed config with a summary in comments. Give
    /// several --url (the replicas of one shared store) to merge what each saw.
    Advise {
        /// A daemon's base URL, e.g. http://127.0.0.1:9470 (repeat for several replicas).
        #[arg(long, value_name = "URL", required = true)]
        url: Vec<String>,
        /// The period to look back on (at most what the daemons keep, `[advice] keep`).
        #[arg(long, value_name = "DURATION", default_value = "1h")]
        over: String,
        /// The admin token (`/v1/advice` is an admin route); defaults to $ADMITD_TOKEN.
        #[arg(long, value_name = "TOKEN")]
        token: Option<String>,
    },
    /// A live view of a running daemon, refreshed every second: the tenants most shed first, the
    /// scope that sheds each, calls in flight, alerts and the store's state (GET /v1/tenants).
    Top {
        /// The daemon: `http://HOST:PORT` or `unix:/PATH` (its Unix socket).
        #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:9470")]
        url: String,
        /// A file holding the metrics or admin token (or a tenant's own key, which shows that
        /// tenant only). Without it, the ADMITD_TOKEN environment variable, if set.
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// Print the view once and exit (for scripts).
        #[arg(long)]
        once: bool,
        /// Tenants shown, at most (1 to 1000).
        #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
    },
}

/// The `listen` of a config file, read on its own: a health probe must not fail on a key it
/// does not need (a secret file it cannot read, for instance).
fn listen_of(path: &std::path::Path) -> Result<Option<ListenAddr>, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: cannot read: {e}"))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| format!("{shown}: {}", e.message()))?;
    match table.get("server").and_then(|s| s.get("listen")) {
        None => Ok(None),
        Some(toml::Value::String(v)) => v
            .parse()
            .map(Some)
            .map_err(|e| format!("{shown}: server.listen: {e}")),
        Some(_) => Err(format!("{shown}: server.listen must be a string")),
    }
}

fn health(
    config: Option<PathBuf>,
    listen: Option<ListenAddr>,
    ready: bool,
    timeout: &str,
) -> Result<(String, u16), String> {
    let timeout = crate::config::parse_duration(timeout).map_err(|e| format!("--timeout: {e}"))?;
    let listen = match (listen, config) {
        (Some(l), _) => l,
        (None, Some(path)) => listen_of(&path)?.unwrap_or_else(|| Config::default().server.listen),
        (None, None) => Config::default().server.listen,
    };
    let target = crate::health::probe_target(&listen);
    let path = if ready { "/readyz" } else { "/healthz" };
    let status = crate::health::probe(&target, path, timeout)?;
    Ok((format!("{target}{path}"), status))
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

/// The store `admitd serve` would use with this config, for `admitd check`: its kind and, for Redis,
/// its hosts without user or password, and what admissions do while it does not answer.
fn store_text(s: &crate::config::StoreConfig) -> String {
    use crate::config::StoreKind;
    match s.kind {
        StoreKind::Memory => {
            "memory (this process only; [store] kind = \"redis\" shares limits between replicas)"
                .to_string()
        }
        StoreKind::Redis => {
            let url = s.url.as_deref().unwrap_or("");
            // Each seed of a list: the scheme and host:port, never user:password@.
            let hosts: Vec<String> = url
                .split(',')
                .map(|u| {
                    let u = u.trim();
                    let (scheme, rest) = u.split_once("://").unwrap_or(("redis", u));
                    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
                    let host = host.split('/').next().unwrap_or(host);
                    format!("{scheme}://{host}")
                })
                .collect();
            format!(
                "redis{} at {} (timeout {:?}, on_error {})",
                if s.cluster { " cluster" } else { "" },
                hosts.join(", "),
                s.timeout,
                s.on_error.as_str()
            )
        }
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Advise { url, over, token } => {
            if let Err(e) = crate::config::parse_duration(&over) {
                eprintln!("admitd advise: --over {over}: {e}");
                return ExitCode::from(2);
            }
            let token = token.or_else(|| std::env::var("ADMITD_TOKEN").ok());
            match crate::advise::fetch(&url, &over, token.as_deref()) {
                Ok(advice) => {
                    print!("{}", crate::advise::render(&advice, &url));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("admitd advise: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Health {
            config,
            listen,
            ready,
            timeout,
        } => match health(config, listen, ready, &timeout) {
            Ok((what, 200)) => {
                println!("{what}: 200");
                ExitCode::SUCCESS
            }
            Ok((what, status)) => {
                eprintln!("{what}: {status}");
                ExitCode::from(1)
            }
            Err(e) => {
                eprintln!("admitd health: {e}");
                ExitCode::from(1)
            }
        },
        Command::Top {
            url,
            token_file,
            once,
            limit,
        } => match crate::top::run(&url, token_file, once, usize::from(limit)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("admitd top: {e}");
                ExitCode::from(1)
            }
        },
        Command::Check { config } => match Config::load(&config) {
            Ok(c) => {
                let spend = match c.spend.units.len() {
                    0 => String::new(),
                    n => format!(", {n} spend units"),
                };
                println!(
                    "{}: ok ({} plans, {} tenants, {} tools, {} upstreams{spend}; mode {})",
                    config.display(),
                    c.plans.len(),
                    c.tenants.len(),
                    c.tools.len(),
                    c.upstreams.len(),
                    c.server.mode.as_str()
                );
                println!("{}: store {}", config.display(), store_text(&c.store));
                for finding in crate::engine::lint::never_fitting_tools(&std::sync::Arc::new(c)) {
                    eprintln!("{}: {}", config.display(), finding.warning());
                }
                // The file was just read whole; a second read that fails only loses the warnings.
                if let Ok(text) = std::fs::read_to_string(&config) {
                    for w in crate::config::near_misses(&config.display().to_string(), &text) {
                        eprintln!("{w}");
                    }
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
