"""admitd for FastMCP servers whose tools run for minutes: the Tasks extension
(``io.modelcontextprotocol/tasks``) with admitd's ``pollIntervalMs``.

    from admitd_client.fastmcp import AdmitdMiddleware
    from admitd_client.fastmcp_tasks import AdmitdTasks

    tasks = AdmitdTasks("http://127.0.0.1:9470", tools={"export_orders"})
    mcp.add_extension(tasks)
    mcp.add_middleware(AdmitdMiddleware("http://127.0.0.1:9470", tasks=tasks))

A call of one of ``tools`` whose client declared the extension on that request is admitted by
admitd as a task and answered at once with a ``CreateTaskResult`` carrying admitd's
``pollIntervalMs``; the tool runs in the background while its lease is renewed, and is released
when it ends. ``tasks/get`` is checked with admitd each time (a poll earlier than told gets the time
left as its ``pollIntervalMs`` and no news). A call from a client that did not declare the extension
runs as an ordinary call (``AdmitdMiddleware`` guards it). FastMCP 4.2.3 carries the extension
machinery (SEP-2133) but not the Tasks extension itself: this module is that extension, served by
FastMCP.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

from fastmcp.server.dependencies import get_access_token
from fastmcp.server.extensions import MethodBinding, ServerExtension, ToolCallContinuation
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolRequestParams, RequestParams
from pydantic import BaseModel, ConfigDict

from ._async import AsyncAdmitd
from ._guard import Guard, Identity, IdentityError, identity_refusal
from ._wire import DEFAULT_URL
from .tasks import TASKS_EXTENSION, Tasks, UnknownTask, declares_tasks

__all__ = ["AdmitdTasks", "TASKS_EXTENSION"]

#: JSON-RPC "invalid params": a task id this server does not know.
_INVALID_PARAMS = -32602


class TaskParams(RequestParams):
    """``tasks/get`` and ``tasks/cancel`` params."""

    task_id: str


class _Wire(BaseModel):
    """A result already in its wire shape (the extension's, which the SDK does not model)."""

    model_config = ConfigDict(extra="allow")


def _wire(d: Dict[str, Any]) -> _Wire:
    return _Wire.model_validate(d)


def request_meta(context: Any, params: Any = None) -> Optional[Mapping[str, Any]]:
    """The request's raw ``_meta`` (where a client declares its extensions for that request), from
    FastMCP's ``Context``: the validated params do not keep its reserved keys."""
    rc = getattr(context, "request_context", None)
    meta = getattr(rc, "meta", None)
    if isinstance(meta, Mapping):
        return meta
    found = getattr(params, "meta", None)
    return found if isinstance(found, Mapping) else None


class AdmitdTasks(ServerExtension):
    """The Tasks extension for the ``tools`` named, paced by admitd (see the module
    documentation). ``identity``, ``upstreams`` and ``costs`` as for ``AdmitdMiddleware``;
    ``ttl_ms`` is each task's ``ttlMs``, ``renew_every_s`` how often its lease is renewed."""

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

    def takes(self, tool: str, meta: Optional[Mapping[str, Any]]) -> bool:
        """Whether this extension answers the call with a task: one of its tools, from a client
        that declared the extension on this very request."""
        return tool in self.task_tools and declares_tasks(meta)

    def methods(self) -> Sequence[MethodBinding]:
        return (
            MethodBinding("tasks/get", TaskParams, self._get),
            MethodBinding("tasks/cancel", TaskParams, self._cancel),
        )

    async def _get(self, ctx: Any, params: TaskParams) -> _Wire:
        try:
            return _wire(await self.tasks.get(params.task_id))
        except UnknownTask:
            raise MCPError(code=_INVALID_PARAMS, message=f"unknown task {params.task_id!r}")

    async def _cancel(self, ctx: Any, params: TaskParams) -> _Wire:
        try:
            return _wire(await self.tasks.cancel(params.task_id))
        except UnknownTask:
            raise MCPError(code=_INVALID_PARAMS, message=f"unknown task {params.task_id!r}")

    async def intercept_tool_call(
        self,
        params: CallToolRequestParams,
        context: Any,
        call_next: ToolCallContinuation,
    ) -> Any:
        if not self.takes(params.name, request_meta(context, params)):
            return await call_next()
        try:
            tenant, subject = await self.guard.who(get_access_token())
        except IdentityError as e:
            # As for any call: not run, and the model reads why.
            from .fastmcp import refusal_result

            return refusal_result(identity_refusal(str(e)))

        async def work() -> Dict[str, Any]:
            result = await call_next()
            to_mcp = getattr(result, "to_mcp_result", None)
            out = to_mcp() if callable(to_mcp) else result
            if isinstance(out, BaseModel):
                dumped: Dict[str, Any] = out.model_dump(by_alias=True, mode="json", exclude_none=True)
                return dumped
            return {"content": [{"type": "text", "text": str(out)}]}

        answer = await self.tasks.start(
            tenant,
            subject,
            params.name,
            work,
            upstream=self.guard.upstreams.get(params.name),
            cost=self.guard.costs.get(params.name),
        )
        if answer.get("resultType") != "task":
            from .fastmcp import refusal_result

            return refusal_result(answer)
        return _wire(answer)
