"""Long-running tool calls as MCP tasks (the Tasks extension, ``io.modelcontextprotocol/tasks``),
with admitd setting the pace.

A tool that runs for minutes answers its ``tools/call`` at once with a task handle
(``CreateTaskResult``: ``resultType: "task"``, ``taskId``, ``ttlMs``, ``pollIntervalMs``) and runs
in the background; the client polls ``tasks/get`` until the task is done. admitd admits the call as
a task (its lease lives ``[tasks] lease_ttl``), hands out the ``pollIntervalMs`` that fits the
tenant's load, and holds the client to it: ``Tasks`` renews the lease while the work runs, checks
every ``tasks/get`` with admitd, and releases the lease when the work ends.

    tasks = Tasks(AsyncAdmitd())
    if declares_tasks(request_meta):          # never answer with a task otherwise
        return await tasks.start(tenant, subject, "export", lambda: export(...))
    tasks_get_result = await tasks.get(task_id)

The SDK adapters (``admitd_client.fastmcp_tasks``) wire this into a server. Tasks are kept in this
process: a ``tasks/get`` must reach the process that started the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, Mapping, Optional, Set

from ._async import AsyncAdmitd
from ._wire import AdmitdUnavailable, Decision, log, outcome_of
from . import _wire

#: The extension's identifier, as clients declare it and servers advertise it.
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
#: Where a request carries the client's capabilities for that request (2026-07-28).
CLIENT_CAPABILITIES_KEY = "io.modelcontextprotocol/clientCapabilities"
#: The JSON-RPC error for a request that needs a capability the client did not declare.
MISSING_REQUIRED_CLIENT_CAPABILITY = -32021

#: A unit of work: returns the tool's ``CallToolResult`` as JSON.
Work = Callable[[], Awaitable[Dict[str, Any]]]


def declares_tasks(meta: Optional[Mapping[str, Any]]) -> bool:
    """Whether a request's ``_meta`` declares the Tasks extension. A server must not answer a
    request with a task unless it does."""
    if not isinstance(meta, Mapping):
        return False
    caps = meta.get(CLIENT_CAPABILITIES_KEY)
    exts = caps.get("extensions") if isinstance(caps, Mapping) else None
    return isinstance(exts, Mapping) and isinstance(exts.get(TASKS_EXTENSION), Mapping)


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )


@dataclass
class PollCheck:
    """admitd's answer to one ``tasks/get``: on time (``due``, with the next interval) or early
    (with the time left until it is due). ``None`` from ``TaskLease.poll``: the task is unknown."""

    due: bool
    poll_interval_ms: int


class TaskLease:
    """The lease of one admitted task, on its ``AsyncAdmitd``."""

    def __init__(self, admitd: AsyncAdmitd, decision: Decision):
        self.admitd = admitd
        self.lease_id: str = str(decision.lease_id)
        self.poll_interval_ms: int = int(decision.body.get("poll_interval_ms", 0) or 0)

    async def renew(self, ttl_ms: Optional[int] = None) -> Optional[int]:
        """Extends the lease (by its own TTL unless ``ttl_ms``); returns how long it now lives
        (ms), or None when admitd no longer knows it."""
        body: Dict[str, Any] = {"lease_id": self.lease_id}
        if ttl_ms is not None:
            body["ttl_ms"] = int(ttl_ms)
        status, _, answer = await self.admitd._request("POST", "/v1/renew", body)
        if status == 200 and isinstance(answer, dict):
            return int(answer.get("expires_in_ms", 0))
        if status == 404:
            return None
        raise _wire.error(status, answer)

    async def poll(self) -> Optional[PollCheck]:
        """Checks one poll with admitd (``POST /v1/tasks/poll``)."""
        status, _, answer = await self.admitd._request(
            "POST", "/v1/tasks/poll", {"lease_id": self.lease_id}
        )
        if status == 200 and isinstance(answer, dict):
            return PollCheck(True, int(answer["poll_interval_ms"]))
        if status == 429 and isinstance(answer, dict):
            return PollCheck(False, max(1, int(answer.get("retry_after_ms", 1))))
        if status == 404:
            return None
        raise _wire.error(status, answer)

    async def release(self, outcome: str = "ok", duration_ms: Optional[float] = None) -> bool:
        return await self.admitd.release(self.lease_id, outcome, duration_ms=duration_ms)


@dataclass
class _Task:
    task_id: str
    lease: TaskLease
    created_at: str
    ttl_ms: int
    started: float
    poll_interval_ms: int
    status: str = "working"
    status_message: Optional[str] = None
    updated_at: str = ""
    result: Optional[Dict[str, Any]] = None
    runner: Optional["asyncio.Task[None]"] = None
    expires: float = 0.0

    def shape(self) -> Dict[str, Any]:
        t: Dict[str, Any] = {
            "taskId": self.task_id,
            "status": self.status,
            "createdAt": self.created_at,
            "lastUpdatedAt": self.updated_at or self.created_at,
            "ttlMs": self.ttl_ms,
            "pollIntervalMs": self.poll_interval_ms,
        }
        if self.status_message:
            t["statusMessage"] = self.status_message
        if self.status == "completed" and self.result is not None:
            t["result"] = self.result
        return t


class UnknownTask(KeyError):
    """No such task here (never started in this process, or past its ``ttlMs``)."""


@dataclass
class Tasks:
    """Runs admitted tool calls as MCP tasks in this process (see the module documentation).

    ``ttl_ms`` is how long a task (and its result) is kept after it was created, the task's
    ``ttlMs``; ``renew_every_s`` how often a running task's lease is renewed (keep it well below
    admitd's ``[tasks] lease_ttl``: a worker that stops renewing loses its slot at that TTL)."""

    admitd: AsyncAdmitd
    ttl_ms: int = 3_600_000
    renew_every_s: float = 60.0
    _tasks: Dict[str, _Task] = field(default_factory=dict)
    _running: Set["asyncio.Task[None]"] = field(default_factory=set)

    async def start(
        self,
        tenant: str,
        subject: str,
        tool: str,
        work: Work,
        **admit_args: Any,
    ) -> Dict[str, Any]:
        """Admits ``tool`` as a task and starts ``work``. Returns the ``CreateTaskResult`` (JSON,
        ``resultType: "task"``) with admitd's ``pollIntervalMs``, or, when admitd refused the
        call, its ``tool_result`` (a ``CallToolResult`` to return unchanged). Only for a request
        whose client declared the extension (``declares_tasks``)."""
        body, headers, hold_s = _wire.admit_request(
            tenant,
            subject,
            tool,
            admit_args.get("upstream"),
            admit_args.get("cost"),
            admit_args.get("max_wait_ms"),
            admit_args.get("call_id"),
            admit_args.get("traceparent"),
        )
        body["task"] = True
        try:
            status, hdrs, answer = await self.admitd._request(
                "POST", "/v1/admit", body, headers, hold_s
            )
            decision = _wire.decision(status, hdrs, answer)
        except AdmitdUnavailable as e:
            decision = _wire.degraded(self.admitd.fail_open, self.admitd.unavailable_retry_s, str(e))
        if not decision.admitted:
            return dict(decision.tool_result or {})
        if decision.degraded or not decision.lease_id:
            # admitd could not be reached and fail_open let the call through: run it without a
            # lease, polled at the slowest sensible pace.
            log.warning("task %s started without admitd: %s", tool, decision.body)
        lease = TaskLease(self.admitd, decision)
        now = _now_iso()
        task = _Task(
            task_id=str(uuid.uuid4()),
            lease=lease,
            created_at=now,
            ttl_ms=self.ttl_ms,
            started=time.monotonic(),
            poll_interval_ms=lease.poll_interval_ms or 5_000,
            expires=time.monotonic() + self.ttl_ms / 1000.0,
        )
        self._prune()
        self._tasks[task.task_id] = task
        runner = asyncio.ensure_future(self._run(task, work, degraded=decision.degraded))
        task.runner = runner
        self._running.add(runner)
        runner.add_done_callback(self._running.discard)
        return {"resultType": "task", **task.shape()}

    async def _run(self, task: _Task, work: Work, degraded: bool) -> None:
        keep = None if degraded else asyncio.ensure_future(self._renew(task))
        outcome = "ok"
        try:
            result = await work()
            task.result = result
            task.status = "completed"
            if result.get("isError"):
                outcome = "error"
        except asyncio.CancelledError:
            task.status = "cancelled"
            outcome = "cancelled"
        except Exception as e:  # the tool's failure is the task's result, as a call's would be
            outcome = outcome_of(e)
            task.status = "completed"
            task.result = {"content": [{"type": "text", "text": str(e)}], "isError": True}
        finally:
            task.updated_at = _now_iso()
            if keep is not None:
                keep.cancel()
            if not degraded:
                duration = (time.monotonic() - task.started) * 1000.0
                with contextlib.suppress(Exception):
                    await task.lease.release(outcome, duration)

    async def _renew(self, task: _Task) -> None:
        every = self.renew_every_s
        while True:
            await asyncio.sleep(every)
            try:
                left = await task.lease.renew()
            except Exception as e:  # admitd away: try again sooner; the lease lives its TTL
                log.warning("could not renew task lease %s: %s", task.lease.lease_id, e)
                every = max(1.0, every / 2)
                continue
            if left is None:
                log.warning("admitd no longer knows task lease %s", task.lease.lease_id)
                return
            every = max(0.1, min(self.renew_every_s, left / 3000.0))

    def _prune(self) -> None:
        now = time.monotonic()
        for tid in [t for t, task in self._tasks.items() if task.expires < now]:
            task = self._tasks.pop(tid)
            if task.runner is not None and not task.runner.done():
                task.runner.cancel()

    async def get(self, task_id: str) -> Dict[str, Any]:
        """The ``tasks/get`` result (JSON, ``resultType: "complete"``). While the task runs, the
        poll is checked with admitd: on time, the answer carries the next ``pollIntervalMs``; early,
        it carries the time left and the task's state as it is (no result before it is due)."""
        self._prune()
        task = self._tasks.get(task_id)
        if task is None:
            raise UnknownTask(task_id)
        if task.status == "working":
            try:
                check = await task.lease.poll()
            except (AdmitdUnavailable, _wire.AdmitdError) as e:
                log.warning("could not check a poll of task %s with admitd: %s", task_id, e)
                check = None
            if check is not None:
                task.poll_interval_ms = check.poll_interval_ms
                task.status_message = (
                    None if check.due else "polled sooner than pollIntervalMs; poll again then"
                )
        return {"resultType": "complete", **task.shape()}

    async def cancel(self, task_id: str) -> Dict[str, Any]:
        """``tasks/cancel``: stops the work (its lease is released as ``cancelled``)."""
        task = self._tasks.get(task_id)
        if task is None:
            raise UnknownTask(task_id)
        if task.runner is not None and not task.runner.done():
            task.runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task.runner
        return {"resultType": "complete", **task.shape()}

    async def aclose(self) -> None:
        """Cancels running tasks (each lease released as ``cancelled``)."""
        for runner in list(self._running):
            runner.cancel()
        if self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)
