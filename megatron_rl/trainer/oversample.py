"""DAPO dynamic sampling by over-sampling (Yu et al. 2025): the pure bookkeeping of one step.

With `rollout.oversample`, a step draws more prompts until it holds B = rollout.prompts_per_step
groups with reward variance (max R − min R > 0, the groups `loss.filter_zero_variance_groups`
keeps), at most floor(rollout.max_oversample · B) prompts in all:

    pools = {step: GroupPool(wanted=B, group_size=G)}
    pools[step].add(samples, rewards)                 # the step's batch
    fill(pools, budget, draw)                         # extra rounds: draw(round, {step: prompts})
    samples, rewards, stats = pools[step].take()      # exactly B groups, in draw order

`round_size` asks for the prompts the keep rate seen so far says the missing groups need,
ceil(missing · drawn / kept) (the drawn count again while none is kept), capped by the budget
left. `select_groups` keeps the first B groups with variance in draw order; when the budget ran
out first it pads with the first zero-variance groups (the filter masks them: no loss term, no
count). Everything here is a function of the rewards, so a step's selection is the same in every
run with the same samples. Cost: O(groups drawn) host work; the samples of up to
max_oversample · B groups on rank 0 until `take`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from megatron_rl.losses.advantages import zero_variance_groups
from megatron_rl.rollout.types import Sample


def round_size(missing: int, drawn: int, kept: int, budget_left: int) -> int:
    """Prompts to draw next: 0 when none are missing or the budget is spent; else the keep rate's
    estimate ceil(missing · drawn / kept) (>= missing), or `drawn` again while nothing was kept,
    capped by `budget_left`."""
    if missing <= 0 or budget_left <= 0:
        return 0
    want = math.ceil(missing * drawn / kept) if kept else max(drawn, missing)
    return min(want, budget_left)


def select_groups(has_variance: list[bool], wanted: int) -> list[int]:
    """Indices (draw order) of the groups a step trains on: the first `wanted` with variance; if
    fewer exist, all of them plus the first zero-variance ones up to `wanted` (fewer than `wanted`
    only when fewer groups were drawn)."""
    keep = [i for i, v in enumerate(has_variance) if v][:wanted]
    pad = [i for i, v in enumerate(has_variance) if not v][:wanted - len(keep)]
    return sorted(keep + pad)


@dataclasses.dataclass
class GroupPool:
    """One step's groups so far, in draw order: samples [drawn · G] (groups contiguous), rewards
    [drawn · G] host floats; rounds: the extra rollout calls that added to it."""

    wanted: int
    group_size: int
    samples: list[Sample] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    rounds: int = 0

    @property
    def drawn(self) -> int:
        return len(self.rewards) // self.group_size

    def add(self, samples: list[Sample], rewards: list[float]) -> None:
        if len(samples) != len(rewards) or len(rewards) % self.group_size:
            raise ValueError(f"GroupPool.add: {len(samples)} samples and {len(rewards)} rewards are not whole "
                             f"groups of {self.group_size}")
        self.samples.extend(samples)
        self.rewards.extend(rewards)

    def has_variance(self) -> list[bool]:
        if not self.rewards:
            return []
        r = torch.tensor(self.rewards, dtype=torch.float32).view(-1, self.group_size)
        return (~zero_variance_groups(r)).tolist()

    def kept(self) -> int:
        return sum(self.has_variance())

    def missing(self) -> int:
        return max(self.wanted - self.kept(), 0)

    def take(self) -> tuple[list[Sample], list[float], dict[str, float]]:
        """The step's `wanted` groups (select_groups) and its counts: rollout/groups_generated
        (drawn), rollout/groups_dropped (drawn − trained), rollout/groups_padded (zero-variance
        groups trained on because the budget ran out), rollout/oversample_rounds."""
        flags = self.has_variance()
        chosen = select_groups(flags, self.wanted)
        G = self.group_size
        samples = [self.samples[g * G + j] for g in chosen for j in range(G)]
        rewards = [self.rewards[g * G + j] for g in chosen for j in range(G)]
        stats = {"rollout/groups_generated": float(self.drawn),
                 "rollout/groups_dropped": float(self.drawn - len(chosen)),
                 "rollout/groups_padded": float(sum(not flags[g] for g in chosen)),
                 "rollout/oversample_rounds": float(self.rounds)}
        return samples, rewards, stats


def fill(pools: dict[int, GroupPool], budget: int,
         draw: Callable[[int, dict[int, int]], tuple[list[Sample], list[float]]]) -> None:
    """Extra rounds until every pool holds its wanted groups with variance or has drawn `budget`
    prompts. Round i (from 1) asks `draw(i, {step: prompts})` for every step still short (sizes
    from round_size), which returns the round's samples and rewards, steps in that order, groups
    contiguous: one rollout-function call for all of them."""
    for round_ in range(1, budget + 1):  # every round draws >= 1 prompt: the budget ends the loop
        sizes = {step: round_size(p.missing(), p.drawn, p.kept(), budget - p.drawn) for step, p in pools.items()}
        sizes = {step: k for step, k in sizes.items() if k}
        if not sizes:
            return
        samples, rewards = draw(round_, sizes)
        at = 0
        for step, k in sizes.items():
            n = k * pools[step].group_size
            pools[step].add(samples[at:at + n], rewards[at:at + n])
            pools[step].rounds += 1
            at += n
