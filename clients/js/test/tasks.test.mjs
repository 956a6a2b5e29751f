// admitd-client/tasks against the real admitd binary: a long call answered as an MCP task
// (the Tasks extension's wire format, revision 2026-07-28) with admitd's pollIntervalMs, polls
// checked with admitd, the lease renewed while the work runs and released when it ends.
// @modelcontextprotocol/sdk 1.32.2 implements only the experimental tasks of revision 2025-11-25,
// so the helper is tested on the wire format, not through the SDK.
//
//   ADMITD_BIN=target/debug/admitd node --test clients/js/test/tasks.test.mjs

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";

import { Admitd } from "admitd-client";
import { Tasks, UnknownTask, declaresTasks, isTask } from "admitd-client/tasks";
import { BIN, binaryExists, quiet, startDaemon } from "./support.mjs";

const CONFIG = `
[limits.subject]
rate = "100/s"
burst = 100
concurrency = 8
[tasks]
poll_interval = "1s"
poll_rate = "5/s"
max_poll_interval = "5s"
lease_ttl = "2s"
`;

const haveBinary = await binaryExists();

test("declaresTasks reads the request's per-request capabilities", () => {
  const meta = { "io.modelcontextprotocol/clientCapabilities": { extensions: { "io.modelcontextprotocol/tasks": {} } } };
  assert.equal(declaresTasks(meta), true);
  assert.equal(declaresTasks({}), false);
  assert.equal(declaresTasks(undefined), false);
  assert.equal(declaresTasks({ "io.modelcontextprotocol/clientCapabilities": { extensions: {} } }), false);
  assert.equal(declaresTasks({ "io.modelcontextprotocol/clientCapabilities": { extensions: { "io.modelcontextprotocol/tasks": true } } }), false);
});

describe("against the daemon", { skip: haveBinary ? false : `no admitd binary at ${BIN}` }, () => {
  let daemon;
  let admitd;
  const inflight = async (tenant) => (await admitd.tenant(tenant))?.inflight ?? 0;

  before(async () => {
    daemon = await startDaemon(CONFIG);
    admitd = new Admitd(daemon.url, { logger: quiet });
  });
  after(async () => daemon?.stop());

  test("a task is paced by admitd, kept alive while it runs, and released when done", async () => {
    const tasks = new Tasks(admitd, { ttlMs: 60_000, renewEveryMs: 500 });
    let finish;
    const finished = new Promise((ok) => (finish = ok));
    const created = await tasks.start({ tenant: "acme", subject: "worker", tool: "export" }, async () => {
      await finished;
      return { content: [{ type: "text", text: "exported" }] };
    });
    assert.equal(isTask(created), true);
    assert.equal(created.resultType, "task");
    assert.equal(created.status, "working");
    assert.equal(created.ttlMs, 60_000);
    assert.ok(created.pollIntervalMs >= 1000, `${created.pollIntervalMs}`);
    for (const key of ["taskId", "createdAt", "lastUpdatedAt"]) assert.equal(typeof created[key], "string");

    // Early: no news, told the time left.
    const early = await tasks.get(created.taskId);
    assert.equal(early.resultType, "complete");
    assert.match(early.statusMessage, /sooner/);
    assert.ok(early.pollIntervalMs <= created.pollIntervalMs);
    // On time: told the next interval.
    await sleep(created.pollIntervalMs);
    const onTime = await tasks.get(created.taskId);
    assert.equal(onTime.statusMessage, undefined);
    assert.ok(onTime.pollIntervalMs >= 1000);

    // Past its 2 s lease TTL the task still holds its slot: it is being renewed.
    await sleep(2500);
    assert.equal(await inflight("acme"), 1);
    finish();
    await sleep(200);
    const done = await tasks.get(created.taskId);
    assert.equal(done.status, "completed");
    assert.equal(done.result.content[0].text, "exported");
    assert.equal(await inflight("acme"), 0);
    await assert.rejects(tasks.get("no-such-task"), UnknownTask);
    await tasks.close();
  });

  test("a cancelled task gives its slot back, and a refused one is admitd's tool result", async () => {
    const tasks = new Tasks(admitd, { renewEveryMs: 500 });
    const created = await tasks.start({ tenant: "initech", subject: "w", tool: "export" }, (signal) =>
      new Promise((_, fail) => signal.addEventListener("abort", () => fail(new Error("aborted")))),
    );
    assert.equal(await inflight("initech"), 1);
    const cancelled = await tasks.cancel(created.taskId);
    assert.equal(cancelled.status, "cancelled");
    assert.equal(await inflight("initech"), 0);

    // Past the subject's 8 slots the call is refused: the answer is admitd's CallToolResult.
    const held = (signal) => new Promise((_, fail) => signal.addEventListener("abort", () => fail(new Error("aborted"))));
    for (let i = 0; i < 8; i++) await tasks.start({ tenant: "globex", subject: "w", tool: "export" }, held);
    const refused = await tasks.start({ tenant: "globex", subject: "w", tool: "export" }, held);
    assert.equal(isTask(refused), false);
    assert.equal(refused.isError, true);
    assert.equal(refused.structuredContent.scope, "concurrency");
    await tasks.close();
    assert.equal(await inflight("globex"), 0);
  });
});
