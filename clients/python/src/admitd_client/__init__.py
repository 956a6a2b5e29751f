"""A client for admitd, the admission controller for MCP tool servers.

Before a tool runs, ask admitd; after it ran, release the lease and report what the upstream
said; when admitd refuses, hand its ready-made tool result to the model instead of running the
tool. The clients use the standard library only:

    from admitd_client import Admitd            # blocking; AsyncAdmitd for asyncio

    admitd = Admitd()                           # http://127.0.0.1:9470, or "unix:/run/admitd/admitd.sock"

    def get_sales(tenant, subject, region):
        with admitd.call(tenant, subject, "get_sales", upstream="warehouse") as call:
            if not call.admitted:
                return call.tool_result         # the CallToolResult (JSON) for the model, unchanged
            resp = warehouse.query(region)
            call.upstream_response(resp.status, resp.headers.get("Retry-After"))
            return resp.body

Leaving the block releases the lease: outcome ``ok``, ``error`` when the block raised,
``cancelled`` when it was cancelled or interrupted, ``upstream_rate_limited`` when the upstream
answered 429 (its ``Retry-After`` then puts the upstream in admitd's penalty box).

If admitd cannot be reached (or answers 5xx), ``on_unavailable`` decides: ``"fail_open"`` (the
default) lets the call run without a lease, marked ``degraded``; ``"fail_closed"`` refuses it with
a tool result that asks the model to wait ``unavailable_retry_s`` seconds. The default keeps the
tools working when the limiter beside them is down (an outage of admitd is not an outage of the
server); choose ``"fail_closed"`` when running past the limits costs more than refusing calls (a
paid upstream, a fragile one). Either way each outage is counted (``client.outage``) and logged
once, when it begins and when admitd answers again, never once per call. (``fail_open=True/False``
is the older spelling.) Requests admitd itself rejects as malformed (400, 413) raise
``AdmitdError``: they are bugs in the caller, not rate limits.

MCP SDK adapters, which do all of the above for every tool: ``admitd_client.fastmcp``
(``pip install "admitd-client[fastmcp]"``) and ``admitd_client.mcp`` (``[mcp]``).
"""

from ._async import AsyncAdmitd
from ._guard import UpstreamRateLimited, claims_identity, report_spend, report_upstream
from ._sync import Admitd
from ._wire import (
    DEFAULT_URL,
    FAIL_CLOSED,
    FAIL_OPEN,
    OUTCOMES,
    AdmitdError,
    AdmitdUnavailable,
    Call,
    Decision,
    Outage,
)

__all__ = [
    "DEFAULT_URL",
    "FAIL_CLOSED",
    "FAIL_OPEN",
    "OUTCOMES",
    "Admitd",
    "AdmitdError",
    "AdmitdUnavailable",
    "AsyncAdmitd",
    "Call",
    "Decision",
    "Outage",
    "UpstreamRateLimited",
    "claims_identity",
    "report_spend",
    "report_upstream",
]
