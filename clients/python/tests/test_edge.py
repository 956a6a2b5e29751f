"""At the gateway: a real nginx running ``deploy/nginx/admitd-edge.conf`` in front of a FastMCP
server that does no admission of its own, admitd's edge check deciding, and FastMCP's client
calling through nginx with an ``[edge]`` API key. A refused call must reach the client as the
answer a server would give, a ``CallToolResult`` with ``isError`` whose text names the wait, and
a call without a credential a JSON-RPC 401 that names the problem."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import unittest
import urllib.error
import urllib.request

from support import Daemon, McpServer, Nginx, require_binary, require_sdk

KEY = "acme-gateway-key-93e1"
WAIT = re.compile(r"Wait (\d+) seconds?")
# A subject bucket of 4 that refills one call per 10 s: a burst of 10 parallel calls runs 4.
CONFIG = f"""
[limits.subject]
rate = "6/min"
burst = 4
[edge]
client_address_header = "x-real-ip"
[[edge.api_keys]]
sha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"
tenant = "acme"
subject = "acme-gateway"
"""


class BehindNginx(unittest.IsolatedAsyncioTestCase):
    @classmethod
    def setUpClass(cls):
        require_binary()
        require_sdk("fastmcp")
        cls.daemon = Daemon(CONFIG)
        cls.server = cls.nginx = None
        try:
            cls.server = McpServer("edge_app", cls.daemon.url)
            assert cls.server.addr is not None
            cls.nginx = Nginx(cls.daemon.url, cls.server.addr)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for p in (cls.nginx, cls.server, cls.daemon):
            if p is not None:
                p.stop()

    def runs(self) -> int:
        with urllib.request.urlopen(self.server.base + "/runs", timeout=10) as resp:
            return int(json.loads(resp.read()).get("fan", 0))

    async def test_a_burst_of_10_on_4_runs_4_and_the_model_reads_the_wait_of_the_others(self):
        from fastmcp import Client

        before = self.runs()
        async with Client(self.nginx.url, auth=KEY, timeout=60) as c:
            results = await asyncio.gather(
                *(c.call_tool("fan", {"n": i}, raise_on_error=False) for i in range(10))
            )
        ran = [r for r in results if not r.is_error]
        refused = [r for r in results if r.is_error]
        self.assertEqual(len(ran), 4, [r.content for r in results])
        self.assertEqual(self.runs() - before, 4)
        waits = []
        for r in refused:
            text = r.content[0].text
            wait = WAIT.search(text)
            self.assertIsNotNone(wait, text)
            waits.append(int(wait.group(1)))
            self.assertEqual(r.structured_content["error"], "rate_limited")
            self.assertEqual(r.structured_content["scope"], "subject")
            # The wait in numbers agrees with the wait in words.
            ms = r.structured_content["retry_after_ms"]
            self.assertEqual(-(-ms // 1000), int(wait.group(1)))
        self.assertTrue(all(w >= 1 for w in waits), waits)

    def test_without_a_credential_the_answer_is_a_json_rpc_401_naming_the_problem(self):
        body = {"jsonrpc": "2.0", "id": "x-1", "method": "tools/call", "params": {"name": "fan", "arguments": {"n": 1}}}
        req = urllib.request.Request(
            self.nginx.url,
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                "Accept": "application/json, text/event-stream",
                "MCP-Protocol-Version": "2026-07-28",
                "Mcp-Method": "tools/call",
                "Mcp-Name": "fan",
            },
            method="POST",
        )
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        try:
            self.assertEqual(e.exception.code, 401)
            self.assertEqual(e.exception.headers["Content-Type"], "application/json")
            answer = json.loads(e.exception.read())
        finally:
            e.exception.close()
        self.assertEqual(answer["jsonrpc"], "2.0")
        self.assertEqual(answer["id"], "x-1")
        self.assertIn("no valid credential", answer["error"]["message"])

    async def test_the_sdk_client_without_a_credential_hears_what_is_wrong(self):
        from fastmcp import Client

        with self.assertRaises(Exception) as e:
            async with Client(self.nginx.url, timeout=30) as c:
                await c.list_tools()
        self.assertIn("no valid credential", str(e.exception) + repr(e.exception.__cause__))


if __name__ == "__main__":
    unittest.main()
