// Tests of the JavaScript client against the real admitd binary (ADMITD_BIN, default
// target/debug/admitd), started on a free port, and against tiny servers that misbehave on purpose.
//
//   ADMITD_BIN=target/debug/admitd node --test clients/js/test/

import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { createServer } from "node:net";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";

import { Admitd, AdmitdError, AdmitdUnavailable } from "admitd-client";
import { BIN, ROOT, binaryExists, closedPort, quiet, startDaemon } from "./support.mjs";

const CONFIG = await readFile(join(ROOT, "clients", "test.toml"), "utf8");

const haveBinary = await binaryExists();

describe("against the daemon", { skip: haveBinary ? false : `no admitd binary at ${BIN}` }, () => {
  let daemon;
  let admitd;
  const inflight = async (tenant) => (await admitd.tenant(tenant))?.inflight ?? 0;

  before(async () => {
    daemon = await startDaemon(CONFIG);
    admitd = new Admitd(daemon.url, { logger: quiet });
  });
  after(async () => daemon?.stop());

  test("admit, then release", async () => {
    const d = await admitd.admit({ tenant: "t-admit", subject: "bot", tool: "search", callId: "c-1" });
    assert.equal(d.admitted, true);
    assert.equal(d.degraded, false);
    assert.ok(d.leaseId);
    assert.equal(d.body.remaining, 1);
    assert.ok(d.headers.ratelimit);
    assert.equal(await inflight("t-admit"), 1);
    assert.equal(await admitd.release(d.leaseId, "ok", { durationMs: 12.5 }), true);
    assert.equal(await inflight("t-admit"), 0);
    assert.equal(await admitd.release(d.leaseId), false, "released already");
  });

  test("a refusal returns the tool result and does not run the tool", async () => {
    for (let i = 0; i < 2; i++) {
      assert.equal((await admitd.admit({ tenant: "t-shed", subject: "bot", tool: "search", maxWaitMs: 0 })).admitted, true);
    }
    let ran = false;
    const result = await admitd.call({ tenant: "t-shed", subject: "bot", tool: "search", maxWaitMs: 0 }, async () => {
      ran = true;
    });
    assert.equal(ran, false);
    assert.equal(result.isError, true);
    assert.match(result.content[0].text, /Wait \d+ seconds?/);
    assert.equal(result.structuredContent.error, "rate_limited");
    assert.equal(result.structuredContent.scope, "subject");
  });

  test("the lease is released with the outcome the function had", async () => {
    const value = await admitd.call({ tenant: "t-ok", subject: "bot", tool: "search" }, async (call) => {
      assert.equal(call.decision.admitted, true);
      assert.equal(await inflight("t-ok"), 1);
      return 42;
    });
    assert.equal(value, 42);
    assert.equal(await inflight("t-ok"), 0);

    await assert.rejects(
      admitd.call({ tenant: "t-err", subject: "bot", tool: "search" }, async () => {
        assert.equal(await inflight("t-err"), 1);
        throw new RangeError("tool failed");
      }),
      RangeError,
    );
    assert.equal(await inflight("t-err"), 0);
  });

  test("an upstream 429 puts the upstream in the penalty box", async () => {
    await admitd.call({ tenant: "t-429", subject: "bot", tool: "get_sales" }, async (call) => {
      call.upstreamResponse(429, "30");
    });
    const again = await admitd.admit({ tenant: "t-429", subject: "other", tool: "get_sales", maxWaitMs: 0 });
    assert.equal(again.admitted, false);
    assert.equal(again.scope, "upstream_penalty");
    assert.ok(again.retryAfterMs > 25000, `${again.retryAfterMs}`);
    const other = await admitd.admit({ tenant: "t-429-b", subject: "bot", tool: "get_sales" });
    assert.equal(other.admitted, true, "another tenant's budget is untouched");
  });

  test("feedback outside a lease", async () => {
    await admitd.feedback({ tenant: "t-fb", upstream: "warehouse", status: 429, retryAfter: 20 });
    const d = await admitd.admit({ tenant: "t-fb", subject: "bot", tool: "get_sales", maxWaitMs: 0 });
    assert.deepEqual([d.admitted, d.scope], [false, "upstream_penalty"]);
  });

  test("malformed requests throw", async () => {
    await assert.rejects(admitd.admit({ tenant: "t-bad", subject: "x".repeat(200), tool: "search" }), (e) => {
      assert.ok(e instanceof AdmitdError);
      assert.equal(e.status, 400);
      assert.equal(e.code, "invalid_request");
      return true;
    });
    await assert.rejects(admitd.release("whatever", "done"), TypeError);
  });

  test("names travel as sent", async () => {
    const d = await admitd.admit({ tenant: "t é/?#", subject: "bot", tool: "search" });
    assert.equal(d.admitted, true);
    assert.equal((await admitd.tenant("t é/?#")).tenant, "t é/?#");
    assert.equal(await admitd.release(d.leaseId), true);
    assert.equal(await admitd.tenant("nobody-here"), null);
  });

  test("an aborted call is released as cancelled", async () => {
    const ac = new AbortController();
    let running;
    const started = new Promise((ok) => (running = ok));
    const pending = admitd.call({ tenant: "t-abort", subject: "bot", tool: "search" }, async () => {
      const aborted = new Promise((_, fail) =>
        ac.signal.addEventListener("abort", () => fail(Object.assign(new Error("aborted"), { name: "AbortError" }))),
      );
      running();
      await aborted;
    });
    await started;
    assert.equal(await inflight("t-abort"), 1);
    ac.abort();
    await assert.rejects(pending, { name: "AbortError" });
    assert.equal(await inflight("t-abort"), 0);
  });
  test("proxies named in the environment or a global fetch are not used", { timeout: 30000 }, async () => {
    // A proxy that refuses everything, as one that cannot reach loopback would.
    let proxied = 0;
    const open = new Set();
    const proxy = createServer((sock) => {
      proxied += 1;
      open.add(sock);
      sock.end("HTTP/1.1 403 Forbidden\r\ncontent-length: 6\r\nconnection: close\r\n\r\ndenied");
    });
    await new Promise((ok) => proxy.listen(0, "127.0.0.1", ok));
    const proxyUrl = `http://127.0.0.1:${proxy.address().port}`;
    const realFetch = globalThis.fetch;
    try {
      // A process-wide fetch that goes through the proxy.
      globalThis.fetch = (url, init) => realFetch(proxyUrl, { ...init, headers: { ...init?.headers, "x-to": String(url) } });
      const d = await admitd.admit({ tenant: "t-proxy", subject: "bot", tool: "search" });
      assert.equal(d.admitted, true);
      assert.equal(await admitd.release(d.leaseId), true);
      globalThis.fetch = realFetch;

      // Node's own proxy support, switched on by the environment, in a process of its own.
      const script =
        `import { Admitd } from ${JSON.stringify(join(ROOT, "clients", "js", "index.js"))};` +
        `const a = new Admitd(${JSON.stringify(daemon.url)}, { failOpen: false });` +
        `const d = await a.admit({ tenant: "t-proxy-env", subject: "bot", tool: "search" });` +
        `console.log(JSON.stringify([d.admitted, d.degraded, await a.release(d.leaseId)]));`;
      const env = { ...process.env, NODE_USE_ENV_PROXY: "1", HTTP_PROXY: proxyUrl, http_proxy: proxyUrl, NO_PROXY: "", no_proxy: "" };
      const child = spawn(process.execPath, ["--input-type=module", "-e", script], { env, stdio: ["ignore", "pipe", "inherit"] });
      let out = "";
      child.stdout.setEncoding("utf8").on("data", (c) => (out += c));
      const code = await new Promise((ok) => child.on("exit", ok));
      assert.equal(code, 0);
      assert.deepEqual(JSON.parse(out), [true, false, true]);
      assert.equal(proxied, 0, "no request went to the proxy");
    } finally {
      globalThis.fetch = realFetch;
      for (const sock of open) sock.destroy();
      await new Promise((ok) => proxy.close(ok));
    }
  });

  test("requests share kept-alive connections", { timeout: 30000 }, async () => {
    const sockets = new Set();
    const watch = (req) => req.on("socket", (s) => sockets.add(s));
    // Count the distinct sockets behind ten sequential requests.
    const agent = admitd.agent;
    const orig = agent.addRequest;
    agent.addRequest = function (req, opts) {
      watch(req);
      return orig.call(this, req, opts);
    };
    try {
      for (let i = 0; i < 10; i++) assert.equal(await admitd.tenant("nobody-here"), null);
    } finally {
      agent.addRequest = orig;
    }
    assert.equal(sockets.size, 1, `${sockets.size} connections for 10 requests`);
  });
});

