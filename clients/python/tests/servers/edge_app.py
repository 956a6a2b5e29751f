"""A FastMCP server with no admission of its own, for the gateway tests: nginx in front of it asks
admitd's edge check (``deploy/nginx/admitd-edge.conf``). ``python edge_app.py``; it prints
``serving on HOST:PORT`` on stderr once it listens, and counts every tool run (``GET /runs``), so
a test can tell refused calls from calls that ran."""

from __future__ import annotations

import asyncio
import collections
import socket
import sys

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse

from fastmcp import FastMCP

RUNS: "collections.Counter[str]" = collections.Counter()
mcp = FastMCP("search")


@mcp.tool
async def fan(n: int) -> str:
    RUNS["fan"] += 1
    await asyncio.sleep(0.3)  # overlap the fanned-out calls
    return f"result {n}"


@mcp.custom_route("/runs", methods=["GET"])
async def runs(request: Request) -> JSONResponse:
    return JSONResponse(dict(RUNS))


def main() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(mcp.http_app(), log_level="warning"))
    print("serving on 127.0.0.1:%d" % sock.getsockname()[1], file=sys.stderr, flush=True)
    asyncio.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
