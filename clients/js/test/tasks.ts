// Type-checks admitd-client/tasks as a server uses it (tsc --strict -p test); the helper itself is
// tested against admitd in tasks.test.mjs.
import { Admitd, type ToolResult } from "admitd-client";
import { Tasks, UnknownTask, declaresTasks, isTask, type CreateTaskResult } from "admitd-client/tasks";

declare function exportOrders(region: string, signal: AbortSignal): Promise<string>;

// [integrations:typescript-tasks]
const tasks = new Tasks(new Admitd("http://127.0.0.1:9470"), { renewEveryMs: 60_000 });

// tools/call of a long tool: a task when the client declared the extension on this request.
export async function callExport(
  meta: Record<string, unknown> | undefined,
  who: { tenant: string; subject: string },
  region: string,
): Promise<CreateTaskResult | ToolResult | null> {
  if (!declaresTasks(meta)) return null; // not a task: run it as an ordinary guarded call
  return tasks.start({ ...who, tool: "export_orders" }, async (signal) => ({
    content: [{ type: "text", text: await exportOrders(region, signal) }],
  }));
}

// tasks/get: checked with admitd, answered with admitd's pollIntervalMs.
export async function tasksGet(taskId: string) {
  try {
    return await tasks.get(taskId);
  } catch (e) {
    if (e instanceof UnknownTask) return { error: { code: -32602, message: e.message } };
    throw e;
  }
}
// [/integrations:typescript-tasks]

export async function answer(meta: Record<string, unknown> | undefined): Promise<number | boolean | null> {
  const r = await callExport(meta, { tenant: "acme", subject: "bot" }, "emea");
  if (r === null) return null;
  if (isTask(r)) return (await tasks.get(r.taskId)).pollIntervalMs ?? 0;
  return r.isError;
}
