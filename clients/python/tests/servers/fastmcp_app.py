"""A FastMCP server guarded by admitd's middleware, over streamable HTTP, for the end-to-end
tests: ``python fastmcp_app.py ADMITD_URL``. It prints ``serving on HOST:PORT`` on stderr once
it listens, and counts every tool run (``GET /runs``), so a test can tell refused calls from
calls that ran."""

from __future__ import annotations

import asyncio
import collections
import socket
import sys

import uvicorn
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

from fastmcp import FastMCP
from fastmcp.server.auth.providers.jwt import StaticTokenVerifier
from tokens import TOKENS

ADMITD_URL = sys.argv[1]
RUNS: "collections.Counter[str]" = collections.Counter()
auth = StaticTokenVerifier(
    tokens={token: {"client_id": who["sub"], "scopes": [], **who} for token, who in TOKENS.items()}
)

# [integrations:fastmcp]
from admitd_client.fastmcp import AdmitdMiddleware, UpstreamRateLimited

mcp = FastMCP("sales", auth=auth)  # any FastMCP auth: JWTVerifier, an OAuth provider, ...
# Tenant and subject come from the validated token's "tenant" and "sub" claims;
# pass identity=lambda token: (tenant, subject) to read them elsewhere.
mcp.add_middleware(AdmitdMiddleware(ADMITD_URL, upstreams={"get_sales": "warehouse"}))


@mcp.tool
async def get_sales(region: str) -> str:
    RUNS["get_sales"] += 1
    if region == "busy":  # as if the warehouse API answered 429 with Retry-After: 30
        raise UpstreamRateLimited(retry_after="30")
    return f"sales in {region}: 42"
# [/integrations:fastmcp]


async def call_model(prompt: str) -> tuple[str, dict]:
    """Stands in for a model API: a summary, and the usage the API reports (as OpenAI's and
    Anthropic's do)."""
    await asyncio.sleep(0)
    return prompt[:40], {"total_tokens": 900}


# [integrations:spend]
from admitd_client.fastmcp import report_spend


@mcp.tool
async def summarize(text: str) -> str:
    RUNS["summarize"] += 1
    summary, usage = await call_model(f"Summarize: {text}")
    # What the model really used; the release settles it instead of the estimate.
    report_spend(tokens=usage["total_tokens"])
    return summary
# [/integrations:spend]


class Report(BaseModel):
    region: str
    total: int


@mcp.tool
async def fan(n: int):
    RUNS["fan"] += 1
    await asyncio.sleep(0.3)  # overlap the fanned-out calls
    return n


@mcp.tool
def as_str(n: int) -> str:
    RUNS["as_str"] += 1
    return str(n)


@mcp.tool
def as_list(n: int) -> list[str]:
    RUNS["as_list"] += 1
    return [str(n)]


@mcp.tool
def as_dict(n: int) -> dict:
    RUNS["as_dict"] += 1
    return {"n": n}


@mcp.tool
def as_model(n: int) -> Report:
    RUNS["as_model"] += 1
    return Report(region="emea", total=n)


@mcp.tool
def fails(n: int) -> str:
    RUNS["fails"] += 1
    raise RuntimeError("the tool broke")


@mcp.tool
async def slow(n: int) -> str:
    RUNS["slow"] += 1
    await asyncio.sleep(30)
    return "late"


@mcp.custom_route("/runs", methods=["GET"])
async def runs(request: Request) -> JSONResponse:
    return JSONResponse(dict(RUNS))


def main() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(mcp.http_app(), log_level="warning")
    server = uvicorn.Server(config)
    print("serving on 127.0.0.1:%d" % sock.getsockname()[1], file=sys.stderr, flush=True)
    asyncio.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
