// End to end with real peers: admitd (the built binary), an MCP server built with
// @modelcontextprotocol/sdk whose tools are wrapped by admitd's Admission (server.ts, type-checked
// with `tsc --strict` and compiled to build/server.js first), and the SDK's own client, over
// streamable HTTP.
//
//   npx tsc --strict -p clients/js/test && ADMITD_BIN=target/debug/admitd node --test clients/js/test/*.test.mjs

import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

import { BIN, ROOT, binaryExists, startDaemon, startNode } from "./support.mjs";

const WAIT = /Wait (\d+) seconds?/;
const haveBinary = await binaryExists();

describe("MCP SDK server and client, end to end", { skip: haveBinary ? false : `no admitd binary at ${BIN}` }, () => {
  let daemon;
  let server;

  before(async () => {
    daemon = await startDaemon(await readFile(join(ROOT, "clients", "e2e.toml"), "utf8"));
    server = await startNode(join(ROOT, "clients", "js", "test", "build", "server.js"), [daemon.url]);
  });
  after(async () => {
    await server?.stop();
    await daemon?.stop();
  });

  const runs = async () => (await fetch(`${server.base}/runs`)).json();
  const inflight = async (tenant) => {
    const resp = await fetch(`${daemon.url}/v1/tenants/${tenant}`);
    return resp.status === 404 ? 0 : (await resp.json()).inflight;
  };
  async function connect(token) {
    const client = new Client({ name: "e2e", version: "1.0.0" });
    const transport = new StreamableHTTPClientTransport(new URL(`${server.base}/mcp`), {
      requestInit: { headers: { Authorization: `Bearer ${token}` } },
    });
    await client.connect(transport);
    return client;
  }
  function assertRefused(result, scope = "subject") {
    assert.equal(result.isError, true, JSON.stringify(result));
    const wait = WAIT.exec(result.content[0].text);
    assert.ok(wait, result.content[0].text);
    assert.equal(result.structuredContent.error, "rate_limited");
    assert.equal(result.structuredContent.scope, scope);
    return Number(wait[1]);
  }

  test("a tool reports the tokens its model used, and the agent sees what is left", { timeout: 60000 }, async () => {
    const before = (await runs()).summarize ?? 0;
    const client = await connect("tok-acme-spend");
    try {
      const results = [];
      for (let i = 0; i < 3; i++) {
        results.push(
          await client.callTool({ name: "summarize", arguments: { text: `report ${i}` }, _meta: { "admitd/run": "r-1" } }),
        );
      }
      // 500 reserved per call, 900 settled: after two calls 200 of the day's 2000 are left.
      assert.deepEqual(
        results.map((r) => Boolean(r.isError)),
        [false, false, true],
      );
      assert.equal(((await runs()).summarize ?? 0) - before, 2);
      assert.deepEqual(results[1]._meta["admitd/spend"].tokens, { reserved: 500, remaining: 600, budget: "subject_daily" });
      const refused = results[2].structuredContent;
      assert.equal(refused.scope, "spend");
      assert.equal(refused.unit, "tokens");
      assert.equal(refused.budget, "subject_daily");
      assert.equal(refused.remaining, 200);
      assert.match(results[2].content[0].text, /2000 tokens/);
    } finally {
      await client.close();
    }
  });

  test("a fan-out runs exactly the admitted calls", { timeout: 60000 }, async () => {
    const before = (await runs()).fan ?? 0;
    const acme = await connect("tok-acme-fan");
    const globex = await connect("tok-globex");
    try {
      const call = (c, n) => c.callTool({ name: "fan", arguments: { n } });
      const results = await Promise.all([
        ...Array.from({ length: 10 }, (_, n) => call(acme, n)),
        ...Array.from({ length: 10 }, (_, n) => call(globex, n)),
      ]);
      const acmeResults = results.slice(0, 10);
      const ran = acmeResults.filter((r) => !r.isError);
      assert.equal(ran.length, 4, JSON.stringify(acmeResults));
      for (const r of acmeResults.filter((r) => r.isError)) assert.ok(assertRefused(r) >= 1);
      assert.ok(results.slice(10).every((r) => !r.isError), "every call of the second tenant ran");
      assert.equal(((await runs()).fan ?? 0) - before, 14);
      assert.equal(await inflight("acme"), 0);
    } finally {
      await acme.close();
      await globex.close();
    }
  });

  test("a refusal fits a tool with an output schema, and one without arguments", { timeout: 60000 }, async () => {
    const c = await connect("tok-acme-typed");
    try {
      for (let i = 0; i < 2; i++) {
        const ok = await c.callTool({ name: "report", arguments: { n: 1 } });
        assert.equal(ok.isError, undefined, JSON.stringify(ok));
        assert.deepEqual(ok.structuredContent, { region: "emea", total: 1 });
      }
      assert.equal((await c.callTool({ name: "no_args", arguments: {} })).isError, undefined);
      assert.equal((await c.callTool({ name: "legacy", arguments: { n: 3 } })).isError, undefined);
      const before = await runs();
      // The client validates structuredContent against the output schema only for results
      // that are not errors, so the refusal reaches the caller as it is.
      assertRefused(await c.callTool({ name: "report", arguments: { n: 2 } }));
      assertRefused(await c.callTool({ name: "no_args", arguments: {} }));
      assertRefused(await c.callTool({ name: "legacy", arguments: { n: 3 } }));
      assert.deepEqual(await runs(), before, "no refused call ran");
    } finally {
      await c.close();
    }
  });

  test("an upstream 429 puts the upstream in the penalty box", { timeout: 60000 }, async () => {
    const c = await connect("tok-initech");
    try {
      const busy = await c.callTool({ name: "get_sales", arguments: { region: "busy" } });
      assert.equal(busy.isError, true);
      assert.equal((await runs()).get_sales, 1);
      const again = await c.callTool({ name: "get_sales", arguments: { region: "emea" } });
      assert.ok(assertRefused(again, "upstream_penalty") >= 25);
      assert.equal((await runs()).get_sales, 1, "the refused call did not run");
    } finally {
      await c.close();
    }
  });

  test("a failed or cancelled call gives its slot back", { timeout: 60000 }, async () => {
    const c = await connect("tok-acme-outcomes");
    try {
      const failed = await c.callTool({ name: "fails", arguments: { n: 1 } });
      assert.equal(failed.isError, true);
      assert.equal(await inflight("acme"), 0);
      const ac = new AbortController();
      const pending = c.callTool({ name: "slow", arguments: { n: 1 } }, undefined, { signal: ac.signal });
      const deadline = Date.now() + 20000;
      while ((await inflight("acme")) === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
      assert.equal(await inflight("acme"), 1);
      ac.abort();
      await assert.rejects(pending);
      while ((await inflight("acme")) !== 0 && Date.now() < deadline + 20000) await new Promise((r) => setTimeout(r, 50));
      assert.equal(await inflight("acme"), 0);
    } finally {
      await c.close();
    }
  });
});
