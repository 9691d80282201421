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

Only regular files are ever opened (`open_regular`: no link followed, the type checked on the
opened file). Anything else in a checkpoint, listed in its manifest or not, is a problem named by
what it is: a named pipe would block the read forever, a device (/dev/zero) never end it, a link
point outside the checkpoint. A manifest entry that is not {"bytes": n, "sha256": hex} makes the
manifest damaged (ValueError naming the entry), never a TypeError mid-check.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat

import torch.distributed as dist

MANIFEST = "manifest.json"
FORMAT = 1
_BLOCK = 1 << 22


class NotRegularFile(OSError):
    """A path that should be a checkpoint's file is a link, a named pipe, a device, ...: never read."""


def open_regular(path: str):
    """`path` opened for reading in binary mode, when it is a regular file itself (not a link,
    named pipe, device or socket; the check is made on the opened file, so nothing can swap it in
    between). Raises NotRegularFile naming what it is instead: opening a named pipe would wait
    for a writer forever, and reading a device (/dev/zero) never ends."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(f"{path} is a symbolic link, not a file") from None
        raise
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise NotRegularFile(f"{path} is {_KINDS.get(kind, 'not a regular file')}, not a file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


_KINDS = {stat.S_IFIFO: "a named pipe", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def list_entries(root: str) -> tuple[list[str], dict[str, str]]:
    """(the regular files under `root` except the manifest, everything else that is there and is
    not a folder: {relative path: what it is}), as relative paths. Links are not followed, and a
    link to a folder is listed as a link."""
    files, others = [], {}
    for d, dirs, names in os.walk(root):
        for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            rel = os.path.relpath(os.path.join(d, n), root)
            kind = stat.S_IFMT(os.lstat(os.path.join(d, n)).st_mode)
            if kind == stat.S_IFREG:
                if rel != MANIFEST:
                    files.append(rel)
            else:
                others[rel] = _KINDS.get(kind, "not a regular file")
    return sorted(files), others


def list_files(root: str) -> list[str]:
    """Every regular file under `root` except the manifest, as sorted relative paths."""
    return list_entries(root)[0]


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
    Call after every rank has finished writing into `root` (a barrier). A checkpoint holds only
    regular files: anything else there (a link, a named pipe) raises NotRegularFile on every rank."""
    listing = _from_rank0(list_entries(root) if _rank_world()[0] == 0 else None)
    files, others = listing
    if others:
        rel, kind = next(iter(sorted(others.items())))
        raise NotRegularFile(f"{os.path.join(root, rel)} is {kind}, not a file: a checkpoint holds only files")
    manifest = {"format": FORMAT, **meta, "files": _gather(_hash_share(root, files))}
    if _rank_world()[0] == 0:
        write_json(os.path.join(root, MANIFEST), manifest)
    return manifest


def read_manifest(root: str) -> dict | None:
    """The manifest of `root`, None when it has none (older checkpoints), ValueError naming the
    file and what is wrong when it cannot be used (not a file, not JSON, an entry that is not
    {"bytes": n, "sha256": hex})."""
    path = os.path.join(root, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        with open_regular(path) as f:
            manifest = json.loads(f.read().decode())
    except NotRegularFile as e:
        raise ValueError(str(e)) from None
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path} is damaged ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path} is damaged (not a manifest)")  # noqa: TRY004 - bad content, as above
    for rel, entry in manifest["files"].items():
        if not _is_entry(entry):
            raise ValueError(f"{path} is damaged (its entry for {rel!r} is {json.dumps(entry)[:80]}, not "
                             f"{{\"bytes\": <size>, \"sha256\": <hex digest>}})")
    return manifest


def _is_entry(entry) -> bool:
    return (isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)


def verify_manifest(root: str) -> list[str]:
    """Collective: check every file of `root` against its manifest. Returns the problems (empty
    when the checkpoint is intact), each naming the file; a missing manifest is reported as one."""
    state = None
    if _rank_world()[0] == 0:
        try:
            manifest = read_manifest(root)
            missing = (f"{os.path.join(root, MANIFEST)} is missing (written by an older version or not by "
                       f"megatron-rl, or not complete)")
            state = [missing] if manifest is None else (manifest["files"], *list_entries(root))
        except (ValueError, OSError) as e:
            state = [str(e)]
    state = _from_rank0(state)
    if isinstance(state, list):
        return state
    expected, present, others = state
    # only regular files inside the checkpoint are ever opened: a named pipe would block the read,
    # a device (/dev/zero) would never end it, and a link may point anywhere
    problems = [f"{os.path.join(root, rel)} is {kind}, not a file: a checkpoint holds only files"
                for rel, kind in sorted(others.items())]
    problems += [f"{os.path.join(root, rel)} is missing" for rel in sorted(set(expected) - set(present) - set(others))]
    problems += [f"{os.path.join(root, rel)} is not in the manifest" for rel in sorted(set(present) - set(expected))]
    rank, world = _rank_world()
    mine = {}
    for rel in sorted(set(expected) & set(present))[rank::world]:
        path, want = os.path.join(root, rel), expected[rel]
        try:
            size = os.lstat(path).st_size
            if size != want["bytes"]:
                mine[rel] = f"{path} has {size} bytes, the manifest says {want['bytes']}"
            elif file_sha256(path) != want["sha256"]:
                mine[rel] = f"{path} does not match its sha256 in the manifest (the bytes changed after the save)"
        except OSError as e:  # replaced or removed since the listing
            mine[rel] = str(e) if isinstance(e, NotRegularFile) else f"{path} cannot be read ({e.strerror or e})"
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
