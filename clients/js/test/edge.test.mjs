// At the gateway: a real nginx running deploy/nginx/admitd-edge.conf in front of an MCP server built
// with @modelcontextprotocol/sdk that does no admission of its own, admitd's edge check deciding,
// and the SDK's own client calling through nginx with an [edge] API key. A refused call must reach
// the client as the answer a server would give: a CallToolResult with isError whose text names the
// wait; a call without a credential a JSON-RPC 401 that names the problem.
//
// The SDK 1.x speaks MCP up to 2025-11-25 and sends neither Mcp-Method nor Mcp-Name, which the edge
// check limits on (MCP 2026-07-28 clients send them): withMcpHeaders adds them from the body, and
// the check accepts 2025-11-25 (min_protocol_version).

import http from "node:http";
import { createHash } from "node:crypto";
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { z } from "zod";
import { withMcpHeaders } from "admitd-client/mcp";

import { BIN, binaryExists, nginxBinary, startDaemon, startNginx } from "./support.mjs";

const KEY = "acme-gateway-key-5b0c";
const WAIT = /Wait (\d+) seconds?/;
// A subject bucket of 4 that refills one call per 10 s: a burst of 10 parallel calls runs 4.
const CONFIG = `
[limits.subject]
rate = "6/min"
burst = 4
[edge]
client_address_header = "x-real-ip"
min_protocol_version = "2025-11-25"
[[edge.api_keys]]
sha256 = "${createHash("sha256").update(KEY).digest("hex")}"
tenant = "acme"
subject = "acme-gateway"
`;

/** A stateless MCP server with one tool, counting its runs. */
async function startServer() {
  let runs = 0;
  const httpServer = http.createServer(async (req, res) => {
    const server = new McpServer({ name: "search", version: "1.0.0" });
    server.registerTool("fan", { inputSchema: { n: z.number() } }, async ({ n }) => {
      runs += 1;
      await new Promise((r) => setTimeout(r, 300)); // overlap the fanned-out calls
      return { content: [{ type: "text", text: `result ${n}` }] };
    });
    const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse: true });
    res.on("close", () => {
      transport.close();
      server.close();
    });
    await server.connect(transport);
    await transport.handleRequest(req, res);
  });
  await new Promise((ok) => httpServer.listen(0, "127.0.0.1", ok));
  return {
    addr: `127.0.0.1:${httpServer.address().port}`,
    runs: () => runs,
    stop: () => new Promise((ok) => httpServer.close(ok)),
  };
}

const haveBinary = await binaryExists();
const nginx = await nginxBinary();
const skip = !haveBinary ? `no admitd binary at ${BIN}` : !nginx ? "no nginx binary (apt-get install nginx-light)" : false;

describe("the TypeScript SDK behind nginx's edge check", { skip }, () => {
  let daemon;
  let server;
  let gateway;

  before(async () => {
    daemon = await startDaemon(CONFIG);
    server = await startServer();
    gateway = await startNginx(nginx, daemon.url, server.addr);
  });
  after(async () => {
    await gateway?.stop();
    await server?.stop();
    await daemon?.stop();
  });

  async function connect(headers) {
    const client = new Client({ name: "edge", version: "1.0.0" });
    const transport = new StreamableHTTPClientTransport(new URL(gateway.url), {
      requestInit: { headers },
      fetch: withMcpHeaders(),
    });
    await client.connect(transport);
    return client;
  }

  test("a burst of 10 on 4 runs 4, and the model reads the wait of the others", { timeout: 60000 }, async () => {
    const before = server.runs();
    const c = await connect({ Authorization: `Bearer ${KEY}` });
    try {
      const results = await Promise.all(
        Array.from({ length: 10 }, (_, n) => c.callTool({ name: "fan", arguments: { n } })),
      );
      const ran = results.filter((r) => !r.isError);
      assert.equal(ran.length, 4, JSON.stringify(results));
      assert.equal(server.runs() - before, 4);
      for (const r of results.filter((r) => r.isError)) {
        const wait = WAIT.exec(r.content[0].text);
        assert.ok(wait, r.content[0].text);
        assert.ok(Number(wait[1]) >= 1);
        assert.equal(r.structuredContent.error, "rate_limited");
        assert.equal(r.structuredContent.scope, "subject");
        assert.equal(Math.ceil(r.structuredContent.retry_after_ms / 1000), Number(wait[1]));
      }
    } finally {
      await c.close();
    }
  });

  test("without a credential the client hears a JSON-RPC 401 that names the problem", { timeout: 30000 }, async () => {
    const resp = await fetch(gateway.url, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        accept: "application/json, text/event-stream",
        "mcp-protocol-version": "2025-11-25",
        "mcp-method": "tools/call",
        "mcp-name": "fan",
      },
      body: JSON.stringify({ jsonrpc: "2.0", id: 3, method: "tools/call", params: { name: "fan", arguments: { n: 1 } } }),
    });
    assert.equal(resp.status, 401);
    assert.equal(resp.headers.get("content-type"), "application/json");
    const answer = await resp.json();
    assert.equal(answer.jsonrpc, "2.0");
    assert.equal(answer.id, 3);
    assert.match(answer.error.message, /no valid credential/);
    // The SDK's client says the same.
    await assert.rejects(connect({}), /no valid credential/);
  });
});
