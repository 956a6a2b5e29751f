// A complete MCP server built with @modelcontextprotocol/sdk, guarded by admitd, identity
// included: run it as it stands.
//
//   npm install ./clients/js @modelcontextprotocol/sdk zod
//   admitd serve &                            # admitd on 127.0.0.1:9470
//   node clients/js/examples/server.mjs       # MCP on http://127.0.0.1:8000/mcp
//
// and call it with `Authorization: Bearer dev-token-acme`. The environment variables ADMITD_URL and
// PORT change the two addresses. clients/js/test/examples.test.mjs runs this file.
import http from "node:http";
import { pathToFileURL } from "node:url";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { z } from "zod";
import { Admission } from "admitd-client/mcp";

const ADMITD_URL = process.env.ADMITD_URL ?? "http://127.0.0.1:9470";
const PORT = Number(process.env.PORT ?? 8000);

// DEVELOPMENT ONLY: tokens written in the source, accepted as they are. Each one stands for a
// caller; its tenant and sub are what admitd keys its limits on. Never deploy this.
const DEV_TOKENS = {
  "dev-token-acme": { tenant: "acme", sub: "acme-bot" },
  "dev-token-globex": { tenant: "globex", sub: "globex-bot" },
};

// Returns the SDK's AuthInfo for a request's bearer token, or undefined. In production, verify
// your identity provider's tokens here instead (a JWT's signature, issuer, audience and expiry,
// e.g. with `jose`'s jwtVerify against the provider's JWKS) and return the same shape:
// { token, clientId, scopes, extra: { tenant, sub } }.
function verify(authorization) {
  const token = authorization?.match(/^Bearer (.+)$/)?.[1];
  const who = token === undefined ? undefined : DEV_TOKENS[token];
  return who && { token, clientId: who.sub, scopes: [], extra: { ...who } };
}

// Tenant and subject come from extra.authInfo (its extra.tenant and extra.sub);
// pass { identity: (extra) => ({ tenant, subject }) } to read them elsewhere.
export const admission = new Admission(ADMITD_URL, { upstreams: { get_sales: "warehouse" } });

export function buildServer() {
  const server = new McpServer({ name: "sales", version: "1.0.0" });
  server.registerTool(
    "get_sales",
    { description: "Sales of a region", inputSchema: { region: z.string() } },
    admission.tool("get_sales", async ({ region }) => ({
      content: [{ type: "text", text: `sales in ${region}: 42` }],
    })),
  );
  return server;
}

// One server and transport per request (stateless streamable HTTP); the verified identity goes to
// the transport as req.auth, which the SDK hands to the tool as extra.authInfo.
const httpServer = http.createServer(async (req, res) => {
  req.auth = verify(req.headers.authorization);
  if (!req.auth) {
    res.writeHead(401, { "content-type": "application/json", "www-authenticate": 'Bearer realm="mcp"' });
    res.end(JSON.stringify({ jsonrpc: "2.0", id: null, error: { code: -32011, message: "no valid credential: send Authorization: Bearer <token>" } }));
    return;
  }
  const server = buildServer();
  const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse: true });
  res.on("close", () => {
    transport.close();
    server.close();
  });
  await server.connect(transport);
  await transport.handleRequest(req, res);
});

if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href) {
  httpServer.listen(PORT, "127.0.0.1", () => console.error(`serving on 127.0.0.1:${PORT}`));
}
