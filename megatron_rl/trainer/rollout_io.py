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
    """The engine failed (after its own restarts/retries), on every rank alike."""


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
