"""admitd for servers built with the official ``mcp`` SDK: a decorator for ``MCPServer`` tools
and a wrapper for the low-level server's ``on_call_tool`` handler.

    from mcp.server.mcpserver import MCPServer
    from admitd_client.mcp import Admission

    admission = Admission("http://127.0.0.1:9470", upstreams={"get_sales": "warehouse"})
    server = MCPServer("sales", token_verifier=..., auth=...)

    @server.tool()
    @admission.tool()
    async def get_sales(region: str) -> str: ...

    # low level: Server("sales", on_call_tool=admission.call_tool(my_call_tool))

Each call asks admitd first, keyed on the tenant and subject of the request's validated access
token (by default its ``tenant`` and ``sub`` claims; pass ``identity`` to choose). A refused call
never runs: the model gets admitd's refusal as the SDK's ``CallToolResult`` with ``isError: true``
and admitd's ``structuredContent``, whatever the tool's return type or output schema. An admitted
call is released after the tool ran: ``ok``; ``error`` when it raised or returned an error result;
``cancelled`` when the request was cancelled; ``upstream_rate_limited`` when the tool raised
``UpstreamRateLimited`` or called ``report_upstream(429, retry_after)``.

Spend budgets: a tool calls ``report_spend(tokens=...)`` (or ``cost=0`` for a cache hit) and the
release settles it. The agent run named in the request's ``_meta["admitd/run"]`` goes to admitd
(the low-level wrapper reads it from the request; an ``MCPServer`` tool from its ``Context``
parameter, so a tool that spends a run budget declares one, ``ctx: Context``), and the result comes back with what each budget has left in its
``_meta["admitd/spend"]``: a ``CallToolResult`` as it is, and a plain value an ``MCPServer`` tool
returns (a str, a dict, a model...) converted into the ``CallToolResult`` the SDK would build from
it (the same content and structured content; pass ``tool(structured_output=...)`` when the tool is
registered with one).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, TypeVar, Union

import anyio.to_thread
import mcp_types as mt
from mcp.server.auth.middleware.auth_context import get_access_token

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
    "Admission",
    "UpstreamRateLimited",
    "claims_identity",
    "refusal_result",
    "report_spend",
    "report_upstream",
]

F = TypeVar("F", bound=Callable[..., Any])
Ctx = TypeVar("Ctx")
Handler = Callable[[Ctx, mt.CallToolRequestParams], Awaitable[Any]]


def refusal_result(tool_result: Dict[str, Any]) -> mt.CallToolResult:
    """admitd's ``tool_result`` (JSON) as the SDK's ``CallToolResult``, ``isError`` kept."""
    return mt.CallToolResult.model_validate(tool_result)


def _with_spend(result: Any, spend: Dict[str, Any]) -> Any:
    """A ``CallToolResult`` with the call's spend budgets in its ``_meta`` (another return value
    goes back unchanged)."""
    if isinstance(result, mt.CallToolResult):
        meta = dict(result.meta or {})
        meta[SPEND_META] = spend
        return result.model_copy(update={"meta": meta})
    return result


def _converter(
    fn: Callable[..., Any], name: str, structured_output: Optional[bool]
) -> Callable[[Any], Any]:
    """How ``MCPServer`` turns what ``fn`` returns into its ``CallToolResult``: the conversion of
    the tool the SDK registers for ``fn`` (same signature, name and ``structured_output``), so the
    content, structured content and its validation are the SDK's own."""
    from mcp.server.mcpserver.tools.base import Tool

    meta = Tool.from_function(fn, name=name, structured_output=structured_output).fn_metadata
    return meta.convert_result


def _context_parameter(fn: Callable[..., Any]) -> Optional[str]:
    """The name of ``fn``'s ``Context`` parameter (the SDK passes the request's context there), if
    it declares one."""
    from mcp.server.mcpserver.utilities.context_injection import find_context_parameter

    return find_context_parameter(fn)


def _run_of_context(ctx: Any) -> Optional[str]:
    """The agent run an ``MCPServer`` ``Context``'s request names in its ``_meta``, if any."""
    try:
        meta = ctx.request_context.meta
    except (AttributeError, ValueError):  # not a Context, or used outside a request
        return None
    return run_of(meta)


def _is_error(result: Any) -> bool:
    return isinstance(result, mt.CallToolResult) and bool(result.is_error)


class Admission:
    """Asks admitd before the tools it wraps run (see the module documentation).

    ``admitd`` is a URL (``http://host:port``, ``unix:/path``) or an ``AsyncAdmitd``;
    ``identity(token)`` returns ``(tenant, subject)`` from the SDK's ``AccessToken`` (None when
    the request carried none); ``upstreams`` and ``costs`` map tool names to the upstream they
    spend and their cost (absent: admitd's configured defaults); ``max_wait_ms`` caps how long
    admitd may hold a call waiting for capacity."""

    def __init__(
        self,
        admitd: Union[AsyncAdmitd, str] = DEFAULT_URL,
        *,
        identity: Optional[Identity] = None,
        upstreams: Optional[Mapping[str, str]] = None,
        costs: Optional[Mapping[str, float]] = None,
        max_wait_ms: Optional[float] = None,
    ):
        self.guard = Guard(admitd, identity, upstreams, costs, max_wait_ms)

    def tool(
        self,
        name: Optional[str] = None,
        *,
        upstream: Optional[str] = None,
        cost: Optional[float] = None,
        structured_output: Optional[bool] = None,
    ) -> Callable[[F], F]:
        """Decorates an ``MCPServer`` tool function (put it under ``@server.tool()``; give
        ``name`` when the tool is registered under another name than the function's, and
        ``structured_output`` when ``server.tool()`` gets one). The function keeps its signature,
        so the SDK derives the same input and output schemas; a synchronous function runs on a
        worker thread, as the SDK runs it."""

        def wrap(fn: F) -> F:
            tool_name = name or fn.__name__
            is_async = inspect.iscoroutinefunction(fn)
            context_kwarg = _context_parameter(fn)
            # Built on the first plain value that needs spend in its _meta, then kept.
            convert: List[Callable[[Any], Any]] = []

            def annotate(result: Any, spend: Dict[str, Any]) -> Any:
                if not isinstance(result, mt.CallToolResult):
                    if not convert:
                        convert.append(_converter(fn, tool_name, structured_output))
                    result = convert[0](result)
                return _with_spend(result, spend)

            @functools.wraps(fn)
            async def guarded(*args: Any, **kwargs: Any) -> Any:
                async def run() -> Any:
                    if is_async:
                        return await fn(*args, **kwargs)
                    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

                ctx = kwargs.get(context_kwarg) if context_kwarg else None
                return await self.guard.run(
                    get_access_token(),
                    tool_name,
                    run,
                    refusal_result,
                    _is_error,
                    upstream=upstream,
                    cost=cost,
                    run_id=_run_of_context(ctx) if ctx is not None else None,
                    annotate=annotate,
                )

            return guarded  # type: ignore[return-value]

        return wrap

    def call_tool(self, handler: Handler[Ctx]) -> Handler[Ctx]:
        """Wraps a low-level ``Server``'s ``on_call_tool`` handler ``(ctx, params)``."""

        @functools.wraps(handler)
        async def guarded(ctx: Ctx, params: mt.CallToolRequestParams) -> Any:
            return await self.guard.run(
                get_access_token(),
                params.name,
                lambda: handler(ctx, params),
                refusal_result,
                _is_error,
                run_id=run_of(params.meta),
                annotate=_with_spend,
            )

        return guarded
