"""http.request's limits against a socket server in this process that writes exactly the bytes
a test gives it: one deadline over the whole request (a trickled status line, headers or body
cannot stretch it) and an answer cap read in chunks, whatever the answer's framing."""
import socket
import threading
import tracemalloc

import pytest

from megatron_rl.rollout.serving.http import AnswerTooLarge, TransportError, request

GUARD_S = 600.0  # the server gives up after this at the latest (never hang CI)
PACE_S = 0.05  # a trickle's pause before each byte: 400 bytes take 20 s, the deadline is 0.5 s


def _read_request(conn) -> None:
    """The whole request, head and body (Content-Length): closing a socket with unread bytes makes
    the kernel reset the connection, which the client would see instead of the answer."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


class RawServer:
    """Answers each connection with `head` (a trickle: one byte per PACE_S), then `body_block`
    `repeat` times as fast as the client reads. `sent`: the body bytes sent to the last client."""

    def __init__(self, head: bytes, trickle: bool = False, body_block: bytes = b"", repeat: int = 0):
        self.head, self.trickle, self.block, self.repeat = head, trickle, body_block, repeat
        self.sent = 0
        self.done = threading.Event()
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/x"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.sock.accept()
        conn.settimeout(GUARD_S)
        try:
            _read_request(conn)
            for i in range(len(self.head)) if self.trickle else [None]:
                if self.trickle and self.stop.wait(PACE_S):
                    return
                conn.sendall(self.head[i:i + 1] if self.trickle else self.head)
            for _ in range(self.repeat):
                conn.sendall(self.block)
                self.sent += len(self.block)
        except OSError:  # the client left
            pass
        finally:
            conn.close()
            self.done.set()

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("head", [
    b"HTTP/1.0 200 OK\r\n" + b"X-Slow: " + b"a" * 400 + b"\r\n\r\n{}",
    b"HTTP/1.0 200 OK\r\nContent-Length: 402\r\n\r\n\"" + b"a" * 400 + b"\"",
], ids=["headers", "body"])
def test_a_trickled_answer_ends_at_the_deadline(head):
    server = RawServer(head, trickle=True)
    try:
        with pytest.raises(TransportError, match=r"within x\.timeout_s=0\.5 s .*connect to last byte") as info:
            request(server.url, {}, timeout=0.5, setting="x.timeout_s")
        assert info.value.timed_out
    finally:
        server.close()


@pytest.mark.parametrize("framing", ["close", "chunked", "length"])
def test_memory_does_not_follow_a_huge_answer(framing):
    """256 MiB offered, a 1 MiB cap: refused by name, the client holding about the cap (traced
    allocations), the server stopped well before the end (the sockets' buffers at most)."""
    block = b" " * (1 << 20)
    head = {"close": b"HTTP/1.0 200 OK\r\n\r\n",
            "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "length": b"HTTP/1.0 200 OK\r\nContent-Length: 268435456\r\n\r\n"}[framing]
    if framing == "chunked":
        block = b"%x\r\n" % len(block) + block + b"\r\n"
    server = RawServer(head, body_block=block, repeat=256)
    tracemalloc.start()
    try:
        with pytest.raises(AnswerTooLarge, match="larger than 1048576 bytes"):
            request(server.url, {}, timeout=GUARD_S, max_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.close()
    assert peak < 4 << 20, peak
    assert server.done.wait(GUARD_S)
    assert server.sent < 64 << 20, server.sent


def test_an_answer_of_exactly_the_cap_is_read_whole():
    body = b"[" + b" " * 1000 + b"]"
    server = RawServer(b"HTTP/1.0 200 OK\r\n\r\n" + body)
    try:
        assert request(server.url, {}, timeout=GUARD_S, max_bytes=len(body)) == body
    finally:
        server.close()
