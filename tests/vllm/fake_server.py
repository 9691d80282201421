"""A fake vLLM server on 127.0.0.1 for the client's validation and fault handling: answers
/inference/v1/generate with well-formed samples unless told to misbehave, and plays a ServerHandle
(start / restart / alive / stop) so the engine's restart logic runs without vLLM. Like a server
we launch, it refuses (HTTP 401) every request without `Authorization: Bearer <api_key>`."""
from __future__ import annotations

import hmac
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HANG_GUARD_S = 600.0  # a hung answer ends by itself after this at the latest (never hang CI)
TRICKLE_S = 0.05  # "trickle": the pause before each byte (a whole answer takes minutes)
FLOOD_BYTES = 256 << 20  # "flood": what the answer offers in all (unless the client leaves first)


def good_answer(body: dict, vocab: int, version: str = "default") -> dict:
    """A valid /inference/v1/generate answer: tokens derived from the seed, log-prob -1 each, full
    length, every token of weight version `version` (vLLM's "default" when unlabelled)."""
    params = body["sampling_params"]
    ids = [(params["seed"] + 7 * t) % vocab for t in range(params["max_tokens"])]
    stops = set(params.get("stop_token_ids") or [])
    for t, tok in enumerate(ids):
        if tok in stops:
            ids = ids[:t + 1]
            break
    finish = "stop" if ids[-1] in stops else "length"
    content = [{"token_id": t, "logprob": -1.0, "top_logprobs": [{"token_id": t, "logprob": -1.0}]} for t in ids]
    return {"choices": [{"index": 0, "finish_reason": finish, "token_ids": ids, "logprobs": {"content": content},
                         "weight_versions": [{"version": version, "start": 0, "end": len(ids)}]}]}


