"""Atomic, verified, resumable checkpoints with megatron-core `dist_checkpointing`.

Layout under `root/`:
    iter_0000012/                    dist_checkpointing dir (model [+ optimizer] sharded state)
    iter_0000012/extra/rank_00003.json  per-rank host state (step, data position, RNG, ...) as JSON
    iter_0000012/manifest.json       run id, step, write time, size + sha256 of every file
    latest                           text file naming the newest complete iteration dir
    previous/<time>/                 another run's checkpoint found at a step this run saves, moved
                                     aside (never deleted)

Saving writes into `iter_XXXXXXX.tmp`, all ranks barrier, the manifest is computed (collective)
and written, rank 0 renames the directory into place and only then rewrites `latest` (temp file
+ fsync + os.replace). A crash at any point leaves `latest` naming a checkpoint that loads; the
`.tmp` folder it may leave is deleted when the run resumes (`sweep_partial_saves`).

Loading verifies the manifest first. Nothing here unpickles code: host state is JSON, rank 0's
extra tensors (a schedule's queued rollouts) load with weights_only, and megatron's own reads are
made safe around it (`no_code_load`: `.metadata` is checked with a restricted unpickler first,
and the load runs with torch's weights-only override), so a crafted checkpoint cannot run code.
The model's names are the bare GPTModel's (no `module.` from the trainer's wrappers), so the
converter's checkpoints and the trainer's are interchangeable. A checkpoint that fails
verification is renamed `iter_XXXXXXX.corrupt` (kept for inspection, never deleted) and
`resume_checkpoint` falls back to the newest older checkpoint of the same run that verifies.

Retention (`keep`) only ever deletes checkpoints of this run (same run id in the manifest) that
are neither among the `keep` newest by step, nor among the `keep` newest by write time, nor the
one `latest` names.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.fs import fsync_dir, fsync_tree
from megatron_rl.model.builder import unwrap_model
from megatron_rl.platform.reaping import reaped_checkpoint_queue
from megatron_rl.trainer.manifest import MANIFEST, build_manifest, read_manifest, verify_manifest, write_json
from megatron_rl.trainer.no_code_load import UnsafeCheckpoint, check_metadata, weights_only_torch_loads
from megatron_rl.trainer.nonfinite import check_parameters

# The distributed optimizer's checkpoint layout: megatron-core's own default raises
# "ShardedTensor.flattened_range is not supported"; this is Megatron-LM's default.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
_ITER = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory or file and what is wrong."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint's bytes differ from its manifest (or a file is missing or unreadable)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def complete_checkpoints(root: str) -> list[str]:
    """Published checkpoint dirs under `root`, oldest step first."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if _ITER.match(d)]


def latest_checkpoint(root: str) -> str | None:
    """The dir `root/latest` names when it exists; else the highest-step checkpoint; else None.
    `latest` may only name an `iter_NNNNNNN` dir of `root` (never `../x` or an absolute path:
    a resume renames a damaged checkpoint, and must not reach outside `root`)."""
    marker = os.path.join(root, "latest")
    if os.path.exists(marker):
        with open(marker, errors="replace") as f:
            name = f.read().strip()
        path = os.path.join(root, name)
        if _ITER.match(name) and os.path.isdir(path):
            return path
    done = complete_checkpoints(root)
    return done[-1] if done else None


def _sharded_state(model, optimizer, is_loading: bool, prefix: str = "") -> dict:
    """The model's (and optimizer's) sharded state under the bare GPTModel's names: a checkpoint
    reads the same whether the model was wrapped (the trainer's DDP / Float16Module) or not (the
    converter's). `prefix` reads checkpoints saved under a wrapper's name (`module.`)."""
    state = {"model": unwrap_model(model).sharded_state_dict(prefix=prefix)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading,
                                                          metadata=OPTIMIZER_METADATA)
    return state


