"""Serve registered environments over HTTP to `env.name: remote` clients (remote.py has the protocol).

    MEGATRON_RL_ENV_KEY=<secret> python -m megatron_rl.data.envs.server --port 8765 [--plugins my_envs]

Each session (one trajectory) holds its own environment instance, made at its reset from the
environment's registered name and settings (make_env: the same checks as a local one). A session's
calls run one at a time; sessions run in parallel, a thread per request (http.server's
ThreadingHTTPServer). The last answer of each session is kept, so a client's retry of the same
reset or turn gets it again and the environment acts once. Bounds: `max_sessions` open at once
(503 beyond: the client retries), a session idle for `idle_s` is dropped (a client that died
leaves nothing behind for long), request bodies of at most 1 MiB (413). The key (environment
variable MEGATRON_RL_ENV_KEY; required unless --no-key) is compared in constant time; a wrong
or missing one gets 401 before anything is read.

It runs the environments' code and, with --plugins, the named modules': what the trainer would
run in its own process, moved here. It imports no torch: it starts in about a second.
"""
from __future__ import annotations

import argparse
import hmac
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_rl.data.envs.base import ENVS, Environment, make_env
from megatron_rl.data.envs.remote import PROTOCOL
from megatron_rl.data.types import Example

MAX_BODY = 1 << 20


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Session:
    env: Environment
    example: Example
    lock: threading.Lock = field(default_factory=threading.Lock)
    turn: int = 0
    answer: dict = field(default_factory=dict)
    used: float = field(default_factory=time.monotonic)


class EnvService:
    """The sessions and what each call does to them (no HTTP here: `handle(name, body)`)."""

    def __init__(self, max_sessions: int = 4096, idle_s: float = 600.0):
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self.sessions: dict[str, _Session] = {}
        self.lock = threading.Lock()

    def handle(self, name: str, body: dict) -> dict:
        if name == "health":
            return {"envs": sorted(ENVS), "sessions": len(self.sessions)}
        session = body.get("session")
        if not isinstance(session, str) or not 0 < len(session) <= 128:
            raise Refused(400, f"session={session!r}: a string id of at most 128 characters")
        if name == "reset":
            return self._reset(session, body)
        if name == "step":
            return self._step(session, body)
        if name == "demonstrate":
            state = self._session(session)
            with state.lock:
                return {"turns": state.env.demonstrate(state.example)}
        if name == "close":
            with self.lock:
                self.sessions.pop(session, None)
            return {}
        raise Refused(404, f"no call {name!r}; calls: reset, step, demonstrate, close, health")

    def _session(self, session: str) -> _Session:
        with self.lock:
            state = self.sessions.get(session)
        if state is None:
            raise Refused(404, f"no session {session!r} (never reset, closed, or idle for more than {self.idle_s:g} s)")
        return state

    def _reset(self, session: str, body: dict) -> dict:
        with self.lock:
            old = self.sessions.get(session)
            if old is not None:  # a retried reset: the answer it got
                old.used = time.monotonic()
                return old.answer
            self._drop_idle()
            if len(self.sessions) >= self.max_sessions:
                raise Refused(503, f"{self.max_sessions} sessions open (max_sessions); retry later")
        example = body.get("example")
        if not isinstance(example, dict) or not all(isinstance(example.get(k), str) for k in ("prompt", "label")):
            raise Refused(400, "example: a mapping with prompt and label strings")
        settings = body.get("settings") or {}
        if not isinstance(settings, dict):
            raise Refused(400, f"settings={settings!r}: a mapping")
        if body.get("env") == "remote":
            raise Refused(400, "env=remote: name an environment this server runs itself")
        try:
            env = make_env(body.get("env"), **settings)
        except (KeyError, TypeError, ValueError) as e:
            raise Refused(400, str(e.args[0] if isinstance(e, KeyError) else e)) from None
        task = example.get("task") if isinstance(example.get("task"), str) else ""
        example = Example(prompt=example["prompt"], label=example["label"], task=task)
        observation = env.reset(example)
        if not isinstance(observation, str):
            raise TypeError(f"{env.name}.reset returned {type(observation).__name__}, not the prompt text")
        state = _Session(env, example, answer={"observation": observation})
        with self.lock:
            self.sessions.setdefault(session, state)
            return self.sessions[session].answer

    def _step(self, session: str, body: dict) -> dict:
        turn, text, ids = body.get("turn"), body.get("text"), body.get("ids")
        if not isinstance(turn, int) or isinstance(turn, bool) or not isinstance(text, str) or \
                not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise Refused(400, "step: turn (an integer), text (a string) and ids (a list of integers)")
        state = self._session(session)
        with state.lock:
            state.used = time.monotonic()
            if turn == state.turn:  # a retried turn: the answer it got
                return state.answer
            if turn != state.turn + 1:
                raise Refused(409, f"turn {turn} after turn {state.turn}: turns come one at a time")
            step = state.env.step(text, ids)
            state.turn, state.answer = turn, {"observation": step.observation, "reward": step.reward,
                                              "done": step.done}
        return state.answer

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self.sessions.items() if now - s.used > self.idle_s]:
            del self.sessions[key]


