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

Overlapped (an engine whose requests are coroutines and a rollout function that draws one group
at a time: `GroupsEach`), the extra groups are not rounds that wait for each other:

    await fill_overlapped(pools, budget, group)   # group(step, r) -> (samples, rewards) of reserve r

keeps `to_launch` groups in flight per step (round_size's estimate less those already running:
the next prompts start while earlier ones still run), and ends a step once `settled` says so: the
shortest prefix of its groups in draw order that is all scored holds B with variance (or every
group of the budget is scored). Only that prefix joins the pool, so `take` selects what
select_groups gives on the rewards of every group in draw order (the first B with variance lie in
that prefix), whatever order the groups completed in; groups launched past it are cancelled or discarded (`rollout/groups_discarded`, which, like
`rollout/oversample_rounds`, the launch waves, depends on timing; everything trained on does not).
Cost: at most budget − B groups launched per step (never more than the budget in all), their
requests bounded by the engine's per-server concurrency; the samples of the groups in flight and
of those scored, O(budget · G) samples per step on rank 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

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


def has_variance(rewards: list[float]) -> bool:
    """One group's rewards differ (max − min > 0: the groups the zero-variance filter keeps)."""
    return not bool(zero_variance_groups(torch.tensor([rewards], dtype=torch.float32))[0])


def settled(flags: list[bool | None], wanted: int) -> int | None:
    """flags: each group's has_variance in draw order, None while it runs. The length of the
    shortest prefix, every group of it scored, holding `wanted` groups with variance; None while
    there is none (a group still running before the wanted-th with variance could be one)."""
    kept = 0
    for i, flag in enumerate(flags):
        if flag is None:
            return None
        kept += flag
        if kept >= wanted:
            return i + 1
    return None


def to_launch(flags: list[bool | None], wanted: int, budget: int) -> int:
    """Groups to launch now (flags as for `settled`, the groups launched so far): round_size's
    estimate from the groups scored, less the ones in flight, within the budget of groups."""
    scored = [f for f in flags if f is not None]
    kept = sum(scored)
    want = round_size(wanted - kept, len(scored), kept, budget - len(scored))
    return max(0, min(want - (len(flags) - len(scored)), budget - len(flags)))


@runtime_checkable
class GroupsEach(Protocol):
    """A rollout function that draws and scores one group at a time (rollout/single_turn.py): what
    `fill_overlapped` needs of it, with an engine whose requests are coroutines (`SamplesEach`)."""

    async def group(self, engine: Any, prompt_ids: list[int], index: int, n: int, sampling: Any) -> list[Sample]:
        """The n samples of one prompt, on streams (index, j)."""

    def score_group(self, example: Any, samples: list[Sample]) -> list[float]:
        """Their rewards."""


@dataclasses.dataclass
class GroupPool:
    """One step's groups so far, in draw order: samples [drawn · G] (groups contiguous), rewards
    [drawn · G] host floats; rounds: the extra rollout calls that added to it (fill_overlapped: its
    launch waves)."""

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
        groups trained on because the budget ran out), rollout/oversample_rounds (`rounds`)."""
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


async def fill_overlapped(pools: dict[int, GroupPool], budget: int,
                          group: Callable[[int, int], Awaitable[tuple[list[Sample], list[float]]]],
                          launched: Callable[[int, int, list[bool | None]], None] = lambda *_: None) -> dict[int, int]:
    """Extra groups as overlapping coroutines (module docstring) until every pool is settled or has
    scored `budget` groups. group(step, r): reserve group r of `step` (r = 0, 1, ... in draw order),
    its samples and rewards; launched(step, k, flags): told before k more groups of `step` start
(flags: its groups so far, as for `settled`). Returns
    {step: groups launched but not kept in the pool} (cancelled, or done past the settled prefix).
    An error of a group cancels every group in flight and is raised."""
    flags = {step: pool.has_variance() for step, pool in pools.items()}
    results: dict[int, list[tuple[list[Sample], list[float]] | None]] = {step: [] for step in pools}
    tasks: dict[asyncio.Task, tuple[int, int]] = {}
    dropped: list[asyncio.Task] = []  # cancelled once their step settled; awaited before returning
    open_, discarded = set(pools), {}
    try:
        while True:
            for step in sorted(open_):
                pool, f = pools[step], flags[step]
                done = settled(f, pool.wanted)
                if done is None and len(f) >= budget and None not in f:
                    done = len(f)  # the budget is drawn and scored: pad (take)
                if done is not None:
                    for samples, rewards in results[step][:max(done - pool.drawn, 0)]:
                        pool.add(samples, rewards)
                    for t in [t for t, (s, _) in tasks.items() if s == step]:
                        t.cancel()
                        del tasks[t]
                        dropped.append(t)
                    discarded[step] = len(f) - max(done, pool.drawn)
                    open_.discard(step)
                    continue
                k = to_launch(f, pool.wanted, budget)
                if k:
                    launched(step, k, list(f))
                    pool.rounds += 1
                    for _ in range(k):
                        r = len(results[step])
                        results[step].append(None)
                        f.append(None)
                        tasks[asyncio.ensure_future(group(step, r))] = (step, r)
            if not tasks:
                return discarded
            finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            failed = [t.exception() for t in finished if t.exception() is not None]
            if failed:
                raise failed[0]  # the rest are cancelled below
            for t in finished:
                step, r = tasks.pop(t)
                samples, rewards = t.result()
                results[step][r] = (samples, rewards)
                flags[step][pools[step].drawn + r] = has_variance(rewards)
    finally:
        left = [*tasks, *dropped]
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left)  # no request of a dropped group still holds a server slot
            for t in left:
                if not t.cancelled():
                    t.exception()  # retrieved: only the first error is raised
