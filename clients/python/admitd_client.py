"""A client for admitd, for MCP servers written in Python.

Before a tool runs, ask admitd; after it ran, release the lease and report what the upstream said;
when admitd refuses, hand its ready-made tool result to the model instead of running the tool.
Standard library only (Python 3.9 or later); one module, to vendor or install as it is.

    from admitd_client import Admitd

    admitd = Admitd()                       # http://127.0.0.1:9470

    def get_sales(tenant, subject, region):
        with admitd.call(tenant, subject, "get_sales", upstream="warehouse") as call:
            if not call.admitted:
                return call.tool_result     # the CallToolResult for the model, unchanged
            resp = warehouse.query(region)
            call.upstream_response(resp.status, resp.headers.get("Retry-After"))
            return resp.body

Leaving the block releases the lease: outcome ``ok``, ``error`` when the block raised,
``cancelled`` when it was cancelled or interrupted, ``upstream_rate_limited`` when the upstream
answered 429 (its ``Retry-After`` then puts the upstream in admitd's penalty box). ``acall`` is the
same for ``async with``; the blocking HTTP calls then run in a worker thread, because admitd may hold
a call for up to its allowed wait before it answers.

If admitd cannot be reached (or answers 5xx), ``fail_open=True`` (the default) lets the call run
without a lease, marked ``degraded``; ``fail_open=False`` refuses it with a tool result that asks the
model to wait ``unavailable_retry_s`` seconds. Requests admitd itself rejects as malformed (400, 413)
raise ``AdmitdError``: they are bugs in the caller, not rate limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import math
import threading
import time
import urllib.parse
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, Iterator, Optional, Tuple, Union

__all__ = ["Admitd", "AdmitdError", "AdmitdUnavailable", "Call", "Decision", "OUTCOMES"]

log = logging.getLogger("admitd_client")

DEFAULT_URL = "http://127.0.0.1:9470"
OUTCOMES = ("ok", "error", "upstream_rate_limited", "cancelled")


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
    #: The MCP ``CallToolResult`` to return to the model when the call was shed.
    tool_result: Optional[Dict[str, Any]] = None
    #: admitd was unavailable and the decision was made here (see ``fail_open``).
    degraded: bool = False
    #: The answer as admitd sent it (empty when ``degraded``).
    body: Dict[str, Any] = field(default_factory=dict)
    #: Response headers, lower-case names (``ratelimit``, ``ratelimit-policy``, ``retry-after``).
    headers: Dict[str, str] = field(default_factory=dict)


def _unavailable_result(wait_s: int) -> Dict[str, Any]:
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


class _Connection(http.client.HTTPConnection):
    """A keep-alive connection that closes its socket when its thread is gone."""

    def __del__(self) -> None:
        self.close()


class Admitd:
    """A connection to one admitd. Safe to share between threads (one keep-alive connection each)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        timeout: float = 5.0,
        fail_open: bool = True,
        unavailable_retry_s: int = 5,
    ):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"admitd URL must be http://host[:port], not {url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self.timeout = timeout
        self.fail_open = fail_open
        self.unavailable_retry_s = max(1, int(unavailable_retry_s))
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: "weakref.WeakSet[http.client.HTTPConnection]" = weakref.WeakSet()

    def close(self) -> None:
        """Closes the keep-alive connections of every thread (a later request opens a new one)."""
        with self._lock:
            conns = list(self._open)
            self._open.clear()
        for conn in conns:
            conn.close()

    def __enter__(self) -> "Admitd":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- HTTP --------------------------------------------------------------------------------------

    def _connection(self) -> Tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = _Connection(self._host, self._port, timeout=self.timeout)
        self._local.conn = conn
        with self._lock:
            self._open.add(conn)
        return conn, False

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _request(
        self,
        method: str,
        path: str,
        body: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Tuple[int, Dict[str, str], Any]:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        for attempt in (1, 2):
            conn, reused = self._connection()
            conn.timeout = timeout or self.timeout
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, path, body=data, headers=hdrs)
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self._drop_connection()
                # A kept-alive connection the server had already closed: the request never got
                # there, so sending it once more on a new connection is safe.
                if reused and attempt == 1:
                    continue
                raise AdmitdUnavailable(f"admitd closed the connection: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection()
                raise AdmitdUnavailable(f"cannot reach admitd at {self._host}:{self._port}: {e}") from e
            if resp.getheader("connection", "").lower() == "close":
                self._drop_connection()
            answer_headers = {k.lower(): v for k, v in resp.getheaders()}
            try:
                parsed = json.loads(raw) if raw else {}
            except ValueError:
                parsed = {"error": "not_json", "message": raw[:200].decode("utf-8", "replace")}
            if resp.status >= 500:
                raise AdmitdUnavailable(f"admitd answered {resp.status}: {parsed}")
            return resp.status, answer_headers, parsed
        raise AssertionError("unreachable")

    @staticmethod
    def _error(status: int, body: Any) -> AdmitdError:
        if isinstance(body, dict):
            return AdmitdError(status, str(body.get("error", "?")), str(body.get("message", "")))
        return AdmitdError(status, "?", str(body))

    # ---- the API -----------------------------------------------------------------------------------

    def admit(
        self,
        tenant: str,
        subject: str,
        tool: str,
        *,
        upstream: Optional[str] = None,
        cost: Optional[float] = None,
        max_wait_ms: Optional[float] = None,
        call_id: Optional[str] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Asks whether the call may run. ``subject`` must come from the validated credential, never
        from anything the model wrote. Pass the incoming request's W3C ``traceparent`` to join the
        caller's trace."""
        body: Dict[str, Any] = {"tenant": tenant, "subject": subject, "tool": tool}
        for key, value in (
            ("upstream", upstream),
            ("cost", cost),
            ("max_wait_ms", max_wait_ms),
            ("call_id", call_id),
        ):
            if value is not None:
                body[key] = value
        headers = {"traceparent": traceparent} if traceparent else {}
        # admitd may hold the call for its allowed wait before it answers.
        wait_s = (max_wait_ms / 1000.0) if max_wait_ms is not None else 2.0
        timeout = self.timeout + max(0.0, wait_s)
        try:
            status, hdrs, answer = self._request("POST", "/v1/admit", body, headers, timeout)
        except AdmitdUnavailable as e:
            return self._degraded(str(e))
        if status == 200:
            return Decision(
                admitted=True,
                lease_id=answer.get("lease_id"),
                waited_ms=int(answer.get("waited_ms", 0)),
                mode=answer.get("mode", "enforce"),
                body=answer,
                headers=hdrs,
            )
        if status == 429:
            return Decision(
                admitted=False,
                scope=answer.get("scope"),
                retry_after_ms=int(answer.get("retry_after_ms", 0)),
                retryable=bool(answer.get("retryable", False)),
                tool_result=answer.get("tool_result"),
                body=answer,
                headers=hdrs,
            )
        raise self._error(status, answer)

    def _degraded(self, why: str) -> Decision:
        if self.fail_open:
            log.warning("admitd unavailable, running the call without a lease: %s", why)
            return Decision(admitted=True, degraded=True)
        log.warning("admitd unavailable, refusing the call: %s", why)
        wait = self.unavailable_retry_s
        return Decision(
            admitted=False,
            retry_after_ms=wait * 1000,
            retryable=True,
            tool_result=_unavailable_result(wait),
            degraded=True,
        )

    def release(
        self,
        lease_id: str,
        outcome: str = "ok",
        *,
        upstream_status: Optional[int] = None,
        retry_after: Union[str, int, float, None] = None,
        duration_ms: Optional[float] = None,
    ) -> bool:
        """Releases a lease. ``retry_after`` is the upstream's ``Retry-After`` value as it came
        (delay-seconds or an HTTP-date). True when released, False when admitd no longer knew the
        lease (released already, or expired after ``lease_ttl``)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, not {outcome!r}")
        body: Dict[str, Any] = {"lease_id": lease_id, "outcome": outcome}
        if upstream_status is not None:
            body["upstream_status"] = int(upstream_status)
        if retry_after is not None:
            body["retry_after"] = _retry_after(retry_after)
        if duration_ms is not None:
            body["duration_ms"] = max(0, int(round(duration_ms)))
        status, _, answer = self._request("POST", "/v1/release", body)
        if status == 200:
            return True
        if status == 404:
            return False
        raise self._error(status, answer)

    def feedback(
        self,
        tenant: str,
        upstream: str,
        status: int,
        retry_after: Union[str, int, float, None] = None,
    ) -> None:
        """Reports an upstream answer seen outside a lease (a 429 starts the penalty box)."""
        body: Dict[str, Any] = {"tenant": tenant, "upstream": upstream, "status": int(status)}
        if retry_after is not None:
            body["retry_after"] = _retry_after(retry_after)
        code, _, answer = self._request("POST", "/v1/feedback", body)
        if code != 202:
            raise self._error(code, answer)

    def tenant(self, tenant: str) -> Optional[Dict[str, Any]]:
        """The tenant's snapshot (buckets, in-flight calls, quota, penalties), or None when admitd
        holds no state for it."""
        path = "/v1/tenants/" + urllib.parse.quote(tenant, safe="")
        status, _, answer = self._request("GET", path)
        if status == 200:
            return answer
        if status == 404:
            return None
        raise self._error(status, answer)

    # ---- one call, start to end --------------------------------------------------------------------

    @contextlib.contextmanager
    def call(self, tenant: str, subject: str, tool: str, **admit_args: Any) -> Iterator["Call"]:
        """Admits the call, and releases it when the block ends (see the module documentation)."""
        c = Call(self, self.admit(tenant, subject, tool, **admit_args))
        try:
            yield c
        except BaseException as e:
            c._finish(_outcome_of(e))
            raise
        c._finish("ok")

    async def admit_async(self, *args: Any, **kwargs: Any) -> Decision:
        return await asyncio.to_thread(self.admit, *args, **kwargs)

    async def release_async(self, *args: Any, **kwargs: Any) -> bool:
        return await asyncio.to_thread(self.release, *args, **kwargs)

    async def feedback_async(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.to_thread(self.feedback, *args, **kwargs)

    @contextlib.asynccontextmanager
    async def acall(
        self, tenant: str, subject: str, tool: str, **admit_args: Any
    ) -> AsyncIterator["Call"]:
        """``call`` for ``async with``."""
        c = Call(self, await self.admit_async(tenant, subject, tool, **admit_args))
        try:
            yield c
        except BaseException as e:
            # Shielded: a cancelled task still gives its slot back.
            await asyncio.shield(asyncio.to_thread(c._finish, _outcome_of(e)))
            raise
        await asyncio.to_thread(c._finish, "ok")


def _retry_after(value: Union[str, int, float]) -> Union[str, int, float]:
    """A ``Retry-After`` header value as it came (text), or a number of seconds."""
    if isinstance(value, str):
        return value.strip()
    return value


def _outcome_of(e: BaseException) -> str:
    if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, GeneratorExit)):
        return "cancelled"
    return "error"


class Call:
    """One admitted (or refused) call, from ``Admitd.call`` or ``Admitd.acall``."""

    def __init__(self, admitd: Admitd, decision: Decision):
        self.admitd = admitd
        self.decision = decision
        #: Overrides the outcome the block's end would choose (one of ``OUTCOMES``).
        self.outcome: Optional[str] = None
        self._status: Optional[int] = None
        self._retry_after: Union[str, int, float, None] = None
        self._started = time.monotonic()
        self._released = False

    @property
    def admitted(self) -> bool:
        return self.decision.admitted

    @property
    def tool_result(self) -> Optional[Dict[str, Any]]:
        """When refused: the ``CallToolResult`` to return to the model unchanged."""
        return self.decision.tool_result

    def upstream_response(
        self, status: int, retry_after: Union[str, int, float, None] = None
    ) -> None:
        """Records what the upstream answered; a 429 is released as ``upstream_rate_limited``
        with its ``Retry-After``."""
        self._status = int(status)
        if retry_after is not None:
            self._retry_after = retry_after

    def _finish(self, default: str) -> None:
        lease = self.decision.lease_id
        if self._released or not self.decision.admitted or lease is None:
            return
        self._released = True
        outcome = self.outcome or ("upstream_rate_limited" if self._status == 429 else default)
        duration_ms = (time.monotonic() - self._started) * 1000.0
        try:
            released = self.admitd.release(
                lease,
                outcome,
                upstream_status=self._status,
                retry_after=self._retry_after,
                duration_ms=duration_ms if math.isfinite(duration_ms) else None,
            )
            if not released:
                log.info("admitd no longer knew lease %s (expired after lease_ttl?)", lease)
        except (AdmitdError, AdmitdUnavailable) as e:
            # The tool's own result or error matters more; the lease expires after lease_ttl.
            log.warning("could not release lease %s: %s", lease, e)
