"""JSON over async HTTP (aiohttp): http.py's contract, awaited as a coroutine on an event loop.

    async with session() as s:
        answer = await request_json(s, url, body, timeout=60.0, api_key=key, max_bytes=cap)

The same limits and failures as http.py (read its docstring): `timeout` is one deadline for the
whole request, connect to last byte (a server that trickles bytes cannot stretch it); `max_bytes`
caps the answer, refused at once from its Content-Length or once the chunks read pass it;
proxies from the environment are ignored (`trust_env=False`); `api_key` goes out as
`Authorization: Bearer <key>` and redirects are not followed (a 3xx is an HttpStatusError), so
the key never reaches another address. Failures: TransportError (no whole answer in time:
refused, reset, timed out), HttpStatusError, BadResponse, AnswerTooLarge.

Cost: a request in flight is a coroutine and a socket, no thread; at most max_bytes + 64 KiB of
answer in memory each. A session keeps idle connections per server for reuse (one per request
in flight at most); the caller bounds the requests in flight (generation.py).
"""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from megatron_rl.rollout.serving.http import (
    _CHUNK,
    _ERROR_BODY_BYTES,
    CONTROL_MAX_BYTES,
    AnswerTooLarge,
    HttpStatusError,
    TransportError,
    _timed_out,
    decode_json,
)

if TYPE_CHECKING:  # imported where a request is made: `import megatron_rl.rollout` needs no aiohttp
    import aiohttp


def session() -> aiohttp.ClientSession:
    """A session for one event loop (make it on that loop): no proxies from the environment, no
    connection limit of its own (the caller bounds its requests), no timeouts of its own (each
    request carries its deadline)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False,
                                 timeout=aiohttp.ClientTimeout(total=None))


async def request(s: aiohttp.ClientSession, url: str, body: dict | None = None, timeout: float = 60.0,
                  api_key: str | None = None, max_bytes: int = CONTROL_MAX_BYTES, setting: str | None = None) -> bytes:
    """POST `body` as JSON (GET when None); the raw answer bytes, whole within `timeout` seconds and
    at most `max_bytes` long (module docstring). `setting`: the config field `timeout` came from."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    try:
        async with asyncio.timeout(timeout):
            async with s.request("GET" if data is None else "POST", url, data=data, headers=headers,
                                 allow_redirects=False) as resp:
                if resp.status >= 300:
                    text = (await resp.content.read(_ERROR_BODY_BYTES)).decode(errors="replace")
                    raise HttpStatusError(resp.status, text)
                return await _read_capped(resp, url, max_bytes)
    except TimeoutError as e:
        raise _timed_out(url, timeout, setting) from e
    except (aiohttp.ClientError, OSError) as e:
        raise TransportError(f"{url}: {type(e).__name__}: {e}") from e


async def _read_capped(resp: aiohttp.ClientResponse, url: str, max_bytes: int) -> bytes:
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise AnswerTooLarge(f"the answer from {url} is larger than {max_bytes} bytes (Content-Length "
                             f"{resp.content_length}); not read")
    chunks, got = [], 0
    while chunk := await resp.content.read(min(_CHUNK, max_bytes + 1 - got)):
        chunks.append(chunk)
        got += len(chunk)
        if got > max_bytes:
            raise AnswerTooLarge(f"the answer from {url} is larger than {max_bytes} bytes; stopped reading there")
    return b"".join(chunks)


async def request_json(s: aiohttp.ClientSession, url: str, body: dict | None = None, timeout: float = 60.0,
                       api_key: str | None = None, max_bytes: int = CONTROL_MAX_BYTES, setting: str | None = None):
    """`request` and decode JSON (an empty answer is None); BadResponse if it is not JSON."""
    return decode_json(await request(s, url, body, timeout, api_key=api_key, max_bytes=max_bytes, setting=setting),
                       url)
