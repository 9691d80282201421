"""The `judge` section: a judge model as the reward (data.reward=judge; rollout/vllm/judge.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_rl import checks

JUDGE_TEMPLATE = ("Question: {prompt}\nReference answer: {label}\nResponse: {response}\n"
                  "Rate the response from 0 to 10. Score:")


@dataclass
class JudgeSection:
    """A judge model as the reward (data.reward=judge; megatron_rl/rollout/vllm/judge.py): a vLLM
    server apart from the rollout pool scores every response, one completion per response.

    model: an HF model folder (with its tokenizer) to serve, launched with the run and stopped with
        it (rollout.vllm.python's kind of environment: python, default the CPU lane's .venv-vllm);
        or url: a vLLM (OpenAI-compatible) server someone else runs; its key in
        $MEGATRON_RL_JUDGE_API_KEY. Exactly one of the two with data.reward=judge.
    template: the judge's prompt, with {prompt}, {response} and {label} filled in.
    pattern: a regular expression; its first match in the answer (its first group, when it has
        one) is the score; scale: the reward is score / scale. An answer without a match scores 0,
        counted in rewards/errors/JudgeUnparsable.
    max_tokens, temperature (0: greedy): the judge's sampling. timeout_s: one request's deadline
        (connect to last byte). max_in_flight: requests at a time (the server batches them).
    dtype, max_model_len, startup_timeout_s: a launched judge's server.
    """

    model: str | None = None
    url: str | None = None
    python: str | None = None
    template: str = JUDGE_TEMPLATE
    pattern: str = r"(-?\d+(?:\.\d+)?)"
    scale: float = 10.0
    max_tokens: int = 8
    temperature: float = 0.0
    timeout_s: float = 60.0
    max_in_flight: int = 16
    dtype: str = "auto"
    max_model_len: int = 2048
    startup_timeout_s: float = 600.0

    def __post_init__(self):
        for key in ("model", "url", "python"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise TypeError(f"judge.{key}={getattr(self, key)!r}: a string or null")
        if self.model is not None and self.url is not None:
            raise ValueError("judge.model and judge.url are both set: launch a judge (model) or use one (url)")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"judge.pattern={self.pattern!r} is not a regular expression: {e}") from None
        try:
            self.template.format(prompt="", response="", label="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"judge.template: only {{prompt}}, {{response}} and {{label}} may be filled in ({e!r}); "
                             f"write a literal brace as {{{{ or }}}}") from None
        checks.number("judge.scale", self.scale, lo=0, lo_open=True)
        checks.integer("judge.max_tokens", self.max_tokens, lo=1)
        checks.number("judge.temperature", self.temperature, lo=0)
        checks.number("judge.timeout_s", self.timeout_s, lo=0, lo_open=True)
        checks.integer("judge.max_in_flight", self.max_in_flight, lo=1, hi=1024)
        checks.integer("judge.max_model_len", self.max_model_len, lo=16)
        checks.number("judge.startup_timeout_s", self.startup_timeout_s, lo=0, lo_open=True)
