#!/usr/bin/env python3
"""Writes the README's curl walk-through from what the built daemon answers.

    python3 scripts/walkthrough.py            # print the generated section
    python3 scripts/walkthrough.py --write    # put it into README.md, between the markers
    python3 scripts/walkthrough.py --check    # fail, with a diff, when README.md differs

It starts the daemon (``target/debug/admitd``, built with ``cargo build`` when missing, or
``$ADMITD_BIN``) on a free loopback port with the walk-through's ``admitd.toml``, sends each request
of the walk-through in order, and renders the text between ``<!-- walkthrough:begin -->`` and
``<!-- walkthrough:end -->`` in README.md: the prose, the curl commands (built from the very requests
sent, shown against the default port 9470) and the answers.

The rendered text is the same on every run. Values that depend on timing or randomness are shown as
placeholders in angle brackets (``<lease id>``, ``<ms>``, ``<n>``, ``<about 30>``); a placeholder that
stands for an expected size (``<about N>``) is checked against the real value first. The rest (tokens
left, ``Retry-After`` of a bucket refusal, the ``Wait N seconds`` of a refusal text) is exact, because
the walk-through's subject limit refills slowly, and the script checks that each timed stretch ran
within the window it needs; a run slowed past one (a loaded machine) is repeated with a new daemon.

To change the walk-through, edit this file and run it with ``--write``."""

from __future__ import annotations

import argparse
import difflib
import email.utils
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
README = os.path.join(ROOT, "README.md")
BEGIN = "<!-- walkthrough:begin -->"
END = "<!-- walkthrough:end -->"
SHOWN_PORT = 9470
# The shell variable every command of the walk-through sends to, set once at the start.
ADDR = "$ADMITD"
WIDTH = 120
ATTEMPTS = 3
# The longest a timed stretch may take for the numbers shown to hold. With a refill step T of 1333 ms
# and d the time since the stretch's first take, the loop's refusal is told T - d and the next one
# 2T - d, each plus up to 100 ms of jitter: `Retry-After: 3` needs d < 667 ms, the tokens left need
# d < T, and `<about 1300>` / `<about 2700>` (within 400 ms) need d < 400 ms. A held call waits T - d.
BURST_WINDOW = 0.35

# The walk-through's config, shown in the README as it is used. A subject refill of one token every
# 1.33 s keeps the exact numbers of the burst section the same on every run: the two refusals are
# told about 1.33 s and 2.67 s, far from a whole second, so `Retry-After` (rounded up) is 2 and 3,
# and a call held for the next token waits well inside the default `max_wait` of 2 s.
CONFIG = """\
[limits.subject]            # each agent credential (subject); the other keys keep their defaults
rate = "45/min"             # one token every 1.33 s: small numbers, so the burst runs out quickly
burst = 5

[tools.get_sales]
upstream = "warehouse"      # calls to get_sales spend the warehouse budget

[upstreams.warehouse]
rate = "20/s"               # per tenant (add shared = true for one budget across all tenants)
burst = 20
"""

# Headers left out of a shown answer: the clock, and a length that follows the masked numbers.
HIDDEN_HEADERS = ("date", "content-length")


class Disturbed(Exception):
    """A timed stretch of the walk-through took longer than its numbers allow: run it again."""


class Mismatch(Exception):
    """The daemon answered something the walk-through cannot show as it is written."""


# ---------------------------------------------------------------------------------------------
# Placeholders: what of an answer changes from run to run, and how it is shown.


class Masked:
    """A value shown as its placeholder, verbatim (no JSON quoting)."""

    def __init__(self, text: str):
        self.text = text


# A rule takes the real value and gives its placeholder text, or None to show the value as it is.
Rule = Callable[[Any], Optional[str]]


def always(label: str) -> Rule:
    return lambda value: label


def when_nonzero(label: str) -> Rule:
    """Timing shows only when there is any: `waited_ms: 0` (not held) is exact."""
    return lambda value: None if value == 0 else label


def about(expected: float, tolerance: float) -> Rule:
    """``<about N>``, after checking that the value is within ``tolerance`` of N."""

    def rule(value: Any) -> str:
        number = float(value)
        if abs(number - expected) > tolerance:
            raise Mismatch(f"expected about {expected:g} (within {tolerance:g}), got {value}")
        return f"<about {expected:g}>"

    return rule


