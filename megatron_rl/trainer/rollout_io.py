"""Talking to the rollout engine from a multi-rank trainer.

The engine lives on global rank 0 (one embedded engine or one vLLM server, as in production);
rank 0 generates and scores (the run's rollout function), then broadcasts the samples to every
rank (weights go the other way through trainer/transport.py). Whatever the engine raises on rank 0
reaches every rank as RolloutFailed, so no rank is left waiting in a collective.
"""
from __future__ import annotations

import torch.distributed as dist


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
