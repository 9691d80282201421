"""One RL step as a straight line of phases (each in trainer/phases.py):

    the schedule's rollout batch -> advantages and the training batch -> π_old log-probs ->
    N optimizer steps over mini-batches -> the new version and (per the schedule) weight sync -> metrics

The schedule (trainer/schedule.py: sync, staged, async) decides when batches are generated and
when the engine gets new weights; the phases are the same for all of them.

Metrics come back as a flat dict of namespaced floats in a `StepResult`; rank-0 logging happens in
the loop, which also sets the trainer's version from it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from megatron_rl.trainer import phases
from megatron_rl.trainer.rollout_io import RolloutFailed

__all__ = ["RolloutFailed", "StepResult", "rl_step"]


@dataclass(frozen=True)
class StepResult:
    """metrics: the step's values (the same on every rank, except rank 0's engine statistics);
    version: the trainer's version after the step's update; sync_failure: the engine failed to take
    the new weights (the update is in the trainer's weights: the step counts, and the run stops)."""

    metrics: dict[str, float]
    version: int
    sync_failure: RolloutFailed | None = None


@contextmanager
def timed(times: dict, key: str):
    t0 = time.perf_counter()
    yield
    times[f"timing/{key}"] = time.perf_counter() - t0


def rl_step(ctx, step: int) -> StepResult:
    """Run RL step `step` (0-based) on every rank. An engine failure before the update raises
    RolloutFailed (the step did not happen); one in the weight sync after it is in the result."""
    times: dict[str, float] = {}
    t_step = time.perf_counter()
    with timed(times, "generate"):
        rollout = phases.generate(ctx, step)
    batch = phases.make_batch(ctx, rollout)
    with timed(times, "old_logprobs"):
        old = phases.old_logprobs(ctx, batch)
    with timed(times, "train"):
        updates = phases.update(ctx, batch, old)
    failed, version = None, ctx.policy_version + 1
    with timed(times, "weight_sync"):
        try:
            version = phases.sync(ctx)
        except RolloutFailed as e:  # every rank alike
            failed = e
    metrics = phases.step_metrics(ctx, batch, old, updates)
    metrics.update(times)
    metrics["timing/step"] = time.perf_counter() - t_step
    return StepResult(metrics, version, failed)
