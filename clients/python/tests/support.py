"""What the tests share: the real admitd binary (``ADMITD_BIN``, default ``target/debug/admitd``)
on a free port, and MCP servers started as their own processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import unittest
from typing import List, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BIN = os.environ.get("ADMITD_BIN", os.path.join(ROOT, "target", "debug", "admitd"))
HERE = os.path.dirname(os.path.abspath(__file__))


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def require_binary() -> None:
    if not os.access(BIN, os.X_OK):
        if "ADMITD_BIN" in os.environ:
            raise RuntimeError(f"ADMITD_BIN={BIN} is not an executable")
        raise unittest.SkipTest(f"no admitd binary at {BIN} (cargo build, or set ADMITD_BIN)")


def require_sdk(module: str) -> None:
    """Skips without the SDK, unless the test command asks for every test to run."""
    try:
        __import__(module)
    except ImportError:
        if os.environ.get("ADMITD_REQUIRE_SDKS") == "1":
            raise
        raise unittest.SkipTest(f"{module} is not installed (pip install './clients/python[{module}]')")


class _Process:
    """A child process whose first stderr line starting with ``marker`` names its address."""

    def __init__(self, argv: List[str], marker: str, env: Optional[dict] = None):
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        found = threading.Event()
        self.addr: Optional[str] = None
        self.log: List[str] = []

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                if line.startswith(marker) and self.addr is None:
                    self.addr = line[len(marker) :].strip()
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(60):
            self.stop()
            raise RuntimeError(f"{argv[0]} did not start:\n" + "".join(self.log[-30:]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


class Daemon(_Process):
    """admitd with the given config, on a free port (or a Unix socket), until ``stop``."""

    def __init__(self, config: str, extra_args: Optional[List[str]] = None):
        self.dir = tempfile.TemporaryDirectory()
        path = os.path.join(self.dir.name, "admitd.toml")
        with open(path, "w") as f:
            f.write(config)
        args = extra_args if extra_args is not None else ["--listen", "127.0.0.1:0"]
        super().__init__([BIN, "serve", "--config", path, *args], "admitd listening on ")
        assert self.addr is not None
        self.url = self.addr if self.addr.startswith("unix:") else "http://" + self.addr

    def stop(self) -> None:
        super().stop()
        self.dir.cleanup()


class McpServer(_Process):
    """``tests/servers/NAME.py`` serving MCP over streamable HTTP, asking the given admitd."""

    def __init__(self, name: str, admitd_url: str):
        script = os.path.join(HERE, "servers", name + ".py")
        super().__init__([sys.executable, script, admitd_url], "serving on ")
        assert self.addr is not None
        self.base = "http://" + self.addr
        self.url = self.base + "/mcp"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nginx_binary() -> Optional[str]:
    import shutil

    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


class Nginx:
    """A real nginx running ``deploy/nginx/admitd-edge.conf`` unchanged but for the addresses of
    admitd, the MCP server and its own port, with every path in a temp dir, until ``stop``."""

    def __init__(self, admitd_url: str, upstream: str):
        binary = nginx_binary()
        if binary is None:
            raise unittest.SkipTest("no nginx binary (apt-get install nginx-light; scripts/test.sh does)")
        self.dir = tempfile.TemporaryDirectory()
        p = self.dir.name
        self.port = closed_port()
        conf = read(os.path.join(ROOT, "deploy", "nginx", "admitd-edge.conf"))
        for example, here in [
            ("server 127.0.0.1:9470;", "server %s;" % admitd_url.removeprefix("http://")),
            ("server 127.0.0.1:8000;", "server %s;" % upstream),
            ("listen 8080;", "listen 127.0.0.1:%d;" % self.port),
        ]:
            if conf.count(example) != 1:
                raise AssertionError(f"{example} is not in the shipped config exactly once")
            conf = conf.replace(example, here)
        with open(os.path.join(p, "admitd-edge.conf"), "w") as f:
            f.write(conf)
        temps = "".join(f"  {k}_temp_path {p}/{k};\n" for k in ["proxy", "fastcgi", "uwsgi", "scgi"])
        with open(os.path.join(p, "nginx.conf"), "w") as f:
            f.write(
                f"worker_processes 1;\npid {p}/nginx.pid;\nerror_log {p}/error.log info;\n"
                "events { worker_connections 256; }\n"
                f"http {{\n  access_log {p}/access.log;\n  client_body_temp_path {p}/body;\n{temps}"
                f"  include {p}/admitd-edge.conf;\n}}\n"
            )
        self.proc = subprocess.Popen(
            [binary, "-p", p, "-c", f"{p}/nginx.conf", "-e", f"{p}/error.log",
             "-g", "daemon off; master_process off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import time

        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("nginx did not start")
                time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/mcp"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.dir.cleanup()
