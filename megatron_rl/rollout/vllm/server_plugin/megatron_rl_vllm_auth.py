"""ASGI middleware for the vLLM server: every request needs `Authorization: Bearer <key>`.

vLLM's own `--api-key` / VLLM_API_KEY check covers only the paths under /v1, /v2, /inference
and /cohere: with VLLM_SERVER_DEV_MODE=1 the development endpoints (/collective_rpc, which runs
any worker method such as reload_weights from any path, /reset_prefix_cache, /sleep, ...) and
others (/health, /metrics, /tokenize, /scale_elastic_ep, ...) stay open to every local user.
This middleware guards every HTTP and WebSocket request, whatever its path or method (OPTIONS
too: a browser's pre-flight request gets no exemption), against one key read from the
environment variable MEGATRON_RL_VLLM_API_KEY when the server builds its app. It fails closed:
without the variable the server does not start.

Loading it into a server (the launcher does this for the servers it starts):

    PYTHONPATH=<this directory> MEGATRON_RL_VLLM_API_KEY=<key> \\
        vllm serve <model> --middleware megatron_rl_vllm_auth.RequireBearerKey ...

Standard library only: it is imported by the vLLM environment's interpreter.
"""
from __future__ import annotations

import hashlib
import hmac
import os

ENV_KEY = "MEGATRON_RL_VLLM_API_KEY"

_BODY = b'{"error": "Unauthorized"}'


def _digest(value: bytes) -> bytes:
    # compare fixed-length digests so the comparison time says nothing about the key's length
    return hashlib.sha256(value).digest()


class RequireBearerKey:
    """Pure ASGI middleware: refuse (HTTP 401, or a WebSocket close with code 1008) every
    request whose Authorization header is not `Bearer <key>`."""

    def __init__(self, app, key: str | None = None):
        self.app = app
        key = key if key is not None else os.environ.get(ENV_KEY, "")
        if not key:
            raise RuntimeError(f"{ENV_KEY} is not set: refusing to serve without an API key")
        self._want = _digest(key.encode())

    def authorised(self, headers) -> bool:
        """`headers`: the ASGI scope's list of (name, value) byte pairs."""
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self._want)

    async def __call__(self, scope, receive, send):
        kind = scope.get("type")
        if kind not in ("http", "websocket") or self.authorised(scope.get("headers") or []):
            return await self.app(scope, receive, send)
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_BODY)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _BODY})
