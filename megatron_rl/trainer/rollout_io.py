"""Talking to the rollout engine from a multi-rank trainer.

The engine lives on global rank 0 (one embedded engine or one vLLM server, as in production);
rank 0 generates and scores (the run's rollout function), then broadcasts the samples to every rank. Weight export is
collective (all ranks iterate it); only rank 0 feeds the engine. Whatever the engine raises on
rank 0 reaches every rank as RolloutFailed, so no rank is left waiting in a collective.
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
