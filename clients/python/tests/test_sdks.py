"""End to end with real peers: admitd (the built binary), an MCP server over streamable HTTP,
and the same SDK's client: FastMCP with ``AdmitdMiddleware`` (``servers/fastmcp_app.py``), and the
official ``mcp`` SDK with ``Admission`` (``servers/mcp_app.py``). Both servers have the same tools,
so one set of tests runs against each."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import unittest
import urllib.request

from support import ROOT, Daemon, McpServer, read, require_binary, require_sdk

WAIT = re.compile(r"Wait (\d+) seconds?")


class _EndToEnd:
    """The tests; a subclass names the SDK (``sdk``) and its server (``app``)."""

    sdk = ""
    app = ""
    daemon: Daemon
    server: McpServer

    @classmethod
    def setUpClass(cls):
        require_binary()
        require_sdk(cls.sdk)
        cls.daemon = Daemon(read(os.path.join(ROOT, "clients", "e2e.toml")))
        try:
            cls.server = McpServer(cls.app, cls.daemon.url)
        except BaseException:
            cls.daemon.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.daemon.stop()

    def runs(self) -> dict:
        with urllib.request.urlopen(self.server.base + "/runs", timeout=10) as resp:
            return json.loads(resp.read())

    def inflight(self, tenant: str) -> int:
        try:
            with urllib.request.urlopen(self.daemon.url + "/v1/tenants/" + tenant, timeout=10) as r:
                return int(json.loads(r.read())["inflight"])
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return 0
            raise

    def client(self, token: str):
        raise NotImplementedError

    def assertRefused(self, result, scope: str = "subject") -> int:
        self.assertTrue(result.is_error)
        text = result.content[0].text
        wait = WAIT.search(text)
        self.assertIsNotNone(wait, text)
        self.assertEqual(result.structured_content["error"], "rate_limited")
        self.assertEqual(result.structured_content["scope"], scope)
        return int(wait.group(1))

    async def test_a_fan_out_runs_exactly_the_admitted_calls(self):
        before = self.runs().get("fan", 0)
        async with self.client("tok-acme-fan") as acme, self.client("tok-globex") as globex:
            results = await asyncio.gather(
                *(acme.call_tool("fan", {"n": i}, raise_on_error=False) for i in range(10)),
                *(globex.call_tool("fan", {"n": i}, raise_on_error=False) for i in range(10)),
            )
        acme_results, globex_results = results[:10], results[10:]
        ran = [r for r in acme_results if not r.is_error]
        refused = [r for r in acme_results if r.is_error]
        self.assertEqual(len(ran), 4, [r.content for r in acme_results])
        for r in refused:
            self.assertGreaterEqual(self.assertRefused(r), 1)
        self.assertTrue(all(not r.is_error for r in globex_results))
        # 4 of acme's, all 10 of globex's: the tool ran exactly for the admitted calls.
        self.assertEqual(self.runs().get("fan", 0) - before, 14)
        self.assertEqual(self.inflight("acme"), 0)
        self.assertEqual(self.inflight("globex"), 0)

    async def test_a_refusal_fits_every_return_type(self):
        typed = ["as_str", "as_list", "as_dict", "as_model"]
        async with self.client("tok-acme-typed") as c:
            # Each typed tool runs once (its result validates), which spends the burst of 4. The
            # plain value it returns (str, list, dict, model) comes back with what each spend
            # budget has left in its _meta.
            for name in typed:
                ok = await c.call_tool(name, {"n": 1})
                self.assertFalse(ok.is_error)
                self.assertEqual(
                    _spend_of(ok).get("tokens"),
                    {"reserved": 0, "remaining": 2000, "budget": "subject_daily"},
                    (name, ok),
                )
            before = self.runs()
            for name in ["fan", *typed]:
                # raise_on_error=False: the refusal is a result the model reads, not an exception;
                # the client validates structured content against the output schema only for
                # results that are not errors, so none of these fail there.
                result = await c.call_tool(name, {"n": 2}, raise_on_error=False)
                self.assertRefused(result)
            tools = {t.name: t for t in await c.list_tools()}
        self.assertIsNotNone(tools["as_model"].output_schema)
        after = self.runs()
        self.assertEqual({k: after.get(k, 0) - before.get(k, 0) for k in typed + ["fan"]},
                         {k: 0 for k in typed + ["fan"]})

    async def test_an_upstream_429_puts_the_upstream_in_the_penalty_box(self):
        async with self.client("tok-initech") as c:
            busy = await c.call_tool("get_sales", {"region": "busy"}, raise_on_error=False)
            self.assertTrue(busy.is_error)
            self.assertEqual(self.runs().get("get_sales", 0), 1)
            again = await c.call_tool("get_sales", {"region": "emea"}, raise_on_error=False)
        self.assertGreaterEqual(self.assertRefused(again, "upstream_penalty"), 25)
        self.assertEqual(self.runs().get("get_sales", 0), 1)  # the refused call did not run

    async def test_a_tool_reports_the_tokens_its_model_used(self):
        before = self.runs().get("summarize", 0)
        async with self.client("tok-acme-spend") as c:
            results = [
                await c.call_tool("summarize", {"text": f"report {i}"}, raise_on_error=False)
                for i in range(3)
            ]
        # 500 reserved per call, 900 settled: 1800 of the day's 2000 are gone after two calls,
        # so the third does not fit its estimate and never runs.
        self.assertEqual([r.is_error for r in results], [False, False, True])
        self.assertEqual(self.runs().get("summarize", 0) - before, 2)
        refused = results[2]
        self.assertEqual(refused.structured_content["scope"], "spend")
        self.assertEqual(refused.structured_content["unit"], "tokens")
        self.assertEqual(refused.structured_content["budget"], "subject_daily")
        self.assertEqual(refused.structured_content["remaining"], 200)
        self.assertIn("2000 tokens", refused.content[0].text)
        self.assertTrue(refused.structured_content["retryable"])
        # What the budget had left after the second call's reservation (settled at 900 after),
        # on the str the tool returned.
        self.assertEqual(
            _spend_of(results[1]).get("tokens"),
            {"reserved": 500, "remaining": 600, "budget": "subject_daily"},
            results[1],
        )

    async def test_a_failed_or_cancelled_call_gives_its_slot_back(self):
        async with self.client("tok-acme-outcomes") as c:
            failed = await c.call_tool("fails", {"n": 1}, raise_on_error=False)
            self.assertTrue(failed.is_error)
            self.assertEqual(self.inflight("acme"), 0)
            task = asyncio.create_task(c.call_tool("slow", {"n": 1}))
            deadline = time.monotonic() + 20
            while self.inflight("acme") == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.assertEqual(self.inflight("acme"), 1)
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 20
            while self.inflight("acme") != 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.assertEqual(self.inflight("acme"), 0)


def _spend_of(result) -> dict:
    """The spend budgets an admitted result carries in its ``_meta`` (empty when it has none)."""
    meta = getattr(result, "meta", None) or getattr(result, "_meta", None) or {}
    return meta.get("admitd/spend", {})


class _Session:
    """The ``mcp`` SDK's client with a bearer token, shaped like FastMCP's for the tests."""

    def __init__(self, url: str, token: str):
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        self.http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
        self.client = Client(streamable_http_client(url, http_client=self.http))

    async def __aenter__(self):
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self.client.__aexit__(*exc)
        await self.http.aclose()

    async def call_tool(self, name, arguments, raise_on_error=True):
        result = await self.client.call_tool(name, arguments)
        if raise_on_error and result.is_error:
            raise RuntimeError(result.content)
        return result

    async def list_tools(self):
        return (await self.client.list_tools()).tools


class FastMcpEndToEnd(_EndToEnd, unittest.IsolatedAsyncioTestCase):
    sdk = "fastmcp"
    app = "fastmcp_app"

    def client(self, token: str):
        from fastmcp import Client

        return Client(self.server.url, auth=token, timeout=60)


class McpSdkEndToEnd(_EndToEnd, unittest.IsolatedAsyncioTestCase):
    sdk = "mcp"
    app = "mcp_app"

    def client(self, token: str):
        return _Session(self.server.url, token)


class McpLowLevelServer(unittest.IsolatedAsyncioTestCase):
    """``Admission.call_tool`` around a low-level ``Server``'s handler, reached in process by the
    SDK's client (no HTTP, so no token: the identity function names the caller)."""

    @classmethod
    def setUpClass(cls):
        require_binary()
        require_sdk("mcp")
        cls.daemon = Daemon(read(os.path.join(ROOT, "clients", "e2e.toml")))

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    async def test_the_handler_runs_only_when_admitted(self):
        import mcp_types as mt
        from mcp import Client
        from mcp.server.lowlevel import Server

        from admitd_client.mcp import Admission

        ran = []
        admission = Admission(self.daemon.url, identity=lambda token: ("acme", "lowlevel-bot"))

        async def list_tools(ctx, params):
            return mt.ListToolsResult(tools=[mt.Tool(name="echo", input_schema={"type": "object"})])

        async def call_tool(ctx, params):
            ran.append(params.name)
            return mt.CallToolResult(content=[mt.TextContent(type="text", text="echoed")])

        server = Server("low", on_list_tools=list_tools, on_call_tool=admission.call_tool(call_tool))
        async with Client(server) as client:
            results = [await client.call_tool("echo", {}) for _ in range(5)]
        self.assertEqual([r.is_error for r in results], [False] * 4 + [True])
        self.assertEqual(len(ran), 4)
        self.assertEqual(results[4].structured_content["scope"], "subject")
        self.assertRegex(results[4].content[0].text, WAIT)
        await admission.guard.admitd.aclose()


