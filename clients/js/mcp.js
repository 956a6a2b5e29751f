// admitd for servers built with @modelcontextprotocol/sdk: a wrapper for tool handlers of
// McpServer.registerTool (or the older McpServer.tool). No dependency on the SDK itself; types in
// mcp.d.ts.
//
//   import { Admission, UpstreamRateLimited } from "admitd-client/mcp";
//   const admission = new Admission("http://127.0.0.1:9470", { upstreams: { get_sales: "warehouse" } });
//   server.registerTool("get_sales", { inputSchema: { region: z.string() } },
//     admission.tool("get_sales", async ({ region }, extra) => ({ content: [{ type: "text", text: "..." }] })));
//
// Each call asks admitd first, keyed on the tenant and subject of the request's validated
// credential (extra.authInfo: by default the `tenant` and `sub` entries of authInfo.extra, the
// subject falling back to authInfo.clientId; pass `identity` to choose). A refused call never
// runs: the handler resolves to admitd's CallToolResult with isError: true, the wait in whole
// seconds in its text and admitd's structuredContent. An admitted call is released after the
// handler settled: "ok"; "error" when it threw or resolved to an isError result; "cancelled" when
// the request was cancelled (extra.signal aborted); "upstream_rate_limited" when the handler threw
// UpstreamRateLimited or called reportUpstream(429, retryAfter).
//
// Spend budgets: a handler calls reportSpend({ tokens: ... }) (or reportSpend({}, { cost: 0 }) for a
// cache hit) and the release settles it; the agent run is read from the request's
// _meta["admitd/run"], and the result carries what each budget has left in _meta["admitd/spend"].

import { AsyncLocalStorage } from "node:async_hooks";
import { Admitd, Call } from "./index.js";

// The admitted call whose handler is running, so that reportUpstream finds it.
const current = new AsyncLocalStorage();

/**
 * Records what the upstream answered, from inside a wrapped handler, without throwing: a 429
 * releases the call as upstream_rate_limited with retryAfter. Returns false (and does nothing)
 * outside a wrapped handler.
 */
export function reportUpstream(status, retryAfter) {
  const call = current.getStore();
  if (!call) return false;
  call.upstreamResponse(status, retryAfter);
  return true;
}

/**
 * Records what the wrapped handler's call actually spent ({ tokens: usage.total_tokens }, added up
 * over several reports) and, with `cost`, its actual cost in cost units ({}, { cost: 0 } for a
 * cache hit); the release settles them instead of admitd's estimates. Returns false (and does
 * nothing) outside a wrapped handler.
 */
export function reportSpend(spent = {}, { cost } = {}) {
  const call = current.getStore();
  if (!call) return false;
  call.reportSpend(spent, { cost });
  return true;
}

/** The request `_meta` key an agent run's id is read from, and the result `_meta` key of spend. */
export const RUN_META = "admitd/run";
export const SPEND_META = "admitd/spend";

/**
 * Thrown by a handler whose upstream answered 429: the call is released as
 * upstream_rate_limited with retryAfter (which puts the upstream in admitd's penalty box), and the
 * error goes on to the SDK, which reports the tool's failure to the model as any other.
 */
export class UpstreamRateLimited extends Error {
  constructor(retryAfter, { status = 429, message } = {}) {
    super(
      message ??
        `the upstream service is rate limiting these calls${retryAfter != null ? ` (Retry-After: ${retryAfter})` : ""}`,
    );
    this.name = "UpstreamRateLimited";
    this.retryAfter = retryAfter ?? undefined;
    this.status = status;
    reportUpstream(status, retryAfter);
  }
}

/** The request carries no validated identity admitd could key on. */
export class IdentityError extends Error {
  constructor(message) {
    super(message);
    this.name = "IdentityError";
  }
}

/**
 * The CallToolResult of a call that was not run because the server cannot tell who is calling: it
 * names the problem for the model and the person reading along. Waiting does not help; it says so.
 */
export function identityRefusal(reason) {
  const text =
    `This call was not run: the server cannot tell who is calling (${reason}). ` +
    "Every call needs a validated credential naming a tenant and a subject: the MCP server must " +
    "verify the client's bearer token and pass it on as authInfo, and the client must send its " +
    "token. Retrying will not help until that is fixed.";
  return {
    content: [{ type: "text", text }],
    structuredContent: { error: "no_identity", reason, retryable: false },
    isError: true,
  };
}

