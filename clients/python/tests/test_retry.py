"""Both clients send a request once more when the server closed a kept-alive connection
without answering it, and never when any part of an answer came (so no admission is counted
twice). The peer is a tiny local HTTP server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import unittest
from typing import List

from admitd_client import Admitd, AsyncAdmitd

ADMITTED = json.dumps(
    {"admitted": True, "lease_id": "l-1", "waited_ms": 0, "mode": "enforce",
     "remaining": 1, "limit": 2, "reset_ms": 500}
).encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(ADMITTED)).encode() + b"\r\n\r\n" + ADMITTED
)


class Misbehaving:
    """Answers the first ``answered`` requests on each connection, then does ``then`` with the
    next one: ``close`` (close without answering) or ``partial`` (half an answer, then close).
    ``requests[i]`` counts the requests that reached connection ``i``."""

    def __init__(self, answered: int, then: str):
        self.answered = answered
        self.then = then
        self.requests: List[int] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                index = len(self.requests)
                self.requests.append(0)
            threading.Thread(target=self._serve, args=(conn, index), daemon=True).start()

    def _serve(self, conn: socket.socket, index: int) -> None:
        buf = b""
        with conn:
            n = 0
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    rest += chunk
                buf = rest[length:]
                with self._lock:
                    self.requests[index] += 1
                n += 1
                if n <= self.answered:
                    conn.sendall(ANSWER)
                    continue
                if self.then == "partial":
                    conn.sendall(ANSWER[:20])
                return


def admit_sync(url: str, times: int):
    with Admitd(url, timeout=2) as client:
        return [client.admit("t", "bot", "search", max_wait_ms=0) for _ in range(times)]


def admit_async(url: str, times: int):
    async def main():
        async with AsyncAdmitd(url, timeout=2) as client:
            return [await client.admit("t", "bot", "search", max_wait_ms=0) for _ in range(times)]

    return asyncio.run(main())


class RetryOnce(unittest.TestCase):
    def test_a_kept_alive_connection_closed_unanswered_is_retried_on_a_new_one(self):
        for admit in (admit_sync, admit_async):
            server = Misbehaving(answered=1, then="close")
            try:
                first, second = admit(server.url, 2)
            finally:
                server.close()
            self.assertTrue(first.admitted and not first.degraded)
            # Answered by the second connection, not made up by fail_open.
            self.assertTrue(second.admitted and not second.degraded, second)
            self.assertEqual(second.lease_id, "l-1")
            self.assertEqual(server.requests, [2, 1])

    def test_a_cut_off_answer_is_never_retried(self):
        for admit in (admit_sync, admit_async):
            server = Misbehaving(answered=1, then="partial")
            try:
                with self.assertLogs("admitd_client", "WARNING"):
                    first, second = admit(server.url, 2)
            finally:
                server.close()
            self.assertFalse(first.degraded)
            self.assertTrue(second.degraded)
            # The request that got half an answer was sent once.
            self.assertEqual(server.requests, [2])

    def test_a_new_connection_closed_unanswered_is_not_retried(self):
        # Nothing shows the request did not reach the server, so it is not sent again.
        for admit in (admit_sync, admit_async):
            server = Misbehaving(answered=0, then="close")
            try:
                with self.assertLogs("admitd_client", "WARNING"):
                    (only,) = admit(server.url, 1)
            finally:
                server.close()
            self.assertTrue(only.degraded)
            self.assertEqual(server.requests, [1])


if __name__ == "__main__":
    unittest.main()
