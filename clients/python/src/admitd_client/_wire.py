"""What the blocking and the asyncio clients share: admitd's address, the request bodies, the
answers they turn into (``Decision``), the errors, and the refusal written when admitd is down.

Everything here is pure (no I/O), so both clients speak exactly the same wire contract."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Union

log = logging.getLogger("admitd_client")

DEFAULT_URL = "http://127.0.0.1:9470"
OUTCOMES = ("ok", "error", "upstream_rate_limited", "cancelled")

#: A ``Retry-After`` value as the upstream sent it (delay-seconds or an HTTP-date), or seconds.
RetryAfter = Union[str, int, float]


class AdmitdError(Exception):
    """admitd refused the request itself (400 ``invalid_request``, 413 ``body_too_large``, ...)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"admitd answered {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class AdmitdUnavailable(Exception):
    """admitd could not be reached, or answered 5xx. Raised by ``release``, ``feedback`` and
    ``tenant``; ``admit`` decides by ``fail_open`` instead."""


@dataclass
class Decision:
    """admitd's answer to ``POST /v1/admit``."""

    admitted: bool
    lease_id: Optional[str] = None
    waited_ms: int = 0
    mode: str = "enforce"
    #: Shed scope (``subject``, ``tenant_upstream``, ...); ``None`` when admitted.
    scope: Optional[str] = None
    retry_after_ms: int = 0
    retryable: bool = False
    #: The MCP ``CallToolResult`` (as JSON) to return to the model when the call was shed.
    tool_result: Optional[Dict[str, Any]] = None
    #: admitd was unavailable and the decision was made here (see ``fail_open``).
    degraded: bool = False
    #: The answer as admitd sent it (empty when ``degraded``).
    body: Dict[str, Any] = field(default_factory=dict)
    #: Response headers, lower-case names (``ratelimit``, ``ratelimit-policy``, ``retry-after``).
    headers: Dict[str, str] = field(default_factory=dict)
    #: Spend budgets (``[spend.*]``), per unit: ``{"usd": {"reserved": 0.05, "remaining": 0.93,
    #: "budget": "run"}}`` when admitted; on a ``spend`` refusal ``{"unit": ..., "budget": ...,
    #: "remaining": ...}``. Empty without spend budgets.
    spend: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Endpoint:
    """Where admitd listens: TCP ``host:port``, or a Unix socket path."""

    host: str = "127.0.0.1"
    port: int = 9470
    unix_path: Optional[str] = None

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        """``http://host[:port]`` or ``unix:/path/to/admitd.sock``."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "unix":
            if not parts.path or parts.netloc or parts.query or parts.fragment:
                raise ValueError(f"admitd Unix socket URL must be unix:/path/to.sock, not {url!r}")
            return cls(host="localhost", port=0, unix_path=parts.path)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"admitd URL must be http://host[:port] or unix:/path, not {url!r}")
        try:
            port = parts.port or 80
        except ValueError as e:
            raise ValueError(f"admitd URL has a bad port: {url!r}") from e
        return cls(host=parts.hostname, port=port)

    @property
    def host_header(self) -> str:
        if self.unix_path is not None:
            return "localhost"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path is not None else self.host_header


def auth_header(token: Optional[str]) -> Dict[str, str]:
    """The ``Authorization`` header for admitd's caller tokens (none without a token)."""
    if not token:
        return {}
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in token):
        raise ValueError("an admitd token is visible ASCII without spaces")
    return {"Authorization": f"Bearer {token}"}


def encode(body: Optional[Mapping[str, Any]]) -> Optional[bytes]:
    return None if body is None else json.dumps(body, separators=(",", ":")).encode()


def decode(status: int, raw: bytes) -> Any:
    """admitd's JSON answer. Every answer of admitd carries a JSON object, so anything else (an
    empty or truncated body, a proxy's page) means admitd did not answer: ``AdmitdUnavailable``."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        text = raw[:200].decode("utf-8", "replace")
        raise AdmitdUnavailable(f"the answer ({status}) is not admitd's JSON: {text!r}")
    return parsed


def admit_request(
    tenant: str,
    subject: str,
    tool: str,
    upstream: Optional[str],
    cost: Optional[float],
    max_wait_ms: Optional[float],
    call_id: Optional[str],
    traceparent: Optional[str],
    run: Optional[str] = None,
    spend: Optional[Mapping[str, float]] = None,
) -> Tuple[Dict[str, Any], Dict[str, str], float]:
    """The admission's body, headers, and how long admitd may hold it before it answers (s)."""
    body: Dict[str, Any] = {"tenant": tenant, "subject": subject, "tool": tool}
    for key, value in (
        ("upstream", upstream),
        ("cost", cost),
        ("max_wait_ms", max_wait_ms),
        ("call_id", call_id),
        ("run", run),
        ("spend", dict(spend) if spend else None),
    ):
        if value is not None:
            body[key] = value
    headers = {"traceparent": traceparent} if traceparent else {}
    # The server's own cap (2 s by default) bounds the hold when the caller names none.
    hold_s = max(0.0, max_wait_ms / 1000.0) if max_wait_ms is not None else 2.0
    return body, headers, hold_s