def quoted(label: str) -> Rule:
    """For a string value: the placeholder keeps its quotes, so it still reads as a string."""
    return lambda value: f'"{label}"'


# Keys whose values depend on timing or randomness wherever they appear.
KEY_RULES: Dict[str, Rule] = {
    "lease_id": quoted("<lease id>"),
    "reset_ms": always("<ms>"),
    "retry_after_ms": when_nonzero("<ms>"),
    "waited_ms": when_nonzero("<ms>"),
    "tokens": always("<n>"),
    "resets_in_ms": always("<ms>"),
}

WAIT_TEXT = re.compile(r"\bWait (\d+) seconds?\b")


def wait_text(rule: Rule) -> Callable[[str], str]:
    """A text rule for the ``Wait N seconds`` of a refusal text."""

    def apply(text: str) -> str:
        def one(m: "re.Match[str]") -> str:
            shown = rule(int(m.group(1)))
            return m.group(0) if shown is None else f"Wait {shown} seconds"

        return WAIT_TEXT.sub(one, text)

    return apply


class Masks:
    """The placeholders for one answer: rules per JSON key and per header, and rewrites of texts."""

    def __init__(
        self,
        keys: Optional[Dict[str, Rule]] = None,
        headers: Optional[Dict[str, Rule]] = None,
        texts: Sequence[Callable[[str], str]] = (),
    ):
        self.keys = dict(KEY_RULES)
        self.keys.update(keys or {})
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        self.texts = list(texts)

    def value(self, key: Optional[str], value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.value(k, v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(None, v) for v in value]
        if key is not None and key in self.keys and not isinstance(value, bool):
            shown = self.keys[key](value)
            if shown is not None:
                return Masked(shown)
        if isinstance(value, str):
            for rewrite in self.texts:
                value = rewrite(value)
        return value

    def header(self, name: str, value: str) -> str:
        rule = self.headers.get(name.lower())
        shown = rule(value) if rule else None
        return value if shown is None else shown

    def line(self, text: str) -> str:
        """Masks ``"key":value`` pairs in a line of text that is not a whole JSON document."""

        def one(m: "re.Match[str]") -> str:
            key, raw = m.group(1), m.group(2)
            if key not in self.keys:
                return m.group(0)
            shown = self.keys[key](json.loads(raw))
            return m.group(0) if shown is None else f'"{key}":{shown}'

        text = re.sub(r'"(\w+)":(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|"(?:[^"\\]|\\.)*")', one, text)
        for rewrite in self.texts:
            text = rewrite(text)
        return text


def compact(value: Any) -> str:
    """JSON as the daemon writes it (no spaces), with placeholders verbatim."""
    if isinstance(value, Masked):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(compact(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def is_container(value: Any) -> bool:
    return isinstance(value, (dict, list)) and bool(value)


def pretty(value: Any, col: int = 0, pad: int = 0, width: int = WIDTH) -> str:
    """Compact JSON wrapped for reading. `col` is the column the value starts at, `pad` the indent of
    its parent's members. Members run on while they fit in `width` columns. An object that does not
    fit continues one column further in than its parent; an array's elements line up after its `[`,
    one object or array a line. An object or array of plain values only is broken only when that makes every line fit (a long
    text stays on one line rather than being split from its key's siblings)."""
    flat = compact(value)
    if not is_container(value) or col + len(flat) <= width:
        return flat
    if isinstance(value, dict):
        opening, closing, inner = "{", "}", pad + 1
        items = [(json.dumps(k) + ":", v) for k, v in value.items()]
    else:
        opening, closing, inner = "[", "]", col + 1
        items = [("", v) for v in value]
    lines = [opening]
    starts = [col]  # the column each line starts at
    for n, (label, v) in enumerate(items):
        tail = "," if n < len(items) - 1 else closing
        piece = label + compact(v) + tail
        at = starts[-1] + len(lines[-1])
        own_line = isinstance(value, list) and is_container(v) and lines[-1] != opening
        if (at + len(piece) <= width and not own_line) or (lines[-1] == opening and not is_container(v)):
            lines[-1] += piece
            continue
        if lines[-1] != opening:
            lines.append(" " * inner)
            starts.append(0)
            at = inner
            if at + len(piece) <= width or not is_container(v):
                lines[-1] += piece
                continue
        lines[-1] += label + pretty(v, at + len(label), inner, width) + tail
    broken = "\n".join(lines)
    if not any(is_container(v) for _, v in items):
        widest = max(s + len(l) for s, l in zip(starts, broken.split("\n")[: len(starts)]))
        if widest > width:
            return flat
    return broken


def show_json(body: str, masks: Masks) -> str:
    """The daemon's JSON body with its placeholders, wrapped; fails when the body is not the
    compact JSON the walk-through can show byte for byte (apart from where lines break)."""
    parsed = json.loads(body)
    if compact(parsed) != body:
        raise Mismatch(f"the body is not compact JSON this script reproduces exactly: {body}")
    return pretty(masks.value(None, parsed))


# ---------------------------------------------------------------------------------------------
# The daemon and the requests sent to it.


class Answer:
    def __init__(self, status: int, reason: str, headers: List[Tuple[str, str]], body: str):
        self.status, self.reason, self.headers, self.body = status, reason, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, binary: str, workdir: str):
        self.binary, self.workdir = binary, workdir
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    def start(self) -> None:
        for _ in range(5):
            self.port = free_port()
            log = open(os.path.join(self.workdir, "admitd.log"), "wb")
            self.proc = subprocess.Popen(
                [self.binary, "serve", "--config", "admitd.toml", "--listen", f"127.0.0.1:{self.port}"],
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if self.request("GET", "/healthz").status == 200:
                        return
                except (OSError, http.client.HTTPException):
                    time.sleep(0.05)
            self.stop()  # the port was taken meanwhile, or the daemon did not come up: once more
        with open(os.path.join(self.workdir, "admitd.log"), errors="replace") as f:
            raise RuntimeError(f"admitd did not start:\n{f.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def request(self, method: str, path: str, body: Optional[str] = None,
                headers: Sequence[Tuple[str, str]] = ()) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            sent = dict(headers)
            if body is not None:
                sent["content-type"] = "application/json"
            conn.request(method, path, body=body, headers=sent)
            r = conn.getresponse()
            return Answer(r.status, r.reason, r.getheaders(), r.read().decode())
        finally:
            conn.close()


def shell_quote_single(text: str) -> str:
    if "'" in text:
        raise ValueError(f"cannot show in single quotes: {text}")
    return f"'{text}'"


def curl_command(path: str, body: Optional[str] = None, headers: Sequence[Tuple[str, str]] = (),
                 flags: str = "-s", quoted_body: Optional[str] = None, tail: str = "") -> str:
    """The curl command that sends the request `Walk.send` sends, to the address in `$ADMITD`."""
    first = f"curl {flags} {ADDR}{path}"
    lines = [first]
    if body is not None or quoted_body is not None:
        lines[0] += " -H 'content-type: application/json'"
    lines += [f"-H {shell_quote_single(f'{k}: {v}')}" for k, v in headers]
    if quoted_body is not None:
        lines.append(f"-d {quoted_body}")
    elif body is not None:
        lines.append(f"-d {shell_quote_single(body)}")
    if tail:
        lines.append(tail)
    return " \\\n  ".join(lines)


def body_of(fields: Dict[str, Any]) -> str:
    return json.dumps(fields, separators=(",", ":"))


def with_lease(fields: Dict[str, Any]) -> str:
    """A body for `-d` in double quotes whose `lease_id` is the shell's `$lease`, as captured by
    `captured`, so that the command can be pasted as it stands."""
    body = body_of(dict(fields, lease_id="$lease"))
    return '"' + body.replace('"', '\\"') + '"'


def captured(command: str) -> str:
    """Runs `command`, shows its answer, and keeps the answer's `lease_id` in `$lease`."""
    return (f"out=$({command})\n"
            'echo "$out"\n'
            "lease=$(echo \"$out\" | grep -o '\"lease_id\":\"[^\"]*\"' | cut -d'\"' -f4)")


# ---------------------------------------------------------------------------------------------
# The walk-through itself.


class Walk:
    def __init__(self, daemon: Daemon, binary_shown: str):
        self.d = daemon
        self.bin = binary_shown
        self.parts: List[str] = []
        self.admits: Dict[str, int] = {}

    # -- output -----------------------------------------------------------------------------
    def text(self, paragraph: str) -> None:
        self.parts.append(paragraph.strip("\n") + "\n")

    def code(self, body: str, lang: str = "") -> None:
        self.parts.append(f"```{lang}\n{body.rstrip(chr(10))}\n```\n")

    def markdown(self) -> str:
        return "\n".join(self.parts)

    # -- requests ---------------------------------------------------------------------------
    def send(self, path: str, fields: Optional[Dict[str, Any]] = None, method: Optional[str] = None,
             headers: Sequence[Tuple[str, str]] = ()) -> Answer:
        body = None if fields is None else body_of(fields)
        if path == "/v1/admit" and fields:
            self.admits[fields["tenant"]] = self.admits.get(fields["tenant"], 0) + 1
        return self.d.request(method or ("GET" if body is None else "POST"), path, body, headers)

    @staticmethod
    def http(a: Answer, masks: Masks) -> str:
        """An answer as `curl -si` prints it, with the hidden headers left out."""
        lines = [f"HTTP/1.1 {a.status} {a.reason}"]
        lines += [f"{k}: {masks.header(k, v)}" for k, v in a.headers if k.lower() not in HIDDEN_HEADERS]
        return "\n".join(lines) + "\n\n" + show_json(a.body, masks)

    @staticmethod
    def with_status(a: Answer, masks: Masks) -> str:
        """An answer as `curl -s -w ' (HTTP %{http_code})\\n'` prints it: on one line."""
        show_json(a.body, masks)  # the same check that the body is shown as the daemon wrote it
        return compact(masks.value(None, a.json())) + f" (HTTP {a.status})"

    @staticmethod
    def expect(a: Answer, status: int, what: str) -> None:
        if a.status != status:
            raise Mismatch(f"{what}: expected HTTP {status}, got {a.status}: {a.body}")

    @staticmethod
    def within(since: float, limit: float, what: str) -> None:
        took = time.monotonic() - since
        if took > limit:
            raise Disturbed(f"{what} took {took:.2f} s, more than the {limit:.2f} s its numbers allow")

    # -- the sections -----------------------------------------------------------------------
    def run(self) -> str:
        self.start()
        self.burst()
        self.hold()
        self.upstream()
        self.look()
        return self.markdown()

    def start(self) -> None:
        check = subprocess.run([self.d.binary, "check", "--config", "admitd.toml"], cwd=self.d.workdir,
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise Mismatch(f"admitd check failed: {check.stdout}{check.stderr}")
        self.text(
            """
The outputs below are what the current build answers: `scripts/walkthrough.py` runs these requests
against it and writes this section (the tests check that it is up to date). Values in angle
brackets change from run to run, because they depend on timing or randomness: `<lease id>`,
`<ms>` (milliseconds), `<n>` (a count of tokens), `<about N>` (close to N). The `date` and
`content-length` headers are left out.

Write `admitd.toml`. Every other limit keeps its default: a tenant gets a bucket of 50 that refills
at 600/min and at most 32 calls in flight, a subject at most 8 calls in flight, and a global bucket
of 5000/s sits behind both. There are no daily quotas and no per-tool buckets.
""")
        self.code(CONFIG, "toml")
        self.text("Build the binary, check the file and start the daemon. Every command below sends to the\n"
                  "address in `ADMITD`: if port 9470 is taken, start admitd with `--listen 127.0.0.1:PORT`\n"
                  "and set `ADMITD=127.0.0.1:PORT` instead.")
        checked = "\n".join(f"# {line}" for line in check.stdout.strip().splitlines())
        self.code(f"cargo build --release\n{self.bin} check --config admitd.toml\n{checked}\n"
                  f"{self.bin} serve --config admitd.toml &\nADMITD=localhost:{SHOWN_PORT}", "sh")

    def burst(self) -> None:
        # Everything from the first admission to the refusal after the loop is timed: the numbers
        # shown exactly (tokens left, Retry-After 3) hold while it all takes under BURST_WINDOW.
        # The requests are sent first, and rendered once the window is known to have held.
        fields = {"tenant": "acme", "subject": "acme-bot", "tool": "search_docs", "call_id": "c-17"}
        trace = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
        loop = {"tenant": "acme", "subject": "acme-bot", "tool": "search_docs", "max_wait_ms": 0}
        pattern = '"(remaining|scope|retry_after_ms)":[^,]*'
        t0 = time.monotonic()
        first = self.send("/v1/admit", fields, headers=trace)
        self.expect(first, 200, "the first admission")
        release = {"lease_id": first.json()["lease_id"], "outcome": "ok", "duration_ms": 812}
        released = self.send("/v1/release", release)
        again = self.send("/v1/release", release)
        found = []
        for i in range(1, 6):
            a = self.send("/v1/admit", loop)
            if a.status == 200:
                self.expect(self.send("/v1/release", {"lease_id": a.json()["lease_id"], "outcome": "ok"}),
                            200, "a release in the loop")
            found.append(" ".join([str(i)] + [m.group(0) for m in re.finditer(pattern, a.body)][:2]))
        refused = self.send("/v1/admit", loop)
        self.within(t0, BURST_WINDOW, "the burst, from the first admission to the second refusal")
        self.expect(released, 200, "the release")
        self.expect(again, 404, "the second release")
        self.expect(refused, 429, "the refusal after the loop")

        self.text("### Admit a call\n\nThe answer is shown, and its `lease_id` kept in `$lease` for the release:")
        self.code(captured(curl_command("/v1/admit", body_of(fields), trace, "-si")), "sh")
        self.code(self.http(first, Masks()))
        self.text(
            """
The headers follow the IETF RateLimit headers draft (draft-ietf-httpapi-ratelimit-headers-11):

- `RateLimit-Policy` lists every bucket layer this call went through. `q` is the burst and `w` is
  the number of seconds a full refill takes.
- `RateLimit` names the tightest layer: the one with the fewest whole tokens left. `r` is tokens
  left and `t` is seconds until that bucket is full again.

`remaining`, `limit` and `reset_ms` in the body describe the same tightest layer. Every answer
of `/v1/admit` carries both headers, a 429 as well as a 200, and so does a 400 for a request whose
tenant, subject and tool are valid but whose other fields are not (a cost of 0, say): it describes
the layers that call would have passed, as they stand. Only a request without a valid key (a body
that is not JSON, a missing name, one over 64 KiB) has no layer to describe. The
`traceparent` header, if sent, becomes the parent of the admission span when OTLP export is on.

### Release it

After the tool ran, release the lease with the `lease_id` of the admission (`$lease`):
""")
        shown = with_lease(release)
        self.code(curl_command("/v1/release", quoted_body=shown), "sh")
        self.code(show_json(released.body, Masks()))
        self.text("Releasing the same lease twice gets a 404:")
        self.code(curl_command("/v1/release", quoted_body=shown, tail="-w ' (HTTP %{http_code})\\n'"), "sh")
        self.code(self.with_status(again, Masks()))

        self.text(
            """
### Use up the subject's burst

`max_wait_ms: 0` means "do not hold me". The loop releases every call it is granted. Without the
release, the subject's concurrency cap of 8 would refuse the ninth call first (scope `concurrency`).
""")
        self.code(
            "for i in $(seq 1 5); do\n"
            f"  out=$(curl -s {ADDR}/v1/admit -H 'content-type: application/json' \\\n"
            f"        -d '{body_of(loop)}')\n"
            "  lease=$(echo \"$out\" | grep -o '\"lease_id\":\"[^\"]*\"' | cut -d'\"' -f4)\n"
            f"  [ -n \"$lease\" ] && curl -s -o /dev/null {ADDR}/v1/release \\\n"
            "        -H 'content-type: application/json' -d \"{\\\"lease_id\\\":\\\"$lease\\\",\\\"outcome\\\":\\\"ok\\\"}\"\n"
            f"  echo \"$i\" $(echo \"$out\" | grep -oE '{pattern}' | head -2)\n"
            "done",
            "sh",
        )
        first_hint = Masks(keys={"retry_after_ms": about(1300, 400)})
        self.code("\n".join(first_hint.line(line) for line in found))
        self.text(
            """
The first call took one of the 5 tokens, so 4 were left for the loop; its fifth call is refused,
and told to come back when the next token arrives, about 1.3 s later. Ask once more, with headers:
""")
        second_hint = Masks(keys={"retry_after_ms": about(2700, 400)})
        self.code(curl_command("/v1/admit", body_of(loop), flags="-si"), "sh")
        self.code(self.http(refused, second_hint))
        self.text(
            """
The refusal's `tool_result` is a complete MCP tool result: the MCP server returns it to the model
unchanged. Its text gives the wait in whole seconds, says the arguments were fine and says not to
retry sooner.

This call was refused a moment after the loop's last call, and it was told about 2.7 s, not 1.3 s.
That is retry-hint staggering. Each refused caller is promised the next refill slot after the slots
already promised to earlier refused callers. Callers that wait as told therefore come back one at a
time, not all together. `Retry-After` is the hint rounded up to whole seconds.
""")

    def hold(self) -> None:
        big = {"tenant": "acme", "subject": "acme-etl", "tool": "export_orders", "cost": 5}
        held = {"tenant": "acme", "subject": "acme-etl", "tool": "export_orders"}
        over = {"tenant": "acme", "subject": "acme-etl", "tool": "export_orders", "cost": 6}
        t0 = time.monotonic()
        a = self.send("/v1/admit", big)
        self.within(t0, BURST_WINDOW, "the call of cost 5 and the start of the call held after it")
        b = self.send("/v1/admit", held)
        self.expect(a, 200, "the call of cost 5")
        self.expect(b, 200, "the held call")
        c = self.send("/v1/admit", over)
        self.expect(c, 429, "the oversized call")

        self.text(
            """
### Hold a call until a token arrives

A call that may wait (no `max_wait_ms`, so the server's `max_wait` of 2 s applies) is held when a
token will arrive within that time, then admitted. Another agent, `acme-etl`, spends its whole burst
on one call of cost 5, then asks again:
""")
        self.code(curl_command("/v1/admit", body_of(big)) + "\n" + curl_command("/v1/admit", body_of(held)), "sh")
        waited = Masks(keys={"waited_ms": about(1300, 400)})
        self.code(show_json(a.body, Masks()) + "\n" + show_json(b.body, waited))
        self.text(
            """
The second call was held until the next token arrived, one refill later, and then admitted; the MCP
server runs the tool as soon as the answer comes. A held call does not jump ahead of callers that
were refused and promised a slot: while such promises are outstanding on a bucket, a call that would
have to wait is refused instead, with the next free slot as its hint.

### An oversized call

If a call costs more than a bucket can ever hold, waiting will not help. admitd says so: the
response has no `Retry-After` header and `retryable` is false.
""")
        self.code(curl_command("/v1/admit", body_of(over), flags="-si"), "sh")
        self.code(self.http(c, Masks()))

    def upstream(self) -> None:
        self.text(
            """
### An upstream that answers 429

`get_sales` spends the `warehouse` budget. Admit a call of a third agent, `acme-report`: the
request names no upstream, so the tool's upstream is used, and a `tenant_upstream` layer appears in
the policy:
""")
        sales = {"tenant": "acme", "subject": "acme-report", "tool": "get_sales"}
        t0 = time.monotonic()
        a = self.send("/v1/admit", sales)
        self.expect(a, 200, "the get_sales admission")
        lease = a.json()["lease_id"]
        self.code(captured(curl_command("/v1/admit", body_of(sales), flags="-si")), "sh")
        self.code(self.http(a, Masks()))
        self.text("The warehouse answered 429 with `Retry-After: 30`. The MCP server reports that on release:")
        release = {"lease_id": lease, "outcome": "upstream_rate_limited", "upstream_status": 429,
                   "retry_after": "30", "duration_ms": 95}
        r = self.send("/v1/release", release)
        self.expect(r, 200, "the release with a 429")
        self.code(curl_command("/v1/release", quoted_body=with_lease(release)), "sh")
        self.code(show_json(r.body, Masks()))
        self.text(
            """
Until those 30 seconds are up, every call from this tenant that spends `warehouse` is refused before
it reaches the upstream, with scope `upstream_penalty`. That includes other tools that name
`warehouse`:
""")
        a = self.send("/v1/admit", sales)
        self.within(t0, 0.3, "the get_sales admission, its release and the refusal after it")
        self.expect(a, 429, "the call in the penalty box")
        if a.json().get("scope") != "upstream_penalty":
            raise Mismatch(f"expected scope upstream_penalty: {a.body}")
        penalty = Masks(keys={"retry_after_ms": about(30000, 1000)}, headers={"retry-after": about(30, 1)},
                        texts=[wait_text(about(30, 1))])
        self.code(curl_command("/v1/admit", body_of(sales), flags="-si"), "sh")
        self.code(self.http(a, penalty))
        other = {"tenant": "globex", "subject": "globex-bot", "tool": "get_sales"}
        g = self.send("/v1/admit", other)
        self.expect(g, 200, "the other tenant's get_sales")
        self.text(
            f"""
The 429 also halved the tenant's warehouse budget (`aimd_factor`, see
[How a call is decided](#how-a-call-is-decided)), which is why `w` went from 1 to 2. Other tenants
are not affected: a `globex` call to `get_sales` is admitted at the same moment. With
`shared = true` on the upstream, the penalty and the budget apply to every tenant.
""")
        self.code(curl_command("/v1/admit", body_of(other)), "sh")
        self.code(show_json(g.body, Masks()))

        # Reported outside a lease, with an HTTP-date 20 seconds from now: a date in the past would
        # set no penalty, which the refusal after it proves did not happen here.
        past = email.utils.formatdate(time.time() - 60, usegmt=True)
        stale = {"tenant": "hooli", "upstream": "warehouse", "status": 429, "retry_after": past}
        self.expect(self.send("/v1/feedback", stale), 202, "the feedback with a past date")
        check = self.send("/v1/admit", {"tenant": "hooli", "subject": "hooli-bot", "tool": "get_sales"})
        self.expect(check, 200, "a call after a feedback whose date is past (it sets no penalty)")
        when = email.utils.formatdate(time.time() + 20, usegmt=True)
        feedback = {"tenant": "globex", "upstream": "warehouse", "status": 429, "retry_after": when}
        f = self.send("/v1/feedback", feedback)
        self.expect(f, 202, "the feedback")
        shown = body_of(dict(feedback, retry_after="$when")).replace('"', '\\"')
        self.text(
            """
If the MCP server sees an upstream 429 outside a lease, it reports it with `POST /v1/feedback`.
`retry_after` may be delay-seconds, as on the release above, or an HTTP-date. A date must be in the
future: one already past sets no penalty. Here it is 20 seconds from now, and the next `globex`
call to `get_sales` is refused:
""")
        a = self.send("/v1/admit", other)
        self.expect(a, 429, "the call after the feedback")
        found = "\n".join(m.group(0) for m in list(re.finditer(r'"(scope|retry_after_ms)":[^,]*', a.body))[:2])
        self.code(
            "when=$(date -u -d '+20 seconds' '+%a, %d %b %Y %H:%M:%S GMT')   # GNU date\n"
            + curl_command("/v1/feedback", quoted_body=f'"{shown}"', tail="-w ' (HTTP %{http_code})\\n'")
            + "\n"
            + curl_command("/v1/admit", body_of(other), tail="| grep -oE '\"(scope|retry_after_ms)\":[^,]*' | head -2"),
            "sh",
        )
        self.code(self.with_status(f, Masks()) + "\n"
                  + Masks(keys={"retry_after_ms": about(20000, 1500)}).line(found))

    def look(self) -> None:
        self.text(
            """
### Look at the tenant

`GET /v1/tenants/acme` shows the tenant's buckets (tokens left per layer and key), its subjects and
calls in flight, the penalty and the warehouse budget's effective rate:
""")
        a = self.send("/v1/tenants/acme")
        self.expect(a, 200, "the tenant snapshot")
        self.code(curl_command("/v1/tenants/acme"), "sh")
        self.code(show_json(a.body, Masks(keys={"retry_after_ms": about(30000, 2000)})), "json")
        self.text(
            """
`acme-etl` still holds the two leases of its calls, which were never released: `inflight` counts
them until they are released or `lease_ttl` (5 minutes by default) passes. A tenant that holds no
state answers 404:
""")
        a = self.send("/v1/tenants/initech")
        self.expect(a, 404, "the unknown tenant")
        self.code(curl_command("/v1/tenants/initech", tail="-w ' (HTTP %{http_code})\\n'").replace(" \\\n  ", " "), "sh")
        self.code(self.with_status(a, Masks()))

        self.text(
            """
### Metrics

Every decision is counted in `admitd_admissions_total`, by tenant, subject, tool, upstream, decision
and scope (all metrics: [docs/metrics.md](docs/metrics.md)):
""")
        grep = r'^admitd_admissions_total\{tenant="acme"'
        lines = self.settled_metrics(grep, self.admits.get("acme", 0))
        self.code(f"curl -s {ADDR}/metrics | grep -E '{grep}' | sort", "sh")
        self.code("\n".join(lines))
        self.text("When you are done, stop the daemon with `kill %1`.")

    def settled_metrics(self, pattern: str, decisions: int) -> List[str]:
        """The matching lines of /metrics once every decision made is counted (they are counted off
        the request path, so a scrape may come a moment early)."""
        deadline = time.monotonic() + 10
        while True:
            a = self.send("/metrics")
            lines = sorted(l for l in a.body.splitlines() if re.search(pattern, l))
            counted = sum(float(l.rsplit(" ", 1)[1]) for l in lines)
            if counted == decisions:
                return lines
            if time.monotonic() > deadline:
                raise Mismatch(f"/metrics counts {counted:g} decisions, the walk-through made {decisions}")
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------


def binary() -> str:
    path = os.environ.get("ADMITD_BIN")
    if path:
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise SystemExit(f"ADMITD_BIN={path}: no such file")
        return path
    path = os.path.join(ROOT, "target", "debug", "admitd")
    if not os.path.isfile(path):
        print("target/debug/admitd is missing: cargo build", file=sys.stderr)
        subprocess.run(["cargo", "build"], cwd=ROOT, check=True)
    return path


def generate(bin_path: str) -> str:
    for attempt in range(1, ATTEMPTS + 1):
        workdir = tempfile.mkdtemp(prefix="admitd-walkthrough-")
        daemon = Daemon(bin_path, workdir)
        try:
            with open(os.path.join(workdir, "admitd.toml"), "w") as f:
                f.write(CONFIG)
            daemon.start()
            return Walk(daemon, "./target/release/admitd").run()
        except Disturbed as e:
            print(f"walk-through attempt {attempt} of {ATTEMPTS} disturbed: {e}", file=sys.stderr)
        finally:
            daemon.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    raise SystemExit(f"the walk-through was slowed past its timing windows {ATTEMPTS} times; "
                     "run it again on a less busy machine")


def splice(readme: str, section: str) -> str:
    """README with the text between the markers replaced by `section`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < 0 or end < start or readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise ValueError(f"README.md must hold {BEGIN} and then {END}, once each")
    return readme[: start + len(BEGIN)] + "\n" + section.rstrip("\n") + "\n" + readme[end:]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail with a diff when README.md differs")
    mode.add_argument("--write", action="store_true", help="write the section into README.md")
    args = parser.parse_args(argv)
    try:
        section = generate(binary())
    except (Mismatch, RuntimeError) as e:
        print(f"walk-through: {e}", file=sys.stderr)
        return 1
    if not (args.check or args.write):
        sys.stdout.write(section)
        return 0
    with open(README) as f:
        old = f.read()
    new = splice(old, section)
    if args.write:
        if new != old:
            with open(README, "w") as f:
                f.write(new)
        return 0
    if new != old:
        sys.stdout.writelines(difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), "README.md", "README.md (generated)"))
        print("README.md's walk-through differs from what the build answers: "
              "run python3 scripts/walkthrough.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
