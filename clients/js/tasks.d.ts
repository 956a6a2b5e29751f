// Types of tasks.js ("admitd-client/tasks"): MCP tasks (the Tasks extension) paced by admitd.

import type { AdmitArgs, Admitd, ToolResult } from "./index.js";

export declare const TASKS_EXTENSION: "io.modelcontextprotocol/tasks";
export declare const CLIENT_CAPABILITIES_KEY: "io.modelcontextprotocol/clientCapabilities";
export declare const MISSING_REQUIRED_CLIENT_CAPABILITY: -32021;

/** Whether a request's `_meta` declares the Tasks extension. */
export declare function declaresTasks(meta: Record<string, unknown> | null | undefined): boolean;

export type TaskStatus = "working" | "input_required" | "completed" | "failed" | "cancelled";

export interface Task {
  taskId: string;
  status: TaskStatus;
  statusMessage?: string;
  createdAt: string;
  lastUpdatedAt: string;
  ttlMs: number | null;
  pollIntervalMs?: number;
  /** The tool's CallToolResult, once completed. */
  result?: Record<string, unknown>;
}

export type CreateTaskResult = Task & { resultType: "task" };
export type GetTaskResult = Task & { resultType: "complete" };

/** Whether start()'s answer is a task (else it is admitd's refusal, a CallToolResult). */
export declare function isTask(answer: CreateTaskResult | ToolResult): answer is CreateTaskResult;

export declare class UnknownTask extends Error {
  readonly taskId: string;
}

export declare class Tasks {
  constructor(admitd?: Admitd | string, options?: { ttlMs?: number; renewEveryMs?: number });
  readonly admitd: Admitd;
  /** The CreateTaskResult, or admitd's tool result when it refused the call. */
  start(
    args: Omit<AdmitArgs, "task">,
    work: (signal: AbortSignal) => Promise<Record<string, unknown>>,
  ): Promise<CreateTaskResult | ToolResult>;
  get(taskId: string): Promise<GetTaskResult>;
  cancel(taskId: string): Promise<GetTaskResult>;
  close(): Promise<void>;
}
