"""admitd for ``mcp`` SDK servers whose tools run for minutes: the Tasks extension
(``io.modelcontextprotocol/tasks``) with admitd's ``pollIntervalMs``.

    from mcp.server.mcpserver import MCPServer
    from admitd_client.mcp_tasks import AdmitdTasks

    server = MCPServer("exports", extensions=[AdmitdTasks(ADMITD_URL, tools={"export_orders"})], ...)

A call of one of ``tools`` whose client declared the extension on that request is admitted by
admitd as a task and answered at once with a ``CreateTaskResult`` carrying admitd's
``pollIntervalMs``; the tool runs in the background while its lease is renewed, and is released
when it ends. ``tasks/get`` is checked with admitd each time. A call from a client that did not
declare the extension is guarded as an ordinary call, so these tools need no ``Admission``
wrapper of their own. ``mcp`` 2.3.0 carries the extension machinery (SEP-2133) but not the Tasks
extension itself: this module is that extension, served by the SDK.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

import mcp_types as mt
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.extension import Extension, MethodBinding
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict

from ._async import AsyncAdmitd
from ._guard import Guard, Identity, IdentityError, identity_refusal
from ._wire import DEFAULT_URL
from .tasks import TASKS_EXTENSION, Tasks, UnknownTask, declares_tasks

__all__ = ["AdmitdTasks", "TASKS_EXTENSION"]

_INVALID_PARAMS = -32602


class TaskParams(mt.RequestParams):
    """``tasks/get`` and ``tasks/cancel`` params."""

    task_id: str


class _Wire(mt.Result):
    """A result already in its wire shape (the extension's, which the SDK does not model)."""

    model_config = ConfigDict(extra="allow")


def _as_json(result: Any) -> Dict[str, Any]:
    if isinstance(result, BaseModel):
        out: Dict[str, Any] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        return out
    if isinstance(result, dict):
        return result
    return {"content": [{"type": "text", "text": str(result)}]}


def _raw_meta(ctx: Any) -> Optional[Mapping[str, Any]]:
    params = getattr(ctx, "params", None)
    meta = params.get("_meta") if isinstance(params, Mapping) else None
    return meta if isinstance(meta, Mapping) else None


class AdmitdTasks(Extension):
    """The Tasks extension for the ``tools`` named, paced by admitd (see the module
    documentation). ``identity``, ``upstreams`` and ``costs`` as for ``Admission``; ``ttl_ms`` is
    each task's ``ttlMs``, ``renew_every_s`` how often its lease is renewed."""

    identifier = TASKS_EXTENSION

    def __init__(
        self,
        admitd: Union[AsyncAdmitd, str] = DEFAULT_URL,
        *,
        tools: Iterable[str],
        identity: Optional[Identity] = None,
        upstreams: Optional[Mapping[str, str]] = None,
        costs: Optional[Mapping[str, float]] = None,
        ttl_ms: int = 3_600_000,
        renew_every_s: float = 60.0,
    ):
        self.guard = Guard(admitd, identity, upstreams, costs, None)
        self.task_tools = frozenset(tools)
        self.tasks = Tasks(self.guard.admitd, ttl_ms=ttl_ms, renew_every_s=renew_every_s)

    def methods(self) -> Sequence[MethodBinding]:
        return (
            MethodBinding("tasks/get", TaskParams, self._get),
            MethodBinding("tasks/cancel", TaskParams, self._cancel),
        )

    async def _get(self, ctx: Any, params: TaskParams) -> _Wire:
        try:
            return _Wire.model_validate(await self.tasks.get(params.task_id))
        except UnknownTask:
            raise MCPError(code=_INVALID_PARAMS, message=f"unknown task {params.task_id!r}")

    async def _cancel(self, ctx: Any, params: TaskParams) -> _Wire:
        try:
            return _Wire.model_validate(await self.tasks.cancel(params.task_id))
        except UnknownTask:
            raise MCPError(code=_INVALID_PARAMS, message=f"unknown task {params.task_id!r}")

    async def intercept_tool_call(self, params: Any, ctx: Any, call_next: Any) -> Any:
        name = params.name
        if name not in self.task_tools:
            return await call_next(ctx)
        if not declares_tasks(_raw_meta(ctx)):
            # Not a task: guarded as an ordinary call.
            return await self.guard.run(
                get_access_token(),
                name,
                lambda: call_next(ctx),
                mt.CallToolResult.model_validate,
                lambda r: bool(getattr(r, "is_error", False)),
            )
        try:
            tenant, subject = await self.guard.who(get_access_token())
        except IdentityError as e:
            return mt.CallToolResult.model_validate(identity_refusal(str(e)))

        async def work() -> Dict[str, Any]:
            return _as_json(await call_next(ctx))

        answer = await self.tasks.start(
            tenant,
            subject,
            name,
            work,
            upstream=self.guard.upstreams.get(name),
            cost=self.guard.costs.get(name),
        )
        if answer.get("resultType") != "task":
            return mt.CallToolResult.model_validate(answer)
        return _Wire.model_validate(answer)
