"""Durable writes shared by the trainer's checkpoints and the converter's Hugging Face exports.

A file's bytes and a folder's entries reach the disk only when synced: after a power loss or a
kernel crash, a new file that was never synced can come back empty on ext4 or XFS (delayed
allocation), and a rename that was never synced can be undone. So a folder is synced whole
(`fsync_tree`) before it is renamed into place, and the parent after the rename (`fsync_dir`).
Syncing what is already on disk costs one call per file.

Files at fixed names in a folder someone else can write to (the run directory: its lock, logs and
metrics) are opened with `open_no_follow`: a symbolic link planted at the name is refused, never
followed to append to or truncate its target.
"""
from __future__ import annotations

import errno
import os
import stat

_OPEN_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
               "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}


def open_no_follow(path: str, mode: str = "r", buffering: int = -1):
    """`open(path, mode)` that refuses a symbolic link at `path` (O_NOFOLLOW) and anything but a
    regular file (a FIFO would block the open or the reads), raising OSError naming the path.
    Modes as open's ("r", "w", "a", "x", with "+" and "b"); "w" truncates only once the file is
    known to be a regular file of its own, not a link's target."""
    kind = mode.replace("b", "").replace("t", "").replace("+", "")
    flags = _OPEN_FLAGS[kind]
    if "+" in mode:
        flags = (flags & ~(os.O_WRONLY | os.O_RDONLY)) | os.O_RDWR
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if os.path.islink(path):   # ELOOP (or EEXIST for "x"): say what it is
            raise OSError(f"{path} is a symbolic link (to {os.readlink(path)}), and it is not followed here; remove "
                          f"it") from None
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise OSError(f"{path} is not a regular file (a FIFO); remove it") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file; remove it")
        os.set_blocking(fd, True)
        if kind == "w":
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode, buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def fsync_dir(path: str) -> None:
    """Sync a folder's entries (the names in it, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Sync every file and folder under `root`, and `root`."""
    for d, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)
