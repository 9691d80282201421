"""One RL step as a straight line of phases (each in trainer/phases.py):

    the schedule's rollout batch -> advantages and the training batch -> π_old log-probs ->
    N optimizer steps over mini-batches -> version + 1 and (per the schedule) weight sync -> metrics

The schedule (trainer/schedule.py: sync, staged, async) decides when batches are generated and
when the engine gets new weights; the phases are the same for all of them.

Metrics come back as a flat dict of namespaced floats; rank-0 logging happens in the loop.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from megatron_rl.trainer import phases
from megatron_rl.trainer.schedule import RolloutFailed

__all__ = ["RolloutFailed", "rl_step"]


@contextmanager
def timed(times: dict, key: str):
    t0 = time.perf_counter()
    yield
    times[f"timing/{key}"] = time.perf_counter() - t0


def rl_step(ctx, step: int) -> dict[str, float]:
    """Run RL step `step` (0-based) on every rank; return its metrics (the same on every rank,
    except rank 0's engine statistics)."""
    times: dict[str, float] = {}
    t_step = time.perf_counter()
    with timed(times, "generate"):
        rollout = phases.generate(ctx, step)
    batch = phases.make_batch(ctx, rollout)
    with timed(times, "old_logprobs"):
        old = phases.old_logprobs(ctx, batch, rollout)
    with timed(times, "train"):
        updates = phases.update(ctx, batch, old)
    failed = None
    with timed(times, "weight_sync"):
        try:
            phases.sync(ctx)
        except RolloutFailed as e:  # every rank alike
            failed = e
    metrics = phases.step_metrics(ctx, rollout, batch, old, updates)
    metrics.update(times)
    metrics["timing/step"] = time.perf_counter() - t_step
    if failed is not None:  # this step's update is in the weights: the checkpoint and the log keep it
        failed.completed_steps, failed.metrics = step + 1, metrics
        raise failed
    return metrics
