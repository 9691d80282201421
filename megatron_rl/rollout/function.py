"""The rollout-function seam: how examples become scored samples (`rollout.function` in the config).

    fn = ROLLOUT_FNS.get(cfg.rollout.function).make(RolloutFnInputs(tokenizer, rewards))
    generated = fn(engine, examples, n=8, sampling=params)   # n samples per example, groups contiguous
    rewards = generated.score()                              # on the main thread, after generation

`single_turn` (rollout/single_turn.py, the default) encodes each prompt, samples n responses from
the engine and scores each decoded response with the task's reward. An agent loop is another
RolloutFn: it drives the engine and an environment turn by turn and returns one token sequence
per trajectory, with the environment's tokens in the response and masked out (`Sample.loss_mask`),
so the trainer scores exactly the tokens the engine sampled.

Why scoring is a separate call: the async schedule generates in a background thread while the
trainer updates, and a reward may need the main thread (the `math` reward bounds sympy with
SIGALRM). A function whose environment already scored the trajectories returns them from `score`.
Cost: whatever the engine's generate() costs plus one reward call per sample; no tensor beyond
the samples themselves.

Adding one: a module with the function and its `RolloutFnSpec`, one line in rollout/registered.py
(a test may register a toy one itself: tests/distributed/test_toy_seams.py), or, outside the package,
a `RolloutFnSpec` named by import path (`rollout.function: my_agents:SPEC`, megatron_rl/plugins.py:
`ROLLOUT_FN_PLUGINS` registers it under that name).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_rl.plugins import PluginSlot, describe
from megatron_rl.registry import Registry
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.types import Sample, SamplingParams


@dataclass(frozen=True)
class Generated:
    """samples: flat [B·n], sample j of example i at index i·n + j; score: () -> one reward per
    sample, in that order (call it on the main thread); stats: host floats the trainer logs with
    the step's rollout metrics (namespaced: `env/failures`)."""

    samples: list[Sample]
    score: Callable[[], list[float]]
    stats: dict[str, float] = field(default_factory=dict)


class RolloutFn(Protocol):
    def __call__(self, engine: RolloutEngine, examples: Sequence[Any], n: int, sampling: SamplingParams) -> Generated:
        """n samples (each with its reward to come) for each of `examples` (data.types.Example)."""


@dataclass(frozen=True)
class RolloutFnInputs:
    """What a rollout function's factory gets: the run's tokenizer (data/tokenizer.py's interface),
    reward runner (rewards/runner.py) and environment settings (config's EnvSection, or None)."""

    tokenizer: Any
    rewards: Any
    env: Any = None


def no_rules(cfg) -> None:
    """A rollout function that any run config can use."""


def one_response(cfg) -> int:
    """A response is one engine sample: at most rollout.max_tokens tokens."""
    return cfg.rollout.max_tokens


def label_samples(inputs: RolloutFnInputs, examples: Sequence[Any]) -> list[Sample]:
    """A single-turn function's supervised samples: prompt -> label + eos (log-probs unused)."""
    tok, out = inputs.tokenizer, []
    for e in examples:
        response = tok.encode(e.label) + [tok.eos_id]
        out.append(Sample(prompt_ids=torch.tensor(tok.encode_prompt(e.prompt), dtype=torch.long), response_ids=torch.tensor(response, dtype=torch.long),
                          rollout_logprobs=torch.zeros(len(response)), finish_reason="stop", policy_version=0))
    return out


@dataclass(frozen=True)
class RolloutFnSpec:
    """A registered rollout function: make(inputs) -> RolloutFn; check(run config) raises
    ValueError naming the field when the config cannot drive it (configure/rules.py calls it);
    max_trained(run config) -> the most trained (sampled) tokens one of its samples holds (the
    default L_norm of a constant-normaliser aggregation); supervised(inputs, examples) -> the
    samples the SFT warm start trains on, shaped as this function's samples are (trainer/sft.py:
    the tokens its loss_mask keeps); runs_envs: it runs environments, so an example's own
    environment (a JSONL row's "env") means something to it (trainer/startup.py refuses such rows
    for a function that would ignore them)."""

    make: Callable[[RolloutFnInputs], RolloutFn]
    check: Callable[[Any], None] = no_rules
    max_trained: Callable[[Any], int] = one_response
    supervised: Callable[[RolloutFnInputs, Sequence[Any]], list[Sample]] = label_samples
    runs_envs: bool = False

    def __post_init__(self):
        if not callable(self.make):
            raise TypeError(f"RolloutFnSpec.make must be a factory RolloutFnInputs -> RolloutFn, got {self.make!r}")


ROLLOUT_FNS = Registry("rollout function", RolloutFnSpec)

ROLLOUT_FN_PLUGINS = PluginSlot(
    kind="rollout function", expects="a RolloutFnSpec (megatron_rl/rollout/function.py)", entries=ROLLOUT_FNS,
    refuse=lambda obj: None if isinstance(obj, RolloutFnSpec) else f"{describe(obj)}, not a RolloutFnSpec",
    add=ROLLOUT_FNS.add)


def max_trained(cfg) -> int:
    """The most trained tokens a sample of the run's rollout function holds (`cfg`: a RunConfig;
    the default L_norm of the token-sum aggregation); rollout.max_tokens for an unknown function
    (the start-up check names it)."""
    fn = cfg.rollout.function
    return ROLLOUT_FNS.get(fn).max_trained(cfg) if fn in ROLLOUT_FNS else cfg.rollout.max_tokens