/**
 * A `fetch` for the SDK's client transport (`new StreamableHTTPClientTransport(url, { fetch:
 * withMcpHeaders() })`) that adds the routing headers of MCP 2026-07-28 to each request, from its
 * JSON-RPC body: `Mcp-Method`, `Mcp-Name` (a tool's or prompt's name), and on `initialize` the
 * `MCP-Protocol-Version` the client asks for. The SDK 1.x speaks MCP up to 2025-11-25 and sends none
 * of them; admitd's edge check at a gateway limits on them.
 */
export function withMcpHeaders(inner = globalThis.fetch) {
  return async (url, init = {}) => {
    if (typeof init.body !== "string") return inner(url, init);
    let msg;
    try {
      msg = JSON.parse(init.body);
    } catch {
      return inner(url, init);
    }
    const headers = new Headers(init.headers);
    if (typeof msg?.method === "string") headers.set("mcp-method", msg.method);
    if (typeof msg?.params?.name === "string") headers.set("mcp-name", msg.params.name);
    if (msg?.method === "initialize" && !headers.has("mcp-protocol-version") && typeof msg.params?.protocolVersion === "string") {
      headers.set("mcp-protocol-version", msg.params.protocolVersion);
    }
    return inner(url, { ...init, headers });
  };
}

/** An identity that reads tenant and subject from extra.authInfo (see the top of this file). */
export function authInfoIdentity({ tenantKey = "tenant", subjectKey = "sub" } = {}) {
  return (extra) => {
    const auth = extra?.authInfo;
    if (!auth) throw new IdentityError("the request carries no validated credential (extra.authInfo)");
    const tenant = auth.extra?.[tenantKey];
    const subject = auth.extra?.[subjectKey] ?? auth.clientId;
    if (typeof tenant !== "string" || !tenant) throw new IdentityError(`authInfo.extra has no ${JSON.stringify(tenantKey)}`);
    if (typeof subject !== "string" || !subject) throw new IdentityError(`authInfo has no ${JSON.stringify(subjectKey)} nor clientId`);
    return { tenant, subject };
  };
}

export class Admission {
  /**
   * `admitd`: a URL ("http://host:port", "unix:/path") or an Admitd. `identity(extra)` returns
   * { tenant, subject }; `upstreams` and `costs` map tool names to the upstream they spend and their
   * cost (absent: admitd's configured defaults); `maxWaitMs` caps how long admitd may hold a call.
   */
  constructor(admitd = "http://127.0.0.1:9470", { identity, upstreams = {}, costs = {}, maxWaitMs } = {}) {
    this.admitd = admitd instanceof Admitd ? admitd : new Admitd(admitd);
    this.identity = identity ?? authInfoIdentity();
    this.upstreams = { ...upstreams };
    this.costs = { ...costs };
    this.maxWaitMs = maxWaitMs;
  }

  /**
   * Wraps a tool handler (`(args, extra)` or, for a tool without input schema, `(extra)`) so that
   * it runs only when admitd admits the call. `name` is the name the tool is registered under.
   */
  tool(name, handler, { upstream, cost } = {}) {
    return async (...args) => {
      const extra = args[args.length - 1];
      let who;
      try {
        who = await this.identity(extra);
      } catch (e) {
        if (!(e instanceof IdentityError)) throw e;
        this.admitd.logger?.warn?.(`admitd: tool ${name} not run: the request has no identity (${e.message})`);
        return identityRefusal(e.message);
      }
      const { tenant, subject } = who;
      const decision = await this.admitd.admit({
        tenant,
        subject,
        tool: name,
        upstream: upstream ?? this.upstreams[name],
        cost: cost ?? this.costs[name],
        maxWaitMs: this.maxWaitMs,
        run: typeof extra?._meta?.[RUN_META] === "string" ? extra._meta[RUN_META] : undefined,
      });
      if (!decision.admitted) return decision.toolResult;
      const call = new Call(decision);
      const cancelled = () => Boolean(extra?.signal?.aborted);
      let result;
      try {
        result = await current.run(call, () => handler(...args));
      } catch (e) {
        const outcome =
          e instanceof UpstreamRateLimited
            ? "upstream_rate_limited"
            : cancelled() || e?.name === "AbortError"
              ? "cancelled"
              : "error";
        await this.admitd.finish(call, outcome);
        throw e;
      }
      await this.admitd.finish(call, cancelled() ? "cancelled" : result?.isError ? "error" : "ok");
      // What each spend budget has left after this call, for the agent to see.
      if (result && typeof result === "object" && Object.keys(call.spend).length > 0) {
        return { ...result, _meta: { ...(result._meta ?? {}), [SPEND_META]: call.spend } };
      }
      return result;
    };
  }
}
