"""MCP tasks end to end: admitd (the built binary) and a server whose long tool runs as a task,
built with FastMCP (``servers/fastmcp_tasks_app.py``, ``admitd_client.fastmcp_tasks``) or with the
official ``mcp`` SDK (``servers/mcp_tasks_app.py``, ``admitd_client.mcp_tasks``), called by the
``mcp`` SDK's client.

Neither pinned SDK (fastmcp 4.2.3, mcp 2.3.0) ships the Tasks extension of revision 2026-07-28
(``io.modelcontextprotocol/tasks``); both carry the extension machinery (SEP-2133) it is built
on. The server side is admitd's adapters; the client side here is the extension as
a client implements it on the SDK's ``ClientExtension`` (declare it on each request, claim the
``resultType: "task"`` result, poll ``tasks/get``), so the exchange is the extension's wire
format between two real SDK peers. ``TasksHelper`` tests the helper alone against admitd."""

from __future__ import annotations

import asyncio
import os
import time
import unittest
import urllib.request
import json
from typing import Any, Dict, List, Literal

from support import Daemon, McpServer, require_binary, require_sdk

CONFIG = """
[limits.subject]
rate = "100/s"
burst = 100
concurrency = 8
[tasks]
poll_interval = "2s"
poll_rate = "5/s"
max_poll_interval = "5s"
lease_ttl = "2s"
"""


def tenant_inflight(daemon: Daemon, tenant: str) -> int:
    try:
        with urllib.request.urlopen(daemon.url + "/v1/tenants/" + tenant, timeout=10) as r:
            return int(json.loads(r.read())["inflight"])
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return 0
        raise


def tasks_client_extension(log: List[Dict[str, Any]]) -> Any:
    """The Tasks extension, client side, on the ``mcp`` SDK's extension hooks: it polls as told,
    except for one poll sent at once, to see it refused."""
    import mcp_types as mt
    from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
    from pydantic import TypeAdapter

    class CreateTaskResult(mt.Result):
        result_type: Literal["task"] = "task"
        task_id: str
        status: str
        ttl_ms: int | None = None
        poll_interval_ms: int | None = None

    class TaskParams(mt.RequestParams):
        task_id: str

    class GetTask(mt.Request[TaskParams, Literal["tasks/get"]]):
        method: Literal["tasks/get"] = "tasks/get"
        params: TaskParams
        name_param = "taskId"

    async def get(ctx: ClaimContext, task_id: str) -> Dict[str, Any]:
        got: Dict[str, Any] = await ctx.session.send_request(
            GetTask(params=TaskParams(task_id=task_id)), TypeAdapter(Dict[str, Any])
        )
        got["at"] = time.monotonic()
        log.append(got)
        return got

    async def resolve(created: CreateTaskResult, ctx: ClaimContext) -> mt.CallToolResult:
        log.append({"created": created.poll_interval_ms, "at": time.monotonic()})
        got = await get(ctx, created.task_id)  # too early, on purpose
        interval = created.poll_interval_ms or 1000
        while True:
            await asyncio.sleep(interval / 1000)
            got = await get(ctx, created.task_id)
            if got["status"] != "working":
                return mt.CallToolResult.model_validate(got["result"])
            interval = got.get("pollIntervalMs", interval)

    class Tasks(ClientExtension):
        identifier = "io.modelcontextprotocol/tasks"

        def claims(self) -> Any:
            return (ResultClaim(result_type="task", model=CreateTaskResult, resolve=resolve),)

    return Tasks()


