#!/usr/bin/env python3
"""Writes the worked example of docs/operations.md ("Limits from observed traffic") from a real run.

    python3 scripts/advice_example.py            # print the generated section
    python3 scripts/advice_example.py --write    # put it into docs/operations.md, between the markers
    python3 scripts/advice_example.py --check    # fail, with a diff, when the section is stale

It starts the daemon (``target/debug/admitd``, built with ``cargo build`` when missing, or
``$ADMITD_BIN``) on a free loopback port in shadow mode with a first guess of limits that is too
tight, sends 14 seconds of traffic (20 ordinary agents, each a burst of 4 calls every 2 s, and one
runaway calling 20 times a second), runs ``admitd advise --over 10s`` against it and renders the
text between ``<!-- advice-example:begin -->`` and ``<!-- advice-example:end -->``.

The figures depend on timing (how many bursts fall in the 10 s, how long a release took), so
``--check`` compares the section with every number masked and the names each line lists sorted,
and holds the run itself to what the example claims: a subject rate of about twice the ordinary
agents' 2 calls a second, a burst of 4 to 8, and only the runaway refused under the proposal. A run
slowed past that (a loaded machine) is repeated with a new daemon.

To change the example, edit this file and run it with ``--write``."""

from __future__ import annotations

import argparse
import difflib
import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOC = os.path.join(ROOT, "docs", "operations.md")
BEGIN = "<!-- advice-example:begin -->"
END = "<!-- advice-example:end -->"
SHOWN_PORT = 9470
ATTEMPTS = 3
TOKEN = "example-admin-token"
AGENTS = 20
SECONDS = 14
OVER = "10s"

CONFIG = f"""\
[server]
mode = "shadow"             # watch first: every call is admitted, refusals are only reported
admin_token_sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"   # /v1/advice is an admin route

[limits.subject]            # the first guess, too tight for these agents
rate = "30/min"
burst = 2
"""


class Mismatch(Exception):
    pass


