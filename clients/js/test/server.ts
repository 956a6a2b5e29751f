// An MCP server built with @modelcontextprotocol/sdk, its tools wrapped by admitd's Admission,
// over streamable HTTP, for the end-to-end test (e2e.test.mjs). Type-checked with `tsc --strict`
// against the SDK, then run: `node build/server.js ADMITD_URL`. It prints `serving on HOST:PORT` on
// stderr once it listens, and counts every tool run (`GET /runs`), so a test can tell refused calls
// from calls that ran.
import http from "node:http";
import { randomUUID } from "node:crypto";
import type { AddressInfo } from "node:net";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import type { AuthInfo } from "@modelcontextprotocol/sdk/server/auth/types.js";
import { isInitializeRequest } from "@modelcontextprotocol/sdk/types.js";
import { z } from "zod";

const ADMITD_URL = process.argv[2] ?? "http://127.0.0.1:9470";
const runs: Record<string, number> = {};
const ran = (tool: string) => {
  runs[tool] = (runs[tool] ?? 0) + 1;
};

// The tests' bearer tokens and who each one is (a real server validates a JWT or asks its
// authorization server, and puts what it learnt into the AuthInfo).
const TOKENS: Record<string, { tenant: string; sub: string }> = {
  "tok-acme-fan": { tenant: "acme", sub: "fan-bot" },
  "tok-acme-typed": { tenant: "acme", sub: "typed-bot" },
  "tok-acme-outcomes": { tenant: "acme", sub: "outcomes-bot" },
  "tok-globex": { tenant: "globex", sub: "globex-bot" },
  "tok-initech": { tenant: "initech", sub: "initech-bot" },
  "tok-acme-spend": { tenant: "acme", sub: "spend-bot" },
};

// Stands in for a model API: a summary, and the usage the API reports.
async function callModel(prompt: string): Promise<{ text: string; usage: { total_tokens: number } }> {
  return { text: prompt.slice(0, 40), usage: { total_tokens: 900 } };
}

function verify(header: string | undefined): AuthInfo | undefined {
  const token = header?.match(/^Bearer (.+)$/)?.[1];
  const who = token === undefined ? undefined : TOKENS[token];
  if (token === undefined || who === undefined) return undefined;
  return { token, clientId: who.sub, scopes: [], extra: { ...who } };
}

// [integrations:typescript]
import { Admission, UpstreamRateLimited, reportSpend } from "admitd-client/mcp";
import type { ToolExtra } from "admitd-client/mcp";

// Tenant and subject come from extra.authInfo (its extra.tenant and extra.sub);
// pass { identity: (extra) => ({ tenant, subject }) } to read them elsewhere.
const admission = new Admission(ADMITD_URL, { upstreams: { get_sales: "warehouse" } });

function buildServer(): McpServer {
  const server = new McpServer({ name: "sales", version: "1.0.0" });
  server.registerTool(
    "get_sales",
    { description: "Sales of a region", inputSchema: { region: z.string() } },
    admission.tool("get_sales", async ({ region }) => {
      ran("get_sales");
      if (region === "busy") throw new UpstreamRateLimited("30"); // as if the warehouse answered 429
      return { content: [{ type: "text", text: `sales in ${region}: 42` }] };
    }),
  );
  // [/integrations:typescript]

  // [integrations:typescript-spend]
  server.registerTool(
    "summarize",
    { inputSchema: { text: z.string() } },
    admission.tool("summarize", async ({ text }) => {
      ran("summarize");
      const answer = await callModel(`Summarize: ${text}`);
      // What the model really used; the release settles it instead of the estimate.
      reportSpend({ tokens: answer.usage.total_tokens });
      return { content: [{ type: "text", text: answer.text }] };
    }),
  );
  // [/integrations:typescript-spend]

  server.registerTool(
    "fan",
    { inputSchema: { n: z.number() } },
    admission.tool("fan", async ({ n }) => {
      ran("fan");
      await new Promise((r) => setTimeout(r, 300)); // overlap the fanned-out calls
      return { content: [{ type: "text", text: String(n) }] };
    }),
  );
  server.registerTool(
    "report",
    { inputSchema: { n: z.number() }, outputSchema: { region: z.string(), total: z.number() } },
    admission.tool("report", async ({ n }) => {
      ran("report");
      const out = { region: "emea", total: n };
      return { content: [{ type: "text", text: JSON.stringify(out) }], structuredContent: out };
    }),
  );
  server.registerTool(
    "no_args",
    { description: "A tool without input schema: its handler gets only extra" },
    // Without an input schema TypeScript cannot infer the handler's parameter through the
    // wrapper, so it is annotated (ToolExtra, or the SDK's RequestHandlerExtra).
    admission.tool("no_args", async (extra: ToolExtra) => {
      ran("no_args");
      return { content: [{ type: "text", text: `hello ${extra.authInfo?.clientId}` }] };
    }),
  );
  server.registerTool(
    "fails",
    { inputSchema: { n: z.number() } },
    admission.tool("fails", async () => {
      ran("fails");
      throw new Error("the tool broke");
    }),
  );
  server.registerTool(
    "slow",
    { inputSchema: { n: z.number() } },
    admission.tool("slow", async (_args, extra) => {
      ran("slow");
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, 30_000);
        extra.signal.addEventListener("abort", () => {
          clearTimeout(timer);
          resolve(undefined);
        });
      });
      return { content: [{ type: "text", text: "late" }] };
    }),
  );
  // The deprecated form still fits.
  server.tool(
    "legacy",
    { n: z.number() },
    admission.tool("legacy", async ({ n }) => ({ content: [{ type: "text" as const, text: String(n) }] })),
  );
  return server;
}

const transports = new Map<string, StreamableHTTPServerTransport>();

async function readJson(req: http.IncomingMessage): Promise<unknown> {
  const chunks: Buffer[] = [];
  for await (const chunk of req) chunks.push(chunk as Buffer);
  const text = Buffer.concat(chunks).toString("utf8");
  return text ? JSON.parse(text) : undefined;
}

const httpServer = http.createServer(async (req, res) => {
  try {
    if (req.url === "/runs") {
      res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify(runs));
      return;
    }
    const auth = verify(req.headers.authorization);
    if (!auth) {
      res.writeHead(401, { "content-type": "application/json" }).end('{"error":"invalid_token"}');
      return;
    }
    const withAuth = Object.assign(req, { auth });
    const body = req.method === "POST" ? await readJson(req) : undefined;
    const sessionId = req.headers["mcp-session-id"];
    let transport = typeof sessionId === "string" ? transports.get(sessionId) : undefined;
    if (!transport && req.method === "POST" && isInitializeRequest(body)) {
      const created = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        onsessioninitialized: (id) => {
          transports.set(id, created);
        },
      });
      created.onclose = () => {
        if (created.sessionId) transports.delete(created.sessionId);
      };
      await buildServer().connect(created);
      transport = created;
    }
    if (!transport) {
      res.writeHead(400, { "content-type": "application/json" }).end('{"error":"no session"}');
      return;
    }
    await transport.handleRequest(withAuth, res, body);
  } catch (e) {
    if (!res.headersSent) res.writeHead(500).end(String(e));
  }
});

httpServer.listen(0, "127.0.0.1", () => {
  const { port } = httpServer.address() as AddressInfo;
  process.stderr.write(`serving on 127.0.0.1:${port}\n`);
});
