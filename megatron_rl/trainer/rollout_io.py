"""Talking to the rollout engine from a multi-rank trainer.

The engine lives on global rank 0 (one embedded engine or one vLLM server, as in production);
rank 0 generates and scores (the run's rollout function) and keeps the samples: each rank gets
only its rows of the training batch, as tensors (trainer/scatter.py); weights go the other way
through trainer/transport.py. Whatever the engine raises on rank 0 reaches every rank as
RolloutFailed, so no rank is left waiting in a collective.
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


def on_rank0(what: str, fn, share: bool = True):
    """Run `fn()` on global rank 0; an exception there is RolloutFailed on every rank (`what` names
    the action in the message). share: every rank gets the result (pickled: small ones only);
    otherwise rank 0 keeps it and the others get None (only the failure travels)."""
    result = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            result = RolloutFailed(f"rollout engine failed {what}: {type(e).__name__}: {e}")
    if share:
        result = broadcast(result)
    elif (error := broadcast(result if isinstance(result, RolloutFailed) else None)) is not None:
        raise error
    if isinstance(result, RolloutFailed):
        raise result
    return result
