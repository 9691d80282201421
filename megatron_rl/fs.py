"""Durable writes shared by the trainer's checkpoints and the converter's Hugging Face exports.

A file's bytes and a folder's entries reach the disk only when synced: after a power loss or a
kernel crash, a new file that was never synced can come back empty on ext4 or XFS (delayed
allocation), and a rename that was never synced can be undone. So a folder is synced whole
(`fsync_tree`) before it is renamed into place, and the parent after the rename (`fsync_dir`).
Syncing what is already on disk costs one call per file.
"""
from __future__ import annotations

import os


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
