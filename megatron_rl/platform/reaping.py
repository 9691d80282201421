"""The checkpoint writer's helper process dies with the trainer, even on SIGKILL.

megatron-core's filesystem writer (every `dist_checkpointing.save`) collects its results
through a queue served by a `multiprocessing` Manager: a spawned Python process that imports
torch (about 270 MB), created on the first save and kept for the life of the trainer. A
trainer that exits normally shuts it down; one killed by SIGKILL, or by a SIGTERM nobody
handles, leaves it running forever.

`reaped_checkpoint_queue()` creates that queue before the first save, from a Manager whose
server process asks the kernel to SIGKILL it when its parent dies (Linux PR_SET_PDEATHSIG; it
exits at once if the parent is already gone), and hands it to megatron-core in place of its
own. It touches the private module global `filesystem_async._results_queue`, whose one reader
is `_get_write_results_queue()`. Should that global change, every save fails on it (the
checkpoint tests), and drill 6+7 in `tests/e2e/test_drills.py` checks that a SIGKILLed
trainer leaves no writer process.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
from multiprocessing.managers import SyncManager

_MANAGER: SyncManager | None = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Runs first in the Manager's server process."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the normal exit path still shuts it down
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def reaped_checkpoint_queue() -> None:
    """Install the queue (idempotent). Call from the main thread: the kernel signals the child
    when the thread that started it ends, so it must be the thread that lives as long as the run."""
    global _MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _MANAGER is not None or filesystem_async._results_queue is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _MANAGER = manager