def binary() -> str:
    b = os.path.abspath(os.environ.get("ADMITD_BIN") or os.path.join(ROOT, "target", "debug", "admitd"))
    if not os.path.exists(b):
        subprocess.run(["cargo", "build"], cwd=ROOT, check=True)
    return b


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(conn: http.client.HTTPConnection, subject: str, run_ms: int) -> None:
    body = json.dumps({"tenant": "acme", "subject": subject, "tool": "search"})
    conn.request("POST", "/v1/admit", body, {"content-type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    lease = answer.get("lease_id")
    if lease:
        body = json.dumps({"lease_id": lease, "outcome": "ok", "duration_ms": run_ms})
        conn.request("POST", "/v1/release", body, {"content-type": "application/json"})
        conn.getresponse().read()


def traffic(port: int) -> None:
    start = time.monotonic()
    errors: List[BaseException] = []

    def agent(i: int) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            # Spread over the 2 s cycle; a burst begins 2 s after the previous one began, so a slow
            # machine stretches the cycle and never squeezes two bursts together.
            time.sleep(i * 2.0 / AGENTS)
            while time.monotonic() - start < SECONDS:
                began = time.monotonic()
                for _ in range(4):
                    call(conn, f"agent-{i + 1:02d}", 20)
                time.sleep(max(0.0, 2.0 - (time.monotonic() - began)))
        except BaseException as e:  # reported below
            errors.append(e)

    def runaway() -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            while time.monotonic() - start < SECONDS:
                call(conn, "runaway", 5)
                time.sleep(0.05)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    threads.append(threading.Thread(target=runaway))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"traffic failed: {errors[0]!r}")


def run_once(admitd: str) -> str:
    with tempfile.TemporaryDirectory() as workdir:
        with open(os.path.join(workdir, "admitd.toml"), "w") as f:
            f.write(CONFIG)
        port = free_port()
        log = open(os.path.join(workdir, "admitd.log"), "wb")
        proc = subprocess.Popen([admitd, "serve", "--config", "admitd.toml", "--listen", f"127.0.0.1:{port}"],
                                cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                    c.request("GET", "/healthz")
                    if c.getresponse().status == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the daemon did not start")
                time.sleep(0.05)
            traffic(port)
            out = subprocess.run([admitd, "advise", "--url", f"http://127.0.0.1:{port}", "--over", OVER,
                                  "--token", TOKEN], capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                raise RuntimeError(f"admitd advise failed: {out.stderr}")
            return out.stdout.replace(f"127.0.0.1:{port}", f"127.0.0.1:{SHOWN_PORT}")
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def holds(output: str) -> Optional[str]:
    """Why a run does not show what the example claims, or None."""
    m = re.search(r'^\[limits\.subject\][^\n]*\nrate = "(\d+)/min"\nburst = (\d+)$', output, re.M)
    if not m:
        return "no [limits.subject] proposal in the output"
    rate, burst = int(m.group(1)), int(m.group(2))
    if not 180 <= rate <= 330:
        return f"subject rate {rate}/min is not about 2 x the ordinary 120/min"
    if not 4 <= burst <= 8:
        return f"subject burst {burst} is not 4 to 8"
    if "# Replayed, the proposal would refuse 1 subjects: acme/runaway" not in output:
        return "the proposal's replay does not name the runaway alone"
    if f"# Replayed, the current config would refuse {AGENTS + 1} subjects" not in output:
        return "the current config's replay does not name every agent"
    return None


def section(output: str) -> str:
    return f"""{BEGIN}
<!-- Generated by scripts/advice_example.py from a real run; edit that file, not this section. -->
The daemon runs in shadow mode with a first guess that is too tight for its agents:

```toml
{CONFIG}```

For {SECONDS} seconds, {AGENTS} ordinary agents (`agent-01` to `agent-{AGENTS:02d}`) each make a burst
of 4 calls every 2 seconds, and one `runaway` calls 20 times a second; every call is released with
its duration. Then:

```console
$ admitd advise --url http://127.0.0.1:{SHOWN_PORT} --over {OVER} --token "$ADMIN_TOKEN"
{output.rstrip()}
```

The ordinary agents make 2 calls a second, so the proposed subject rate is about twice that, and
the burst is the 4 calls of one burst; the runaway is one subject in {AGENTS + 1} and does not move the
95th percentile. Replayed, the first guess would have refused every agent (the false positives
shadow mode exists to reveal) and the proposal refuses only the runaway. The figures differ a
little from run to run (how many bursts fall in the period); the tests check that this section is
what the current build answers, numbers aside.
{END}"""


def normal(text: str) -> str:
    """The section with every number masked and the names each summary line lists sorted."""
    lines = []
    for line in re.sub(r"\d+(\.\d+)?", "#", text).splitlines():
        head, sep, rest = line.partition(" subjects: ")
        if sep:
            rest, _, more = rest.partition(" and # more")
            line = head + sep + ", ".join(sorted(rest.split(", "))) + (" and # more" if more or _ else "")
        lines.append(line)
    return "\n".join(lines)


def generate(admitd: str) -> str:
    why = ""
    for _ in range(ATTEMPTS):
        output = run_once(admitd)
        why = holds(output) or ""
        if not why:
            return section(output)
    raise Mismatch(f"{ATTEMPTS} runs did not show what the example claims: {why}")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail with a diff when the section is stale")
    mode.add_argument("--write", action="store_true", help="write the section into docs/operations.md")
    args = parser.parse_args(argv)
    try:
        new = generate(binary())
    except (Mismatch, RuntimeError) as e:
        print(f"advice example: {e}", file=sys.stderr)
        return 1
    if not (args.check or args.write):
        sys.stdout.write(new + "\n")
        return 0
    with open(DOC) as f:
        doc = f.read()
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        print(f"advice example: {DOC} has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    old = doc[start:end + len(END)]
    if args.write:
        with open(DOC, "w") as f:
            f.write(doc[:start] + new + doc[end + len(END):])
        return 0
    if normal(old) != normal(new):
        diff = difflib.unified_diff(normal(old).splitlines(), normal(new).splitlines(), "documented",
                                    "this build", lineterm="")
        print("advice example: docs/operations.md is stale (numbers masked); run "
              "scripts/advice_example.py --write\n" + "\n".join(diff), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
