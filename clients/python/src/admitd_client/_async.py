"""The asyncio client: HTTP/1.1 over asyncio streams, with a small pool of keep-alive
connections. A call admitd holds for capacity waits on its socket in the event loop, so any
number of held calls costs no thread."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Set, Tuple

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

# Answers are small JSON bodies; anything bigger is not admitd.
_MAX_BODY = 1 << 20


class _ClosedUnanswered(Exception):
    """The connection ended before the first byte of an answer."""


class _CutOff(Exception):
    """The connection ended, or went wrong, after an answer had begun."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        #: Whether an answer came back on this connection already (it was kept alive).
        self.answered = False

    def close(self) -> None:
        self.writer.close()


class AsyncAdmitd:
    """An asyncio client of one admitd; use it from one event loop.

    ``url`` is ``http://host:port`` or ``unix:/path/to/admitd.sock``; ``token`` is sent as
    ``Authorization: Bearer`` when admitd requires caller tokens. ``connect_timeout`` bounds
    reaching admitd (short, so that ``on_unavailable`` decides quickly); ``timeout`` bounds each answer,
    on top of the wait admitd may hold an admission for. At most ``max_idle`` connections are kept
    open between requests."""

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
        max_idle: int = 16,
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
        self.max_idle = max_idle
        self._idle: List[_Conn] = []
        # Releases that outlive a cancelled caller: held here until they finish.
        self._background: Set["asyncio.Task[None]"] = set()

    async def aclose(self) -> None:
        """Waits for pending releases and closes the idle connections."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()

    async def __aenter__(self) -> "AsyncAdmitd":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ---- HTTP --------------------------------------------------------------------------------------

    async def _open(self) -> _Conn:
        ep = self.endpoint
        if ep.unix_path is not None:
            opening = asyncio.open_unix_connection(ep.unix_path)
        else:
            opening = asyncio.open_connection(ep.host, ep.port)
        reader, writer = await asyncio.wait_for(opening, self.connect_timeout)
        return _Conn(reader, writer)

    async def _request(
        self,
        method: str,
        path: str,
        body: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        hold_s: float = 0.0,
    ) -> Tuple[int, Dict[str, str], Any]:
        data = _wire.encode(body)
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.endpoint.host_header}"]
        if data is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        head += [f"{k}: {v}" for k, v in {**self._auth, **(headers or {})}.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (data or b"")
        for attempt in (1, 2):
            conn = self._idle.pop() if self._idle else None
            try:
                if conn is None:
                    conn = await self._open()
                conn.writer.write(request)
                status, hdrs, raw, keep = await asyncio.wait_for(
                    self._read_answer(conn), self.timeout + hold_s
                )
            except (_ClosedUnanswered, ConnectionResetError, BrokenPipeError) as e:
                if conn is not None:
                    conn.close()
                # The server closed a kept-alive connection before answering this request (an
                # idle timeout, a restart, or an earlier request's early 4xx): nothing was
                # answered, so nothing was counted, and sending it once more is safe.
                if conn is not None and conn.answered and attempt == 1:
                    continue
                raise AdmitdUnavailable(f"admitd closed the connection: {e!r}") from e
            except (OSError, asyncio.TimeoutError, ValueError, _CutOff) as e:
                if conn is not None:
                    conn.close()
                raise AdmitdUnavailable(f"cannot reach admitd at {self.endpoint}: {e!r}") from e
            except BaseException:
                # Cancelled mid-request: the connection's state is unknown, so it is not reused.
                if conn is not None:
                    conn.close()
                raise
            conn.answered = True
            if keep and len(self._idle) < self.max_idle:
                self._idle.append(conn)
            else:
                conn.close()
            parsed = _wire.decode(status, raw)
            if status >= 500:
                raise AdmitdUnavailable(f"admitd answered {status}: {parsed}")
            return status, hdrs, parsed
        raise AssertionError("unreachable: the second attempt returns or raises")

    @staticmethod
    async def _read_answer(conn: _Conn) -> Tuple[int, Dict[str, str], bytes, bool]:
        r = conn.reader
        await conn.writer.drain()
        try:
            line = await r.readline()
        except (ConnectionResetError, BrokenPipeError) as e:
            raise _ClosedUnanswered(repr(e)) from e
        if not line:
            raise _ClosedUnanswered("end of stream before the status line")
        # Part of an answer came: from here on, a failure is never retried.
        try:
            return await AsyncAdmitd._read_rest(r, line)
        except (OSError, asyncio.IncompleteReadError) as e:
            raise _CutOff(repr(e)) from e

    @staticmethod
    async def _read_rest(
        r: asyncio.StreamReader, line: bytes
    ) -> Tuple[int, Dict[str, str], bytes, bool]:
        parts = line.decode("latin-1").split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP answer: {line[:80]!r}")
        status = int(parts[1])
        headers: Dict[str, str] = {}
        while True:
            line = await r.readline()
            if not line:
                raise asyncio.IncompleteReadError(b"", None)
            if line in (b"\r\n", b"\n"):
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise ValueError(f"bad header line {line[:80]!r}")
            key = name.strip().lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        keep = parts[0] == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            total = 0
            while True:
                size_line = await r.readline()
                size = int(size_line.split(b";", 1)[0].strip() or b"x", 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                total += size
                if total > _MAX_BODY:
                    raise ValueError("answer too large")
                chunks.append(await r.readexactly(size))
                await r.readexactly(2)
            raw = b"".join(chunks)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if not 0 <= length <= _MAX_BODY:
                raise ValueError(f"bad Content-Length {length}")
            raw = await r.readexactly(length)
        elif status in (204, 304) or 100 <= status < 200:
            raw = b""
        else:
            raw = await r.read(_MAX_BODY)
            keep = False
        return status, headers, raw, keep

    # ---- the API -----------------------------------------------------------------------------------

    async def admit(
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
        """Asks whether the call may run (see ``Admitd.admit``)."""
        body, headers, hold_s = _wire.admit_request(
            tenant, subject, tool, upstream, cost, max_wait_ms, call_id, traceparent, run, spend
        )
        try:
            status, hdrs, answer = await self._request("POST", "/v1/admit", body, headers, hold_s)
        except AdmitdUnavailable as e:
            self.outage.failed(self.on_unavailable, str(e))
            return _wire.degraded(self.fail_open, self.unavailable_retry_s, str(e))
        self.outage.answered()
        return _wire.decision(status, hdrs, answer)

    async def release(
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
        """Releases a lease (see ``Admitd.release``)."""
        body = _wire.release_request(
            lease_id, outcome, upstream_status, retry_after, duration_ms, spent, cost
        )
        return await self._release(body)

    async def _release(self, body: Dict[str, Any]) -> bool:
        status, _, answer = await self._request("POST", "/v1/release", body)
        if status == 200:
            return True
        if status == 404:
            return False
        raise _wire.error(status, answer)

    async def feedback(
        self, tenant: str, upstream: str, status: int, retry_after: Optional[RetryAfter] = None
    ) -> None:
        """Reports an upstream answer seen outside a lease (a 429 starts the penalty box)."""
        body = _wire.feedback_request(tenant, upstream, status, retry_after)
        code, _, answer = await self._request("POST", "/v1/feedback", body)
        if code != 202:
            raise _wire.error(code, answer)

    async def tenant(self, tenant: str) -> Optional[Dict[str, Any]]:
        """The tenant's snapshot, or None when admitd holds no state for it."""
        status, _, answer = await self._request("GET", _wire.tenant_path(tenant))
        if status == 200:
            return answer  # type: ignore[no-any-return]
        if status == 404:
            return None
        raise _wire.error(status, answer)

    # ---- one call, start to end --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def call(
        self, tenant: str, subject: str, tool: str, **admit_args: Any
    ) -> AsyncIterator[Call]:
        """``Admitd.call`` for ``async with``. A cancelled block still gives its slot back: the
        release runs to its end even when the caller is cancelled again while it is sent."""
        c = Call(await self.admit(tenant, subject, tool, **admit_args))
        try:
            yield c
        except BaseException as e:
            await self.finish(c, _wire.outcome_of(e))
            raise
        await self.finish(c, "ok")

    async def finish(self, call: Call, default: str) -> None:
        """Releases ``call`` once (outcome ``default`` unless the call recorded its own); the
        release survives the caller's cancellation."""
        body = call._release_body(default)
        if body is None:
            return
        task = asyncio.ensure_future(self._release_logged(body))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        await asyncio.shield(task)

    async def _release_logged(self, body: Dict[str, Any]) -> None:
        try:
            if not await self._release(body):
                log.info("admitd no longer knew lease %s (expired after lease_ttl?)", body["lease_id"])
        except (AdmitdError, AdmitdUnavailable) as e:
            # The tool's own result or error matters more; the lease expires after lease_ttl.
            log.warning("could not release lease %s: %s", body["lease_id"], e)
