"""The complete example servers of docs/integrations.md (``clients/python/examples``), run as they
stand: with their development token a call runs and a burst is refused with the wait; without an
identity a call is not run, and the model reads why (not "Internal server error")."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import unittest

from support import ROOT, Daemon, closed_port, read, require_binary, require_sdk

EXAMPLES = os.path.join(ROOT, "clients", "python", "examples")


def load(name: str, admitd_url: str):
    """Imports an example as a module (its ``__main__`` part does not run)."""
    os.environ["ADMITD_URL"] = admitd_url
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, name + ".py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Example:
    sdk = ""
    name = ""
    daemon: Daemon
    proc: subprocess.Popen
    url: str

    @classmethod
    def setUpClass(cls):
        require_binary()
        require_sdk(cls.sdk)
        cls.daemon = Daemon(read(os.path.join(ROOT, "clients", "e2e.toml")))
        port = closed_port()
        env = dict(os.environ, ADMITD_URL=cls.daemon.url, PORT=str(port))
        cls.proc = subprocess.Popen(
            [sys.executable, os.path.join(EXAMPLES, cls.name + ".py")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or cls.proc.poll() is not None:
                    cls.tearDownClass()
                    raise RuntimeError(f"{cls.name}.py did not start")
                time.sleep(0.1)
        cls.url = f"http://127.0.0.1:{port}/mcp"

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        try:
            cls.proc.wait(10)
        except subprocess.TimeoutExpired:
            cls.proc.kill()
            cls.proc.wait()
        cls.daemon.stop()

    def client(self, token: str):
        raise NotImplementedError

    def in_process(self, module):
        raise NotImplementedError

    async def test_the_development_token_runs_calls_until_the_burst_is_spent(self):
        async with self.client("dev-token-acme") as c:
            results = [await c.call_tool("get_sales", {"region": "emea"}, raise_on_error=False) for _ in range(5)]
        self.assertEqual([r.is_error for r in results], [False] * 4 + [True])
        self.assertEqual(results[0].content[0].text, "sales in emea: 42")
        self.assertRegex(results[4].content[0].text, r"Wait \d+ seconds?")

    async def test_a_call_without_identity_is_not_run_and_says_why(self):
        module = load(self.name, self.daemon.url)
        with self.assertLogs("admitd_client", "WARNING") as logs:
            result = await self.in_process(module)
        self.assertTrue(result.is_error)
        text = result.content[0].text
        self.assertIn("cannot tell who is calling", text)
        self.assertIn("no validated access token", text)
        self.assertNotIn("Internal server error", text)
        self.assertEqual(result.structured_content["error"], "no_identity")
        self.assertFalse(result.structured_content["retryable"])
        self.assertIn("get_sales not run", "".join(logs.output))


class FastMcpExample(_Example, unittest.IsolatedAsyncioTestCase):
    sdk = "fastmcp"
    name = "fastmcp_server"

    def client(self, token: str):
        from fastmcp import Client

        return Client(self.url, auth=token, timeout=60)

    async def in_process(self, module):
        from fastmcp import Client

        # In memory: no HTTP, so no token reaches the middleware.
        async with Client(module.mcp) as c:
            return await c.call_tool("get_sales", {"region": "emea"}, raise_on_error=False)


class McpSdkExample(_Example, unittest.IsolatedAsyncioTestCase):
    sdk = "mcp"
    name = "mcp_server"

    def client(self, token: str):
        from test_sdks import _Session

        return _Session(self.url, token)

    async def in_process(self, module):
        from mcp import Client

        async with Client(module.server) as c:
            result = await c.call_tool("get_sales", {"region": "emea"})
        await module.admission.guard.admitd.aclose()
        return result


if __name__ == "__main__":
    unittest.main()
