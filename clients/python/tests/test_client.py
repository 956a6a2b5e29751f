"""The blocking and asyncio clients against the real admitd binary (``ADMITD_BIN``, default
``target/debug/admitd``), started on a free port for each test class.

    ADMITD_BIN=target/debug/admitd python3 -m unittest discover -s clients/python/tests -v
"""

import asyncio
import hashlib
import os
import socket
import tempfile
import threading
import time
import unittest

from admitd_client import Admitd, AdmitdError, AdmitdUnavailable, AsyncAdmitd
from support import ROOT, Daemon, closed_port, read, require_binary

CONFIG = read(os.path.join(ROOT, "clients", "test.toml"))


class AgainstTheDaemon(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        require_binary()
        cls.daemon = Daemon(CONFIG)
        cls.admitd = Admitd(cls.daemon.url)

    @classmethod
    def tearDownClass(cls):
        cls.admitd.close()
        cls.daemon.stop()

    def inflight(self, tenant):
        snap = self.admitd.tenant(tenant)
        return 0 if snap is None else snap["inflight"]

    def test_admit_then_release(self):
        d = self.admitd.admit("t-admit", "bot", "search", call_id="c-1")
        self.assertTrue(d.admitted)
        self.assertFalse(d.degraded)
        self.assertTrue(d.lease_id)
        self.assertEqual(d.body["remaining"], 1)
        self.assertIn("ratelimit", d.headers)
        self.assertEqual(self.inflight("t-admit"), 1)
        self.assertTrue(self.admitd.release(d.lease_id, "ok", duration_ms=12.5))
        self.assertEqual(self.inflight("t-admit"), 0)
        # Released already: admitd no longer knows the lease.
        self.assertFalse(self.admitd.release(d.lease_id))

    def test_a_refusal_carries_the_tool_result_and_the_block_does_not_run_the_tool(self):
        for _ in range(2):
            self.assertTrue(self.admitd.admit("t-shed", "bot", "search", max_wait_ms=0).admitted)
        ran = False
        with self.admitd.call("t-shed", "bot", "search", max_wait_ms=0) as call:
            if call.admitted:
                ran = True
            result = call.tool_result
        self.assertFalse(ran)
        self.assertEqual(call.decision.scope, "subject")
        self.assertTrue(call.decision.retryable)
        self.assertGreater(call.decision.retry_after_ms, 0)
        self.assertTrue(result["isError"])
        self.assertIn("Wait", result["content"][0]["text"])
        self.assertEqual(result["structuredContent"]["error"], "rate_limited")

    def test_a_short_shortfall_is_waited_out(self):
        for _ in range(2):
            self.admitd.admit("t-wait", "bot", "search")
        d = self.admitd.admit("t-wait", "bot", "search", max_wait_ms=2000)
        self.assertTrue(d.admitted, d.body)
        self.assertGreater(d.waited_ms, 0)

    def test_the_block_releases_with_the_outcome_it_had(self):
        with self.admitd.call("t-ok", "bot", "search") as call:
            self.assertTrue(call.admitted)
            self.assertEqual(self.inflight("t-ok"), 1)
        self.assertEqual(self.inflight("t-ok"), 0)

        with self.assertRaises(ZeroDivisionError):
            with self.admitd.call("t-err", "bot", "search") as call:
                self.assertEqual(self.inflight("t-err"), 1)
                1 / 0
        # The exception went on to the caller, and the slot came back.
        self.assertEqual(self.inflight("t-err"), 0)
        self.assertTrue(call._released)

    def test_an_upstream_429_puts_the_upstream_in_the_penalty_box(self):
        admitd, tenant, subject = self.admitd, "t-429", "bot"

        def get_sales(region: str) -> dict:
            status, retry_after = 429, "30"  # what the warehouse answered
            # [integrations:plain]
            with admitd.call(tenant, subject, "get_sales", upstream="warehouse") as call:
                if not call.admitted:
                    return call.tool_result  # the CallToolResult for the model, unchanged
                # ... call the upstream ...
                call.upstream_response(status, retry_after)  # a 429 starts the penalty box
                return {"content": [{"type": "text", "text": f"sales in {region}"}]}
            # [/integrations:plain]

        self.assertNotIn("isError", get_sales("emea"))
        again = self.admitd.admit("t-429", "other-bot", "get_sales", max_wait_ms=0)
        self.assertFalse(again.admitted)
        self.assertEqual(again.scope, "upstream_penalty")
        self.assertGreater(again.retry_after_ms, 25_000)
        # Another tenant's budget for the same (not shared) upstream is untouched.
        self.assertTrue(self.admitd.admit("t-429-b", "bot", "get_sales").admitted)

    def test_feedback_outside_a_lease(self):
        self.admitd.feedback("t-fb", "warehouse", 429, retry_after=20)
        d = self.admitd.admit("t-fb", "bot", "get_sales", max_wait_ms=0)
        self.assertEqual((d.admitted, d.scope), (False, "upstream_penalty"))

    def test_malformed_requests_raise(self):
        with self.assertRaises(AdmitdError) as e:
            self.admitd.admit("t-bad", "x" * 200, "search")
        self.assertEqual((e.exception.status, e.exception.code), (400, "invalid_request"))
        self.assertIn("128 bytes", e.exception.message)
        with self.assertRaises(ValueError):
            self.admitd.release("whatever", "done")

    def test_names_travel_as_sent(self):
        d = self.admitd.admit("t é/?#", "bot", "search")
        self.assertTrue(d.admitted)
        snap = self.admitd.tenant("t é/?#")
        self.assertEqual(snap["tenant"], "t é/?#")
        self.assertTrue(self.admitd.release(d.lease_id))
        self.assertIsNone(self.admitd.tenant("nobody-here"))

    def test_threads_share_one_client(self):
        errors = []

        def work(i):
            try:
                for _ in range(5):
                    with self.admitd.call("t-threads", f"bot-{i}", "search") as call:
                        self.assertTrue(call.admitted or call.tool_result["isError"])
            except Exception as e:  # noqa: BLE001 - collected for the assertion below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(self.inflight("t-threads"), 0)

    def test_a_kept_alive_connection_closed_by_the_daemon_is_reopened(self):
        with Admitd(self.daemon.url) as client:
            self.assertTrue(client.admit("t-reopen", "bot", "search").admitted)
            # Close the socket under the client, as a daemon restart or an idle timeout would.
            client._local.conn.sock.shutdown(socket.SHUT_RDWR)
            self.assertTrue(client.admit("t-reopen", "bot", "search").admitted)


class AsyncAgainstTheDaemon(unittest.IsolatedAsyncioTestCase):
    daemon: Daemon

    @classmethod
    def setUpClass(cls):
        require_binary()
        cls.daemon = Daemon(CONFIG)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    async def asyncSetUp(self):
        self.admitd = AsyncAdmitd(self.daemon.url)

    async def asyncTearDown(self):
        await self.admitd.aclose()

    async def inflight(self, tenant):
        snap = await self.admitd.tenant(tenant)
        return 0 if snap is None else snap["inflight"]

    async def test_admit_refuse_release(self):
        d = await self.admitd.admit("a-admit", "bot", "search", call_id="c-1")
        self.assertTrue(d.admitted)
        self.assertFalse(d.degraded)
        self.assertEqual(d.body["remaining"], 1)
        self.assertIn("ratelimit", d.headers)
        self.assertEqual(await self.inflight("a-admit"), 1)
        self.assertTrue(await self.admitd.release(d.lease_id, "ok", duration_ms=3))
        self.assertFalse(await self.admitd.release(d.lease_id))
        self.assertEqual(await self.inflight("a-admit"), 0)
        await self.admitd.admit("a-admit", "bot", "search")
        shed = await self.admitd.admit("a-admit", "bot", "search", max_wait_ms=0)
        self.assertFalse(shed.admitted)
        self.assertEqual(shed.scope, "subject")
        self.assertTrue(shed.tool_result["isError"])
        self.assertIn("retry-after", shed.headers)

    async def test_the_block_releases_with_the_outcome_it_had(self):
        async with self.admitd.call("a-ok", "bot", "search") as call:
            self.assertTrue(call.admitted)
            self.assertEqual(await self.inflight("a-ok"), 1)
        self.assertEqual(await self.inflight("a-ok"), 0)
        with self.assertRaises(ZeroDivisionError):
            async with self.admitd.call("a-err", "bot", "search"):
                1 / 0
        self.assertEqual(await self.inflight("a-err"), 0)

        started = asyncio.Event()

        async def slow_tool():
            async with self.admitd.call("a-cancel", "bot", "search"):
                started.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(slow_tool())
        await started.wait()
        self.assertEqual(await self.inflight("a-cancel"), 1)
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual(await self.inflight("a-cancel"), 0)

    async def test_an_upstream_429_puts_the_upstream_in_the_penalty_box(self):
        async with self.admitd.call("a-429", "bot", "get_sales") as call:
            call.upstream_response(429, "30")
        again = await self.admitd.admit("a-429", "other-bot", "get_sales", max_wait_ms=0)
        self.assertEqual((again.admitted, again.scope), (False, "upstream_penalty"))
        self.assertGreater(again.retry_after_ms, 25_000)
        await self.admitd.feedback("a-fb", "warehouse", 429, retry_after=20)
        d = await self.admitd.admit("a-fb", "bot", "get_sales", max_wait_ms=0)
        self.assertEqual((d.admitted, d.scope), (False, "upstream_penalty"))

    async def test_malformed_requests_raise(self):
        with self.assertRaises(AdmitdError) as e:
            await self.admitd.admit("a-bad", "x" * 200, "search")
        self.assertEqual((e.exception.status, e.exception.code), (400, "invalid_request"))
        # The connection stays usable after a 400.
        self.assertTrue((await self.admitd.admit("a-bad", "bot", "search")).admitted)

    async def test_held_calls_hold_no_thread(self):
        # Ten subjects, three calls each: the third of each waits about a second for a token.
        threads_before = threading.active_count()
        peak = threads_before

        async def sample():
            nonlocal peak
            while True:
                peak = max(peak, threading.active_count())
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        started = time.monotonic()
        decisions = await asyncio.gather(
            *(
                self.admitd.admit("a-held", f"bot-{i}", "search", max_wait_ms=2000)
                for i in range(10)
                for _ in range(3)
            )
        )
        sampler.cancel()
        self.assertTrue(all(d.admitted for d in decisions), [d.body for d in decisions])
        held = [d for d in decisions if d.waited_ms > 0]
        self.assertEqual(len(held), 10)
        self.assertGreater(time.monotonic() - started, 0.5)
        self.assertEqual(peak, threads_before)


class OverAUnixSocketWithATokenRequired(unittest.TestCase):
    """Both clients reach a daemon that listens on a Unix socket and requires a caller token."""

    TOKEN = "client-test-token-7f3a9c"

    @classmethod
    def setUpClass(cls):
        require_binary()
        cls.sockdir = tempfile.TemporaryDirectory()
        cls.url = "unix:" + os.path.join(cls.sockdir.name, "admitd.sock")
        digest = hashlib.sha256(cls.TOKEN.encode()).hexdigest()
        config = CONFIG.replace("[server]\n", f'[server]\napi_tokens_sha256 = ["{digest}"]\n', 1)
        cls.daemon = Daemon(config, ["--listen", cls.url])

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        cls.sockdir.cleanup()

    def test_the_blocking_client(self):
        self.assertEqual(self.daemon.url, self.url)
        with Admitd(self.url, token=self.TOKEN) as client:
            with client.call("u-sync", "bot", "search") as call:
                self.assertTrue(call.admitted and not call.decision.degraded)
                self.assertEqual(client.tenant("u-sync")["inflight"], 1)
            self.assertEqual(client.tenant("u-sync")["inflight"], 0)
        with Admitd(self.url) as anonymous:
            with self.assertRaises(AdmitdError) as e:
                anonymous.admit("u-sync", "bot", "search")
            self.assertEqual(e.exception.status, 401)

    def test_the_asyncio_client(self):
        async def main():
            async with AsyncAdmitd(self.url, token=self.TOKEN) as client:
                async with client.call("u-async", "bot", "search") as call:
                    self.assertTrue(call.admitted and not call.decision.degraded)
                    self.assertEqual((await client.tenant("u-async"))["inflight"], 1)
                self.assertEqual((await client.tenant("u-async"))["inflight"], 0)
            async with AsyncAdmitd(self.url, token="wrong-token") as anonymous:
                with self.assertRaises(AdmitdError) as e:
                    await anonymous.admit("u-async", "bot", "search")
                self.assertEqual(e.exception.status, 401)

        asyncio.run(main())

    def test_a_token_cannot_carry_a_header_break(self):
        for cls in (Admitd, AsyncAdmitd):
            with self.assertRaises(ValueError):
                cls(self.url, token="abc\r\nX-Evil: 1")


class SpendAgainstTheDaemon(unittest.TestCase):
    """A call's run and estimates go with its admission; what it reports spending goes with its
    release, and the next admission sees the settled figure."""

    def test_reported_spend_is_settled_at_release(self):
        require_binary()
        daemon = Daemon("[spend.usd]\nestimate = 0.01\nrun = 1.0\n")
        admitd = Admitd(daemon.url)
        try:
            with admitd.call("t", "bot", "search", run="r-1", spend={"usd": 0.5}) as call:
                self.assertEqual(call.spend["usd"], {"reserved": 0.5, "remaining": 0.5, "budget": "run"})
                call.report_spend(usd=0.2)
                call.report_spend({"usd": 0.05})
            d = admitd.admit("t", "bot", "search", run="r-1")
            self.assertEqual(d.spend["usd"]["remaining"], 0.74)
            self.assertTrue(admitd.release(d.lease_id, spent={"usd": 0.75}, cost=0))
            refused = admitd.admit("t", "bot", "search", run="r-1")
            self.assertFalse(refused.admitted)
            self.assertEqual(refused.scope, "spend")
            self.assertEqual(refused.spend, {"unit": "usd", "budget": "run", "remaining": 0})
        finally:
            admitd.close()
            daemon.stop()


class WithoutTheDaemon(unittest.TestCase):
    def test_fail_open_runs_the_call_without_a_lease(self):
        client = Admitd(f"http://127.0.0.1:{closed_port()}", timeout=1)
        with self.assertLogs("admitd_client", "WARNING"):
            with client.call("t", "bot", "search") as call:
                self.assertTrue(call.admitted)
                self.assertTrue(call.decision.degraded)
                self.assertIsNone(call.decision.lease_id)

    def test_fail_closed_refuses_with_a_tool_result(self):
        client = Admitd(f"http://127.0.0.1:{closed_port()}", fail_open=False, unavailable_retry_s=7)
        with self.assertLogs("admitd_client", "WARNING"):
            d = client.admit("t", "bot", "search")
        self.assertFalse(d.admitted)
        self.assertTrue(d.degraded)
        self.assertEqual(d.retry_after_ms, 7000)
        self.assertTrue(d.tool_result["isError"])
        self.assertIn("Wait 7 seconds", d.tool_result["content"][0]["text"])
        with self.assertRaises(AdmitdUnavailable):
            client.release("00", "ok")

    def test_async_fail_open_and_fail_closed(self):
        async def main():
            port = closed_port()
            async with AsyncAdmitd(f"http://127.0.0.1:{port}") as client:
                async with client.call("t", "bot", "search") as call:
                    self.assertTrue(call.admitted)
                    self.assertTrue(call.decision.degraded)
            async with AsyncAdmitd(f"http://127.0.0.1:{port}", fail_open=False) as client:
                d = await client.admit("t", "bot", "search")
                self.assertEqual((d.admitted, d.degraded, d.retry_after_ms), (False, True, 5000))
                with self.assertRaises(AdmitdUnavailable):
                    await client.release("00", "ok")

        with self.assertLogs("admitd_client", "WARNING"):
            asyncio.run(main())

    def test_an_admitd_that_does_not_answer_fails_open_within_the_timeout(self):
        # A listening socket nobody accepts from: the connection opens, no answer ever comes.
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            url = "http://127.0.0.1:%d" % silent.getsockname()[1]
            for client in (Admitd(url, timeout=0.3), AsyncAdmitd(url, timeout=0.3)):
                started = time.monotonic()
                with self.assertLogs("admitd_client", "WARNING"):
                    if isinstance(client, AsyncAdmitd):
                        d = asyncio.run(client.admit("t", "bot", "search", max_wait_ms=0))
                    else:
                        d = client.admit("t", "bot", "search", max_wait_ms=0)
                        client.close()
                self.assertTrue(d.admitted and d.degraded)
                self.assertLess(time.monotonic() - started, 2.0)

    def test_the_choice_is_named_fail_open_or_fail_closed(self):
        url = f"http://127.0.0.1:{closed_port()}"
        self.assertEqual(Admitd(url).on_unavailable, "fail_open")
        client = Admitd(url, on_unavailable="fail_closed", unavailable_retry_s=3)
        with self.assertLogs("admitd_client", "WARNING"):
            d = client.admit("t", "bot", "search")
        self.assertEqual((d.admitted, d.degraded, d.retry_after_ms), (False, True, 3000))
        self.assertEqual(AsyncAdmitd(url, fail_open=False).on_unavailable, "fail_closed")
        for bad in [dict(on_unavailable="open"), dict(on_unavailable="fail_open", fail_open=False)]:
            with self.assertRaises(ValueError):
                Admitd(url, **bad)

    def test_an_outage_is_counted_and_logged_once_not_per_call(self):
        require_binary()
        port = closed_port()
        for client in (Admitd(f"http://127.0.0.1:{port}"), AsyncAdmitd(f"http://127.0.0.1:{port}")):
            # One loop for the async client's whole life: its kept-alive connections belong to it.
            loop = asyncio.new_event_loop()

            def admit():
                if isinstance(client, AsyncAdmitd):
                    return loop.run_until_complete(client.admit("t", "bot", "search", max_wait_ms=0))
                return client.admit("t", "bot", "search", max_wait_ms=0)

            with self.assertLogs("admitd_client", "DEBUG") as logs:
                for _ in range(5):
                    self.assertTrue(admit().degraded)
            warnings = [r for r in logs.records if r.levelname == "WARNING"]
            self.assertEqual(len(warnings), 1, logs.output)
            self.assertIn("admitd unavailable (fail_open): running calls without a lease", warnings[0].getMessage())
            self.assertEqual((client.outage.outages, client.outage.calls), (1, 5))
            self.assertIsNotNone(client.outage.since)
            # admitd comes back on that address: one line says so, with what the outage touched.
            daemon = Daemon("", ["--listen", f"127.0.0.1:{port}"])
            try:
                with self.assertLogs("admitd_client", "WARNING") as logs:
                    for _ in range(3):
                        self.assertFalse(admit().degraded)
                self.assertEqual(len(logs.records), 1, logs.output)
                self.assertIn("answers again", logs.output[0])
                self.assertIn("5 calls were decided without it", logs.output[0])
                self.assertIsNone(client.outage.since)
            finally:
                daemon.stop()
            # The next outage is a second one.
            with self.assertLogs("admitd_client", "WARNING"):
                self.assertTrue(admit().degraded)
            self.assertEqual((client.outage.outages, client.outage.calls), (2, 6))
            if isinstance(client, AsyncAdmitd):
                loop.run_until_complete(client.aclose())
            else:
                client.close()
            loop.close()

    def test_only_http_and_unix_urls(self):
        for bad in ("https://127.0.0.1:9470", "127.0.0.1:9470", "http://", "unix:", "unix://host/x"):
            with self.assertRaises(ValueError):
                Admitd(bad)
            with self.assertRaises(ValueError):
                AsyncAdmitd(bad)


if __name__ == "__main__":
    unittest.main()