class FakeVllm:
    """behaviour(body, answer) -> one of: a dict (sent as JSON), bytes (sent raw), an int (that
    HTTP status), a (status, bytes) pair, "drop" (close the connection without an answer: also marks the server dead),
    "hang" (no answer until the test calls release_hung() or the server is stopped, as a killed
    process's connections end; then the good answer, if anyone still listens), "trickle" (the
    good answer one byte every TRICKLE_S, as a server that is alive but never done),
    "flood" / "flood-declared" (FLOOD_BYTES of blanks, without / with a Content-Length saying
    so; `flooded` gets the bytes sent before the client left or it was all sent, and
    `flood_ended` is set then). `completions(body)`: the answer to /v1/completions (the parity
    probe's), in the same forms as behaviour's (None: the dummy answer). Default: the good answer. `hanging` is set once a request hangs. POST /abort_requests (and
/pause?mode=abort, also recorded in `posts`) ends the requests hung at that moment with
finish_reason "abort", as vLLM's does (`aborts` counts them; with
abort_endpoint=False it answers 404, as a server without VLLM_SERVER_DEV_MODE does).

    routes: {path: (inbound, outbound)}: generate endpoints of other dialects (rollout/serving). A
    POST to `path` is served as /inference/v1/generate is, on `inbound(body)` (that dialect's body
    in vLLM's form), and a JSON answer goes back as `outbound(answer)` (in that dialect's form).
    {path: "abort"}: that dialect's abort (as /abort_requests); {path: control}: another control
    call, answered `control(body)` (as behaviour's forms). Both are recorded in `posts`.

    api_key: the key every request must carry (None: a fresh random one; "" : no key needed).
    `unauthorised` counts the requests refused for the key. `posts`: the paths of the other POSTs
    (/pause?mode=keep, /resume, /collective_rpc, ...), in order. `weight_versions`: the spans every
    answer carries (None: vLLM's unlabelled "default"). `cached_tokens(prompt ids) -> int`: the
    prompt tokens every answer says came from the prefix cache (usage.prompt_tokens_details, as
    vLLM with --enable-prompt-tokens-details; None: no usage, as a server without it)."""

    can_restart = True
    model_name = "fake"

    def __init__(self, vocab: int = 64, behaviour=None, api_key: str | None = None, abort_endpoint: bool = True,
                 routes: dict | None = None):
        self.vocab = vocab
        self.routes = dict(routes or {})
        self.abort_endpoint = abort_endpoint
        self.aborts = 0  # POST /abort_requests received
        self.abort_refused = threading.Event()  # set when one was answered 404 (abort_endpoint=False)
        self.behaviour = behaviour or (lambda body, answer: answer)
        self.api_key = secrets.token_urlsafe(16) if api_key is None else (api_key or None)
        self.requests: list[dict] = []
        self.posts: list[str] = []
        self.refused: set[str] = set()  # POST paths answered 404, as a server without the development endpoints does
        self.weight_versions: list[dict] | None = None
        self.cached_tokens = None
        self.restarts = 0
        self.unauthorised = 0
        self.dead = False
        self.lock = threading.Lock()
        self.httpd = None
        self.port = None
        self.hanging = threading.Event()
        self.flooded: list[int] = []
        self.flood_ended = threading.Event()
        self.completions = None
        self._released = False
        self._wake = threading.Event()  # of the running server: set by release_hung() and stop()
        self._hung = threading.Condition()  # hung requests wait on it for _wake or an abort

    @property
    def log_where(self) -> str:
        return f"fake server at port {self.port}"

    def log_tail(self, lines: int = 25) -> str:
        return ""

    def answer(self, body: dict) -> dict:
        out = good_answer(body, self.vocab)
        if self.weight_versions is not None:
            out["choices"][0]["weight_versions"] = self.weight_versions
        if self.cached_tokens is not None:
            n, done = len(body["token_ids"]), len(out["choices"][0]["token_ids"])
            out["usage"] = {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done,
                            "prompt_tokens_details": {"cached_tokens": self.cached_tokens(body["token_ids"])}}
        return out

    def release_hung(self) -> None:
        """Let every hung request (and any later "hang") answer."""
        self._released = True
        self._wake.set()
        with self._hung:
            self._hung.notify_all()

    def _authorised(self, header: str | None) -> bool:
        if self.api_key is None:
            return True
        return header is not None and hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode())

    # ---- ServerHandle ----
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, model_dir: str) -> float:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if not self._check_key():
                    return
                if fake.dead:
                    self.close_connection = True
                    return
                if self.path == "/v1/models":
                    return self._send(200, json.dumps({"data": [{"id": fake.model_name}]}).encode())
                self._send(200, b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._check_key():
                    return
                if self.path == "/abort_requests":
                    return self._abort()
                if self.path == "/v1/completions" and fake.completions is not None:
                    return self._reply(fake.completions(body))
                route = fake.routes.get(self.path)
                if self.path.startswith("/pause?mode=abort") or route == "abort":  # ends the frozen requests too
                    with fake.lock:
                        fake.posts.append(self.path)
                    return self._abort()
                if callable(route):  # another dialect's control call
                    with fake.lock:
                        fake.posts.append(self.path)
                    return self._reply(route(body))
                if route is not None:
                    body = route[0](body)
                elif self.path != "/inference/v1/generate":
                    with fake.lock:
                        fake.posts.append(self.path)
                    if self.path in fake.refused:
                        return self._send(404, b'{"detail": "Not Found"}')
                    return self._send(200, b'{"results": [null]}')
                with fake.lock:
                    fake.requests.append(body)
                    aborts = fake.aborts  # an abort from now on ends this request's hang
                out = "drop" if fake.dead else fake.behaviour(body, fake.answer(body))
                if out == "hang":
                    fake.hanging.set()
                    with fake._hung:  # no timer: only release_hung(), a stop or an abort ends the hang
                        fake._hung.wait_for(lambda: wake.is_set() or fake.aborts != aborts, HANG_GUARD_S)
                    out = fake.answer(body)
                    if not wake.is_set():
                        out["choices"][0]["finish_reason"] = "abort"
                if out == "drop":
                    fake.dead = True
                    self.close_connection = True
                    return
                if route is not None and isinstance(out, dict):
                    out = route[1](out)
                self._reply(out, body)

            def _reply(self, out, body=None):
                if out in ("flood", "flood-declared"):
                    return self._flood(declared=out == "flood-declared")
                if out == "trickle":
                    return self._trickle(json.dumps(fake.answer(body)).encode())
                if isinstance(out, int):
                    return self._send(out, b'{"error": "fake"}')
                if isinstance(out, tuple):
                    return self._send(*out)
                self._send(200, out if isinstance(out, bytes) else json.dumps(out).encode())

            def _trickle(self, payload):
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                for i in range(len(payload)):
                    if wake.wait(TRICKLE_S):  # the server stops: so does the answer
                        return
                    try:
                        self.wfile.write(payload[i:i + 1])
                    except OSError:  # the client gave up
                        return

            def _flood(self, declared):
                self.send_response(200)
                if declared:
                    self.send_header("Content-Length", str(FLOOD_BYTES))
                self.end_headers()
                sent, block = 0, b" " * (64 << 10)
                try:
                    while sent < FLOOD_BYTES and not wake.is_set():
                        self.wfile.write(block)
                        sent += len(block)
                except OSError:  # the client left
                    pass
                self.close_connection = True
                with fake.lock:
                    fake.flooded.append(sent)
                fake.flood_ended.set()

            def _abort(self):
                if not fake.abort_endpoint:
                    fake.abort_refused.set()
                    return self._send(404, b'{"detail": "Not Found"}')
                with fake._hung:
                    with fake.lock:
                        fake.aborts += 1
                    fake._hung.notify_all()
                self._send(200, b'{"status": "aborted"}')

            def _check_key(self) -> bool:
                if fake._authorised(self.headers.get("Authorization")):
                    return True
                with fake.lock:
                    fake.unauthorised += 1
                self._send(401, b'{"error": "Unauthorized"}')
                return False

            def _send(self, status, payload):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except OSError:  # the client gave up (timeout) or the test stopped the server
                    pass

        wake = self._wake = threading.Event()
        if self._released:
            wake.set()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.dead = False
        return 0.0

    def restart(self, model_dir: str) -> float:
        self.stop()
        self.restarts += 1
        return self.start(model_dir)

    def alive(self) -> bool:
        return self.httpd is not None and not self.dead

    def stop(self, graceful: bool = True) -> None:
        httpd, self.httpd = self.httpd, None  # one stop wins, as LocalServer.stop's swap
        if httpd is not None:
            self._wake.set()  # hung requests end, as a killed server's connections do
            with self._hung:
                self._hung.notify_all()
            httpd.shutdown()
            httpd.server_close()

