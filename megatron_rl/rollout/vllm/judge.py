"""A judge model as the reward (`data.reward: judge`, the `judge` config section): a vLLM server,
separate from the rollout pool, asked to score every response.

    judge = Judge(cfg.judge, run_dir)                 # launches judge.model, or uses judge.url
    rewards = RewardRunner(judge)                     # its batch path: Judge.score_batch
    judge.close()

Per item (prompt, response, label) one OpenAI-compatible completion (`/v1/completions`, text in,
text out: the judge model's own tokenizer): the prompt is `judge.template` with {prompt},
{response} and {label} filled in; the answer's first match of the regular expression
`judge.pattern` (its first group when it has one) is the score, divided by `judge.scale` (a
judge asked for 0-10 with scale 10 gives rewards in [0, 1]). Greedy by default (judge.temperature
0), at most judge.max_tokens tokens.

Failures are reward failures (rewards/runner.py: reward 0, counted by type): no match (JudgeUnparsable),
a score that is not finite, an HTTP error or a dead server (TransportError, HttpStatusError), no
whole answer within judge.timeout_s (TransportError: the deadline covers the whole request); an
answer larger than JUDGE_MAX_BYTES is cut off (AnswerTooLarge). A batch's requests run concurrently,
at most judge.max_in_flight at once (the server batches them), so a batch of B items takes about
B / max_in_flight round trips; one slow answer holds one slot, never the others. The requests are
coroutines on the judge's own event loop (serving/loop.py's RequestLoop, async HTTP: serving/ahttp.py), one thread
for the judge whatever max_in_flight is; score_batch waits for them from any thread.

A launched judge runs like a rollout server (serving/launcher.py: its own API key, its log in
<run_dir>/judge/server.log, stopped with the run) on judge.model (an HF folder with its tokenizer),
with judge.dtype and judge.max_model_len; judge.url is a server someone else runs (its key in
$MEGATRON_RL_JUDGE_API_KEY).

Cost: one request per item, a coroutine each (B of them per batch, max_in_flight of them with a
socket open); host memory of max_in_flight answers; one thread; the judge server's own memory.
"""
from __future__ import annotations

import asyncio
import math
import os
import re

from megatron_rl.rollout.serving.errors import ServerStartError
from megatron_rl.rollout.serving.launcher import HOST, LocalServer, RemoteServer
from megatron_rl.rollout.serving.loop import RequestLoop
from megatron_rl.rollout.vllm.env import detect_device, ensure_vllm_python, local_server

ENV_JUDGE_KEY = "MEGATRON_RL_JUDGE_API_KEY"
JUDGE_MAX_BYTES = 1 << 20  # an answer of max_tokens tokens is far smaller


class JudgeUnparsable(ValueError):
    """The judge's answer holds no match of judge.pattern."""


class Judge:
    """The judge reward (module docstring). section: config.schema.JudgeSection."""

    def __init__(self, section, run_dir: str):
        self.cfg = section
        self.pattern = re.compile(section.pattern)
        if section.url:
            self.server = RemoteServer(section.url.rstrip("/"), section.timeout_s,
                                       api_key=os.environ.get(ENV_JUDGE_KEY) or None, kind="vLLM",
                                       key_hint=f"${ENV_JUDGE_KEY}")
            try:
                self.server.start(None)  # healthy, and the model it serves
            except ServerStartError as e:
                raise ServerStartError(f"judge.url: {e} (the judge's key goes in ${ENV_JUDGE_KEY})") from None
        else:
            python = ensure_vllm_python(section.python)
            env = {"VLLM_HOST_IP": HOST}
            if detect_device(python) == "cpu":
                env["VLLM_CPU_KVCACHE_SPACE"] = "1"
            args = ["--dtype", section.dtype, "--max-model-len", str(section.max_model_len), "--enforce-eager",
                    "--max-num-seqs", str(section.max_in_flight), "--seed", "0"]
            self.server = local_server(python, args, env, os.path.join(run_dir, "judge", "server.log"),
                                       section.startup_timeout_s, section.timeout_s)
            self.server.start(section.model)
        self._requests = RequestLoop("judge-requests")  # its HTTP session is made on the loop by the first request

    # ---- the reward -------------------------------------------------------------------------------
    def __call__(self, prompt: str, response: str, label: str) -> float:
        """One item's score (raises what score_batch would return for it)."""
        [out] = self.score_batch([(prompt, response, label)])
        if isinstance(out, BaseException):
            raise out
        return out

    def score_batch(self, items: list[tuple[str, str, str]]) -> list[float | Exception]:
        """Every item's score, or the exception that left it without one, in order; concurrently,
        at most judge.max_in_flight requests at a time."""
        return self._requests.call(self._score_all(items))

    async def _score_all(self, items: list[tuple[str, str, str]]) -> list[float | Exception]:
        slots = asyncio.Semaphore(self.cfg.max_in_flight)

        async def one(prompt: str, response: str, label: str) -> float:
            async with slots:
                return await self._score(prompt, response, label)

        return await asyncio.gather(*(one(*item) for item in items), return_exceptions=True)

    async def _score(self, prompt: str, response: str, label: str) -> float:
        text = self.cfg.template.format(prompt=prompt, response=response, label=label)
        body = {"model": self.server.model_name, "prompt": text, "max_tokens": self.cfg.max_tokens,
                "temperature": self.cfg.temperature, "seed": 0}
        answer = await self._requests.json(self.server.url + "/v1/completions", body, timeout=self.cfg.timeout_s,
                                           api_key=self.server.api_key, max_bytes=JUDGE_MAX_BYTES,
                                           setting="judge.timeout_s")
        return parse_score(answer_text(answer), self.pattern, self.cfg.scale)

    def close(self) -> None:
        """Cancel requests still running, close the HTTP session and the loop, stop a launched server."""
        self._requests.close()
        if isinstance(self.server, LocalServer):
            self.server.stop()


def answer_text(answer) -> str:
    """The completion's text of an OpenAI-compatible answer (ValueError / TypeError when it has none)."""
    try:
        text = answer["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a completion answer: {str(answer)[:200]!r}") from None
    if not isinstance(text, str):
        raise TypeError(f"the completion's text is {type(text).__name__}")
    return text


def parse_score(text: str, pattern: re.Pattern, scale: float) -> float:
    """The first match of `pattern` in `text` (its first group when it has one) as a number / scale."""
    m = pattern.search(text)
    if m is None:
        raise JudgeUnparsable(f"no match of judge.pattern {pattern.pattern!r} in the judge's answer {text[:200]!r}")
    value = float(m.group(1) if pattern.groups else m.group(0)) / scale
    if not math.isfinite(value):
        raise JudgeUnparsable(f"the judge's score {m.group(0)!r} / {scale:g} is not a finite number")
    return value
