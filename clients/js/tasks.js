// admitd-client/tasks: long-running tool calls as MCP tasks (the Tasks extension,
// "io.modelcontextprotocol/tasks", revision 2026-07-28), with admitd setting the pace.
//
// A tool that runs for minutes answers its tools/call at once with a task handle (CreateTaskResult:
// resultType "task", taskId, ttlMs, pollIntervalMs) and runs in the background; the client polls
// tasks/get until the task is done. admitd admits the call as a task (its lease lives [tasks]
// lease_ttl), hands out the pollIntervalMs that fits the tenant's load, and holds the client to it:
// Tasks renews the lease while the work runs, checks every tasks/get with admitd, and releases the
// lease when the work ends.
//
// @modelcontextprotocol/sdk 1.32.2 implements the experimental tasks of revision 2025-11-25
// (pollInterval, tasks/result), not this extension, so nothing here imports the SDK: a server
// answers tools/call with start()'s result and serves tasks/get with get(). Tasks live in this
// process: a tasks/get must reach the process that started the task.

import { randomUUID } from "node:crypto";

import { Admitd } from "./index.js";

export const TASKS_EXTENSION = "io.modelcontextprotocol/tasks";
export const CLIENT_CAPABILITIES_KEY = "io.modelcontextprotocol/clientCapabilities";
export const MISSING_REQUIRED_CLIENT_CAPABILITY = -32021;

/** Whether a request's `_meta` declares the Tasks extension: never answer with a task otherwise. */
export function declaresTasks(meta) {
  const exts = meta?.[CLIENT_CAPABILITIES_KEY]?.extensions;
  const declared = exts?.[TASKS_EXTENSION];
  return declared != null && typeof declared === "object";
}

/** Whether start()'s answer is a task (else it is admitd's refusal, a CallToolResult). */
export function isTask(answer) {
  return answer?.resultType === "task";
}

export class UnknownTask extends Error {
  constructor(taskId) {
    super(`unknown task ${JSON.stringify(taskId)}`);
    this.name = "UnknownTask";
    this.taskId = taskId;
  }
}

function shape(t) {
  const out = {
    taskId: t.taskId,
    status: t.status,
    createdAt: t.createdAt,
    lastUpdatedAt: t.updatedAt ?? t.createdAt,
    ttlMs: t.ttlMs,
    pollIntervalMs: t.pollIntervalMs,
  };
  if (t.statusMessage) out.statusMessage = t.statusMessage;
  if (t.status === "completed" && t.result) out.result = t.result;
  return out;
}

export class Tasks {
  /**
   * `ttlMs`: how long a task and its result are kept (the task's ttlMs); `renewEveryMs`: how often a
   * running task's lease is renewed (well below admitd's [tasks] lease_ttl).
   */
  constructor(admitd = new Admitd(), { ttlMs = 3_600_000, renewEveryMs = 60_000 } = {}) {
    this.admitd = typeof admitd === "string" ? new Admitd(admitd) : admitd;
    this.ttlMs = ttlMs;
    this.renewEveryMs = renewEveryMs;
    this.tasks = new Map();
  }

  /**
   * Admits the call as a task and starts `work` (resolving to the tool's CallToolResult). Resolves to
   * the CreateTaskResult with admitd's pollIntervalMs, or to admitd's tool result when it refused the
   * call (return it unchanged). Only for a request whose client declared the extension.
   */
  async start(args, work) {
    const decision = await this.admitd.admit({ ...args, task: true });
    if (!decision.admitted) return decision.toolResult;
    const now = new Date().toISOString();
    const task = {
      taskId: randomUUID(),
      leaseId: decision.leaseId,
      status: "working",
      createdAt: now,
      ttlMs: this.ttlMs,
      pollIntervalMs: decision.body.poll_interval_ms ?? 5000,
      expires: Date.now() + this.ttlMs,
      started: performance.now(),
      abort: new AbortController(),
    };
    this.#prune();
    this.tasks.set(task.taskId, task);
    task.done = this.#run(task, work);
    return { resultType: "task", ...shape(task) };
  }

  async #run(task, work) {
    const renewing = task.leaseId ? this.#renew(task) : null;
    let outcome = "ok";
    try {
      const result = await work(task.abort.signal);
      task.result = result;
      task.status = task.abort.signal.aborted ? "cancelled" : "completed";
      if (result?.isError) outcome = "error";
      if (task.abort.signal.aborted) outcome = "cancelled";
    } catch (e) {
      if (task.abort.signal.aborted) {
        task.status = "cancelled";
        outcome = "cancelled";
      } else {
        task.status = "completed";
        task.result = { content: [{ type: "text", text: String(e?.message ?? e) }], isError: true };
        outcome = "error";
      }
    } finally {
      task.updatedAt = new Date().toISOString();
      clearTimeout(renewing?.timer);
      if (renewing) renewing.stopped = true;
      if (task.leaseId) {
        const durationMs = performance.now() - task.started;
        await this.admitd.release(task.leaseId, outcome, { durationMs }).catch(() => {});
      }
    }
  }

  #renew(task) {
    const state = { timer: null, stopped: false };
    const schedule = (ms) => {
      state.timer = setTimeout(async () => {
        if (state.stopped) return;
        let next = this.renewEveryMs;
        try {
          const left = await this.admitd.renew(task.leaseId);
          if (left == null) return; // admitd no longer knows it: nothing left to keep alive
          next = Math.max(100, Math.min(this.renewEveryMs, left / 3));
        } catch {
          next = Math.max(1000, next / 2); // admitd away: try again sooner
        }
        if (!state.stopped) schedule(next);
      }, ms);
      state.timer.unref?.();
    };
    schedule(this.renewEveryMs);
    return state;
  }

  #prune() {
    const now = Date.now();
    for (const [id, t] of this.tasks) {
      if (t.expires < now) {
        t.abort.abort();
        this.tasks.delete(id);
      }
    }
  }

  /**
   * The tasks/get result. While the task runs the poll is checked with admitd: on time, the answer
   * carries the next pollIntervalMs; early, the time left and no news.
   */
  async get(taskId) {
    this.#prune();
    const task = this.tasks.get(taskId);
    if (!task) throw new UnknownTask(taskId);
    if (task.status === "working" && task.leaseId) {
      const check = await this.admitd.pollTask(task.leaseId).catch(() => null);
      if (check) {
        task.pollIntervalMs = check.pollIntervalMs;
        task.statusMessage = check.due ? undefined : "polled sooner than pollIntervalMs; poll again then";
      }
    }
    return { resultType: "complete", ...shape(task) };
  }

  /** tasks/cancel: aborts the work's signal; its lease is released as cancelled. */
  async cancel(taskId) {
    const task = this.tasks.get(taskId);
    if (!task) throw new UnknownTask(taskId);
    task.abort.abort();
    await task.done;
    return { resultType: "complete", ...shape(task) };
  }

  /** Cancels every running task and waits for their leases to be released. */
  async close() {
    for (const t of this.tasks.values()) t.abort.abort();
    await Promise.all([...this.tasks.values()].map((t) => t.done));
  }
}
