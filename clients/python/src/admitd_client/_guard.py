"""What the MCP SDK adapters share: who is calling (from the validated access token), how a tool
tells that its upstream answered 429, and one guarded tool run from admission to release.

The adapters only translate between an SDK's types and this module, so the FastMCP middleware and
the ``mcp`` wrappers behave identically."""

from __future__ import annotations

import contextvars
import inspect
from typing import (
    Any,
    Awaitable,
    Callable,
    Dict,
    Mapping,
    Optional,
    Tuple,
    TypeVar,
    Union,
)

from ._async import AsyncAdmitd
from ._wire import Call, RetryAfter, log, outcome_of

T = TypeVar("T")
R = TypeVar("R")

#: Maps the request's validated access token (the SDK's ``AccessToken``, or None when the
#: request carried none) to ``(tenant, subject)``. May be a coroutine function.
Identity = Callable[[Any], Union[Tuple[str, str], Awaitable[Tuple[str, str]]]]

_current: "contextvars.ContextVar[Optional[Call]]" = contextvars.ContextVar(
    "admitd_call", default=None
)


class UpstreamRateLimited(Exception):
    """Raised by a tool whose upstream answered 429 (or another status that means "slow
    down"). The adapter releases the call as ``upstream_rate_limited`` with ``retry_after``, which
    puts the upstream in admitd's penalty box, and lets the exception go on to the SDK, which
    reports the tool's failure to the model as it reports any other.

    Creating it records the status on the guarded call at once (as ``report_upstream`` does),
    because an SDK may turn the tool's exception into an error result before the adapter sees
    it."""

    def __init__(
        self,
        retry_after: Optional[RetryAfter] = None,
        *,
        status: int = 429,
        message: Optional[str] = None,
    ):
        self.retry_after = retry_after
        self.status = status
        if message is None:
            message = "the upstream service is rate limiting these calls"
            if retry_after is not None:
                message += f" (Retry-After: {retry_after})"
        super().__init__(message)
        report_upstream(status, retry_after)


def report_upstream(status: int, retry_after: Optional[RetryAfter] = None) -> bool:
    """Records what the upstream answered, from inside a tool the adapter guards, without
    raising: a 429 releases the call as ``upstream_rate_limited`` with ``retry_after``. Returns
    False (and does nothing) outside a guarded tool call."""
    call = _current.get()
    if call is None:
        log.debug("report_upstream(%s) outside a guarded tool call: ignored", status)
        return False
    call.upstream_response(status, retry_after)
    return True


def report_spend(
    spent: Optional[Mapping[str, float]] = None, *, cost: Optional[float] = None, **units: float
) -> bool:
    """Records what the guarded tool call actually spent, from inside the tool: per spend unit
    (``report_spend(tokens=usage.total_tokens)``, added up over several reports) and, with
    ``cost``, its actual cost in cost units (``report_spend(cost=0)`` for a cache hit). The
    adapter's release settles them instead of admitd's estimates. Returns False (and does
    nothing) outside a guarded tool call."""
    call = _current.get()
    if call is None:
        log.debug("report_spend outside a guarded tool call: ignored")
        return False
    call.report_spend(spent, cost=cost, **units)
    return True


#: The request ``_meta`` key the MCP adapters read an agent run's id from (``run`` in admitd), and
#: the result ``_meta`` key they report the call's spend budgets under.
RUN_META = "admitd/run"
SPEND_META = "admitd/spend"


def run_of(meta: Any) -> Optional[str]:
    """The agent run a request's ``_meta`` names (``{"admitd/run": "r-17"}``), if any."""
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        meta = getattr(meta, "model_extra", None) or getattr(meta, "__dict__", {})
    run = meta.get(RUN_META) if isinstance(meta, Mapping) else None
    return run if isinstance(run, str) and run else None


class IdentityError(LookupError):
    """The request carries no validated identity admitd could key on."""