def decision(status: int, headers: Dict[str, str], answer: Any) -> Decision:
    """The ``Decision`` for a /v1/admit answer; raises ``AdmitdError`` for anything but 200/429."""
    if status == 200 and isinstance(answer, dict):
        return Decision(
            admitted=True,
            lease_id=answer.get("lease_id"),
            waited_ms=int(answer.get("waited_ms", 0)),
            mode=str(answer.get("mode", "enforce")),
            body=answer,
            headers=headers,
            spend=answer.get("spend") or {},
        )
    if status == 429 and isinstance(answer, dict):
        return Decision(
            admitted=False,
            scope=answer.get("scope"),
            retry_after_ms=int(answer.get("retry_after_ms", 0)),
            retryable=bool(answer.get("retryable", False)),
            tool_result=answer.get("tool_result"),
            body=answer,
            headers=headers,
            spend={k: answer[k] for k in ("unit", "budget", "remaining") if k in answer},
        )
    raise error(status, answer)


#: What a client does with a call while admitd cannot be reached: run it without a lease.
FAIL_OPEN = "fail_open"
#: ... or refuse it with a tool result that asks the model to wait ``unavailable_retry_s``.
FAIL_CLOSED = "fail_closed"


def unavailable_mode(on_unavailable: Optional[str], fail_open: Optional[bool]) -> str:
    """The client's choice: ``on_unavailable``, or the older ``fail_open`` flag; ``fail_open`` by
    default (see the package documentation for why)."""
    if on_unavailable is None:
        return FAIL_CLOSED if fail_open is False else FAIL_OPEN
    if on_unavailable not in (FAIL_OPEN, FAIL_CLOSED):
        raise ValueError(f"on_unavailable is {FAIL_OPEN!r} or {FAIL_CLOSED!r}, not {on_unavailable!r}")
    if fail_open is not None and fail_open != (on_unavailable == FAIL_OPEN):
        raise ValueError(f"fail_open={fail_open} contradicts on_unavailable={on_unavailable!r}")
    return on_unavailable


