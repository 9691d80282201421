"""The run directory: what a fresh run moves aside, and the start-up checks that keep saves possible.

    run_dir/checkpoints/   iter_XXXXXXX/ + latest (trainer.checkpoint)
    run_dir/sft/           the SFT warm start's checkpoint (reusable as train.init_checkpoint)
    run_dir/metrics.jsonl  one JSON row per logged step
    run_dir/tensorboard/   event files
    run_dir/previous/<time>/   an earlier run's checkpoints, metrics and events, moved by a fresh run
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from megatron_rl.fs import open_no_follow
from megatron_rl.platform.reaping import forked_children_die_with_this_process

MOVED_BY_FRESH_RUN = ("checkpoints", "metrics.jsonl", "tensorboard")
LOCK = ".lock"


class RunDirRefused(RuntimeError):
    """The run directory cannot be taken; nothing in it is touched (not even an error log)."""


class RunDirInUse(RunDirRefused):
    """Another live process holds the run directory's lock."""


def lock_run_dir(run_dir: str):
    """Rank 0, before anything in `run_dir` is touched: take an exclusive `flock` on
    `run_dir/.lock` for the life of the run and return the open file (keep it; closing it, or the
    process ending in any way, SIGKILL included, releases the lock). A second launch into the same
    directory (a SLURM requeue while the old job still runs, a repeated command) would otherwise
    move, truncate or retire the first one's checkpoints and metrics: it gets RunDirInUse naming
    the holder's pid and host instead. A symbolic link (or anything but a file) at run_dir/.lock
    is RunDirRefused: the lock file is written, and a link's target must not be."""
    import fcntl
    import socket

    os.makedirs(run_dir, exist_ok=True)
    try:
        f = open_no_follow(os.path.join(run_dir, LOCK), "a+")  # held open for the whole run
    except OSError as e:
        raise RunDirRefused(f"train.run_dir={run_dir}: cannot take its lock: {e}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirInUse(f"train.run_dir={run_dir} is in use by another run ({holder}); wait for it to end, stop "
                          f"it, or choose another train.run_dir") from None
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
            raise
        # Lustre mounted without -o flock, some FUSE or NFS set-ups: no lock to take. Refusing to
        # start would block every run there; run unguarded, and say so
        print(f"warning: train.run_dir={run_dir}: its filesystem cannot lock files ({os.strerror(e.errno)}), so a "
              f"second launch into it is not kept out; mount it with flock support (Lustre: -o flock) to have that",
              file=sys.stderr, flush=True)
        return f
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    # A forked child (megatron's checkpoint writer) shares the open file and with it the lock,
    # which lasts until every copy is closed: one that outlived a killed trainer held the run
    # directory. Children close their copy at once (the lock stays the parent's) and die with it.
    forked_children_die_with_this_process(f)
    return f


def archive_previous_run(run_dir: str) -> str | None:
    """Rank 0, before a fresh run writes anything: move the checkpoints, metrics.jsonl and
    TensorBoard events of an earlier run to run_dir/previous/<time>/. Returns that folder
    (None when there was nothing to move). The SFT checkpoint stays: a fresh run may start
    from it (train.init_checkpoint)."""
    found = [n for n in MOVED_BY_FRESH_RUN if os.path.exists(os.path.join(run_dir, n))]
    ckpts = os.path.join(run_dir, "checkpoints")  # only a non-empty directory (a file there is
    found = [n for n in found if n != "checkpoints" or (os.path.isdir(ckpts) and os.listdir(ckpts))]  # reported later)
    if not found:
        return None
    parent = os.path.join(run_dir, "previous")
    os.makedirs(parent, exist_ok=True)
    dest = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=parent)
    for name in found:
        os.replace(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest


def checkpoint_bytes(model, groups, dtype: torch.dtype, with_optimizer: bool = True) -> int:
    """Size of one checkpoint of `model` (collective): every parameter counted once over its
    replicas (dense ones are replicated over DP x CP, experts over the expert-DP group), at the
    model's dtype, plus fp32 master weights (bf16/fp16) and Adam's two fp32 moments."""
    per_param = torch.finfo(dtype).bits // 8
    if with_optimizer:
        per_param += (4 if dtype != torch.float32 else 0) + 8
    dense = dist.get_world_size(groups.dp_cp_group)
    expert = dist.get_world_size(groups.pgs.expt_dp)
    params = list(model.parameters())
    local = sum(p.numel() / (dense if getattr(p, "allreduce", True) else expert) for p in params)
    total = torch.tensor([local], dtype=torch.float64, device=params[0].device)  # the collective's device
    dist.all_reduce(total)
    return int(total.item() * per_param)


def check_writable(directory: str, need_bytes: int, field: str,
                   held: list[tuple[str, int]] = ()) -> str | None:
    """None when `directory` can be created, written, and has `need_bytes` free (plus 5%); else
    the reason, naming the directory, the sizes and the config field that chose it. `held`: (folder,
    bytes) of what this run directory keeps that may be deleted (unfinished saves of earlier
    runs): named when the disk is too full."""
    probe = os.path.join(directory, f".write-test-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open_no_follow(probe, "wb") as f:
            f.write(b"0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        return (f"cannot write checkpoints to {directory} ({e.strerror or e}); "
                f"{'free some space' if full else 'make it writable'} or choose another {field}"
                f"{_held(held) if full else ''}")
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    free = shutil.disk_usage(directory).free
    if free < need_bytes * 1.05:
        return (f"{directory} has {free / 2**30:.2f} GiB free, one checkpoint needs about "
                f"{need_bytes / 2**30:.2f} GiB; free some space or choose another {field}{_held(held)}")
    return None


def _held(held: list[tuple[str, int]]) -> str:
    if not held:
        return ""
    listed = ", ".join(f"{path} ({size / 2**30:.2f} GiB)" for path, size in held)
    return f". Unfinished saves of earlier runs hold space: {listed}"
