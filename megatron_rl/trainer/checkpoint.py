"""Atomic, resumable checkpoints with megatron-core `dist_checkpointing`.

Layout under `root/`:
    iter_0000012/            dist_checkpointing dir (model [+ optimizer] sharded state)
    iter_0000012/extra/rank_00003.pt   per-rank host state (step, data position, RNG states, ...)
    latest                   text file naming the newest *complete* iteration dir

A save writes into `iter_XXXXXXX.tmp`, all ranks barrier, rank 0 renames it and only then
rewrites `latest` (via a temp file + os.replace). A crash at any point leaves `latest`
pointing at a checkpoint that loads.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

# The distributed optimizer's checkpoint layout: megatron-core's own default raises
# "ShardedTensor.flattened_range is not supported"; this is Megatron-LM's default.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def _iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under `root`, or None."""
    marker = os.path.join(root, "latest")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{marker} names {name!r}, which does not exist; remove the marker or "
                                f"restore the directory")
    return path


def _sharded_state(model, optimizer, is_loading: bool) -> dict:
    state = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading,
                                                          metadata=OPTIMIZER_METADATA)
    return state


def save_checkpoint(root: str, step: int, model, optimizer=None, extra: dict | None = None, keep: int = 2) -> str:
    """Save model (and optimizer) sharded state plus per-rank `extra`; return the final dir.

    Collective over all ranks. `keep`: how many complete checkpoints to retain (older ones are
    deleted after the new one is published).
    """
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = _iter_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), tmp)
    os.makedirs(os.path.join(tmp, "extra"), exist_ok=True)
    torch.save(extra or {}, os.path.join(tmp, "extra", f"rank_{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        marker_tmp = os.path.join(root, "latest.tmp")
        with open(marker_tmp, "w") as f:
            f.write(os.path.basename(final))
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker_tmp, os.path.join(root, "latest"))
        done = sorted(d for d in os.listdir(root) if d.startswith("iter_") and not d.endswith(".tmp"))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str, model, optimizer=None) -> dict:
    """Load a checkpoint dir into `model` (and `optimizer`); return this rank's `extra` dict.

    The parallel layout may differ from the one that saved (dist_checkpointing reshards).
    """
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), path)
    model.load_state_dict(state["model"], strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    extra_file = os.path.join(path, "extra", f"rank_{dist.get_rank():05d}.pt")
    if not os.path.exists(extra_file):  # resumed with more ranks than saved: rank 0's host state
        extra_file = os.path.join(path, "extra", "rank_00000.pt")
    return torch.load(extra_file, weights_only=False)
