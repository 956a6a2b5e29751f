// admitd-client: a client for admitd, for MCP servers on Node.js (18 or later): ask before a tool
// runs, release after, hand refusals to the model. No dependencies; types in index.d.ts. The wrapper
// for @modelcontextprotocol/sdk tool handlers is in ./mcp.js ("admitd-client/mcp").
//
//   import { Admitd } from "admitd-client";
//   const admitd = new Admitd(); // http://127.0.0.1:9470, or "unix:/run/admitd/admitd.sock"
//
//   const result = await admitd.call({ tenant, subject, tool: "get_sales", upstream: "warehouse" }, async (call) => {
//     const resp = await fetch(warehouseUrl(args));
//     call.upstreamResponse(resp.status, resp.headers.get("retry-after"));
//     return { content: [{ type: "text", text: await resp.text() }] };
//   });
//
// `call` runs the function only when admitd admits the call, and returns admitd's ready-made
// CallToolResult (isError: true) when it refuses. The lease is released when the function settles:
// outcome "ok", "error" when it threw (the error is rethrown), "cancelled" when it threw an AbortError,
// "upstream_rate_limited" when the upstream answered 429 (its Retry-After then puts the upstream in
// admitd's penalty box).
//
// If admitd cannot be reached (or answers 5xx), onUnavailable decides: "fail_open" (the default)
// runs the call without a lease, marked degraded; "fail_closed" refuses it with a tool result that
// asks the model to wait unavailableRetryS seconds. The default keeps the tools working when the
// limiter beside them is down; choose "fail_closed" when running past the limits costs more than
// refusing calls. Each outage is counted (admitd.outage) and logged once when it begins and once
// when admitd answers again, never per call. (failOpen: true/false is the older spelling.) Requests admitd rejects as malformed (400, 413) throw AdmitdError.

import http from "node:http";
import { Buffer } from "node:buffer";

export const OUTCOMES = Object.freeze(["ok", "error", "upstream_rate_limited", "cancelled"]);

/** admitd refused the request itself (400 invalid_request, 413 body_too_large, ...). */
export class AdmitdError extends Error {
  constructor(status, code, message) {
    super(`admitd answered ${status} ${code}: ${message}`);
    this.name = "AdmitdError";
    this.status = status;
    this.code = code;
    this.detail = message;
  }
}

/** admitd could not be reached, or answered 5xx (thrown by release, feedback and tenant). */
export class AdmitdUnavailable extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = "AdmitdUnavailable";
  }
}

function unavailableResult(waitS) {
  const text =
    `This tool is temporarily unavailable. Wait ${waitS} seconds, then retry this call with the ` +
    "same arguments; the arguments are fine. Do not retry sooner. Meanwhile, continue with what " +
    "you already have and tell the user this result is pending.";
  return {
    content: [{ type: "text", text }],
    structuredContent: { error: "unavailable", scope: null, retry_after_ms: waitS * 1000, retryable: true },
    isError: true,
  };
}

/** A `Retry-After` value as it came (text), or a number of seconds. */
function retryAfterValue(v) {
  return typeof v === "string" ? v.trim() : v;
}

/** What a client does with a call while admitd cannot be reached: run it without a lease ... */
export const FAIL_OPEN = "fail_open";
/** ... or refuse it with a tool result that asks the model to wait unavailableRetryS seconds. */
export const FAIL_CLOSED = "fail_closed";

function unavailableMode(onUnavailable, failOpen) {
  if (onUnavailable == null) return failOpen === false ? FAIL_CLOSED : FAIL_OPEN;
  if (onUnavailable !== FAIL_OPEN && onUnavailable !== FAIL_CLOSED) {
    throw new TypeError(`onUnavailable is "fail_open" or "fail_closed", not ${JSON.stringify(onUnavailable)}`);
  }
  if (failOpen != null && failOpen !== (onUnavailable === FAIL_OPEN)) {
    throw new TypeError(`failOpen: ${failOpen} contradicts onUnavailable: ${JSON.stringify(onUnavailable)}`);
  }
  return onUnavailable;
}

