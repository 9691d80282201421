"""The API key: the server-side middleware that refuses every request without it (run here as a
plain ASGI app, no vLLM), and the client never sending it anywhere else. The same checks on a real
vLLM server are in test_server.py."""
import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from megatron_rl.rollout.serving.http import request
from megatron_rl.rollout.vllm.config import VllmConfig
from megatron_rl.rollout.vllm.server_plugin.megatron_rl_vllm_auth import ENV_KEY, RequireBearerKey

KEY = "s3cret-key"


async def _app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(middleware, kind="http", method="POST", path="/collective_rpc", headers=()):
    """Run one request through `middleware`; (status or close code, whether the app was reached)."""
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await _app(scope, receive, send)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    middleware.app = app
    scope = {"type": kind, "method": method, "path": path, "headers": [(k.lower(), v) for k, v in headers]}
    asyncio.run(middleware(scope, receive, send))
    first = sent[0] if sent else {}
    return first.get("status", first.get("code")), bool(reached)


@pytest.mark.parametrize("path", ["/collective_rpc", "/reset_prefix_cache", "/sleep", "/v1/completions",
                                  "/health", "/metrics", "/scale_elastic_ep", "/"])
def test_every_path_needs_the_key(path, monkeypatch):
    monkeypatch.setenv(ENV_KEY, KEY)
    mw = RequireBearerKey(_app)
    assert call(mw, path=path) == (401, False)
    assert call(mw, path=path, method="OPTIONS") == (401, False)  # no pre-flight exemption
    assert call(mw, path=path, headers=[(b"Authorization", b"Bearer " + KEY.encode())]) == (200, True)


@pytest.mark.parametrize("value, ok", [
    (b"Bearer " + KEY.encode(), True),
    (b"bearer " + KEY.encode(), True),           # the scheme is case-insensitive
    (b"Bearer  " + KEY.encode() + b" ", True),   # surrounding blanks
    (b"Bearer wrong", False),
    (b"Bearer " + KEY.encode() + b"x", False),
    (b"Bearer " + KEY[:-1].encode(), False),
    (b"Basic " + KEY.encode(), False),
    (KEY.encode(), False),
    (b"Bearer", False),
    (b"", False),
])
def test_only_the_exact_bearer_key_passes(value, ok):
    mw = RequireBearerKey(_app, key=KEY)
    assert call(mw, headers=[(b"authorization", value)]) == ((200, True) if ok else (401, False))


def test_two_authorization_headers_are_refused():
    mw = RequireBearerKey(_app, key=KEY)
    good = (b"authorization", b"Bearer " + KEY.encode())
    assert call(mw, headers=[good, (b"authorization", b"Bearer wrong")]) == (401, False)


def test_websockets_are_closed_without_the_key_and_lifespan_passes():
    mw = RequireBearerKey(_app, key=KEY)
    assert call(mw, kind="websocket", path="/v1/realtime") == (1008, False)
    assert call(mw, kind="lifespan", path="") == (None, True)


def test_no_key_no_server(monkeypatch):
    """Fails closed: a server started without the variable refuses to build its app."""
    monkeypatch.delenv(ENV_KEY, raising=False)
    with pytest.raises(RuntimeError, match=ENV_KEY):
        RequireBearerKey(_app)
    monkeypatch.setenv(ENV_KEY, "")
    with pytest.raises(RuntimeError, match=ENV_KEY):
        RequireBearerKey(_app)


class _Recorder(BaseHTTPRequestHandler):
    """GET: `redirect_to` set -> 302 there; else 200 and remember the Authorization header."""

    redirect_to: str | None = None
    seen: ClassVar[list] = []

    def do_GET(self):
        if self.redirect_to:
            self.send_response(302)
            self.send_header("Location", self.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.seen.append(self.headers.get("Authorization"))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve(handler):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_the_key_is_sent_but_never_follows_a_redirect():
    other = type("Other", (_Recorder,), {"seen": []})
    target = _serve(other)
    mover = _serve(type("Mover", (_Recorder,), {"redirect_to": f"http://127.0.0.1:{target.server_address[1]}"}))
    try:
        request(f"http://127.0.0.1:{target.server_address[1]}/health", timeout=120, api_key=KEY)
        request(f"http://127.0.0.1:{mover.server_address[1]}/health", timeout=120, api_key=KEY)
        assert other.seen == [f"Bearer {KEY}", None]
    finally:
        for httpd in (target, mover):
            httpd.shutdown()
            httpd.server_close()


def test_no_api_key_in_extra_args():
    with pytest.raises(ValueError, match="no --api-key"):
        VllmConfig(extra_args=["--api-key", "x"])
    with pytest.raises(ValueError, match="no --api-key"):
        VllmConfig(extra_args=["--api-key=x"])


def test_no_secret_in_extra_args():
    """argv is visible to `ps`, written to server.log and kept in every checkpoint's config copy."""
    for args in (["--hf-token", "x"], ["--hf-token=x"], ["--auth-secret", "x"], ["--db-password=x"]):
        with pytest.raises(ValueError, match=r"looks like a secret; pass it in rollout.vllm.env"):
            VllmConfig(extra_args=args)
    VllmConfig(extra_args=["--max-num-batched-tokens", "4096", "--tokenizer-mode", "slow", "--ssl-keyfile", "k.pem"])


def test_underscored_flags_are_read_as_vllm_reads_them():
    """vLLM's parser takes --hf_token for --hf-token (and --api_key for --api-key)."""
    with pytest.raises(ValueError, match="looks like a secret"):
        VllmConfig(extra_args=["--hf_token=x"])
    with pytest.raises(ValueError, match="no --api-key"):
        VllmConfig(extra_args=["--api_key", "x"])
