"""A fake vLLM server on 127.0.0.1 for the client's validation and fault handling: answers
/v1/completions with well-formed samples unless told to misbehave, and plays a ServerHandle
(start / restart / alive / stop) so the engine's restart logic runs without vLLM."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def good_answer(body: dict, vocab: int) -> dict:
    """A valid answer: tokens derived from the seed, log-prob -1 each, full length."""
    n = body["max_tokens"]
    ids = [(body["seed"] + 7 * t) % vocab for t in range(n)]
    stops = set(body.get("stop_token_ids") or [])
    for t, tok in enumerate(ids):
        if tok in stops:
            ids = ids[:t + 1]
            break
    finish = "stop" if ids[-1] in stops else "length"
    return {"choices": [{"index": 0, "text": "", "finish_reason": finish, "token_ids": ids,
                         "logprobs": {"token_logprobs": [-1.0] * len(ids),
                                      "tokens": [f"token_id:{t}" for t in ids],
                                      "top_logprobs": [{f"token_id:{t}": -1.0} for t in ids]}}]}


class FakeVllm:
    """behaviour(body, answer) -> one of: a dict (sent as JSON), bytes (sent raw), an int (that
    HTTP status), "drop" (close the connection without an answer: also marks the server dead),
    ("sleep", s) (answer after s seconds). Default: the good answer."""

    can_restart = True
    model_name = "fake"

    def __init__(self, vocab: int = 64, behaviour=None):
        self.vocab = vocab
        self.behaviour = behaviour or (lambda body, answer: answer)
        self.requests: list[dict] = []
        self.restarts = 0
        self.dead = False
        self.lock = threading.Lock()
        self.httpd = None
        self.port = None

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
                if fake.dead:
                    self.close_connection = True
                    return
                if self.path == "/v1/models":
                    return self._send(200, json.dumps({"data": [{"id": fake.model_name}]}).encode())
                self._send(200, b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self._send(200, b'{"results": [null]}')
                with fake.lock:
                    fake.requests.append(body)
                out = "drop" if fake.dead else fake.behaviour(body, good_answer(body, fake.vocab))
                if isinstance(out, tuple) and out[0] == "sleep":
                    time.sleep(out[1])
                    out = good_answer(body, fake.vocab)
                if out == "drop":
                    fake.dead = True
                    self.close_connection = True
                    return
                if isinstance(out, int):
                    return self._send(out, b'{"error": "fake"}')
                self._send(200, out if isinstance(out, bytes) else json.dumps(out).encode())

            def _send(self, status, payload):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except OSError:  # the client gave up (timeout) or the test stopped the server
                    pass

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
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