export class Admitd {
  constructor(
    url = "http://127.0.0.1:9470",
    { timeoutMs = 2000, connectTimeoutMs = 500, onUnavailable, failOpen, unavailableRetryS = 5, token, logger = console } = {},
  ) {
    if (typeof url === "string" && url.startsWith("unix:")) {
      const path = url.slice("unix:".length);
      if (!path.startsWith("/") || path.startsWith("//")) {
        throw new TypeError(`admitd Unix socket URL must be unix:/path/to.sock, not ${JSON.stringify(url)}`);
      }
      this.base = url;
      this.socketPath = path;
    } else {
      let u;
      try {
        u = new URL(url);
      } catch {
        u = null;
      }
      if (!u || u.protocol !== "http:" || !u.hostname) {
        throw new TypeError(`admitd URL must be http://host[:port] or unix:/path, not ${JSON.stringify(url)}`);
      }
      this.base = `http://${u.host}`;
      // URL keeps an IPv6 literal in brackets; a socket wants it without them.
      this.host = u.hostname.replace(/^\[(.*)\]$/, "$1");
      this.port = Number(u.port || 80);
    }
    if (token != null && !/^[\x21-\x7e]+$/.test(token)) {
      throw new TypeError("an admitd token is visible ASCII without spaces");
    }
    this.auth = token ? { authorization: `Bearer ${token}` } : {};
    this.agent = new http.Agent({ keepAlive: true });
    this.timeoutMs = timeoutMs;
    this.connectTimeoutMs = connectTimeoutMs;
    this.onUnavailable = unavailableMode(onUnavailable, failOpen);
    this.failOpen = this.onUnavailable === FAIL_OPEN;
    /** admitd's outages as this client saw them: how many, the calls decided without admitd, and
     * when the current one began (Date.now(); null while admitd answers). */
    this.outage = { outages: 0, calls: 0, since: null };
    this.callsThisOutage = 0;
    this.unavailableRetryS = Math.max(1, Math.trunc(unavailableRetryS));
    this.logger = logger;
  }

  /** Closes the kept-alive connections (a later request opens a new one). */
  close() {
    this.agent.destroy();
  }