describe("over a Unix socket, with a caller token required", { skip: haveBinary ? false : `no admitd binary at ${BIN}` }, () => {
  const TOKEN = "client-test-token-7f3a9c";
  let daemon;
  let sockDir;
  before(async () => {
    sockDir = await mkdtemp(join(tmpdir(), "admitd-js-sock-"));
    const digest = createHash("sha256").update(TOKEN).digest("hex");
    const config = CONFIG.replace("[server]\n", `[server]\napi_tokens_sha256 = ["${digest}"]\n`);
    daemon = await startDaemon(config, `unix:${join(sockDir, "admitd.sock")}`);
  });
  after(async () => {
    await daemon?.stop();
    await rm(sockDir, { recursive: true, force: true });
  });

  test("calls go over the socket with the token", async () => {
    assert.equal(daemon.url, `unix:${join(sockDir, "admitd.sock")}`);
    const admitd = new Admitd(daemon.url, { token: TOKEN, logger: quiet });
    const value = await admitd.call({ tenant: "u-js", subject: "bot", tool: "search" }, async (call) => {
      assert.equal(call.decision.degraded, false);
      assert.equal((await admitd.tenant("u-js")).inflight, 1);
      return "ran";
    });
    assert.equal(value, "ran");
    assert.equal((await admitd.tenant("u-js")).inflight, 0);
    admitd.close();
    const anonymous = new Admitd(daemon.url, { logger: quiet });
    await assert.rejects(anonymous.admit({ tenant: "u-js", subject: "bot", tool: "search" }), (e) => {
      assert.ok(e instanceof AdmitdError);
      assert.equal(e.status, 401);
      return true;
    });
    anonymous.close();
    assert.throws(() => new Admitd(daemon.url, { token: "abc\r\nx-evil: 1" }), TypeError);
  });
});