def save_checkpoint(root: str, step: int, model, optimizer=None, extra: dict | None = None, keep: int = 2,
                    run_id: str = "", rank0_tensors: dict | None = None, sharded_strategy=None) -> str:
    """Save model (and optimizer) sharded state plus per-rank JSON `extra`; return the final dir.

    Collective over all ranks. `keep` >= 1: checkpoints of this `run_id` to retain (see the
    module docstring). `extra` must be JSON-serialisable (plain numbers, strings, lists, dicts).
    rank0_tensors: rank 0's {file name: object of tensors, numbers, strings, lists, dicts}, saved
    as `extra/<name>.pt` and read back with `read_rank0_tensors` (weights_only).
    sharded_strategy: megatron's save strategy (default: its torch_dist one); the converter
    passes lazy_save's, which writes a meta-device model's tensors one at a time.
    """
    from megatron.core import dist_checkpointing

    reaped_checkpoint_queue()  # megatron's writer helper process must not outlive a killed trainer
    rank = _rank()
    final = _iter_dir(root, step)
    # a checkpoint must never hold inf/NaN: a resume would train on them and an export serve them
    check_parameters(model, f"not saving {final}: the weights", "Resume from an earlier checkpoint")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), tmp,
                            sharded_strategy=sharded_strategy)
    os.makedirs(os.path.join(tmp, "extra"), exist_ok=True)
    write_json(os.path.join(tmp, "extra", f"rank_{rank:05d}.json"), extra or {})
    if rank == 0:
        for name, obj in (rank0_tensors or {}).items():
            with open(os.path.join(tmp, "extra", f"{name}.pt"), "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
    _barrier()
    build_manifest(tmp, {"run_id": run_id, "step": step, "written_at": time.time()})
    _barrier()
    if rank == 0:
        # on disk before `latest` names it and retention deletes older ones: megatron's writer syncs
        # its shards, not common.pt, metadata.json or the folders (megatron_rl/fs.py)
        fsync_tree(tmp)
        replaced = _set_aside(root, final, run_id) if os.path.isdir(final) else None
        os.replace(tmp, final)
        marker_tmp = os.path.join(root, "latest.tmp")
        with open(marker_tmp, "w") as f:
            f.write(os.path.basename(final))
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker_tmp, os.path.join(root, "latest"))
        fsync_dir(root)
        if replaced is not None:  # this run's earlier save of the same step: gone only now
            shutil.rmtree(replaced, ignore_errors=True)
        for old in retired_checkpoints(root, run_id, keep):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _set_aside(root: str, path: str, run_id: str) -> str | None:
    """An existing dir at the step being saved is renamed out of the way before the new one takes
    its name. This run's own earlier save of the same step is returned, to be deleted once the new
    one is published; anything else (another run's, or unreadable) moves to previous/ and stays."""
    manifest = read_manifest_or_none(path)
    if manifest is not None and manifest.get("run_id") == run_id and run_id:
        aside = _unique(path + ".replaced")
        os.replace(path, aside)
        return aside
    dest = os.path.join(root, "previous", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(dest, exist_ok=True)
    os.replace(path, _unique(os.path.join(dest, os.path.basename(path))))
    return None


def _unique(path: str) -> str:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist."""
    candidate, n = path, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def retired_checkpoints(root: str, run_id: str, keep: int) -> list[str]:
    """This run's checkpoints that retention may delete: not among the `keep` newest by step nor
    the `keep` newest by write time, and not the one `latest` names."""
    mine = []
    for path in complete_checkpoints(root):
        manifest = read_manifest_or_none(path)
        if manifest is not None and manifest.get("run_id") == run_id:
            mine.append((int(manifest["step"]), float(manifest["written_at"]), path))
    protected = {p for *_, p in sorted(mine)[-keep:]}
    protected |= {p for _, _, p in sorted(mine, key=lambda m: m[1])[-keep:]}
    protected.add(latest_checkpoint(root))
    return [p for *_, p in mine if p not in protected]


def sweep_partial_saves(root: str) -> list[str]:
    """Rank 0 of a resuming run that holds the run directory's lock: delete the `iter_XXXXXXX.tmp`
    folders that saves cut short by a crash left behind (each up to a full checkpoint's size;
    nothing else would ever remove one whose step is not saved again). Never published, so never
    named by `latest`; a complete one only repeats a step the resumed run trains again. The
    `.replaced` and `.corrupt` folders stay: those may be the only copy of a step. Returns the
    deleted paths."""
    if not os.path.isdir(root):
        return []
    found = sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".tmp") and _ITER.match(n[:-4]))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def read_extra(path: str, rank: int = 0) -> dict:
    """Rank `rank`'s host state of checkpoint dir `path` (rank 0's when the checkpoint has fewer
    ranks: a resume with more ranks than saved)."""
    name = os.path.join(path, "extra", f"rank_{rank:05d}.json")
    if not os.path.exists(name):
        name = os.path.join(path, "extra", "rank_00000.json")
    if not os.path.exists(name):
        raise CorruptCheckpoint(f"{path} has no host state (extra/rank_*.json); it is incomplete or was not "
                                f"written by this version of megatron-rl")
    try:
        with open(name) as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{name} is damaged ({e})") from None


def read_rank0_tensors(path: str, name: str):
    """What rank 0 saved as `rank0_tensors[name]` in checkpoint dir `path` (None when absent).
    Loaded with weights_only=True: tensors and plain containers, never code."""
    file = os.path.join(path, "extra", f"{name}.pt")
    if not os.path.exists(file):
        return None
    try:
        return torch.load(file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - name the file, whatever the unpickler says
        raise CorruptCheckpoint(f"{file} cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") \
            from None


def load_checkpoint(path: str, model, optimizer=None, verify: bool = True) -> dict:
    """Verify, then load a checkpoint dir into `model` (and `optimizer`); return this rank's
    host state. The parallel layout may differ from the one that saved (dist_checkpointing
    reshards). Raises CheckpointError naming the damaged file."""
    from megatron.core import dist_checkpointing

    if verify:
        if not os.path.exists(os.path.join(path, MANIFEST)):
            raise CheckpointError(f"{path} has no manifest.json: it was written by an older version of megatron-rl "
                                  f"or not by megatron-rl; start a fresh run (train.resume=false) or re-save it")
        problems = verify_manifest(path)
        if problems:
            raise CorruptCheckpoint(f"checkpoint {path} failed verification: " + "; ".join(problems[:3]) +
                                  (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    extra = read_extra(path, _rank())
    try:
        metadata = check_metadata(path)
    except UnsafeCheckpoint as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a damaged file: name it, whatever the unpickler says
        raise CorruptCheckpoint(f"{path}/.metadata cannot be read ({type(e).__name__}: {e})") from None
    prefix = _saved_prefix(metadata, model)
    try:
        with weights_only_torch_loads():  # megatron's byte items and common.pt: tensors, never code
            state = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True, prefix=prefix), path)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path}: {_first_failure(e)}") from e
    unwrap_model(model).load_state_dict(_strip(state["model"], prefix), strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return extra


def _first_failure(e: BaseException) -> str:
    """`Type: first line` of what went wrong; for torch's CheckpointException (which gathers every
    rank's exception), of the lowest failing rank's."""
    if isinstance(e, CheckpointException) and e.failures:
        e = e.failures[min(e.failures)][0]
    lines = [line for line in str(e).splitlines() if line.strip()]
    if isinstance(e, pickle.UnpicklingError):  # torch's weights-only refusal: say what it refused, not "retry"
        named = [line.strip() for line in lines if "GLOBAL" in line]
        return ("an item holds more than tensors and plain data, refused because loading it could run code"
                + (f" ({named[0]})" if named else ""))
    return f"{type(e).__name__}: {lines[0] if lines else ''}"  # a bare assert has no message


def _saved_prefix(metadata, model) -> str:
    """`module.` for a checkpoint written before checkpoints used the bare model's names (the
    trainer saved its DDP wrapper's), else ``."""
    if metadata is None:
        return ""
    names = set(unwrap_model(model).state_dict())
    saved = metadata.state_dict_metadata
    if any(n in saved for n in names) or not any(f"module.{n}" in saved for n in names):
        return ""
    return "module."


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix):] if prefix and k.startswith(prefix) else k: v for k, v in state.items()}


