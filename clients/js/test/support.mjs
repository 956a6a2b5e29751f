// What the tests share: the real admitd binary (ADMITD_BIN, default target/debug/admitd) on a free
// port, and child processes that say where they listen.

import { spawn } from "node:child_process";
import { access, mkdtemp, rm, writeFile } from "node:fs/promises";
import { constants } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
export const BIN = process.env.ADMITD_BIN ?? join(ROOT, "target", "debug", "admitd");


export const quiet = { warn() {}, info() {} };

export async function startDaemon(config, listen = "127.0.0.1:0") {
  const dir = await mkdtemp(join(tmpdir(), "admitd-js-"));
  const path = join(dir, "admitd.toml");
  await writeFile(path, config);
  const child = spawn(BIN, ["serve", "--listen", listen, "--config", path], {
    stdio: ["ignore", "ignore", "pipe"],
  });
  // Never outlive the tests, whatever ends them. The address counts once its line is complete:
  // a chunk may end inside the port number.
  process.on("exit", () => child.kill("SIGKILL"));
  const addr = await new Promise((ok, fail) => {
    let seen = "";
    const timer = setTimeout(() => fail(new Error(`admitd did not start: ${seen}`)), 20000);
    child.stderr.setEncoding("utf8");
    child.stderr.on("data", (chunk) => {
      seen += chunk;
      const m = seen.match(/admitd listening on (\S+)\r?\n/);
      if (m) {
        clearTimeout(timer);
        ok(m[1]);
      }
    });
    child.on("exit", (code) => fail(new Error(`admitd exited (${code}): ${seen}`)));
  });
  return {
    url: addr.startsWith("unix:") ? addr : `http://${addr}`,
    dir,
    async stop() {
      const exited = new Promise((ok) => child.once("exit", ok));
      child.kill("SIGTERM");
      await exited;
      await rm(dir, { recursive: true, force: true });
    },
  };
}

export async function closedPort() {
  const srv = createServer();
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  const { port } = srv.address();
  await new Promise((ok) => srv.close(ok));
  return port;
}

export async function binaryExists() {
  try {
    await access(BIN, constants.X_OK);
    return true;
  } catch {
    if (process.env.ADMITD_BIN) throw new Error(`ADMITD_BIN=${BIN} is not an executable`);
    return false;
  }
}


/** Runs `node SCRIPT ...args` until `stop`; resolves once it printed `serving on HOST:PORT`. */
export async function startNode(script, args) {
  const child = spawn(process.execPath, [script, ...args], { stdio: ["ignore", "ignore", "pipe"] });
  process.on("exit", () => child.kill("SIGKILL"));
  const addr = await new Promise((ok, fail) => {
    let seen = "";
    const timer = setTimeout(() => fail(new Error(`${script} did not start: ${seen}`)), 30000);
    child.stderr.setEncoding("utf8");
    child.stderr.on("data", (chunk) => {
      seen += chunk;
      const m = seen.match(/serving on (\S+)\r?\n/);
      if (m) {
        clearTimeout(timer);
        ok(m[1]);
      }
    });
    child.on("exit", (code) => fail(new Error(`${script} exited (${code}): ${seen}`)));
  });
  return {
    base: `http://${addr}`,
    async stop() {
      const exited = new Promise((ok) => child.once("exit", ok));
      child.kill("SIGTERM");
      await exited;
    },
  };
}