describe("without the daemon", () => {
  test("fail open runs the call without a lease", async () => {
    const warned = [];
    const admitd = new Admitd(`http://127.0.0.1:${await closedPort()}`, { logger: { warn: (m) => warned.push(m) } });
    const value = await admitd.call({ tenant: "t", subject: "bot", tool: "search" }, async (call) => {
      assert.equal(call.decision.degraded, true);
      assert.equal(call.decision.leaseId, null);
      return "ran";
    });
    assert.equal(value, "ran");
    assert.equal(warned.length, 1);
  });

  test("fail closed refuses with a tool result", async () => {
    const admitd = new Admitd(`http://127.0.0.1:${await closedPort()}`, { failOpen: false, unavailableRetryS: 7, logger: quiet });
    const d = await admitd.admit({ tenant: "t", subject: "bot", tool: "search" });
    assert.equal(d.admitted, false);
    assert.equal(d.degraded, true);
    assert.equal(d.retryAfterMs, 7000);
    assert.match(d.toolResult.content[0].text, /Wait 7 seconds/);
    await assert.rejects(admitd.release("00", "ok"), AdmitdUnavailable);
  });

  test("the choice is named fail_open or fail_closed", async () => {
    const url = `http://127.0.0.1:${await closedPort()}`;
    assert.equal(new Admitd(url).onUnavailable, "fail_open");
    assert.equal(new Admitd(url, { failOpen: false }).onUnavailable, "fail_closed");
    const admitd = new Admitd(url, { onUnavailable: "fail_closed", unavailableRetryS: 3, logger: quiet });
    const d = await admitd.admit({ tenant: "t", subject: "bot", tool: "search" });
    assert.deepEqual([d.admitted, d.degraded, d.retryAfterMs], [false, true, 3000]);
    assert.throws(() => new Admitd(url, { onUnavailable: "open" }), TypeError);
    assert.throws(() => new Admitd(url, { onUnavailable: "fail_open", failOpen: false }), TypeError);
  });

  test("an outage is counted and logged once, not per call", { timeout: 30000, skip: haveBinary ? false : `no admitd binary at ${BIN}` }, async () => {
    const port = await closedPort();
    const warned = [];
    const admitd = new Admitd(`http://127.0.0.1:${port}`, { logger: { warn: (m) => warned.push(m), info() {} } });
    const admit = () => admitd.admit({ tenant: "t", subject: "bot", tool: "search", maxWaitMs: 0 });
    for (let i = 0; i < 5; i++) assert.equal((await admit()).degraded, true);
    assert.equal(warned.length, 1, warned.join("\n"));
    assert.match(warned[0], /^admitd unavailable \(fail_open\): running calls without a lease/);
    assert.equal(admitd.outage.outages, 1);
    assert.equal(admitd.outage.calls, 5);
    assert.notEqual(admitd.outage.since, null);
    // admitd comes back on that address: one line says so, with what the outage touched.
    const daemon = await startDaemon("", `127.0.0.1:${port}`);
    try {
      for (let i = 0; i < 3; i++) assert.equal((await admit()).degraded, false);
      assert.equal(warned.length, 2, warned.join("\n"));
      assert.match(warned[1], /answers again after .* s unavailable; 5 calls were decided without it/);
      assert.equal(admitd.outage.since, null);
    } finally {
      await daemon.stop();
    }
    // The next outage is a second one.
    assert.equal((await admit()).degraded, true);
    assert.deepEqual([admitd.outage.outages, admitd.outage.calls], [2, 6]);
    assert.equal(warned.length, 3);
    admitd.close();
  });

  test("a kept-alive connection closed by admitd is replaced, and the request sent again", { timeout: 30000 }, async () => {
    // Answers the first request on each connection; a second request on the first connection is
    // read and the connection closed without an answer, as a daemon that closed it would.
    const seen = [];
    const server = createServer((sock) => {
      const conn = seen.length;
      seen.push(0);
      let buf = "";
      sock.on("data", (chunk) => {
        buf += chunk;
        while (buf.includes("\r\n\r\n")) {
          const end = buf.indexOf("\r\n\r\n") + 4;
          const len = Number(/content-length: *(\d+)/i.exec(buf.slice(0, end))?.[1] ?? 0);
          if (buf.length < end + len) return;
          buf = buf.slice(end + len);
          seen[conn] += 1;
          if (conn === 0 && seen[conn] === 2) {
            sock.destroy();
            return;
          }
          const body = '{"tenant":"t"}';
          sock.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${body.length}\r\n\r\n${body}`);
        }
      });
    });
    await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
    try {
      const admitd = new Admitd(`http://127.0.0.1:${server.address().port}`, { logger: quiet });
      assert.equal((await admitd.tenant("t")).tenant, "t");
      assert.equal((await admitd.tenant("t")).tenant, "t");
      assert.deepEqual(seen, [2, 1], "the second request went out again on a new connection");
      admitd.agent.destroy();
    } finally {
      await new Promise((ok) => server.close(ok));
    }
  });

  test("a closed connection on a fresh socket is not retried", { timeout: 30000 }, async () => {
    let accepted = 0;
    const server = createServer((sock) => {
      accepted += 1;
      sock.on("data", () => sock.destroy());
    });
    await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
    try {
      const admitd = new Admitd(`http://127.0.0.1:${server.address().port}`, { logger: quiet });
      await assert.rejects(admitd.tenant("t"), AdmitdUnavailable);
      assert.equal(accepted, 1);
    } finally {
      await new Promise((ok) => server.close(ok));
    }
  });

  test("an IPv6 address is reached without its brackets", async () => {
    const admitd = new Admitd("http://[::1]:1", { failOpen: false, unavailableRetryS: 3, logger: quiet });
    assert.equal(admitd.host, "::1");
    assert.equal(admitd.port, 1);
    const d = await admitd.admit({ tenant: "t", subject: "bot", tool: "search" });
    assert.deepEqual([d.admitted, d.degraded, d.retryAfterMs], [false, true, 3000]);
  });

  test("a cut-off answer on a kept-alive connection is never sent again", { timeout: 30000 }, async () => {
    // Answers the first request; to the second, half an answer, then the connection closes.
    let requests = 0;
    const body = '{"tenant":"t"}';
    const answer = `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${body.length}\r\n\r\n${body}`;
    const server = createServer((sock) => {
      let buf = "";
      sock.on("data", (chunk) => {
        buf += chunk;
        while (buf.includes("\r\n\r\n")) {
          buf = buf.slice(buf.indexOf("\r\n\r\n") + 4);
          requests += 1;
          if (requests === 1) sock.write(answer);
          else sock.end(answer.slice(0, 20));
        }
      });
    });
    await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
    try {
      const admitd = new Admitd(`http://127.0.0.1:${server.address().port}`, { logger: quiet });
      assert.equal((await admitd.tenant("t")).tenant, "t");
      await assert.rejects(admitd.tenant("t"), AdmitdUnavailable);
      assert.equal(requests, 2, "the request that got half an answer was sent once");
      admitd.close();
    } finally {
      await new Promise((ok) => server.close(ok));
    }
  });

  test("only http and unix URLs", () => {
    for (const bad of ["https://127.0.0.1:9470", "ftp://x", "127.0.0.1:9470", "unix:", "unix:relative.sock", "unix://host/x"]) {
      assert.throws(() => new Admitd(bad), TypeError, bad);
    }
    assert.equal(new Admitd("unix:/run/admitd/admitd.sock").socketPath, "/run/admitd/admitd.sock");
  });
});