def identity_refusal(reason: str) -> Dict[str, Any]:
    """The ``CallToolResult`` (JSON) of a call that was not run because the server cannot tell
    who is calling: it names the problem for the model and the person reading along, instead of
    the SDK's "Internal server error". Waiting does not help, so it says so."""
    text = (
        f"This call was not run: the server cannot tell who is calling ({reason}). "
        "Every call needs a validated access token naming a tenant and a subject: the MCP server "
        "needs an auth provider (FastMCP: auth=...; the mcp SDK: token_verifier=...), and the "
        "client must send its token. Retrying will not help until that is fixed."
    )
    return {
        "content": [{"type": "text", "text": text}],
        "structuredContent": {"error": "no_identity", "reason": reason, "retryable": False},
        "isError": True,
    }


def claims_identity(
    tenant_claim: str = "tenant", subject_claim: str = "sub"
) -> Callable[[Any], Tuple[str, str]]:
    """An ``Identity`` that reads the tenant and the subject from the access token's claims
    (the subject falls back to the token's ``subject``, then its ``client_id``)."""

    def identity(token: Any) -> Tuple[str, str]:
        if token is None:
            raise IdentityError("the request carries no validated access token")
        claims: Mapping[str, Any] = getattr(token, "claims", None) or {}
        tenant = claims.get(tenant_claim)
        subject = (
            claims.get(subject_claim)
            or getattr(token, "subject", None)
            or getattr(token, "client_id", None)
        )
        if not isinstance(tenant, str) or not tenant:
            raise IdentityError(f"the access token has no {tenant_claim!r} claim")
        if not isinstance(subject, str) or not subject:
            raise IdentityError(f"the access token has no {subject_claim!r} claim")
        return tenant, subject

    return identity


class Guard:
    """One policy for every tool of a server: which admitd, who is calling, and each tool's
    upstream and cost (absent: admitd's configured defaults for the tool)."""

    def __init__(
        self,
        admitd: Union[AsyncAdmitd, str],
        identity: Optional[Identity],
        upstreams: Optional[Mapping[str, str]],
        costs: Optional[Mapping[str, float]],
        max_wait_ms: Optional[float],
    ):
        self.admitd = AsyncAdmitd(admitd) if isinstance(admitd, str) else admitd
        self.identity: Identity = identity or claims_identity()
        self.upstreams: Dict[str, str] = dict(upstreams or {})
        self.costs: Dict[str, float] = dict(costs or {})
        self.max_wait_ms = max_wait_ms

    async def who(self, token: Any) -> Tuple[str, str]:
        found = self.identity(token)
        if inspect.isawaitable(found):
            found = await found
        tenant, subject = found
        return tenant, subject

    async def run(
        self,
        token: Any,
        tool: str,
        run: Callable[[], Awaitable[T]],
        refused: Callable[[Dict[str, Any]], R],
        is_error: Callable[[T], bool],
        upstream: Optional[str] = None,
        cost: Optional[float] = None,
        run_id: Optional[str] = None,
        annotate: Optional[Callable[[T, Dict[str, Any]], T]] = None,
    ) -> Union[T, R]:
        """Admits the call, runs it only when admitted, and releases it after it ran:
        ``error`` when it raised or returned an error result, ``cancelled`` when cancelled,
        ``upstream_rate_limited`` when it raised ``UpstreamRateLimited`` or reported a 429."""
        try:
            tenant, subject = await self.who(token)
        except IdentityError as e:
            log.warning("admitd: tool %s not run: the request has no identity (%s)", tool, e)
            return refused(identity_refusal(str(e)))
        decision = await self.admitd.admit(
            tenant,
            subject,
            tool,
            upstream=upstream if upstream is not None else self.upstreams.get(tool),
            cost=cost if cost is not None else self.costs.get(tool),
            max_wait_ms=self.max_wait_ms,
            run=run_id,
        )
        call = Call(decision)
        if not call.admitted:
            assert decision.tool_result is not None, "a refusal always carries its tool result"
            return refused(decision.tool_result)
        reset = _current.set(call)
        try:
            result = await run()
        except UpstreamRateLimited as e:
            call.upstream_response(e.status, e.retry_after)
            await self.admitd.finish(call, "upstream_rate_limited")
            raise
        except BaseException as e:
            await self.admitd.finish(call, outcome_of(e))
            raise
        finally:
            _current.reset(reset)
        await self.admitd.finish(call, "error" if is_error(result) else "ok")
        if annotate is not None and call.spend:
            # What each budget has left after this call, for the agent to see.
            result = annotate(result, call.spend)
        return result
