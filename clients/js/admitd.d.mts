// Types of admitd.mjs (TypeScript finds them when it imports "./admitd.mjs").

export type Outcome = "ok" | "error" | "upstream_rate_limited" | "cancelled";
export declare const OUTCOMES: readonly Outcome[];

/** An MCP CallToolResult, as admitd writes it for a refused call. */
export interface ToolResult {
  content: { type: "text"; text: string }[];
  structuredContent: { error: string; scope: string | null; retry_after_ms: number; retryable: boolean };
  isError: true;
}

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
}

export type Decision =
  | {
      admitted: true;
      /** null when degraded (admitd unreachable, failOpen). */
      leaseId: string | null;
      waitedMs: number;
      mode?: "enforce" | "shadow";
      degraded: boolean;
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
  /** Per request, plus the allowed wait on admissions. Default 5000. */
  timeoutMs?: number;
  /** Run calls without a lease when admitd is unreachable (default), or refuse them. */
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

export declare class Call {
  readonly decision: Decision & { admitted: true };
  /** Overrides the outcome chosen when the function settles. */
  outcome?: Outcome;
  readonly status?: number;
  readonly retryAfter?: string | number;
  /** Records what the upstream answered; a 429 is released as upstream_rate_limited. */
  upstreamResponse(status: number, retryAfter?: string | number | null): void;
}

export declare class Admitd {
  constructor(url?: string, options?: AdmitdOptions);
  admit(args: AdmitArgs): Promise<Decision>;
  release(
    leaseId: string,
    outcome?: Outcome,
    extra?: { upstreamStatus?: number; retryAfter?: string | number; durationMs?: number },
  ): Promise<boolean>;
  feedback(args: { tenant: string; upstream: string; status: number; retryAfter?: string | number }): Promise<void>;
  tenant(name: string): Promise<Record<string, unknown> | null>;
  /** Runs fn only when admitted; resolves to admitd's tool result when refused. */
  call<T>(args: AdmitArgs, fn: (call: Call) => Promise<T> | T): Promise<T | ToolResult>;
}
