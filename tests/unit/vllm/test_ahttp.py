"""ahttp.request (the vLLM engine's async client) keeps http.py's contract, against servers in
threads of this process: one deadline over the whole request, an answer cap, HTTP errors sorted,
no redirect followed (the key goes nowhere else), no proxy from the environment."""
import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from megatron_rl.rollout.serving import ahttp
from megatron_rl.rollout.serving.http import AnswerTooLarge, BadResponse, HttpStatusError, TransportError
from tests.unit.vllm.test_http import GUARD_S, RawServer


def run(url, **kwargs):
    async def main():
        async with ahttp.session() as s:
            return await ahttp.request_json(s, url, {"a": 1}, **kwargs)
    return asyncio.run(main())


def test_a_trickled_answer_ends_at_the_deadline():
    server = RawServer(b"HTTP/1.0 200 OK\r\nContent-Length: 402\r\n\r\n\"" + b"a" * 400 + b"\"", trickle=True)
    try:
        with pytest.raises(TransportError, match=r"within x\.timeout_s=0\.5 s .*connect to last byte") as info:
            run(server.url, timeout=0.5, setting="x.timeout_s")
        assert info.value.timed_out
    finally:
        server.close()


@pytest.mark.parametrize("framing", ["close", "length"])
def test_an_answer_past_the_cap_is_refused(framing):
    block = b" " * (1 << 20)
    head = {"close": b"HTTP/1.0 200 OK\r\n\r\n", "length": b"HTTP/1.0 200 OK\r\nContent-Length: 268435456\r\n\r\n"}
    server = RawServer(head[framing], body_block=block, repeat=256)
    try:
        with pytest.raises(AnswerTooLarge, match="larger than 1048576 bytes"):
            run(server.url, timeout=GUARD_S, max_bytes=1 << 20)
    finally:
        server.close()
    assert server.done.wait(GUARD_S)
    assert server.sent < 64 << 20, server.sent


def test_an_answer_of_exactly_the_cap_is_read_whole_and_errors_are_sorted():
    body = b"[" + b" " * 1000 + b"]"
    for head, expect in [(b"HTTP/1.0 200 OK\r\n\r\n" + body, []),
                         (b"HTTP/1.0 200 OK\r\n\r\n{nope", BadResponse),
                         (b"HTTP/1.0 503 Busy\r\nContent-Length: 4\r\n\r\nbusy", HttpStatusError)]:
        server = RawServer(head)
        try:
            if isinstance(expect, type):
                with pytest.raises(expect) as info:
                    run(server.url, timeout=GUARD_S, max_bytes=len(body))
                if expect is HttpStatusError:
                    assert info.value.status == 503 and info.value.body == "busy"
            else:
                assert run(server.url, timeout=GUARD_S, max_bytes=len(body)) == expect
        finally:
            server.close()


def test_a_refused_connection_is_a_transport_error():
    server = RawServer(b"")
    server.close()
    with pytest.raises(TransportError) as info:
        run(server.url, timeout=GUARD_S)
    assert not info.value.timed_out


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list] = []
    location = ""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append((self.server.server_address[1], self.headers.get("Authorization")))
        if self.location:
            self.send_response(307)
            self.send_header("Location", self.location)
            self.send_header("Content-Length", "0")
        else:
            self.send_response(200)
            self.send_header("Content-Length", "2")
        self.end_headers()
        if not self.location:
            self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def _serve(handler):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/x"


def test_the_key_goes_to_the_server_only_and_no_redirect_is_followed(monkeypatch):
    elsewhere, elsewhere_url = _serve(type("Elsewhere", (_Recorder,), {"seen": []}))
    redirecting = type("Redirecting", (_Recorder,), {"seen": [], "location": elsewhere_url})
    server, url = _serve(redirecting)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there: a proxy would fail
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    try:
        with pytest.raises(HttpStatusError) as info:
            run(url, timeout=GUARD_S, api_key="k3y")
        assert info.value.status == 307
        assert redirecting.seen == [(server.server_address[1], "Bearer k3y")]  # reached directly, with the key
        assert elsewhere.RequestHandlerClass.seen == []  # the redirect's target never heard of it
    finally:
        for s in (server, elsewhere):
            s.shutdown()
            s.server_close()