class Outage:
    """admitd being unreachable, seen from one client: counted and logged once per outage, not
    once per call (an outage during a burst would otherwise write a line for every call).

    ``outages`` counts the outages since the client was made, ``calls`` the admissions decided
    here, without admitd, over all of them, and ``since`` is when the current outage began
    (``time.monotonic()``), None while admitd answers. The first failed admission of an outage
    logs a warning naming the choice in force; the first answer after it logs how long it lasted
    and how many calls it touched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outages = 0
        self.calls = 0
        self.since: Optional[float] = None
        self._calls_now = 0

    def failed(self, mode: str, why: str) -> None:
        with self._lock:
            self.calls += 1
            self._calls_now += 1
            first = self.since is None
            if first:
                self.since = time.monotonic()
                self.outages += 1
        if first:
            what = "running calls without a lease" if mode == FAIL_OPEN else "refusing calls"
            log.warning("admitd unavailable (%s): %s until it answers again: %s", mode, what, why)
        else:
            log.debug("admitd still unavailable: %s", why)

    def answered(self) -> None:
        if self.since is None:
            return
        with self._lock:
            since, calls = self.since, self._calls_now
            self.since, self._calls_now = None, 0
        if since is not None:
            log.warning(
                "admitd answers again after %.1f s unavailable; %d calls were decided without it",
                time.monotonic() - since,
                calls,
            )


def degraded(fail_open: bool, unavailable_retry_s: int, why: str) -> Decision:
    """The decision made here when admitd cannot answer (logged by ``Outage``, once per outage)."""
    if fail_open:
        return Decision(admitted=True, degraded=True)
    return Decision(
        admitted=False,
        retry_after_ms=unavailable_retry_s * 1000,
        retryable=True,
        tool_result=unavailable_result(unavailable_retry_s),
        degraded=True,
    )


def unavailable_result(wait_s: int) -> Dict[str, Any]:
    text = (
        f"This tool is temporarily unavailable. Wait {wait_s} seconds, then retry this call with the "
        "same arguments; the arguments are fine. Do not retry sooner. Meanwhile, continue with what "
        "you already have and tell the user this result is pending."
    )
    return {
        "content": [{"type": "text", "text": text}],
        "structuredContent": {
            "error": "unavailable",
            "scope": None,
            "retry_after_ms": wait_s * 1000,
            "retryable": True,
        },
        "isError": True,
    }


def release_request(
    lease_id: str,
    outcome: str,
    upstream_status: Optional[int],
    retry_after: Optional[RetryAfter],
    duration_ms: Optional[float],
    spent: Optional[Mapping[str, float]] = None,
    cost: Optional[float] = None,
) -> Dict[str, Any]:
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, not {outcome!r}")
    body: Dict[str, Any] = {"lease_id": lease_id, "outcome": outcome}
    if upstream_status is not None:
        body["upstream_status"] = int(upstream_status)
    if retry_after is not None:
        body["retry_after"] = retry_after_value(retry_after)
    if duration_ms is not None and duration_ms == duration_ms:  # NaN never goes on the wire
        body["duration_ms"] = max(0, int(round(duration_ms)))
    if spent:
        body["spent"] = {unit: float(x) for unit, x in spent.items()}
    if cost is not None:
        body["cost"] = float(cost)
    return body


def feedback_request(
    tenant: str, upstream: str, status: int, retry_after: Optional[RetryAfter]
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"tenant": tenant, "upstream": upstream, "status": int(status)}
    if retry_after is not None:
        body["retry_after"] = retry_after_value(retry_after)
    return body


def tenant_path(tenant: str) -> str:
    return "/v1/tenants/" + urllib.parse.quote(tenant, safe="")


def retry_after_value(value: RetryAfter) -> RetryAfter:
    """A ``Retry-After`` header value as it came (text), or a number of seconds."""
    if isinstance(value, str):
        return value.strip()
    return value


def error(status: int, body: Any) -> AdmitdError:
    if isinstance(body, dict):
        return AdmitdError(status, str(body.get("error", "?")), str(body.get("message", "")))
    return AdmitdError(status, "?", str(body))


def outcome_of(e: BaseException) -> str:
    """The release outcome for a call that ended with ``e``."""
    if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, GeneratorExit)):
        return "cancelled"
    return "error"


class Call:
    """One admitted (or refused) call, from ``Admitd.call`` or ``AsyncAdmitd.call``."""

    def __init__(self, decision: Decision):
        self.decision = decision
        #: Overrides the outcome the block's end would choose (one of ``OUTCOMES``).
        self.outcome: Optional[str] = None
        self.upstream_status: Optional[int] = None
        self.retry_after: Optional[RetryAfter] = None
        #: What the call actually spent per spend unit, settled at its release (see
        #: ``report_spend``); units left out keep admitd's estimate.
        self.spent: Dict[str, float] = {}
        #: What the call actually cost in cost units (0 for a cache hit); None keeps the estimate.
        self.cost: Optional[float] = None
        self._started = time.monotonic()
        self._released = False

    @property
    def admitted(self) -> bool:
        return self.decision.admitted

    @property
    def tool_result(self) -> Optional[Dict[str, Any]]:
        """When refused: the ``CallToolResult`` (as JSON) to return to the model unchanged."""
        return self.decision.tool_result

    def upstream_response(self, status: int, retry_after: Optional[RetryAfter] = None) -> None:
        """Records what the upstream answered; a 429 is released as ``upstream_rate_limited``
        with its ``Retry-After``."""
        self.upstream_status = int(status)
        if retry_after is not None:
            self.retry_after = retry_after

    def report_spend(
        self, spent: Optional[Mapping[str, float]] = None, *, cost: Optional[float] = None, **units: float
    ) -> None:
        """Records what the call actually spent (``report_spend(tokens=1234, usd=0.013)``,
        added up over several reports) and, with ``cost``, its actual cost in cost units; its
        release settles them instead of the estimates."""
        for unit, x in {**dict(spent or {}), **units}.items():
            self.spent[unit] = self.spent.get(unit, 0.0) + float(x)
        if cost is not None:
            self.cost = float(cost)

    @property
    def spend(self) -> Dict[str, Any]:
        """Per spend unit what this call reserved and what its budgets have left (see
        ``Decision.spend``)."""
        return self.decision.spend

    def _release_body(self, default: str) -> Optional[Dict[str, Any]]:
        """The release to send once (None when there is no lease or it went already)."""
        lease = self.decision.lease_id
        if self._released or not self.decision.admitted or lease is None:
            return None
        self._released = True
        outcome = self.outcome or (
            "upstream_rate_limited" if self.upstream_status == 429 else default
        )
        return release_request(
            lease,
            outcome,
            self.upstream_status,
            self.retry_after,
            (time.monotonic() - self._started) * 1000.0,
            self.spent,
            self.cost,
        )
