"""What a schedule (trainer/schedule.py) asks for, without deciding when: batches of samples and
weight pushes.

    batches = Batches(cfg, prompts, tokenizer, rollout_fn, rewards, engine)
    sampled = batches.sample([step, step + 1])     # rank 0: one rollout-function call (any thread)
    by_step = batches.score(sampled)               # rank 0, main thread: {step: Rollout}
    weights = EngineWeights(policy, transport, engine)
    weights.push(version); weights.engine_version()   # collective

`Rollout` is one step's whole batch, on rank 0 only: the other ranks get their rows of it as
tensors (trainer/scatter.py). Cost: the samples of the steps asked for, on rank 0.

With `rollout.oversample` (DAPO dynamic sampling, trainer/oversample.py) `score` goes on drawing
each step's reserve prompts (`prompts.reserve`) until the step holds rollout.prompts_per_step
groups with reward variance or has drawn floor(rollout.max_oversample · prompts_per_step)
prompts: each extra round is one rollout-function call for every step still short, sampled with
the engine's current weights (the ones `sample` used: a schedule changes them only after
`score`) and a seed of its own, and prints a line per step it draws for. Those rounds run on the main thread because each needs the
previous round's rewards; under the async schedule they are not overlapped with the update.
With an engine whose requests are coroutines (the vLLM engine: rollout/engine.py `SamplesEach`)
and a rollout function that draws one group at a time (single_turn: oversample.py `GroupsEach`),
the extra groups are not rounds: each is a coroutine, scored as soon as its samples are back, and
the next prompts start while earlier groups still run (oversample.py `fill_overlapped`); step s's
reserve group r samples on streams (r, j) of a seed derived from (the first call's seed, step s),
so its samples, and the step's selection, do not depend on which groups completed first. Any other
engine or rollout function keeps the rounds.
Cost: up to max_oversample times the samples and engine time of a step; overlapped, the groups of
a step in flight at once are at most round_size's estimate, never past the budget; their requests bounded
by the engine's per-server concurrency.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math

import torch

from megatron_rl.data.types import derive_seed
from megatron_rl.rollout.engine import SamplesEach
from megatron_rl.rollout.function import Generated
from megatron_rl.rollout.types import Sample, SamplingParams
from megatron_rl.trainer.oversample import GroupPool, GroupsEach, fill, fill_overlapped
from megatron_rl.trainer.rollout_io import broadcast

log = logging.getLogger(__name__)


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
        """Rank 0, main thread: rewards, split back per step (over-sampled first when the run says
        so). The first step's reward_stats carry the reward runner's and the rollout function's
        stats (of the steps' first call); with over-sampling every step's carry its own counts."""
        r = self.cfg.rollout
        samples, rewards = sampled.generated.samples, sampled.generated.score()
        n = r.prompts_per_step * r.group_size
        per_step = {step: (samples[i * n:(i + 1) * n], rewards[i * n:(i + 1) * n], {})
                    for i, step in enumerate(sampled.steps)}
        if r.oversample:
            per_step = self._oversample(per_step, sampling_for(self.cfg, self.tokenizer, sampled.steps[0]))
        stats = {**self.rewards.stats(), **sampled.generated.stats}
        return {step: Rollout(s, torch.tensor(rw, dtype=torch.float32), {**(stats if i == 0 else {}), **counts})
                for i, (step, (s, rw, counts)) in enumerate(per_step.items())}

    def _oversample(self, per_step: dict, first: SamplingParams) -> dict:
        """{step: (samples, rewards, {})} -> the same with exactly prompts_per_step groups each (the
        first with reward variance, in draw order) and each step's counts (GroupPool.take).
        first: the steps' first call's sampling; extra round i samples with the seed derived from
        (its seed, i), so no round reuses another call's random streams. Overlapped (module
        docstring: `_overlapped`), each step's counts also carry rollout/groups_discarded."""
        r = self.cfg.rollout
        pools = {step: GroupPool(r.prompts_per_step, r.group_size) for step in per_step}
        for step, (samples, rewards, _) in per_step.items():
            pools[step].add(samples, rewards)

        budget = math.floor(r.max_oversample * r.prompts_per_step)

        def draw(round_: int, sizes: dict[int, int]):
            for step, k in sizes.items():
                pool = pools[step]
                print(f"step {step + 1}: over-sampling round {round_}: {k} more prompts ({pool.kept()} of "
                      f"{r.prompts_per_step} groups with reward variance, {pool.drawn} of at most {budget} prompts "
                      f"drawn)", flush=True)
            examples = [e for step, k in sizes.items()
                        for e in self.prompts.reserve(step, pools[step].drawn - r.prompts_per_step, k)]
            sampling = dataclasses.replace(first, seed=derive_seed(first.seed, "oversample", round_) & (2**63 - 1))
            generated = self.rollout_fn(self.engine, examples, r.group_size, sampling)
            return generated.samples, generated.score()

        if isinstance(self.engine, SamplesEach) and isinstance(self.rollout_fn, GroupsEach):
            discarded = self._overlapped(pools, budget, first)
        else:
            fill(pools, budget, draw)
            discarded = {}
        out = {}
        for step, pool in pools.items():
            samples, rewards, counts = pool.take()
            if counts["rollout/groups_padded"]:
                log.warning("step %d: rollout.max_oversample=%g reached after %d prompts with %d of %d groups "
                            "having reward variance; training on %d zero-variance groups, which "
                            "loss.filter_zero_variance_groups masks", step + 1, r.max_oversample, pool.drawn,
                            r.prompts_per_step - int(counts["rollout/groups_padded"]), r.prompts_per_step,
                            int(counts["rollout/groups_padded"]))
            if step in discarded:
                counts["rollout/groups_discarded"] = float(discarded[step])
            out[step] = (samples, rewards, counts)
        return out

    def _overlapped(self, pools: dict[int, GroupPool], budget: int, first: SamplingParams) -> dict[int, int]:
        """The extra groups as overlapping coroutines (fill_overlapped), on this (the main) thread's
        event loop, each scored here as its samples come back; the requests run on the engine's loop.
        Reserve group r of step s: example r of `prompts.reserve(s, 0, budget − B)`, streams (r, j) of
        the seed derived from (first.seed, "oversample", "step", s). Returns fill_overlapped's
        {step: groups discarded}."""
        r, fn = self.cfg.rollout, self.rollout_fn
        extra = budget - r.prompts_per_step
        reserves = {step: self.prompts.reserve(step, 0, extra) if extra > 0 else [] for step in pools}
        seeds = {step: derive_seed(first.seed, "oversample", "step", step) & (2**63 - 1) for step in pools}

        async def group(step: int, index: int):
            example = reserves[step][index]
            sampling = dataclasses.replace(first, seed=seeds[step])
            samples = await fn.group(self.engine, self.tokenizer.encode_prompt(example.prompt), index,
                                     r.group_size, sampling)
            return samples, fn.score_group(example, samples)

        def launched(step: int, k: int, flags: list[bool | None]) -> None:
            scored = [f for f in flags if f is not None]
            print(f"step {step + 1}: over-sampling: {k} more prompts ({sum(scored)} of {r.prompts_per_step} groups "
                  f"with reward variance, {len(scored)} scored and {len(flags) - len(scored)} in flight of at most "
                  f"{budget} prompts)", flush=True)

        return asyncio.run(fill_overlapped(pools, budget, group, launched))


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
