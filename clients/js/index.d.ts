// Types of index.js ("admitd-client").

export type Outcome = "ok" | "error" | "upstream_rate_limited" | "cancelled";
export declare const OUTCOMES: readonly Outcome[];

/**
 * An MCP CallToolResult, as admitd writes it for a refused call. A type alias with index signatures
 * (not an interface), so that it is assignable to the SDK's CallToolResult, whose schema lets any
 * object carry further keys.
 */
export type ToolResult = {
  [key: string]: unknown;
  content: { [key: string]: unknown; type: "text"; text: string }[];
  structuredContent: {
    [key: string]: unknown;
    error: string;
    scope: string | null;
    retry_after_ms: number;
    retryable: boolean;
  };
  isError: true;
};

export interface AdmitArgs {
  tenant: string;
  /** From the validated credential, never from anything the model wrote. */
  subject: string;
  tool: string;
  upstream?: string;
  cost?: number;
  maxWaitMs?: number;
  callId?: string;
  /** The incoming request's W3C traceparent, to parent the admission span. */
  traceparent?: string;
  /** Admit the call as an MCP task: its lease lives [tasks] lease_ttl; body.poll_interval_ms. */
  task?: boolean;
  /** The agent run (task) the call belongs to, for `run` spend budgets. */
  run?: string;
  /** This call's own spend estimates per unit ({ usd: 0.05 }). */
  spend?: Record<string, number>;
}

/** Per spend unit: what an admitted call reserved, and the least any budget of the unit has left. */
export type SpendView = Record<
  string,
  { reserved: number; remaining?: number; budget?: "run" | "subject_daily" | "tenant_daily" }
>;

export type Decision =
  | {
      admitted: true;
      /** null when degraded (admitd unreachable, failOpen). */
      leaseId: string | null;
      waitedMs: number;
      mode?: "enforce" | "shadow";
      degraded: boolean;
      /** With spend budgets configured (absent when degraded). */
      spend?: SpendView;
      body: Record<string, unknown>;
      headers: Record<string, string>;
    }
  | {
      admitted: false;
      scope: string | null;
      retryAfterMs: number;
      retryable: boolean;
      toolResult: ToolResult;
      degraded: boolean;
      body: Record<string, unknown>;
      headers: Record<string, string>;
    };

export interface AdmitdOptions {
  /** Per answer, on top of the wait admitd may hold an admission for. Default 2000. */
  timeoutMs?: number;
  /** Reaching admitd; short, so that failOpen decides quickly. Default 500. */
  connectTimeoutMs?: number;
  /** Sent as `Authorization: Bearer` when admitd requires caller tokens (server.api_tokens_sha256). */
  token?: string;
  /**
   * While admitd cannot be reached: "fail_open" (default) runs calls without a lease, "fail_closed"
   * refuses them with a tool result asking the model to wait unavailableRetryS seconds.
   */
  onUnavailable?: "fail_open" | "fail_closed";
  /** The older spelling of onUnavailable: true is "fail_open", false "fail_closed". */
  failOpen?: boolean;
  /** The wait the refusal asks for when admitd is unreachable and failOpen is false. Default 5. */
  unavailableRetryS?: number;
  logger?: { warn?(msg: string): void; info?(msg: string): void } | null;
}

export declare class AdmitdError extends Error {
  status: number;
  code: string;
  detail: string;
}

export declare class AdmitdUnavailable extends Error {}

export declare const FAIL_OPEN: "fail_open";
export declare const FAIL_CLOSED: "fail_closed";

export declare class Call {
  constructor(decision: Decision & { admitted: true });
  readonly decision: Decision & { admitted: true };
  readonly released: boolean;
  /** Overrides the outcome chosen when the function settles. */
  outcome?: Outcome;
  readonly status?: number;
  readonly retryAfter?: string | number;
  /** Records what the upstream answered; a 429 is released as upstream_rate_limited. */
  upstreamResponse(status: number, retryAfter?: string | number | null): void;
  /** What the call actually spent per unit, settled at its release. */
  readonly spent: Record<string, number>;
  readonly cost?: number;
  /** Records what the call actually spent (added up) and, with `cost`, its actual cost units. */
  reportSpend(spent?: Record<string, number>, options?: { cost?: number }): void;
  /** Per spend unit what this call reserved and what its budgets have left. */
  readonly spend: SpendView;
}

export declare class Admitd {
  /** `url`: "http://host:port" (default http://127.0.0.1:9470) or "unix:/path/to/admitd.sock". */
  constructor(url?: string, options?: AdmitdOptions);
  /** What this client does while admitd cannot be reached. */
  readonly onUnavailable: "fail_open" | "fail_closed";
  /** admitd's outages as this client saw them: how many, the calls decided without admitd, and
   * when the current one began (Date.now(); null while admitd answers). */
  readonly outage: { outages: number; calls: number; since: number | null };
  /** Closes the kept-alive connections (a later request opens a new one). */
  close(): void;
  admit(args: AdmitArgs): Promise<Decision>;
  release(
    leaseId: string,
    outcome?: Outcome,
    extra?: {
      upstreamStatus?: number;
      retryAfter?: string | number;
      durationMs?: number;
      spent?: Record<string, number>;
      cost?: number;
    },
  ): Promise<boolean>;
  feedback(args: { tenant: string; upstream: string; status: number; retryAfter?: string | number }): Promise<void>;
  tenant(name: string): Promise<Record<string, unknown> | null>;
  /** Extends a lease; the milliseconds it now lives, or null when admitd no longer knows it. */
  renew(leaseId: string, ttlMs?: number): Promise<number | null>;
  /** Checks one poll of a task with admitd; null when the task is unknown. */
  pollTask(leaseId: string): Promise<{ due: boolean; pollIntervalMs: number } | null>;
  /** Runs fn only when admitted; resolves to admitd's tool result when refused. */
  call<T>(args: AdmitArgs, fn: (call: Call) => Promise<T> | T): Promise<T | ToolResult>;
  /** Releases an admitted call once; never throws (a failed release is logged). */
  finish(call: Call, fallback: Outcome): Promise<void>;
}
