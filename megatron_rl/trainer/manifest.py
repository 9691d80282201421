"""Checksum manifests of checkpoint directories, computed and verified by all ranks together.

    manifest = build_manifest(dir, meta={"run_id": ..., "step": 12})   # collective
    bad = verify_manifest(dir)          # collective; [] when every file matches, else reasons

`manifest.json` lists every file under the checkpoint dir (relative path -> bytes, sha256) plus
the run's metadata (run id, step, write time). It is written into the temporary directory
before the directory is renamed into place, so a published checkpoint and its manifest appear
together. Rank 0 lists the directory and reads the manifest, and every rank uses that one view.
Each rank hashes every world_size-th file of the list, so hashing a large checkpoint costs
1/world_size of reading it once; the results meet on every rank with one all_gather_object, so
every rank reaches the same verdict.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch.distributed as dist

MANIFEST = "manifest.json"
FORMAT = 1
_BLOCK = 1 << 22


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def list_files(root: str) -> list[str]:
    """Every regular file under `root` except the manifest, as sorted relative paths."""
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(mine: dict) -> dict:
    """Union of every rank's dict (all ranks get it)."""
    _, world = _rank_world()
    if world == 1:
        return mine
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    out: dict = {}
    for p in parts:
        out.update(p)
    return out


def _from_rank0(obj):
    """Rank 0's `obj` on every rank: one directory listing decides for all (a shared filesystem
    may show a rank a stale listing), so every rank takes the same branch of the collectives."""
    _, world = _rank_world()
    if world == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _hash_share(root: str, files: list[str]) -> dict[str, dict]:
    rank, world = _rank_world()
    share = {}
    for rel in files[rank::world]:
        path = os.path.join(root, rel)
        share[rel] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    return share


def build_manifest(root: str, meta: dict) -> dict:
    """Collective: hash every file under `root`; rank 0 writes root/manifest.json (fsynced).
    Call after every rank has finished writing into `root` (a barrier)."""
    files = _from_rank0(list_files(root) if _rank_world()[0] == 0 else None)
    manifest = {"format": FORMAT, **meta, "files": _gather(_hash_share(root, files))}
    if _rank_world()[0] == 0:
        write_json(os.path.join(root, MANIFEST), manifest)
    return manifest


def read_manifest(root: str) -> dict | None:
    """The manifest of `root`, None when it has none (older checkpoints), ValueError when unreadable."""
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path} is damaged (not a manifest)")  # noqa: TRY004 - bad content, as above
    return manifest


def verify_manifest(root: str) -> list[str]:
    """Collective: check every file of `root` against its manifest. Returns the problems (empty
    when the checkpoint is intact), each naming the file; a missing manifest is reported as one."""
    state = None
    if _rank_world()[0] == 0:
        try:
            manifest = read_manifest(root)
            state = ([f"{os.path.join(root, MANIFEST)} is missing (not written by this version, or not complete)"]
                     if manifest is None else (manifest["files"], list_files(root)))
        except ValueError as e:
            state = [str(e)]
    state = _from_rank0(state)
    if isinstance(state, list):
        return state
    expected, present = state
    problems = [f"{os.path.join(root, rel)} is missing" for rel in sorted(set(expected) - set(present))]
    problems += [f"{os.path.join(root, rel)} is not in the manifest" for rel in sorted(set(present) - set(expected))]
    rank, world = _rank_world()
    mine = {}
    for rel in sorted(set(expected) & set(present))[rank::world]:
        path, want = os.path.join(root, rel), expected[rel]
        size = os.path.getsize(path)
        if size != want["bytes"]:
            mine[rel] = f"{path} has {size} bytes, the manifest says {want['bytes']}"
        elif file_sha256(path) != want["sha256"]:
            mine[rel] = f"{path} does not match its sha256 in the manifest (the bytes changed after the save)"
    found = _gather(mine)
    return problems + [found[k] for k in sorted(found)]


def write_json(path: str, obj) -> None:
    """Write JSON durably: temp file, fsync, rename over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
