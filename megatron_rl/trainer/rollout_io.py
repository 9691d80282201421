"""Talking to the rollout engine from a multi-rank trainer.

The engine lives on global rank 0 (one embedded engine or one vLLM server, as in production);
rank 0 generates and scores, then broadcasts the samples to every rank. Weight export is
collective (all ranks iterate it); only rank 0 feeds the engine. Whatever the engine raises on
rank 0 reaches every rank as RolloutFailed, so no rank is left waiting in a collective.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_rl.rollout.types import Sample, SamplingParams


def broadcast(obj, src: int = 0):
    """Pickle-broadcast a Python object from `src` to all ranks."""
    if dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


class RolloutFailed(RuntimeError):
    """The engine failed (after its own restarts/retries). completed_steps: the RL steps whose
    updates are in the weights when it happened (what a checkpoint saved now holds); None = the
    step in progress has not been applied. metrics: the last completed step's metrics when they
    have not been logged yet (the failure came after its update: weight sync, evaluation)."""

    def __init__(self, message: str, completed_steps: int | None = None, metrics: dict | None = None):
        super().__init__(message)
        self.completed_steps = completed_steps
        self.metrics = metrics


def on_rank0(what: str, fn):
    """Run `fn()` on global rank 0 and share its result; an exception there is RolloutFailed on
    every rank (`what` names the action in the message)."""
    result = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            result = RolloutFailed(f"rollout engine failed {what}: {type(e).__name__}: {e}")
    result = broadcast(result)
    if isinstance(result, RolloutFailed):
        raise result
    return result


def sync_weights(policy, engine, version: int) -> None:
    """Push the policy's current weights to the engine (collective export; rank 0 loads)."""
    named = policy.export()
    error = None
    if engine is not None:
        try:
            engine.update_weights(named, version)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = RolloutFailed(f"rollout engine failed to load weights version {version}: {type(e).__name__}: {e}")
    for _ in named:  # keep step with rank 0's gathers (all of them when the engine stopped reading)
        pass
    error = broadcast(error)
    if error is not None:
        raise error


def sample(engine, tokenizer, examples, n: int, sampling: SamplingParams) -> list[Sample]:
    """Rank 0: n samples per example, flat [B*n]; groups are contiguous (sample j of prompt i at
    index i*n + j)."""
    prompts = [tokenizer.encode_prompt(e.prompt) for e in examples]
    return [s for g in engine.generate(prompts, n=n, sampling=sampling) for s in g]


def score(tokenizer, examples, samples: list[Sample], n: int, reward_runner) -> list[float]:
    """The reward of every sample (in the caller's thread: the math reward's time limit needs the
    main thread). The reward runner counts its failures itself (`reward_runner.stats()`)."""
    responses = [tokenizer.decode(s.response_ids.tolist()) for s in samples]
    return reward_runner([(examples[i // n].prompt, responses[i], examples[i // n].label, examples[i // n].task)
                          for i in range(len(samples))])


def generate_and_score(engine, tokenizer, examples, n: int, sampling: SamplingParams, reward_runner):
    """Rank 0: `sample` then `score`. Returns (samples flat [B*n], rewards [B*n])."""
    samples = sample(engine, tokenizer, examples, n, sampling)
    return samples, score(tokenizer, examples, samples, n, reward_runner)


def evaluate(engine, tokenizer, examples, reward_runner, max_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> float:
    """Rank 0: held-out accuracy (mean reward) of the engine's current weights, greedy by default
    or sampled at `temperature` (one sample per problem); other ranks get it by broadcast."""

    def accuracy():
        sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                  stop_token_ids=tokenizer.stop_ids)
        _, rewards = generate_and_score(engine, tokenizer, examples, 1, sampling, reward_runner)
        return sum(rewards) / max(len(rewards), 1)

    return on_rank0("during an evaluation", accuracy)
