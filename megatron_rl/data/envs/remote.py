"""An environment behind a server: `env.name: remote` talks to environments that run in their own
process or host (heavy dependencies, sandboxes, many instances) over HTTP, one session per
trajectory. The server is `python -m megatron_rl.data.envs.server` (server.py) or anything that
speaks the same protocol:

    POST /v1/reset  {"session", "env", "settings", "example": {"prompt", "label", "task"}}
                    -> {"observation": str}
    POST /v1/step   {"session", "turn", "text", "ids"} -> {"observation": str, "reward": float|null, "done": bool}
    POST /v1/demonstrate {"session"} -> {"turns": [str] | null}   (a solving trajectory's turns, for SFT)
    POST /v1/close  {"session"} -> {}
    GET  /v1/health -> {"envs": [names]}

JSON bodies; every request carries `Authorization: Bearer <key>` (the key comes from the
environment variable the `key_env` setting names, never from the config, which is copied into
every checkpoint); an error is a non-2xx answer with {"error": "..."}. The client names the
session (a fresh random id per trajectory) and numbers the turns, so the server can answer a
retried reset or step with the answer it already gave instead of acting twice: a lost answer,
a timeout or a server that was briefly unreachable is retried `retries` times, `backoff_s`
apart, safely. An answer the server refuses (4xx, or 500: the environment raised) is not
retried; the error, with the server's words, ends the trajectory like a local environment's
exception (rollout/env_calls.py counts it in env/failures).

Why not OpenEnv's client (`openenv-core`): its 0.1 protocol (POST /reset, /step) serves one
episode per server worker with neither a session nor a request id, so a batch of trajectories
would need a server each and a retry could act twice; and it brings FastAPI, uvicorn, pydantic,
huggingface_hub and rich. This protocol is stdlib-only on both sides (urllib here, http.server
there).

Cost: one HTTP round trip per reset and per step (the multi-turn rollout runs them in threads,
one per trajectory, so a batch's calls overlap); nothing is held between turns but the session id.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_rl.data.envs.base import Environment, Step, register_env
from megatron_rl.data.types import Example

PROTOCOL = "v1"
MAX_ANSWER_BYTES = 1 << 20  # an observation is text for the next turn; more is a broken server


class EnvServerError(RuntimeError):
    """The environment server refused a call or could not be reached; the message names the
    server, the call and the cause."""


@register_env("remote")
@dataclass
class RemoteEnv(Environment):
    """url: the server (http://host:port); env: the environment the server runs for us (one of
    its registered names); settings: that environment's settings, sent with every reset;
    timeout_s: one request's deadline; retries / backoff_s: how often and how far apart a
    request that got no answer is sent again; key_env: the environment variable holding the
    server's key (default MEGATRON_RL_ENV_KEY; unset: no key is sent); observation_role: the chat
    role of the observations (env.check_render; "tool" for a tool's results, as calculator's)."""

    url: str = ""
    env: str = ""
    settings: dict = field(default_factory=dict)
    timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.2
    key_env: str = "MEGATRON_RL_ENV_KEY"
    observation_role: str = "user"

    max_turns = 1 << 20  # the server's environment ends its trajectories (done); env.max_turns caps them

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"remote's setting url={self.url!r}: the environment server, e.g. http://127.0.0.1:8765")
        if not self.env:
            raise ValueError("remote's setting env: name the environment the server runs, e.g. calculator")
        if not isinstance(self.settings, dict):
            raise TypeError(f"remote's setting settings={self.settings!r}: a mapping of the server environment's settings")
        if not self.timeout_s > 0 or self.retries < 0 or self.backoff_s < 0:
            raise ValueError(f"remote: timeout_s={self.timeout_s} must be > 0, retries={self.retries} and "
                             f"backoff_s={self.backoff_s} >= 0")
        self.session = uuid.uuid4().hex
        self.turn = 0

    def reset(self, example: Example) -> str:
        answer = self._call("reset", {"session": self.session, "env": self.env, "settings": self.settings,
                                      "example": {"prompt": example.prompt, "label": example.label,
                                                  "task": example.task}})
        return _field(answer, "observation", str, self.url, "reset")

    def step(self, generated_text: str, generated_ids: Sequence[int]) -> Step:
        self.turn += 1
        answer = self._call("step", {"session": self.session, "turn": self.turn, "text": generated_text,
                                     "ids": [int(i) for i in generated_ids]})
        reward = answer.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise EnvServerError(f"environment server {self.url} step: reward {reward!r} is not a number or null")
        step = Step(_field(answer, "observation", str, self.url, "step"), reward,
                    _field(answer, "done", bool, self.url, "step"))
        if step.done:
            self.close()
        return step

    def demonstrate(self, example: Example) -> list[str] | None:
        """The server's environment's demonstration for the example it was just reset with."""
        turns = self._call("demonstrate", {"session": self.session}).get("turns")
        if turns is not None and not (isinstance(turns, list) and all(isinstance(t, str) for t in turns)):
            raise EnvServerError(f"environment server {self.url} demonstrate: turns={turns!r} is not a list of texts")
        return turns

    def close(self) -> None:
        """Tell the server the trajectory is over (best effort: the server also drops idle sessions)."""
        try:
            self._call("close", {"session": self.session}, retries=0)
        except EnvServerError:
            pass

    def _call(self, name: str, body: dict, retries: int | None = None) -> dict:
        return call(self.url, name, body, self.timeout_s, self.retries if retries is None else retries,
                    self.backoff_s, os.environ.get(self.key_env))


def call(url: str, name: str, body: dict | None, timeout_s: float, retries: int, backoff_s: float,
         key: str | None) -> dict:
    """One protocol call (`name`: reset, step, close with a JSON `body`; health with None), sent
    again up to `retries` times when no answer came (connection refused or reset, timeout, 502,
    503, 504). Returns the answer's JSON object; raises EnvServerError."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/{PROTOCOL}/{name}", data=data,
                                     method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    why = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return _json(answer.read(MAX_ANSWER_BYTES + 1), url, name)
        except urllib.error.HTTPError as e:
            error = _error_text(e)
            if e.code not in (502, 503, 504):
                raise EnvServerError(f"environment server {url} {name}: HTTP {e.code}: {error}") from None
            why = f"HTTP {e.code}: {error}"
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            why = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
    raise EnvServerError(f"environment server {url} {name}: no answer after {retries + 1} tries, "
                         f"timeout_s={timeout_s} each ({why})")


def _json(raw: bytes, url: str, name: str) -> dict:
    if len(raw) > MAX_ANSWER_BYTES:
        raise EnvServerError(f"environment server {url} {name}: an answer of more than {MAX_ANSWER_BYTES} bytes")
    try:
        answer = json.loads(raw)
    except ValueError:
        raise EnvServerError(f"environment server {url} {name}: the answer is not JSON: {raw[:200]!r}") from None
    if not isinstance(answer, dict):
        raise EnvServerError(f"environment server {url} {name}: the answer is not a JSON object: {raw[:200]!r}")
    return answer


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read(4096)).get("error", ""))[:300] or e.reason
    except (ValueError, AttributeError, OSError):
        return str(e.reason)


def _field(answer: dict, key: str, kind: type, url: str, name: str):
    value = answer.get(key)
    if not isinstance(value, kind):
        raise EnvServerError(f"environment server {url} {name}: {key}={value!r} is not a {kind.__name__}")
    return value
