//! A real Redis for the shared-store tests: one `redis-server` ([`RedisServer`]) or a three-node Redis
//! Cluster ([`RedisCluster`]) on free loopback ports, without persistence, each in a temporary
//! directory, killed when dropped. Needs `redis-server` and `redis-cli` (Debian package
//! `redis-server`; `scripts/test.sh` installs it).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to answer PING after it was started.
const READY_WITHIN: Duration = Duration::from_secs(10);
/// How long a new cluster may take until every node says `cluster_state:ok`.
const CLUSTER_OK_WITHIN: Duration = Duration::from_secs(30);

/// The path of a Redis program (`redis-server`, `redis-cli`): on PATH, else in /usr/bin or /usr/sbin.
pub fn redis_bin(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    let fixed = ["/usr/bin", "/usr/sbin", "/usr/local/bin"].map(PathBuf::from);
    on_path
        .into_iter()
        .chain(fixed)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} not found on PATH, in /usr/bin or in /usr/sbin: the shared-store tests run a real \
                 Redis. scripts/test.sh installs it (apt-get install redis-server, which brings redis-cli)"
            )
        })
}

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A free port whose cluster bus port (port + 10000) is free too.
pub fn free_cluster_port() -> u16 {
    for _ in 0..200 {
        let port = free_port();
        if port > 65535 - 10000 {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port P with P + 10000 free as well (the cluster bus port)")
}

/// One `redis-server` on 127.0.0.1, no persistence, in a temporary directory.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    /// Arguments beyond the common ones (e.g. a password).
    extra: Vec<String>,
    /// A cluster node: cluster mode on, its nodes file `nodes-PORT.conf` in its directory.
    cluster: bool,
    /// `--requirepass`, when given: `cli` authenticates with it.
    password: Option<String>,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// A standalone server on a free port, answering PING.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Like [`RedisServer::start`], with more `redis-server` arguments (e.g. `["--requirepass", "pw"]`).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        RedisServer::start_on(free_port, extra, false)
    }

    /// Starts on a port from `pick`, trying another one if the port was taken in the meantime.
    fn start_on(pick: fn() -> u16, extra: &[&str], cluster: bool) -> RedisServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let password = extra
            .iter()
            .position(|a| a == "--requirepass")
            .and_then(|i| extra.get(i + 1).cloned());
        let mut last = String::new();
        for _ in 0..5 {
            let mut server = RedisServer {
                child: None,
                port: pick(),
                extra: extra.clone(),
                cluster,
                password: password.clone(),
                dir: tempfile::tempdir().expect("a temporary directory for redis-server"),
            };
            match server.spawn_and_wait() {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("redis-server did not start on any of five free ports; last: {last}")
    }

    /// `redis://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's directory (its log, `redis.log`, and a cluster node's config file).
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// Kills the server (SIGKILL: no goodbye to clients, nothing saved) and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, with the same arguments, and waits until it answers.
    /// Its data is gone (no persistence); a cluster node keeps its identity from its nodes file.
    pub fn restart(&mut self) {
        self.stop();
        let end = Instant::now() + READY_WITHIN;
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return,
                // The old socket may linger for a moment; anything else is a real failure.
                Err(e) if Instant::now() < end && e.contains("Address already in use") => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => panic!("redis-server did not restart on port {}: {e}", self.port),
            }
        }
    }

    /// Stops the process without killing it (SIGSTOP): connections stay open but nothing is answered,
    /// as with a hung or partitioned Redis. [`RedisServer::resume`] continues it.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Continues a [`RedisServer::pause`]d server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.pid().expect("redis-server is not running");
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill {sig} {pid} failed");
    }

    /// Runs `redis-cli` against this server with `args` and returns its standard output, trimmed.
    /// Panics when redis-cli fails (e.g. the server does not answer); see [`RedisServer::try_cli`].
    pub fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args)
            .unwrap_or_else(|e| panic!("redis-cli -p {} {args:?}: {e}", self.port))
    }

    /// `redis-cli` against this server: its trimmed standard output, or what it said when it failed.
    /// Redis error replies (`ERR ...`) are output, not failures.
    pub fn try_cli(&self, args: &[&str]) -> Result<String, String> {
        let mut cmd = Command::new(redis_bin("redis-cli"));
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(pw) = &self.password {
            cmd.args(["-a", pw, "--no-auth-warning"]);
        }
        run(cmd.args(args))
    }

    /// [`RedisServer::cli`] logging in with `password` (one set since the server started).
    pub fn cli_as(&self, password: &str, args: &[&str]) -> String {
        let mut cmd = Command::new(redis_bin("redis-cli"));
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        cmd.args(["-a", password, "--no-auth-warning"]);
        run(cmd.args(args)).unwrap_or_else(|e| panic!("redis-cli -p {} {args:?}: {e}", self.port))
    }

    /// True when the server answers a PING on a fresh connection (`-NOAUTH` counts: it answered).
    pub fn answers(&self) -> bool {
        ping(self.port)
    }

    /// The last lines of the server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    fn spawn_and_wait(&mut self) -> Result<(), String> {
        let dir = self.dir.path();
        let mut cmd = Command::new(redis_bin("redis-server"));
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--protected-mode", "no"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .args(&self.extra);
        if self.cluster {
            // Relative to --dir, where redis-server runs.
            let nodes_file = format!("nodes-{}.conf", self.port);
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &nodes_file,
            ]);
            cmd.args(["--cluster-node-timeout", "2000"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run redis-server: {e}"))?;
        self.child = Some(child);
        let end = Instant::now() + READY_WITHIN;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!(
                    "redis-server exited with {status}:\n{}",
                    self.log_tail()
                ));
            }
            if ping(self.port) {
                return Ok(());
            }
            if Instant::now() > end {
                self.stop();
                return Err(format!(
                    "no answer to PING within {READY_WITHIN:?}:\n{}",
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Redis Cluster of masters only (no replicas), each a [`RedisServer`] with cluster mode on.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// `n` (at least 3) nodes, the 16384 slots spread over them, every node saying `cluster_state:ok`.
    pub fn start(n: usize) -> RedisCluster {
        assert!(n >= 3, "a Redis Cluster needs at least 3 masters, not {n}");
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| RedisServer::start_on(free_cluster_port, &[], true))
            .collect();
        let cluster = RedisCluster { nodes };
        let mut create = Command::new(redis_bin("redis-cli"));
        create.args(["--cluster", "create"]);
        create.args(cluster.nodes.iter().map(RedisServer::addr));
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        let out =
            run(&mut create).unwrap_or_else(|e| panic!("redis-cli --cluster create failed: {e}"));
        assert!(
            out.contains("All 16384 slots covered"),
            "redis-cli --cluster create did not cover every slot:\n{out}"
        );
        cluster.wait_ok(CLUSTER_OK_WITHIN);
        cluster
    }

    /// Waits until `CLUSTER INFO` says `cluster_state:ok` on every node.
    pub fn wait_ok(&self, limit: Duration) {
        let end = Instant::now() + limit;
        loop {
            let states: Vec<String> = self
                .nodes
                .iter()
                .map(|n| {
                    let info = n.try_cli(&["CLUSTER", "INFO"]).unwrap_or_default();
                    let state = info
                        .lines()
                        .find_map(|l| l.trim().strip_prefix("cluster_state:"))
                        .unwrap_or("no answer");
                    format!("{}: {state}", n.addr())
                })
                .collect();
            if states.iter().all(|s| s.ends_with(": ok")) {
                return;
            }
            assert!(
                Instant::now() < end,
                "the cluster is not ok on every node within {limit:?}: {states:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis://127.0.0.1:PORT` of every node, the seed list a cluster client starts from.
    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The seed URLs comma-separated, as `[store] url` takes them with `cluster = true`.
    pub fn url(&self) -> String {
        self.seed_urls().join(",")
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// One node, to stop, pause or restart it.
    pub fn node_mut(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// `redis-cli -c` (following MOVED and ASK redirections) through the first node that runs.
    pub fn cli(&self, args: &[&str]) -> String {
        let node = self
            .nodes
            .iter()
            .find(|n| n.pid().is_some())
            .expect("no cluster node is running");
        let mut c = vec!["-c"];
        c.extend_from_slice(args);
        node.cli(&c)
    }
}

/// Runs a command to completion: trimmed stdout, or an error with its exit status and stderr.
fn run(cmd: &mut Command) -> Result<String, String> {
    let out: Output = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "{}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            stdout
        ))
    }
}

/// A raw RESP `PING` on a fresh connection: true on `+PONG`, or `-NOAUTH` from a server with a password.
fn ping(port: u16) -> bool {
    let Ok(mut s) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"*1\r\n$4\r\nPING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(n) if n > 0 => buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"),
        _ => false,
    }
}
