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
`.tmp` folder it may leave is deleted when the run starts again (`sweep_partial_saves`). A save
that fails (a full disk, a writer process that died: platform/checkpoint_writer.py) raises
CheckpointError naming the step, the file or writer, and that folder.

Loading verifies the manifest first, and opens only regular files of the checkpoint (a named
pipe would block, a device never end, a link point anywhere; `.metadata` may name only files of
the manifest). A caller's `check` of the host state runs before any weight is read, the same
verdict on every rank. Nothing here unpickles code: host state is JSON, rank 0's
extra tensors (a schedule's queued rollouts) load with weights_only, and megatron's own reads are
made safe around it (`no_code_load`: `.metadata` is checked with a restricted unpickler first,
and the load runs with torch's weights-only override), so a crafted checkpoint cannot run code.
The model's names are the bare GPTModel's (no `module.` from the trainer's wrappers), so the
converter's checkpoints and the trainer's are interchangeable. A checkpoint that cannot be
verified (CorruptCheckpoint: damaged bytes, no or a malformed manifest, unusable host state) is
renamed `iter_XXXXXXX.corrupt` (kept for inspection, never deleted) and
`resume_checkpoint` falls back to the newest older checkpoint of the same run that verifies.

Retention (`keep`) only ever deletes checkpoints of this run (same run id in the manifest) that
are neither among the `keep` newest by step, nor among the `keep` newest by write time, nor the
one `latest` names.
"""
from __future__ import annotations

import contextlib
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
from megatron_rl.platform.checkpoint_writer import WriterFailed, watched_save_strategy
from megatron_rl.platform.reaping import reaped_checkpoint_queue
from megatron_rl.trainer.manifest import (
    NotRegularFile,
    build_manifest,
    open_regular,
    read_manifest,
    verify_manifest,
    write_json,
)
from megatron_rl.trainer.no_code_load import UnsafeCheckpoint, check_metadata, weights_only_torch_loads
from megatron_rl.trainer.nonfinite import check_parameters

# The distributed optimizer's checkpoint layout: megatron-core's own default raises
# "ShardedTensor.flattened_range is not supported"; this is Megatron-LM's default.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
_ITER = re.compile(r"^iter_(\d{7})$")
_WORKER_FAILURE = "Worker failure: "  # megatron's FileSystemWriterAsync.retrieve_write_results


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory or file and what is wrong."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that cannot be verified: its bytes differ from its manifest, a file is missing
    or unreadable or not a regular file, the manifest is missing or malformed, or its host state
    is unusable. A resume sets it aside and falls back."""


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
    try:
        with open_regular(marker) as f:  # not a named pipe that would block the start
            name = f.read(64).decode(errors="replace").strip()
    except OSError:  # absent, or not a file: the highest-step checkpoint
        name = ""
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
    final = _iter_dir(root, step)
    # a checkpoint must never hold inf/NaN (a resume would train on them, an export serve them): a
    # refusal before anything is written, raised as itself (NonFiniteWeights), not as a failed save
    check_parameters(model, f"not saving {final}: the weights", "Resume from an earlier checkpoint")
    try:
        return _save(root, step, model, optimizer, extra, keep, run_id, rank0_tensors, sharded_strategy)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"cannot save the checkpoint of step {step} to {final}: {_first_failure(e)}"
                              f"{_space_left(root)}; the unfinished {final}.tmp is deleted when the run "
                              f"starts again") from e


def _space_left(root: str) -> str:
    """` (N GiB free under root)`: a save that failed for want of space says so."""
    try:
        return f" ({shutil.disk_usage(root).free / 2**30:.2f} GiB free under {root})"
    except OSError:
        return ""


def _save(root, step, model, optimizer, extra, keep, run_id, rank0_tensors, sharded_strategy) -> str:
    from megatron.core import dist_checkpointing

    reaped_checkpoint_queue()  # megatron's writer helper process must not outlive a killed trainer
    rank = _rank()
    final = _iter_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), tmp,
                            sharded_strategy=sharded_strategy or watched_save_strategy())
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
            try:
                mine.append((int(manifest["step"]), float(manifest["written_at"]), path))
            except (KeyError, TypeError, ValueError):  # a manifest not as this run writes them: kept
                continue
    protected = {p for *_, p in sorted(mine)[-keep:]}
    protected |= {p for _, _, p in sorted(mine, key=lambda m: m[1])[-keep:]}
    protected.add(latest_checkpoint(root))
    return [p for *_, p in mine if p not in protected]


