"""The blocking client: one keep-alive ``http.client`` connection per thread."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import weakref
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from . import _wire
from ._wire import (
    DEFAULT_URL,
    AdmitdError,
    AdmitdUnavailable,
    Call,
    Decision,
    Endpoint,
    RetryAfter,
    log,
)

# Errors that, raised before the first byte of an answer, mean the server closed the
# connection without answering.
_CLOSED_UNANSWERED = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
)


class _Connection(http.client.HTTPConnection):
    """A keep-alive connection to admitd over TCP or a Unix socket, with its own connect
    timeout, that closes its socket when its thread is gone."""

    def __init__(self, endpoint: Endpoint, connect_timeout: float):
        super().__init__(endpoint.host, endpoint.port, timeout=connect_timeout)
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        #: Whether an answer came back on this connection already (it was kept alive).
        self.answered = False

    def connect(self) -> None:
        if self.endpoint.unix_path is None:
            self.sock = socket.create_connection(
                (self.host, self.port), self.connect_timeout
            )
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.endpoint.unix_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def __del__(self) -> None:
        self.close()


class Admitd:
    """A blocking client of one admitd. Safe to share between threads (one keep-alive
    connection each).

    ``url`` is ``http://host:port`` or ``unix:/path/to/admitd.sock``; ``token`` is sent as
    ``Authorization: Bearer`` when admitd requires caller tokens. ``connect_timeout`` bounds
    reaching admitd (short: it runs beside the server, and ``on_unavailable`` should decide quickly);
    ``timeout`` bounds each answer, on top of the wait admitd may hold an admission for."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        timeout: float = 2.0,
        connect_timeout: float = 0.5,
        on_unavailable: Optional[str] = None,
        fail_open: Optional[bool] = None,
        unavailable_retry_s: int = 5,
        token: Optional[str] = None,
    ):
        self.endpoint = Endpoint.parse(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.on_unavailable = _wire.unavailable_mode(on_unavailable, fail_open)
        self.fail_open = self.on_unavailable == _wire.FAIL_OPEN
        #: admitd's outages as this client saw them (``outages``, ``calls``, ``since``).
        self.outage = _wire.Outage()
        self.unavailable_retry_s = max(1, int(unavailable_retry_s))
        self._auth = _wire.auth_header(token)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: "weakref.WeakSet[_Connection]" = weakref.WeakSet()

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

    def _connection(self) -> _Connection:
        conn: Optional[_Connection] = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        conn = _Connection(self.endpoint, self.connect_timeout)
        self._local.conn = conn
        with self._lock:
            self._open.add(conn)
        return conn

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
        hold_s: float = 0.0,
    ) -> Tuple[int, Dict[str, str], Any]:
        data = _wire.encode(body)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(self._auth)
        hdrs.update(headers or {})
        for attempt in (1, 2):
            conn = self._connection()
            kept_alive = conn.answered
            try:
                if conn.sock is None:
                    conn.connect()
                assert conn.sock is not None
                conn.sock.settimeout(self.timeout + hold_s)
                conn.request(method, path, body=data, headers=hdrs)
                resp = conn.getresponse()
            except _CLOSED_UNANSWERED as e:
                self._drop_connection()
                # The server closed a kept-alive connection before answering this request (an
                # idle timeout, a restart, or an earlier request's early 4xx): nothing was
                # answered, so nothing was counted, and sending it once more is safe.
                if kept_alive and attempt == 1:
                    continue
                raise AdmitdUnavailable(f"admitd closed the connection: {e!r}") from e
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection()
                raise AdmitdUnavailable(f"cannot reach admitd at {self.endpoint}: {e!r}") from e
            # Part of an answer came: from here on, a failure is never retried.
            try:
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection()
                raise AdmitdUnavailable(f"admitd's answer was cut off: {e!r}") from e
            conn.answered = True
            if resp.will_close:
                self._drop_connection()
            answer_headers = {k.lower(): v for k, v in resp.getheaders()}
            try:
                parsed = _wire.decode(resp.status, raw)
            except AdmitdUnavailable:
                self._drop_connection()
                raise
            if resp.status >= 500:
                raise AdmitdUnavailable(f"admitd answered {resp.status}: {parsed}")
            return resp.status, answer_headers, parsed
        raise AssertionError("unreachable: the second attempt returns or raises")

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
        run: Optional[str] = None,
        spend: Optional[Mapping[str, float]] = None,
    ) -> Decision:
        """Asks whether the call may run. ``subject`` must come from the validated credential, never
        from anything the model wrote. Pass the incoming request's W3C ``traceparent`` to join the
        caller's trace."""
        body, headers, hold_s = _wire.admit_request(
            tenant, subject, tool, upstream, cost, max_wait_ms, call_id, traceparent, run, spend
        )
        try:
            status, hdrs, answer = self._request("POST", "/v1/admit", body, headers, hold_s)
        except AdmitdUnavailable as e:
            self.outage.failed(self.on_unavailable, str(e))
            return _wire.degraded(self.fail_open, self.unavailable_retry_s, str(e))
        self.outage.answered()
        return _wire.decision(status, hdrs, answer)

    def release(
        self,
        lease_id: str,
        outcome: str = "ok",
        *,
        upstream_status: Optional[int] = None,
        retry_after: Optional[RetryAfter] = None,
        duration_ms: Optional[float] = None,
        spent: Optional[Mapping[str, float]] = None,
        cost: Optional[float] = None,
    ) -> bool:
        """Releases a lease. ``retry_after`` is the upstream's ``Retry-After`` value as it came
        (delay-seconds or an HTTP-date). True when released, False when admitd no longer knew the
        lease (released already, or expired after ``lease_ttl``)."""
        body = _wire.release_request(
            lease_id, outcome, upstream_status, retry_after, duration_ms, spent, cost
        )
        return self._release(body)

    def _release(self, body: Dict[str, Any]) -> bool:
        status, _, answer = self._request("POST", "/v1/release", body)
        if status == 200:
            return True
        if status == 404:
            return False
        raise _wire.error(status, answer)

    def feedback(
        self, tenant: str, upstream: str, status: int, retry_after: Optional[RetryAfter] = None
    ) -> None:
        """Reports an upstream answer seen outside a lease (a 429 starts the penalty box)."""
        body = _wire.feedback_request(tenant, upstream, status, retry_after)
        code, _, answer = self._request("POST", "/v1/feedback", body)
        if code != 202:
            raise _wire.error(code, answer)

    def tenant(self, tenant: str) -> Optional[Dict[str, Any]]:
        """The tenant's snapshot (buckets, in-flight calls, quota, penalties), or None when admitd
        holds no state for it."""
        status, _, answer = self._request("GET", _wire.tenant_path(tenant))
        if status == 200:
            return answer  # type: ignore[no-any-return]
        if status == 404:
            return None
        raise _wire.error(status, answer)

    # ---- one call, start to end --------------------------------------------------------------------

    @contextlib.contextmanager
    def call(self, tenant: str, subject: str, tool: str, **admit_args: Any) -> Iterator[Call]:
        """Admits the call, and releases it when the block ends: outcome ``ok``, ``error`` when
        the block raised, ``cancelled`` when it was interrupted, ``upstream_rate_limited`` when
        ``call.upstream_response`` recorded a 429."""
        c = Call(self.admit(tenant, subject, tool, **admit_args))
        try:
            yield c
        except BaseException as e:
            self._finish(c, _wire.outcome_of(e))
            raise
        self._finish(c, "ok")

    def _finish(self, call: Call, default: str) -> None:
        body = call._release_body(default)
        if body is None:
            return
        try:
            if not self._release(body):
                log.info("admitd no longer knew lease %s (expired after lease_ttl?)", body["lease_id"])
        except (AdmitdError, AdmitdUnavailable) as e:
            # The tool's own result or error matters more; the lease expires after lease_ttl.
            log.warning("could not release lease %s: %s", body["lease_id"], e)