class _TasksEndToEnd:
    """The tests; a subclass names the SDK (``sdk``) and its server (``app``)."""

    sdk = ""
    app = ""
    daemon: Daemon
    server: McpServer

    @classmethod
    def setUpClass(cls):
        require_binary()
        require_sdk(cls.sdk)
        require_sdk("mcp")
        cls.daemon = Daemon(CONFIG)
        try:
            cls.server = McpServer(cls.app, cls.daemon.url)
        except BaseException:
            cls.daemon.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.daemon.stop()

    def session(self, token: str, extensions: List[Any]) -> Any:
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
        self.addAsyncCleanup(http.aclose)
        return Client(streamable_http_client(self.server.url, http_client=http), extensions=extensions)

    async def test_a_long_call_becomes_a_task_paced_by_admitd_and_kept_alive(self):
        log: List[Dict[str, Any]] = []
        async with self.session("tok-acme-fan", [tasks_client_extension(log)]) as client:
            call = asyncio.ensure_future(client.call_tool("export_orders", {"region": "emea"}))
            # The task outlives its 2 s lease TTL while its worker renews it: its slot stays taken.
            await asyncio.sleep(2.5)
            self.assertEqual(tenant_inflight(self.daemon, "acme"), 1)
            result = await asyncio.wait_for(call, 30)
        self.assertFalse(result.is_error, result)
        self.assertIn("exported the orders of emea", result.content[0].text)
        created, early, *polls = log
        self.assertGreaterEqual(created["created"], 2000, "admitd's poll interval, never below poll_interval")
        # The poll sent at once was early: no news, and told the time left.
        self.assertEqual(early["status"], "working")
        self.assertIn("sooner", early.get("statusMessage", ""))
        self.assertLessEqual(early["pollIntervalMs"], created["created"])
        # Every poll made as told was on time: told the next interval, none called early.
        for p in polls[:-1]:
            self.assertEqual(p["status"], "working")
            self.assertNotIn("statusMessage", p)
            self.assertGreaterEqual(p["pollIntervalMs"], 2000)
        self.assertEqual(polls[-1]["status"], "completed")
        # Released when the work ended.
        deadline = time.monotonic() + 10
        while tenant_inflight(self.daemon, "acme") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.assertEqual(tenant_inflight(self.daemon, "acme"), 0)

    async def test_a_client_without_the_extension_gets_an_ordinary_call(self):
        async with self.session("tok-globex", []) as client:
            started = time.monotonic()
            call = asyncio.ensure_future(client.call_tool("export_orders", {"region": "apac"}))
            await asyncio.sleep(1)
            self.assertEqual(tenant_inflight(self.daemon, "globex"), 1, "admitted as a call")
            result = await asyncio.wait_for(call, 30)
        self.assertFalse(result.is_error, result)
        self.assertIn("exported the orders of apac", result.content[0].text)
        self.assertGreaterEqual(time.monotonic() - started, 2.9, "ran inline, no task")


class FastMcpTasksEndToEnd(_TasksEndToEnd, unittest.IsolatedAsyncioTestCase):
    sdk = "fastmcp"
    app = "fastmcp_tasks_app"


class McpSdkTasksEndToEnd(_TasksEndToEnd, unittest.IsolatedAsyncioTestCase):
    sdk = "mcp"
    app = "mcp_tasks_app"


class TasksHelper(unittest.IsolatedAsyncioTestCase):
    """``admitd_client.tasks`` against admitd, on the extension's wire format, no SDK."""

    @classmethod
    def setUpClass(cls):
        require_binary()
        cls.daemon = Daemon(CONFIG)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    async def test_start_get_and_the_end_of_a_task(self):
        from admitd_client import AsyncAdmitd
        from admitd_client.tasks import Tasks, UnknownTask, declares_tasks

        meta = {"io.modelcontextprotocol/clientCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}}}
        self.assertTrue(declares_tasks(meta))
        self.assertFalse(declares_tasks({}))
        self.assertFalse(declares_tasks({"io.modelcontextprotocol/clientCapabilities": {"extensions": {}}}))
        self.assertFalse(declares_tasks(None))

        async with AsyncAdmitd(self.daemon.url) as admitd:
            tasks = Tasks(admitd, ttl_ms=60_000, renew_every_s=0.5)
            done = asyncio.Event()

            async def work() -> Dict[str, Any]:
                await done.wait()
                return {"content": [{"type": "text", "text": "done"}]}

            created = await tasks.start("initech", "worker", "export", work)
            self.assertEqual(created["resultType"], "task")
            self.assertEqual(created["status"], "working")
            self.assertEqual(created["ttlMs"], 60_000)
            self.assertGreaterEqual(created["pollIntervalMs"], 2000)
            for key in ("taskId", "createdAt", "lastUpdatedAt"):
                self.assertIsInstance(created[key], str)
            early = await tasks.get(created["taskId"])
            self.assertEqual(early["resultType"], "complete")
            self.assertIn("sooner", early["statusMessage"])
            await asyncio.sleep(created["pollIntervalMs"] / 1000)
            on_time = await tasks.get(created["taskId"])
            self.assertNotIn("statusMessage", on_time)
            # Kept alive past its 2 s lease TTL.
            await asyncio.sleep(2.5)
            self.assertEqual(tenant_inflight(self.daemon, "initech"), 1)
            done.set()
            await asyncio.sleep(0.2)
            finished = await tasks.get(created["taskId"])
            self.assertEqual(finished["status"], "completed")
            self.assertEqual(finished["result"]["content"][0]["text"], "done")
            self.assertEqual(tenant_inflight(self.daemon, "initech"), 0)
            with self.assertRaises(UnknownTask):
                await tasks.get("no-such-task")
            await tasks.aclose()


if __name__ == "__main__":
    unittest.main()
