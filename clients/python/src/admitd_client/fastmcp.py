"""admitd for FastMCP servers: one middleware guards every tool.

    from fastmcp import FastMCP
    from admitd_client.fastmcp import AdmitdMiddleware

    mcp = FastMCP("sales", auth=...)
    mcp.add_middleware(AdmitdMiddleware("http://127.0.0.1:9470", upstreams={"get_sales": "warehouse"}))

Each ``tools/call`` asks admitd first, keyed on the tenant and subject of the request's validated
access token (by default its ``tenant`` and ``sub`` claims; pass ``identity`` to choose). A refused
call never runs: the model gets admitd's refusal as FastMCP's own ``ToolResult`` with
``isError: true``, the wait in whole seconds in its text and admitd's ``structuredContent``,
whatever the tool's return type or output schema. An admitted call is released after the tool
ran: ``ok``; ``error`` when it raised or returned an error result; ``cancelled`` when the request
was cancelled; ``upstream_rate_limited`` when the tool raised ``UpstreamRateLimited`` or called
``report_upstream(429, retry_after)``.

Spend budgets: a tool calls ``report_spend(tokens=...)`` (or ``cost=0`` for a cache hit) and the
release settles it; the agent run is read from the request's ``_meta["admitd/run"]``, and the
result carries what each budget has left in its ``_meta["admitd/spend"]``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Union

import mcp_types as mt
from fastmcp.server.dependencies import get_access_token
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import ToolResult

from ._async import AsyncAdmitd
from ._guard import (
    SPEND_META,
    Guard,
    Identity,
    UpstreamRateLimited,
    claims_identity,
    report_spend,
    report_upstream,
    run_of,
)
from ._wire import DEFAULT_URL

__all__ = [
    "AdmitdMiddleware",
    "UpstreamRateLimited",
    "claims_identity",
    "refusal_result",
    "report_spend",
    "report_upstream",
]


def refusal_result(tool_result: Dict[str, Any]) -> ToolResult:
    """admitd's ``tool_result`` (JSON) as FastMCP's ``ToolResult``, ``isError`` kept."""
    parsed = mt.CallToolResult.model_validate(tool_result)
    return ToolResult(
        content=list(parsed.content),
        structured_content=parsed.structured_content,
        is_error=True,
    )


class AdmitdMiddleware(Middleware):
    """Asks admitd before every tool call (see the module documentation).

    ``admitd`` is a URL (``http://host:port``, ``unix:/path``) or an ``AsyncAdmitd``;
    ``identity(token)`` returns ``(tenant, subject)`` from FastMCP's ``AccessToken`` (None when
    the request carried none); ``upstreams`` and ``costs`` map tool names to the upstream they
    spend and their cost (absent: admitd's configured defaults); ``max_wait_ms`` caps how long
    admitd may hold a call waiting for capacity; ``tasks`` is an ``AdmitdTasks`` extension
    (``admitd_client.fastmcp_tasks``), whose task calls it leaves to that extension to admit."""

    def __init__(
        self,
        admitd: Union[AsyncAdmitd, str] = DEFAULT_URL,
        *,
        identity: Optional[Identity] = None,
        upstreams: Optional[Mapping[str, str]] = None,
        costs: Optional[Mapping[str, float]] = None,
        max_wait_ms: Optional[float] = None,
        tasks: Optional[Any] = None,
    ):
        self.guard = Guard(admitd, identity, upstreams, costs, max_wait_ms)
        # An ``AdmitdTasks`` extension admits the calls it answers with a task itself.
        self.tasks = tasks

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        if self.tasks is not None:
            from .fastmcp_tasks import request_meta

            meta = request_meta(context.fastmcp_context, context.message)
            if self.tasks.takes(context.message.name, meta):
                return await call_next(context)
        return await self.guard.run(
            get_access_token(),
            context.message.name,
            lambda: call_next(context),
            refusal_result,
            lambda result: bool(result.is_error),
            run_id=run_of(context.message.meta),
            annotate=_with_spend,
        )


def _with_spend(result: ToolResult, spend: Dict[str, Any]) -> ToolResult:
    """The tool's result with the call's spend budgets in its ``_meta``."""
    meta = dict(getattr(result, "meta", None) or {})
    meta[SPEND_META] = spend
    try:
        result.meta = meta
    except (AttributeError, TypeError, ValueError):
        pass
    return result
