"""A server built with the official ``mcp`` SDK (``MCPServer``) whose ``export_orders`` tool runs
for seconds, answered as an MCP task with admitd's ``pollIntervalMs`` (``AdmitdTasks``), for the
end-to-end tests: ``python mcp_tasks_app.py ADMITD_URL``. It prints ``serving on HOST:PORT`` on
stderr once it listens."""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Optional

import uvicorn

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from tokens import TOKENS

ADMITD_URL = sys.argv[1]


class StaticTokens:
    """A token verifier that knows the tests' bearer tokens."""

    async def verify_token(self, token: str) -> Optional[AccessToken]:
        who = TOKENS.get(token)
        if who is None:
            return None
        return AccessToken(token=token, client_id=who["sub"], scopes=[], subject=who["sub"], claims=who)


token_verifier = StaticTokens()
auth = AuthSettings(issuer_url="http://127.0.0.1", resource_server_url="http://127.0.0.1/mcp")

# [integrations:mcp-tasks]
from admitd_client.mcp_tasks import AdmitdTasks

# export_orders needs no Admission wrapper: AdmitdTasks admits it, as a task for clients that
# declare the Tasks extension and as an ordinary call for the others.
tasks = AdmitdTasks(ADMITD_URL, tools={"export_orders"}, renew_every_s=0.5)  # tests: a 2 s lease_ttl
server = MCPServer("exports", token_verifier=token_verifier, auth=auth, extensions=[tasks])


@server.tool()
async def export_orders(region: str) -> str:
    await asyncio.sleep(3)  # minutes, in a real export
    return f"exported the orders of {region}"
# [/integrations:mcp-tasks]


def main() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    uv = uvicorn.Server(config)
    print("serving on 127.0.0.1:%d" % sock.getsockname()[1], file=sys.stderr, flush=True)
    asyncio.run(uv.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
