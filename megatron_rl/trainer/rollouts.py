"""What a schedule (trainer/schedule.py) asks for, without deciding when: batches of samples and
weight pushes.

    batches = Batches(cfg, prompts, tokenizer, rollout_fn, rewards, engine)
    sampled = batches.sample([step, step + 1])     # rank 0: one rollout-function call (any thread)
    by_step = batches.score(sampled)               # rank 0, main thread: {step: Rollout}
    weights = EngineWeights(policy, transport, engine)
    weights.push(version); weights.engine_version()   # collective

`Rollout` is one step's whole batch, on rank 0 only: the other ranks get their rows of it as
tensors (trainer/scatter.py). Cost: the samples of the steps asked for, on rank 0.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_rl.rollout.function import Generated
from megatron_rl.rollout.types import Sample, SamplingParams
from megatron_rl.trainer.rollout_io import broadcast


@dataclasses.dataclass
class Rollout:
    """Rank 0's batch of one step. samples: B*G, groups contiguous; rewards: [B*G] float32 (CPU);
    reward_stats: host floats."""

    samples: list[Sample]
    rewards: torch.Tensor
    reward_stats: dict


@dataclasses.dataclass
class Sampled:
    """Rank 0: the rollout function's samples of `steps` (one engine call), not yet scored."""

    steps: list[int]
    generated: Generated


def sampling_for(cfg, tokenizer, step: int) -> SamplingParams:
    r, keep = cfg.rollout, cfg.loss.keep_sampling_mask
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                          stop_token_ids=tokenizer.stop_ids, seed=cfg.train.seed * 1_000_003 + step,
                          return_kept_ids=keep, logprobs_mode="processed" if keep else "raw")


class Batches:
    """The run's batches: the prompts of a step through the rollout function and the engine (rank 0)."""

    def __init__(self, cfg, prompts, tokenizer, rollout_fn, rewards, engine):
        self.cfg, self.prompts, self.tokenizer = cfg, prompts, tokenizer
        self.rollout_fn, self.rewards, self.engine = rollout_fn, rewards, engine

    def sample(self, steps: list[int]) -> Sampled:
        """Rank 0: the batches of `steps` from ONE call of the rollout function with the engine's
        current weights (sampling seeded by the first step)."""
        cfg = self.cfg
        examples = [e for step in steps for e in self.prompts.batch(step, cfg.rollout.prompts_per_step)]
        return Sampled(steps, self.rollout_fn(self.engine, examples, cfg.rollout.group_size,
                                              sampling_for(cfg, self.tokenizer, steps[0])))

    def score(self, sampled: Sampled) -> dict[int, Rollout]:
        """Rank 0, main thread: rewards, split back per step."""
        samples, rewards = sampled.generated.samples, sampled.generated.score()
        stats = {**self.rewards.stats(), **sampled.generated.stats}
        n = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        return {step: Rollout(samples[i * n:(i + 1) * n],
                              torch.tensor(rewards[i * n:(i + 1) * n], dtype=torch.float32), stats if i == 0 else {})
                for i, step in enumerate(sampled.steps)}


class EngineWeights:
    """The policy's weights into the engine through the run's weight transport."""

    def __init__(self, policy, transport, engine):
        self.policy, self.transport, self.engine = policy, transport, engine

    def push(self, version: int) -> None:
        """The engine gets the trainer's current weights as `version` (collective)."""
        self.transport.push(self.policy, self.engine, version)

    def engine_version(self) -> int | None:
        """The version the engine holds, on every rank (collective)."""
        return broadcast(self.engine.policy_version if self.engine is not None else None)
