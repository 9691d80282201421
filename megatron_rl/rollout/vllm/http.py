"""JSON over HTTP with the standard library, failures sorted into what the client does next.

    TransportError   no answer (refused, reset, timed out): the server may be dead or hung
    HttpStatusError  an HTTP error status; .status >= 500 is retried, 4xx is not
    BadResponse      an answer that is not JSON

Proxies from the environment are ignored: the server is always reached directly. `api_key`
goes out as `Authorization: Bearer <key>` on the request itself only: urllib does not copy such
a header onto a redirected request, so a redirect never carries the key elsewhere.
"""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

from megatron_rl.rollout.vllm.errors import BadResponse

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class TransportError(OSError):
    """The request got no HTTP answer. `timed_out` tells a timeout from a refused/reset connection."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class HttpStatusError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def request(url: str, body: dict | None = None, timeout: float = 60.0, method: str | None = None,
            api_key: str | None = None) -> bytes:
    """POST `body` as JSON (GET when body is None and method unset); the raw answer bytes."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    if api_key:
        req.add_unredirected_header("Authorization", f"Bearer {api_key}")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        try:
            text = e.read().decode(errors="replace")
        except Exception:  # noqa: BLE001 - the status is what matters
            text = ""
        raise HttpStatusError(e.code, text) from None
    except TimeoutError as e:
        raise TransportError(f"{url}: timed out after {timeout:g} s", timed_out=True) from e
    except urllib.error.URLError as e:
        timed_out = isinstance(e.reason, TimeoutError)
        raise TransportError(f"{url}: {e.reason}", timed_out=timed_out) from e
    except (http.client.HTTPException, ConnectionError, OSError) as e:
        raise TransportError(f"{url}: {type(e).__name__}: {e}") from e


def request_json(url: str, body: dict | None = None, timeout: float = 60.0, api_key: str | None = None):
    """`request` and decode JSON (an empty answer is None); BadResponse if it is not JSON."""
    raw = request(url, body, timeout, api_key=api_key)
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadResponse(f"malformed JSON from {url}: {e}; starts {raw[:80]!r}") from None


def healthy(base_url: str, timeout: float, api_key: str | None = None) -> bool:
    """GET /health answers 200 within `timeout` (a 401 from a server that wants another key: False)."""
    try:
        request(base_url + "/health", timeout=timeout, api_key=api_key)
        return True
    except (TransportError, HttpStatusError):
        return False
