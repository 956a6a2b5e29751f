"""A server built with the official ``mcp`` SDK (``MCPServer``), its tools guarded by admitd's
``Admission``, over streamable HTTP, for the end-to-end tests: ``python mcp_app.py ADMITD_URL``.
It prints ``serving on HOST:PORT`` on stderr once it listens, and counts every tool run
(``GET /runs``), so a test can tell refused calls from calls that ran."""

from __future__ import annotations

import asyncio
import collections
import socket
import sys
from typing import Optional

import uvicorn
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from tokens import TOKENS

ADMITD_URL = sys.argv[1]
RUNS: "collections.Counter[str]" = collections.Counter()


class StaticTokens:
    """A token verifier that knows the tests' bearer tokens (a real server validates a JWT or
    asks its authorization server)."""

    async def verify_token(self, token: str) -> Optional[AccessToken]:
        who = TOKENS.get(token)
        if who is None:
            return None
        return AccessToken(token=token, client_id=who["sub"], scopes=[], subject=who["sub"], claims=who)


token_verifier = StaticTokens()
auth = AuthSettings(issuer_url="http://127.0.0.1", resource_server_url="http://127.0.0.1/mcp")

# [integrations:mcp]
from admitd_client.mcp import Admission, UpstreamRateLimited

server = MCPServer("sales", token_verifier=token_verifier, auth=auth)
# Tenant and subject come from the validated token's "tenant" and "sub" claims;
# pass identity=lambda token: (tenant, subject) to read them elsewhere.
admission = Admission(ADMITD_URL, upstreams={"get_sales": "warehouse"})


@server.tool()
@admission.tool()
async def get_sales(region: str) -> str:
    RUNS["get_sales"] += 1
    if region == "busy":  # as if the warehouse API answered 429 with Retry-After: 30
        raise UpstreamRateLimited(retry_after="30")
    return f"sales in {region}: 42"
# [/integrations:mcp]


async def call_model(prompt: str) -> tuple[str, dict]:
    """Stands in for a model API: a summary, and the usage the API reports (as OpenAI's and
    Anthropic's do)."""
    await asyncio.sleep(0)
    return prompt[:40], {"total_tokens": 900}


from admitd_client.mcp import report_spend


@server.tool()
@admission.tool()
async def summarize(text: str) -> str:
    RUNS["summarize"] += 1
    summary, usage = await call_model(f"Summarize: {text}")
    report_spend(tokens=usage["total_tokens"])
    return summary


class Report(BaseModel):
    region: str
    total: int


@server.tool()
@admission.tool()
async def fan(n: int):
    RUNS["fan"] += 1
    await asyncio.sleep(0.3)  # overlap the fanned-out calls
    return n


@server.tool()
@admission.tool()
def as_str(n: int) -> str:
    RUNS["as_str"] += 1
    return str(n)


@server.tool()
@admission.tool()
def as_list(n: int) -> list[str]:
    RUNS["as_list"] += 1
    return [str(n)]


@server.tool()
@admission.tool()
def as_dict(n: int) -> dict:
    RUNS["as_dict"] += 1
    return {"n": n}


@server.tool()
@admission.tool()
def as_model(n: int) -> Report:
    RUNS["as_model"] += 1
    return Report(region="emea", total=n)


@server.tool()
@admission.tool()
def fails(n: int) -> str:
    RUNS["fails"] += 1
    raise RuntimeError("the tool broke")


@server.tool()
@admission.tool()
async def slow(n: int) -> str:
    RUNS["slow"] += 1
    await asyncio.sleep(30)
    return "late"


@server.custom_route("/runs", methods=["GET"])
async def runs(request: Request) -> JSONResponse:
    return JSONResponse(dict(RUNS))


def main() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    print("serving on 127.0.0.1:%d" % sock.getsockname()[1], file=sys.stderr, flush=True)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