class McpServerPlainValues(unittest.IsolatedAsyncioTestCase):
    """``Admission.tool`` on ``MCPServer`` tools that return plain values: each comes back as the
    SDK builds it from the same function unguarded (content, structured content, output schema),
    plus what each spend budget has left in its ``_meta``. Reached in process by the SDK's
    client."""

    @classmethod
    def setUpClass(cls):
        require_binary()
        require_sdk("mcp")
        cls.daemon = Daemon(read(os.path.join(ROOT, "clients", "e2e.toml")))

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    async def test_a_plain_value_gets_the_spend_in_its_meta(self):
        from mcp import Client
        from mcp.server.mcpserver import MCPServer
        from pydantic import BaseModel

        from admitd_client.mcp import Admission

        class Report(BaseModel):
            region: str
            total: int

        def as_str(n: int) -> str:
            return str(n)

        def as_list(n: int) -> list[str]:
            return [str(n), "x"]

        def as_dict(n: int) -> dict:
            return {"n": n}

        async def as_typed_dict(n: int) -> dict[str, int]:
            return {"n": n}

        def as_model(n: int) -> Report:
            return Report(region="emea", total=n)

        # Annotations are strings in this module: the SDK evaluates them in its globals.
        as_model.__annotations__["return"] = Report

        def untyped(n: int):
            return {"n": n, "list": [1, 2]}

        def unstructured(n: int) -> dict[str, int]:
            return {"n": n}

        admission = Admission(self.daemon.url, identity=lambda token: ("globex", "plain-bot"))
        server = MCPServer("plain")
        fns = [as_str, as_list, as_dict, as_typed_dict, as_model, untyped, unstructured]
        for fn in fns:
            structured = False if fn is unstructured else None
            server.tool(name=fn.__name__, structured_output=structured)(fn)
            guarded = admission.tool(f"guarded_{fn.__name__}", structured_output=structured)(fn)
            server.tool(name=f"guarded_{fn.__name__}", structured_output=structured)(guarded)
        async with Client(server) as client:
            schemas = {t.name: t.output_schema for t in (await client.list_tools()).tools}
            for fn in fns:
                name = fn.__name__
                plain = await client.call_tool(name, {"n": 3})
                guarded = await client.call_tool(f"guarded_{name}", {"n": 3})
                self.assertFalse(guarded.is_error, guarded)
                self.assertEqual(guarded.content, plain.content, name)
                self.assertEqual(guarded.structured_content, plain.structured_content, name)
                self.assertEqual(schemas[f"guarded_{name}"], schemas[name], name)
                self.assertIsNone(_spend_of(plain).get("tokens"), name)
                self.assertEqual(
                    _spend_of(guarded).get("tokens"),
                    {"reserved": 0, "remaining": 2000, "budget": "subject_daily"},
                    (name, guarded),
                )
        await admission.guard.admitd.aclose()

    async def test_a_tool_with_a_context_charges_the_run_its_request_names(self):
        from mcp import Client
        from mcp.server.mcpserver import Context, MCPServer

        from admitd_client.mcp import Admission, report_spend

        async def draft(n: int, ctx: Context) -> str:
            report_spend(tokens=n)
            return "drafted"

        # Annotations are strings in this module: the SDK finds the Context parameter by its type.
        draft.__annotations__["ctx"] = Context

        admission = Admission(self.daemon.url, identity=lambda token: ("globex", "run-bot"))
        server = MCPServer("runs")
        server.tool(name="draft")(admission.tool("draft")(draft))
        run = {"admitd/run": "r-draft"}
        async with Client(server) as client:
            first = await client.call_tool("draft", {"n": 200}, meta=run)
            # The run's 300 (the big plan's) are the least left: 300 before the first call, then
            # 100 once it settled 200; a call outside the run sees the subject's day instead.
            second = await client.call_tool("draft", {"n": 150}, meta=run)
            third = await client.call_tool("draft", {"n": 1}, meta=run)
            outside = await client.call_tool("draft", {"n": 1})
        self.assertEqual(
            _spend_of(first).get("tokens"), {"reserved": 0, "remaining": 300, "budget": "run"}
        )
        self.assertEqual(
            _spend_of(second).get("tokens"), {"reserved": 0, "remaining": 100, "budget": "run"}
        )
        # 350 settled against 300: the run is spent, and says waiting will not help.
        self.assertTrue(third.is_error, third)
        self.assertEqual(third.structured_content["scope"], "spend")
        self.assertEqual(third.structured_content["budget"], "run")
        self.assertFalse(third.structured_content["retryable"])
        self.assertFalse(outside.is_error, outside)
        self.assertEqual(_spend_of(outside).get("tokens", {}).get("budget"), "subject_daily")
        await admission.guard.admitd.aclose()


if __name__ == "__main__":
    unittest.main()
