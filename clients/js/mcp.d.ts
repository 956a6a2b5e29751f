// Types of mcp.js ("admitd-client/mcp"). They name only the parts of the SDK's handler `extra`
// they read, so the package depends on no SDK version.

import type { Admitd, ToolResult } from "./index.js";

/** The parts of the SDK's RequestHandlerExtra the wrapper reads. */
export interface ToolExtra {
  signal?: AbortSignal;
  authInfo?: { clientId: string; extra?: Record<string, unknown> };
}

export type Identity = (
  extra: ToolExtra,
) => { tenant: string; subject: string } | Promise<{ tenant: string; subject: string }>;

export interface AdmissionOptions {
  /** From the validated credential; default: authInfoIdentity(). */
  identity?: Identity;
  /** Tool name to the upstream it spends (absent: admitd's configured default). */
  upstreams?: Record<string, string>;
  /** Tool name to its cost (absent: admitd's configured default). */
  costs?: Record<string, number>;
  /** Caps how long admitd may hold a call waiting for capacity. */
  maxWaitMs?: number;
}

export declare function reportUpstream(status: number, retryAfter?: string | number | null): boolean;

/** Records what the wrapped handler's call spent; false outside a wrapped handler. */
export declare function reportSpend(spent?: Record<string, number>, options?: { cost?: number }): boolean;

/** The request `_meta` key of an agent run's id, and the result `_meta` key of spend. */
export declare const RUN_META: "admitd/run";
export declare const SPEND_META: "admitd/spend";

export declare class UpstreamRateLimited extends Error {
  constructor(retryAfter?: string | number | null, options?: { status?: number; message?: string });
  readonly retryAfter?: string | number;
  readonly status: number;
}

export declare class IdentityError extends Error {}
/** The CallToolResult of a call not run because the server cannot tell who is calling. */
export declare function identityRefusal(reason: string): {
  content: [{ type: "text"; text: string }];
  structuredContent: { error: "no_identity"; reason: string; retryable: false };
  isError: true;
};

export declare function authInfoIdentity(options?: { tenantKey?: string; subjectKey?: string }): Identity;

export declare class Admission {
  constructor(admitd?: Admitd | string, options?: AdmissionOptions);
  readonly admitd: Admitd;
  /** Wraps a tool handler so that it runs only when admitd admits the call. */
  tool<A extends unknown[], R>(
    name: string,
    handler: (...args: A) => R | Promise<R>,
    options?: { upstream?: string; cost?: number },
  ): (...args: A) => Promise<R | ToolResult>;
}

/**
 * A `fetch` that adds MCP 2026-07-28's routing headers (`Mcp-Method`, `Mcp-Name`, and on `initialize`
 * `MCP-Protocol-Version`) from each request's JSON-RPC body, for the SDK 1.x behind admitd's edge check.
 */
export declare function withMcpHeaders(
  inner?: (url: string | URL, init?: RequestInit) => Promise<Response>,
): (url: string | URL, init?: RequestInit) => Promise<Response>;
