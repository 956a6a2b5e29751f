// The complete example server of docs/integrations.md (clients/js/examples/server.mjs), run as it
// stands: with its development token a call runs and a burst is refused with the wait; without a
// credential the HTTP answer is a JSON-RPC 401; without an identity a call is not run, and the
// model reads why.

import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { InMemoryTransport } from "@modelcontextprotocol/sdk/inMemory.js";

import { BIN, ROOT, binaryExists, closedPort, startDaemon, startNode } from "./support.mjs";

const haveBinary = await binaryExists();
const EXAMPLE = join(ROOT, "clients", "js", "examples", "server.mjs");

describe("the example server", { skip: haveBinary ? false : `no admitd binary at ${BIN}` }, () => {
  let daemon;
  let server;
  let port;

  before(async () => {
    daemon = await startDaemon(await readFile(join(ROOT, "clients", "e2e.toml"), "utf8"));
    port = await closedPort();
    process.env.ADMITD_URL = daemon.url;
    process.env.PORT = String(port);
    server = await startNode(EXAMPLE, []);
  });
  after(async () => {
    await server?.stop();
    await daemon?.stop();
  });

  test("the development token runs calls until the burst is spent", { timeout: 60000 }, async () => {
    const client = new Client({ name: "example", version: "1.0.0" });
    await client.connect(
      new StreamableHTTPClientTransport(new URL(`${server.base}/mcp`), {
        requestInit: { headers: { Authorization: "Bearer dev-token-acme" } },
      }),
    );
    try {
      const results = [];
      for (let i = 0; i < 5; i++) results.push(await client.callTool({ name: "get_sales", arguments: { region: "emea" } }));
      assert.deepEqual(results.map((r) => Boolean(r.isError)), [false, false, false, false, true]);
      assert.equal(results[0].content[0].text, "sales in emea: 42");
      assert.match(results[4].content[0].text, /Wait \d+ seconds?/);
    } finally {
      await client.close();
    }
  });

  test("without a credential the answer is a JSON-RPC 401", async () => {
    const resp = await fetch(`${server.base}/mcp`, {
      method: "POST",
      headers: { "content-type": "application/json", accept: "application/json, text/event-stream" },
      body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "tools/list" }),
    });
    assert.equal(resp.status, 401);
    assert.match((await resp.json()).error.message, /no valid credential/);
  });

  test("a call without identity is not run and says why", async () => {
    const { buildServer, admission } = await import(EXAMPLE);
    const warned = [];
    admission.admitd.logger = { warn: (m) => warned.push(m), info() {} };
    const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
    const mcp = buildServer();
    await mcp.connect(serverSide);
    const client = new Client({ name: "in-process", version: "1.0.0" });
    await client.connect(clientSide);
    try {
      const result = await client.callTool({ name: "get_sales", arguments: { region: "emea" } });
      assert.equal(result.isError, true);
      assert.match(result.content[0].text, /cannot tell who is calling/);
      assert.doesNotMatch(result.content[0].text, /Internal server error/);
      assert.equal(result.structuredContent.error, "no_identity");
      assert.equal(result.structuredContent.retryable, false);
      assert.ok(warned.some((m) => m.includes("get_sales not run")), warned.join("\n"));
    } finally {
      await client.close();
    }
  });
});