def make_server(host: str, port: int, key: str | None, service: EnvService | None = None) -> ThreadingHTTPServer:
    """A server on (host, port) (0: any free port, `server.server_address[1]`) answering the protocol
    for `service`; call `serve_forever()` (or in a thread) and `shutdown()`."""
    service = service or EnvService()
    expected = f"Bearer {key}".encode() if key else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # http.server calls these by name
            self._serve(with_body=False)

        def do_POST(self):
            self._serve(with_body=True)

        def _serve(self, with_body: bool):
            try:
                if expected is not None and not hmac.compare_digest(
                        self.headers.get("Authorization", "").encode(), expected):
                    raise Refused(401, "a wrong or missing key (Authorization: Bearer <key>)")
                prefix = f"/{PROTOCOL}/"
                if not self.path.startswith(prefix):
                    raise Refused(404, f"no path {self.path!r}; the protocol is under {prefix}")
                body = self._body() if with_body else {}
                answer, status = service.handle(self.path[len(prefix):], body), 200
            except Refused as e:
                answer, status = {"error": str(e)}, e.status
            except Exception as e:  # noqa: BLE001 - the environment raised: the client's trajectory ends
                answer, status = {"error": f"{type(e).__name__}: {e}"[:1000]}, 500
            data = json.dumps(answer).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout); it retries
                self.close_connection = True

        def _body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                raise Refused(400, "Content-Length is not a number") from None
            if length > MAX_BODY:
                self.close_connection = True
                raise Refused(413, f"a body of {length} bytes; at most {MAX_BODY}")
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                raise Refused(400, "the body is not JSON") from None
            if not isinstance(body, dict):
                raise Refused(400, "the body is not a JSON object")
            return body

        def log_message(self, format, *args):  # quiet: a line per call would flood a log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve megatron-rl environments over HTTP (env.name: remote).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one, printed at start)")
    p.add_argument("--plugins", nargs="*", default=[], help="modules to import for the environments they register")
    p.add_argument("--max-sessions", type=int, default=4096, help="sessions open at once (default 4096)")
    p.add_argument("--idle-s", type=float, default=600.0, help="drop a session idle this long (default 600)")
    p.add_argument("--no-key", action="store_true", help="serve without a key (a trusted network only)")
    args = p.parse_args(argv)
    from megatron_rl.plugins import PluginError, import_module

    for module in args.plugins:
        try:
            import_module(module)
        except PluginError as e:
            print(f"--plugins {module}: {e}", file=sys.stderr)
            return 2
    key = os.environ.get("MEGATRON_RL_ENV_KEY")
    if not key and not args.no_key:
        print("set MEGATRON_RL_ENV_KEY to the key clients send (or pass --no-key on a trusted network)",
              file=sys.stderr)
        return 2
    server = make_server(args.host, args.port, key, EnvService(args.max_sessions, args.idle_s))
    host, port = server.server_address[:2]
    print(f"serving environments {', '.join(sorted(ENVS))} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
