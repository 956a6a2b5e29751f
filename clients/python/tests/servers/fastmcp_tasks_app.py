"""A FastMCP server whose ``export_orders`` tool runs for seconds, answered as an MCP task with
admitd's ``pollIntervalMs`` (``AdmitdTasks``), for the end-to-end tests:
``python fastmcp_tasks_app.py ADMITD_URL``. It prints ``serving on HOST:PORT`` on stderr once it
listens."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn

from fastmcp import FastMCP
from fastmcp.server.auth.providers.jwt import StaticTokenVerifier
from tokens import TOKENS

ADMITD_URL = sys.argv[1]
auth = StaticTokenVerifier(
    tokens={token: {"client_id": who["sub"], "scopes": [], **who} for token, who in TOKENS.items()}
)

# [integrations:fastmcp-tasks]
from admitd_client.fastmcp import AdmitdMiddleware
from admitd_client.fastmcp_tasks import AdmitdTasks

mcp = FastMCP("exports", auth=auth)
# Calls of export_orders from clients that declare the Tasks extension become tasks: admitted by
# admitd as tasks, answered at once with admitd's pollIntervalMs, renewed while they run.
tasks = AdmitdTasks(ADMITD_URL, tools={"export_orders"}, renew_every_s=0.5)  # tests: a 2 s lease_ttl
mcp.add_extension(tasks)
mcp.add_middleware(AdmitdMiddleware(ADMITD_URL, tasks=tasks))


@mcp.tool
async def export_orders(region: str) -> str:
    await asyncio.sleep(3)  # minutes, in a real export
    return f"exported the orders of {region}"
# [/integrations:fastmcp-tasks]


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