  async #request(method, path, body, headers = {}, holdMs = 0) {
    let resp;
    const payload = body === undefined ? undefined : JSON.stringify(body);
    try {
      try {
        resp = await this.#send(method, path, payload, headers, this.timeoutMs + holdMs);
      } catch (e) {
        // admitd closed a kept-alive connection before answering this request (an idle timeout,
        // a restart, or an earlier request's early 4xx): nothing was answered, so nothing was
        // counted, and sending it once more on a new connection is safe. Never when any byte of
        // an answer came, and never on a new connection, which may have been read.
        if (!e.reusedSocket || e.answerBegan) throw e;
        resp = await this.#send(method, path, payload, headers, this.timeoutMs + holdMs);
      }
    } catch (e) {
      throw new AdmitdUnavailable(`cannot reach admitd at ${this.base}: ${e.code ?? e.name ?? e.message}`, { cause: e });
    }
    const { status, headers: respHeaders, text } = resp;
    let parsed;
    try {
      parsed = JSON.parse(text);
    } catch {
      parsed = undefined;
    }
    // Every answer of admitd is a JSON object: anything else (an empty or cut-off body, a proxy's
    // page) means admitd did not answer.
    if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
      throw new AdmitdUnavailable(`the answer (${status}) is not admitd's JSON: ${JSON.stringify(text.slice(0, 200))}`);
    }
    if (status >= 500) {
      throw new AdmitdUnavailable(`admitd answered ${status}: ${text.slice(0, 200)}`);
    }
    return { status, headers: respHeaders, body: parsed };
  }

  // One HTTP exchange straight to admitd over the client's own keep-alive connections. admitd runs
  // beside the server, so the request never goes through a proxy named in the environment
  // (HTTP_PROXY with NODE_USE_ENV_PROXY, or a global fetch dispatcher): a proxy cannot reach the
  // loopback address it would be asked for.
  #send(method, path, payload, headers, timeoutMs) {
    return new Promise((resolve, reject) => {
      const h = { ...this.auth, ...headers };
      if (payload !== undefined) {
        h["content-type"] = "application/json";
        h["content-length"] = Buffer.byteLength(payload);
      }
      const where = this.socketPath ? { socketPath: this.socketPath } : { host: this.host, port: this.port };
      const req = http.request(
        { ...where, path, method, headers: h, agent: this.agent, signal: AbortSignal.timeout(timeoutMs) },
        (res) => {
          const chunks = [];
          res.on("data", (c) => chunks.push(c));
          res.on("error", reject);
          res.on("end", () => {
            const flat = {};
            for (const [k, v] of Object.entries(res.headers)) flat[k] = Array.isArray(v) ? v.join(", ") : v;
            resolve({ status: res.statusCode, headers: flat, text: Buffer.concat(chunks).toString("utf8") });
          });
        },
      );
      let answerBegan = false;
      req.on("socket", (socket) => {
        const began = () => {
          answerBegan = true;
        };
        socket.on("data", began);
        req.once("close", () => socket.off("data", began));
        if (socket.connecting) {
          const timer = setTimeout(
            () => req.destroy(Object.assign(new Error("connect timeout"), { code: "ETIMEDOUT" })),
            this.connectTimeoutMs,
          );
          socket.once("connect", () => clearTimeout(timer));
          req.once("close", () => clearTimeout(timer));
        }
      });
      req.on("error", (e) => {
        e.reusedSocket = req.reusedSocket;
        e.answerBegan = answerBegan;
        reject(e);
      });
      req.end(payload);
    });
  }

  static #error(status, body) {
    return new AdmitdError(status, String(body?.error ?? "?"), String(body?.message ?? ""));
  }

  /**
   * Asks whether the call may run. `subject` must come from the validated credential, never from
   * anything the model wrote; pass the incoming request's W3C `traceparent` to join its trace.
   */
  async admit({ tenant, subject, tool, upstream, cost, maxWaitMs, callId, traceparent, task, run, spend }) {
    const body = { tenant, subject, tool };
    if (task) body.task = true;
    if (run != null) body.run = run;
    if (spend != null && Object.keys(spend).length > 0) body.spend = { ...spend };
    if (upstream != null) body.upstream = upstream;
    if (cost != null) body.cost = cost;
    if (maxWaitMs != null) body.max_wait_ms = maxWaitMs;
    if (callId != null) body.call_id = callId;
    const headers = traceparent ? { traceparent } : {};
    // admitd may hold the call for its allowed wait (the server's cap, 2 s by default) before it answers.
    const holdMs = Math.max(0, maxWaitMs ?? 2000);
    let answer;
    try {
      answer = await this.#request("POST", "/v1/admit", body, headers, holdMs);
    } catch (e) {
      if (e instanceof AdmitdUnavailable) {
        this.#unavailable(e.message);
        return this.#degraded();
      }
      throw e;
    }
    this.#answered();
    const { status, headers: h, body: b } = answer;
    if (status === 200) {
      return {
        admitted: true,
        leaseId: b.lease_id,
        waitedMs: b.waited_ms ?? 0,
        mode: b.mode,
        degraded: false,
        spend: b.spend ?? {},
        body: b,
        headers: h,
      };
    }
    if (status === 429) {
      return {
        admitted: false,
        scope: b.scope,
        retryAfterMs: b.retry_after_ms ?? 0,
        retryable: Boolean(b.retryable),
        toolResult: b.tool_result,
        degraded: false,
        body: b,
        headers: h,
      };
    }
    throw Admitd.#error(status, b);
  }

  // An outage is counted and logged once, when it begins and when admitd answers again, never
  // once per call: during a burst a line per call would bury everything else.
  #unavailable(why) {
    this.outage.calls += 1;
    this.callsThisOutage += 1;
    if (this.outage.since !== null) return;
    this.outage.since = Date.now();
    this.outage.outages += 1;
    const what = this.failOpen ? "running calls without a lease" : "refusing calls";
    this.logger?.warn?.(`admitd unavailable (${this.onUnavailable}): ${what} until it answers again: ${why}`);
  }

  #answered() {
    if (this.outage.since === null) return;
    const secs = ((Date.now() - this.outage.since) / 1000).toFixed(1);
    this.logger?.warn?.(
      `admitd answers again after ${secs} s unavailable; ${this.callsThisOutage} calls were decided without it`,
    );
    this.outage.since = null;
    this.callsThisOutage = 0;
  }

  #degraded() {
    if (this.failOpen) {
      return { admitted: true, leaseId: null, waitedMs: 0, degraded: true, body: {}, headers: {} };
    }
    const wait = this.unavailableRetryS;
    return {
      admitted: false,
      scope: null,
      retryAfterMs: wait * 1000,
      retryable: true,
      toolResult: unavailableResult(wait),
      degraded: true,
      body: {},
      headers: {},
    };
  }

  /**
   * Releases a lease; `retryAfter` is the upstream's Retry-After value as it came. Resolves to true
   * when released, false when admitd no longer knew the lease (released already, or expired).
   */
  async release(leaseId, outcome = "ok", { upstreamStatus, retryAfter, durationMs, spent, cost } = {}) {
    if (!OUTCOMES.includes(outcome)) {
      throw new TypeError(`outcome must be one of ${OUTCOMES.join(", ")}, not ${JSON.stringify(outcome)}`);
    }
    const body = { lease_id: leaseId, outcome };
    if (upstreamStatus != null) body.upstream_status = Math.trunc(upstreamStatus);
    if (retryAfter != null) body.retry_after = retryAfterValue(retryAfter);
    if (durationMs != null) body.duration_ms = Math.max(0, Math.round(durationMs));
    if (spent != null && Object.keys(spent).length > 0) body.spent = { ...spent };
    if (cost != null) body.cost = cost;
    const { status, body: b } = await this.#request("POST", "/v1/release", body);
    if (status === 200) return true;
    if (status === 404) return false;
    throw Admitd.#error(status, b);
  }

  /** Reports an upstream answer seen outside a lease (a 429 starts the penalty box). */
  async feedback({ tenant, upstream, status, retryAfter }) {
    const body = { tenant, upstream, status: Math.trunc(status) };
    if (retryAfter != null) body.retry_after = retryAfterValue(retryAfter);
    const answer = await this.#request("POST", "/v1/feedback", body);
    if (answer.status !== 202) throw Admitd.#error(answer.status, answer.body);
  }

  /**
   * Extends a lease (by its own TTL unless `ttlMs`): resolves to the milliseconds it now lives, or
   * null when admitd no longer knows it.
   */
  async renew(leaseId, ttlMs) {
    const body = { lease_id: leaseId };
    if (ttlMs != null) body.ttl_ms = Math.trunc(ttlMs);
    const { status, body: b } = await this.#request("POST", "/v1/renew", body);
    if (status === 200) return b.expires_in_ms;
    if (status === 404) return null;
    throw Admitd.#error(status, b);
  }

  /**
   * Checks one poll of a task: `{ due: true, pollIntervalMs }` on time (the next interval),
   * `{ due: false, pollIntervalMs }` early (the time left), null when the task is unknown.
   */
  async pollTask(leaseId) {
    const { status, body: b } = await this.#request("POST", "/v1/tasks/poll", { lease_id: leaseId });
    if (status === 200) return { due: true, pollIntervalMs: b.poll_interval_ms };
    if (status === 429) return { due: false, pollIntervalMs: Math.max(1, b.retry_after_ms ?? 1) };
    if (status === 404) return null;
    throw Admitd.#error(status, b);
  }

  /** The tenant's snapshot, or null when admitd holds no state for it. */
  async tenant(name) {
    const { status, body } = await this.#request("GET", `/v1/tenants/${encodeURIComponent(name)}`);
    if (status === 200) return body;
    if (status === 404) return null;
    throw Admitd.#error(status, body);
  }

  /**
   * Admits the call and runs `fn(call)` only if admitted; otherwise resolves to admitd's tool
   * result for the model. Releases the lease when `fn` settles (see the top of this file).
   */
  async call(args, fn) {
    const decision = await this.admit(args);
    if (!decision.admitted) return decision.toolResult;
    const call = new Call(decision);
    try {
      const result = await fn(call);
      await this.finish(call, "ok");
      return result;
    } catch (e) {
      await this.finish(call, e?.name === "AbortError" ? "cancelled" : "error");
      throw e;
    }
  }

  /**
   * Releases an admitted call once: with `call.outcome` when set, `upstream_rate_limited` when the
   * upstream answered 429, else `fallback`. Never throws: a release that fails is logged, and the
   * lease expires after lease_ttl.
   */
  async finish(call, fallback) {
    const lease = call.decision.leaseId;
    if (!lease || call.released) return;
    call.released = true;
    const outcome = call.outcome ?? (call.status === 429 ? "upstream_rate_limited" : fallback);
    try {
      const released = await this.release(lease, outcome, {
        upstreamStatus: call.status,
        retryAfter: call.retryAfter,
        durationMs: performance.now() - call.started,
        spent: call.spent,
        cost: call.cost,
      });
      if (!released) this.logger?.info?.(`admitd no longer knew lease ${lease} (expired after lease_ttl?)`);
    } catch (e) {
      // The tool's own result or error matters more; the lease expires after lease_ttl.
      this.logger?.warn?.(`could not release lease ${lease}: ${e.message}`);
    }
  }
}