def resume_checkpoint(root: str, model, optimizer=None, log=print) -> tuple[str, dict] | None:
    """Load the newest checkpoint under `root` that verifies: `latest` first, then older ones of
    the same run. A damaged one is renamed `<dir>.corrupt` and reported through `log`, never
    deleted. Returns (path, host state), or None when `root` holds no checkpoint. Collective."""
    first = latest_checkpoint(root)
    if first is None:
        return None
    run_id = _run_id_of(first)  # None when its manifest is unreadable: then any older one may serve
    candidates = [first] + [p for p in reversed(complete_checkpoints(root)) if p != first and p < first]
    for path in candidates:
        if path != first and run_id is not None and _run_id_of(path) != run_id:
            continue
        try:
            return path, load_checkpoint(path, model, optimizer)
        except CorruptCheckpoint as e:
            if _rank() == 0:
                aside = _unique(path + ".corrupt")
                log(f"{e}\n  keeping it as {aside} and trying the previous checkpoint")
                os.replace(path, aside)
            _barrier()
    raise CheckpointError(f"no checkpoint under {root} passed verification (damaged ones were renamed *.corrupt); "
                          f"restore one or start a fresh run with train.resume=false")


def read_manifest_or_none(path: str) -> dict | None:
    """The manifest, or None when it is missing or unreadable."""
    try:
        return read_manifest(path)
    except ValueError:
        return None


def _run_id_of(path: str) -> str | None:
    manifest = read_manifest_or_none(path)
    return manifest.get("run_id") if manifest else None
