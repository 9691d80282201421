"""JSON over HTTP with the standard library, failures sorted into what the client does next.

    TransportError   no whole answer within the deadline (refused, reset, timed out): the server
                     may be dead or hung
    HttpStatusError  an HTTP error status; .status >= 500 is retried, 4xx is not
    BadResponse      an answer that is not JSON
    AnswerTooLarge   (a BadResponse) an answer longer than the request allows

Limits. `timeout` is one deadline for the whole request, connect to last byte: each socket
operation waits only for what is left of it, so a server that trickles bytes cannot stretch a
request past it. `max_bytes` caps the answer: it is read in chunks and refused once past the
cap (or at once when its Content-Length says so), so a request holds at most `max_bytes` of
answer whatever the server sends.

Proxies from the environment are ignored: the server is always reached directly. `api_key`
goes out as `Authorization: Bearer <key>` on the request itself only: urllib does not copy such
a header onto a redirected request, so a redirect never carries the key elsewhere.
"""
from __future__ import annotations

import functools
import http.client
import io
import json
import time
import urllib.error
import urllib.request


class BadResponse(ValueError):
    """One answer failed validation (internal: counted and retried by the client)."""


class AnswerTooLarge(BadResponse):
    """An answer longer than any valid answer to its request (request's max_bytes): refused
    once the cap is read, the rest never read."""

CONTROL_MAX_BYTES = 8 << 20  # the cap on answers with no bound of their own (/health, /pause, ...)
_CHUNK = 64 << 10
_ERROR_BODY_BYTES = 64 << 10  # of an error answer, for its message


class TransportError(OSError):
    """The request got no whole HTTP answer. `timed_out` tells a missed deadline from a refused/reset
    connection."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class HttpStatusError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class _DeadlineReader(io.RawIOBase):
    """A response's socket, each read waiting only for what is left until `deadline`."""

    def __init__(self, sock, deadline: float):
        self._sock, self._raw, self._deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(left)
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """What http.client.HTTPResponse reads from: the socket's file, under the deadline."""

    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str, *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


def _response_class(deadline: float):
    class Response(http.client.HTTPResponse):
        def __init__(self, sock, *args, **kwargs):
            super().__init__(_DeadlineSocket(sock, deadline), *args, **kwargs)

    return Response


class _Deadline:
    """Connection mixin: connect and send wait for what is left until `deadline`; the answer is
    read under it too."""

    def __init__(self, host, *, deadline: float, **kwargs):
        super().__init__(host, **kwargs)
        self.deadline = deadline
        self.response_class = _response_class(deadline)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        return left

    def connect(self):
        self.timeout = self._left()
        super().connect()

    def send(self, data):
        if self.sock is not None:  # else send() connects, under what is left
            self.sock.settimeout(self._left())  # sendall's timeout bounds the whole send
        super().send(data)


class _HTTP(_Deadline, http.client.HTTPConnection):
    pass


class _HTTPS(_Deadline, http.client.HTTPSConnection):
    pass


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    def __init__(self, deadline: float):
        urllib.request.HTTPSHandler.__init__(self)
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_HTTP, deadline=self.deadline), req)

    def https_open(self, req):
        return self.do_open(functools.partial(_HTTPS, deadline=self.deadline), req,
                            context=self._context)


def _read_capped(resp, url: str, max_bytes: int) -> bytes:
    length = resp.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise AnswerTooLarge(f"the answer from {url} is larger than {max_bytes} bytes (Content-Length {length}); "
                             f"not read")
    chunks, got = [], 0
    while chunk := resp.read(min(_CHUNK, max_bytes + 1 - got)):
        chunks.append(chunk)
        got += len(chunk)
        if got > max_bytes:
            raise AnswerTooLarge(f"the answer from {url} is larger than {max_bytes} bytes; stopped reading there")
    return b"".join(chunks)


def request(url: str, body: dict | None = None, timeout: float = 60.0, method: str | None = None,
            api_key: str | None = None, max_bytes: int = CONTROL_MAX_BYTES, setting: str | None = None) -> bytes:
    """POST `body` as JSON (GET when body is None and method unset); the raw answer bytes, read
    within `timeout` seconds in all and at most `max_bytes` long (module docstring). `setting`:
    the config field `timeout` came from, named when the deadline passes. Cost: one connection,
    at most max_bytes + 64 KiB of memory for the answer."""
    deadline = time.monotonic() + timeout
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    if api_key:
        req.add_unredirected_header("Authorization", f"Bearer {api_key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _DeadlineHandler(deadline))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return _read_capped(resp, url, max_bytes)
    except urllib.error.HTTPError as e:
        try:
            text = e.read(_ERROR_BODY_BYTES).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the status is what matters
            text = ""
        raise HttpStatusError(e.code, text) from None
    except TimeoutError as e:
        raise _timed_out(url, timeout, setting) from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise _timed_out(url, timeout, setting) from e
        raise TransportError(f"{url}: {e.reason}") from e
    except (http.client.HTTPException, ConnectionError, OSError) as e:
        raise TransportError(f"{url}: {type(e).__name__}: {e}") from e


def _timed_out(url: str, timeout: float, setting: str | None) -> TransportError:
    named = f"{setting}={timeout:g} s" if setting else f"{timeout:g} s"
    return TransportError(f"{url}: no whole answer within {named} (the deadline covers the whole request, "
                          f"connect to last byte)", timed_out=True)


def request_json(url: str, body: dict | None = None, timeout: float = 60.0, api_key: str | None = None,
                 max_bytes: int = CONTROL_MAX_BYTES, setting: str | None = None):
    """`request` and decode JSON (an empty answer is None); BadResponse if it is not JSON."""
    return decode_json(request(url, body, timeout, api_key=api_key, max_bytes=max_bytes, setting=setting), url)


def decode_json(raw: bytes, url: str):
    """An answer's JSON (an empty answer is None); BadResponse if it is not JSON."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadResponse(f"malformed JSON from {url}: {e}; starts {raw[:80]!r}") from None


def healthy(base_url: str, timeout: float, api_key: str | None = None, path: str = "/health") -> bool:
    """GET `path` answers 200 within `timeout` (a 401 from a server that wants another key: False)."""
    try:
        request(base_url + path, timeout=timeout, api_key=api_key)
        return True
    except (TransportError, HttpStatusError, BadResponse):
        return False
