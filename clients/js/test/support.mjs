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

/** The nginx binary, or undefined. */
export async function nginxBinary() {
  for (const dir of (process.env.PATH ?? "").split(":").concat(["/usr/sbin"])) {
    try {
      await access(join(dir, "nginx"), constants.X_OK);
      return join(dir, "nginx");
    } catch {}
  }
  return undefined;
}

/**
 * A real nginx running deploy/nginx/admitd-edge.conf unchanged but for the addresses of admitd, the
 * MCP server and its own port, with every path in a temp dir, until `stop`.
 */
export async function startNginx(binary, admitdUrl, upstream) {
  const { readFile } = await import("node:fs/promises");
  const dir = await mkdtemp(join(tmpdir(), "admitd-nginx-"));
  const port = await closedPort();
  let conf = await readFile(join(ROOT, "deploy", "nginx", "admitd-edge.conf"), "utf8");
  for (const [example, here] of [
    ["server 127.0.0.1:9470;", `server ${admitdUrl.replace(/^http:\/\//, "")};`],
    ["server 127.0.0.1:8000;", `server ${upstream};`],
    ["listen 8080;", `listen 127.0.0.1:${port};`],
  ]) {
    if (conf.split(example).length !== 2) throw new Error(`${example} is not in the shipped config exactly once`);
    conf = conf.replace(example, here);
  }
  await writeFile(join(dir, "admitd-edge.conf"), conf);
  const temps = ["proxy", "fastcgi", "uwsgi", "scgi"].map((k) => `  ${k}_temp_path ${dir}/${k};\n`).join("");
  await writeFile(
    join(dir, "nginx.conf"),
    `worker_processes 1;\npid ${dir}/nginx.pid;\nerror_log ${dir}/error.log info;\n` +
      `events { worker_connections 256; }\n` +
      `http {\n  access_log ${dir}/access.log;\n  client_body_temp_path ${dir}/body;\n${temps}` +
      `  include ${dir}/admitd-edge.conf;\n}\n`,
  );
  const child = spawn(
    binary,
    ["-p", dir, "-c", `${dir}/nginx.conf`, "-e", `${dir}/error.log`, "-g", "daemon off; master_process off;"],
    { stdio: "ignore" },
  );
  process.on("exit", () => child.kill("SIGKILL"));
  const { connect } = await import("node:net");
  const deadline = Date.now() + 10000;
  for (;;) {
    const up = await new Promise((ok) => {
      const s = connect(port, "127.0.0.1", () => {
        s.end();
        ok(true);
      });
      s.on("error", () => ok(false));
    });
    if (up) break;
    if (Date.now() > deadline || child.exitCode !== null) throw new Error("nginx did not start");
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    url: `http://127.0.0.1:${port}/mcp`,
    async stop() {
      const exited = new Promise((ok) => child.once("exit", ok));
      child.kill("SIGTERM");
      await exited;
      await rm(dir, { recursive: true, force: true });
    },
  };
}