def partial_saves(root: str) -> list[str]:
    """The `iter_XXXXXXX.tmp` folders under `root`: saves that a crash or a failed write cut short."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".tmp") and _ITER.match(n[:-4]))


def sweep_partial_saves(root: str) -> list[str]:
    """Rank 0 of a starting run that holds the run directory's lock, before its space check:
    delete the `iter_XXXXXXX.tmp` folders that saves cut short by a crash or a failed write (a
    full disk) left behind. Each holds up to a full checkpoint's size, and nothing else would
    ever remove one whose step is not saved again (a fresh run would carry it to previous/). Never
    published, so never named by `latest`; a complete one only repeats a step the run trains
    again. The `.replaced` and `.corrupt` folders stay: those may be the only copy of a step.
    Returns the deleted paths."""
    found = partial_saves(root)
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def folder_bytes(path: str) -> int:
    """Bytes of the files under `path` (links not followed)."""
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, n)).st_size
    return total


def read_extra(path: str, rank: int = 0) -> dict:
    """Rank `rank`'s host state of checkpoint dir `path` (rank 0's when the checkpoint has fewer
    ranks: a resume with more ranks than saved)."""
    name = os.path.join(path, "extra", f"rank_{rank:05d}.json")
    if not os.path.lexists(name):
        name = os.path.join(path, "extra", "rank_00000.json")
    if not os.path.lexists(name):
        raise CorruptCheckpoint(f"{path} has no host state (extra/rank_*.json); it is incomplete or was not "
                                f"written by this version of megatron-rl")
    try:
        with open_regular(name) as f:
            extra = json.loads(f.read().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{name} is damaged ({e})") from None
    except OSError as e:
        raise CorruptCheckpoint(str(e) if isinstance(e, NotRegularFile) else f"{name} cannot be read ({e})") from None
    if not isinstance(extra, dict):
        raise CorruptCheckpoint(f"{name} is damaged (not a JSON object)")
    return extra


def read_rank0_tensors(path: str, name: str):
    """What rank 0 saved as `rank0_tensors[name]` in checkpoint dir `path` (None when absent).
    Loaded with weights_only=True: tensors and plain containers, never code."""
    file = os.path.join(path, "extra", f"{name}.pt")
    if not os.path.lexists(file):
        return None
    try:
        with open_regular(file) as f:
            return torch.load(f, weights_only=True)
    except Exception as e:  # noqa: BLE001 - name the file, whatever the unpickler says
        if isinstance(e, NotRegularFile):
            raise CorruptCheckpoint(str(e)) from None
        raise CorruptCheckpoint(f"{file} cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") \
            from None


def load_checkpoint(path: str, model, optimizer=None, verify: bool = True, check=None) -> dict:
    """Verify, then load a checkpoint dir into `model` (and `optimizer`); return this rank's
    host state. The parallel layout may differ from the one that saved (dist_checkpointing
    reshards). `check(path, host_state)` runs before any weight is read: a refusal (e.g. a
    config the checkpoint cannot continue under) is raised then, not as a failed load. Raises
    CorruptCheckpoint when the checkpoint cannot be verified (damaged bytes, a missing or
    unusable manifest, files that are not regular files, unusable host state), CheckpointError
    for other reasons it cannot be used; each names the file. Collective: every rank raises the
    same exception (the lowest failing rank's)."""
    from megatron.core import dist_checkpointing

    if verify:
        problems = verify_manifest(path)
        if problems:
            raise CorruptCheckpoint(f"checkpoint {path} failed verification: " + "; ".join(problems[:3]) +
                                    (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    extra, metadata = _on_every_rank_alike(lambda: _before_the_load(path, verify, check))
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


def _before_the_load(path: str, verify: bool, check):
    """This rank's host state, after `check`, and the checkpoint's `.metadata` (read safely, and
    naming only files of the manifest: megatron opens the files it names)."""
    extra = read_extra(path, _rank())
    if check is not None:
        check(path, extra)
    try:
        metadata = check_metadata(path)
    except UnsafeCheckpoint as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a damaged file: name it, whatever the unpickler says
        raise CorruptCheckpoint(f"{path}/.metadata cannot be read ({type(e).__name__}: {e})") from None
    if verify and metadata is not None:
        listed = set((read_manifest(path) or {}).get("files", {}))
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = getattr(info, "relative_path", None)
            if name not in listed:
                raise CorruptCheckpoint(f"{path}/.metadata names {name!r} as a file of the checkpoint, which its "
                                        f"manifest does not list")
    return extra, metadata


def _on_every_rank_alike(fn):
    """`fn()` on every rank; when it raises on any, every rank raises the lowest failing rank's
    exception (a rank that went on alone would wait for the others in the load's collectives)."""
    try:
        out, error = fn(), None
    except Exception as e:  # noqa: BLE001 - carried to every rank, then raised
        out, error = None, e
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return out


def _first_failure(e: BaseException) -> str:
    """`Type: first line` of what went wrong; for torch's CheckpointException (which gathers every
    rank's exception), of the lowest failing rank's."""
    if isinstance(e, CheckpointException):
        if not e.failures:  # megatron's save gives the details to the coordinating rank only
            return "it failed on another rank (rank 0 names the cause)"
        e = e.failures[min(e.failures)][0]
    lines = [line for line in str(e).splitlines() if line.strip()]
    if lines and lines[0].startswith(_WORKER_FAILURE):  # a writer's own error (platform/checkpoint_writer.py
        return lines[0][len(_WORKER_FAILURE):]        # names the file), in megatron's words around it
    if isinstance(e, WriterFailed):
        return lines[0]
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


def resume_checkpoint(root: str, model, optimizer=None, log=print, check=None) -> tuple[str, dict] | None:
    """Load the newest checkpoint under `root` that verifies: `latest` first, then older ones of
    the same run. One that cannot be verified (see load_checkpoint) is renamed `<dir>.corrupt`
    and reported through `log`, never deleted. `check`: as in load_checkpoint, for each
    candidate. Returns (path, host state), or None when `root` holds no checkpoint. Collective."""
    first = latest_checkpoint(root)
    if first is None:
        return None
    run_id = _run_id_of(first)  # None when its manifest is unreadable: then any older one may serve
    candidates = [first] + [p for p in reversed(complete_checkpoints(root)) if p != first and p < first]
    for path in candidates:
        if path != first and run_id is not None and _run_id_of(path) != run_id:
            continue
        try:
            return path, load_checkpoint(path, model, optimizer, check=check)
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
