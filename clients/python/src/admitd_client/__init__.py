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

If admitd cannot be reached (or answers 5xx), ``fail_open=True`` (the default) lets the call run
without a lease, marked ``degraded``; ``fail_open=False`` refuses it with a tool result that asks
the model to wait ``unavailable_retry_s`` seconds. Requests admitd itself rejects as malformed
(400, 413) raise ``AdmitdError``: they are bugs in the caller, not rate limits.

MCP SDK adapters, which do all of the above for every tool: ``admitd_client.fastmcp``
(``pip install "admitd-client[fastmcp]"``) and ``admitd_client.mcp`` (``[mcp]``).
"""

from ._async import AsyncAdmitd
from ._guard import UpstreamRateLimited, claims_identity, report_upstream
from ._sync import Admitd
from ._wire import (
    DEFAULT_URL,
    OUTCOMES,
    AdmitdError,
    AdmitdUnavailable,
    Call,
    Decision,
)

__all__ = [
    "DEFAULT_URL",
    "OUTCOMES",
    "Admitd",
    "AdmitdError",
    "AdmitdUnavailable",
    "AsyncAdmitd",
    "Call",
    "Decision",
    "UpstreamRateLimited",
    "claims_identity",
    "report_upstream",
]