/** One admitted call, inside `Admitd.call` or a wrapped tool handler. */
export class Call {
  constructor(decision) {
    this.decision = decision;
    /** Overrides the outcome chosen when the function settles (one of OUTCOMES). */
    this.outcome = undefined;
    this.status = undefined;
    this.retryAfter = undefined;
    this.released = false;
    this.started = performance.now();
    /** What the call actually spent per spend unit (reportSpend); units left out keep the estimate. */
    this.spent = {};
    /** What the call actually cost in cost units (0 for a cache hit); undefined keeps the estimate. */
    this.cost = undefined;
  }

  /**
   * Records what the call actually spent ({ tokens: 1234 }, added up over several reports) and,
   * with `cost`, its actual cost in cost units; the release settles them instead of the estimates.
   */
  reportSpend(spent = {}, { cost } = {}) {
    for (const [unit, x] of Object.entries(spent)) this.spent[unit] = (this.spent[unit] ?? 0) + Number(x);
    if (cost != null) this.cost = Number(cost);
  }

  /** Per spend unit what this call reserved and what its budgets have left ({} without spend). */
  get spend() {
    return this.decision.spend ?? {};
  }

  /** Records what the upstream answered; a 429 is released as upstream_rate_limited. */
  upstreamResponse(status, retryAfter) {
    this.status = Math.trunc(status);
    if (retryAfter != null) this.retryAfter = retryAfter;
  }
}
