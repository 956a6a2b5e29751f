"""A complete FastMCP server guarded by admitd, identity included: run it as it stands.

    pip install "./clients/python[fastmcp]"
    admitd serve &                                       # admitd on 127.0.0.1:9470
    python clients/python/examples/fastmcp_server.py     # MCP on http://127.0.0.1:8000/mcp

and call it with ``Authorization: Bearer dev-token-acme`` (FastMCP:
``Client("http://127.0.0.1:8000/mcp", auth="dev-token-acme")``). The environment variables
``ADMITD_URL`` and ``PORT`` change the two addresses. clients/python/tests/test_examples.py runs
this file."""

import os

from fastmcp import FastMCP
from fastmcp.server.auth.providers.jwt import StaticTokenVerifier

from admitd_client.fastmcp import AdmitdMiddleware

ADMITD_URL = os.environ.get("ADMITD_URL", "http://127.0.0.1:9470")

# DEVELOPMENT ONLY: tokens written in the source, accepted as they are. Each one stands for a
# caller; its "tenant" and "sub" claims are what admitd keys its limits on. Never deploy this.
auth = StaticTokenVerifier(
    tokens={
        "dev-token-acme": {"client_id": "acme-bot", "scopes": [], "tenant": "acme", "sub": "acme-bot"},
        "dev-token-globex": {"client_id": "globex-bot", "scopes": [], "tenant": "globex", "sub": "globex-bot"},
    }
)
# In production, plug in the verifier of your identity provider instead, for example JWTs:
#
#     from fastmcp.server.auth.providers.jwt import JWTVerifier
#     auth = JWTVerifier(
#         jwks_uri="https://auth.example.com/.well-known/jwks.json",
#         issuer="https://auth.example.com/",
#         audience="mcp.example.com",
#     )
#
# Its tokens need a "tenant" claim (and "sub"); if the tenant lives elsewhere, pass
# AdmitdMiddleware(..., identity=lambda token: (tenant, subject)).

mcp = FastMCP("sales", auth=auth)
mcp.add_middleware(AdmitdMiddleware(ADMITD_URL, upstreams={"get_sales": "warehouse"}))


@mcp.tool
def get_sales(region: str) -> str:
    """Sales of a region."""
    return f"sales in {region}: 42"


if __name__ == "__main__":
    mcp.run(transport="http", host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
