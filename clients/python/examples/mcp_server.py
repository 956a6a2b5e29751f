"""A complete server built with the official ``mcp`` SDK, guarded by admitd, identity included:
run it as it stands.

    pip install "./clients/python[mcp]"
    admitd serve &                                   # admitd on 127.0.0.1:9470
    python clients/python/examples/mcp_server.py     # MCP on http://127.0.0.1:8000/mcp

and call it with ``Authorization: Bearer dev-token-acme``. The environment variables
``ADMITD_URL`` and ``PORT`` change the two addresses. clients/python/tests/test_examples.py runs
this file."""

import os
from typing import Optional

import uvicorn
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer

from admitd_client.mcp import Admission

ADMITD_URL = os.environ.get("ADMITD_URL", "http://127.0.0.1:9470")
PORT = int(os.environ.get("PORT", "8000"))

# DEVELOPMENT ONLY: tokens written in the source, accepted as they are. Each one stands for a
# caller; its "tenant" and "sub" claims are what admitd keys its limits on. Never deploy this.
DEV_TOKENS = {
    "dev-token-acme": {"tenant": "acme", "sub": "acme-bot"},
    "dev-token-globex": {"tenant": "globex", "sub": "globex-bot"},
}


class DevelopmentTokens:
    """DEVELOPMENT ONLY: a token verifier that knows the tokens above. In production, use one
    that validates your identity provider's tokens (a JWT's signature, issuer, audience and
    expiry, or an introspection call) and returns the same ``AccessToken`` with its claims."""

    async def verify_token(self, token: str) -> Optional[AccessToken]:
        who = DEV_TOKENS.get(token)
        if who is None:
            return None
        return AccessToken(token=token, client_id=who["sub"], scopes=[], subject=who["sub"], claims=who)


server = MCPServer(
    "sales",
    token_verifier=DevelopmentTokens(),
    auth=AuthSettings(
        issuer_url="https://auth.example.com",  # your authorization server
        resource_server_url=f"http://127.0.0.1:{PORT}/mcp",  # this server, as clients reach it
        # True with a verifier that reports each token's resource; the development one does not.
        validate_token_resource=False,
    ),
)
# Tenant and subject come from the validated token's "tenant" and "sub" claims;
# pass identity=lambda token: (tenant, subject) to read them elsewhere.
admission = Admission(ADMITD_URL, upstreams={"get_sales": "warehouse"})


@server.tool()
@admission.tool()
async def get_sales(region: str) -> str:
    """Sales of a region."""
    return f"sales in {region}: 42"


if __name__ == "__main__":
    uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=PORT, log_level="warning")
