"""The checkpoint writer's helper processes die with the trainer, even on SIGKILL, and live
through a SIGTERM sent to the whole job.

megatron-core's filesystem writer (every `dist_checkpointing.save`) uses two kinds of process:

- a queue for the write results, served by a `multiprocessing` Manager: a spawned Python process
  that imports torch (about 270 MB), created on the first save and kept for the life of the
  trainer. A trainer that exits normally shuts it down; one killed by SIGKILL, or by a SIGTERM
  nobody handles, leaves it running forever. And SLURM (time limit, scancel, preemption),
  systemd and `timeout` send SIGTERM to every process of the job: a Manager that died of it
  broke the pipe of the save the trainer then makes to stop cleanly, losing every step since
  the last periodic save.
- writer workers forked for each save. A worker inherits the run directory's lock, and one
  whose trainer was SIGKILLed mid-save waits forever on the dead trainer's queue, so the lock
  was never released and every resume into the run directory was refused.

`reaped_checkpoint_queue()` creates that queue before the first save and hands it to megatron-core
in place of its own. It is served by a bare interpreter (`python -I -S` running this file: the
standard library only, no torch; about 0.1 CPU s and 15 MB, where megatron's spawned Manager took
3 to 4 CPU s and 350 MB re-importing the trainer's modules) that ignores SIGTERM and asks the kernel
to SIGKILL it when its parent dies (Linux PR_SET_PDEATHSIG; it exits at once if the parent is
already gone); a trainer that exits normally stops it. `forked_children_die_with_this_process`
gives every child the process forks from then on (the writer workers) the same death signal, and
has it close the run directory's lock (`trainer/run_dir.py` registers it) right after. This
touches the private module global `filesystem_async._results_queue`, whose one reader is
`_get_write_results_queue()`. Should that global change, every save fails on it (the checkpoint
tests). Drills 6 and 7 in
`tests/e2e/test_drills.py` check that a SIGKILLed trainer leaves no writer process and a free
run directory, and that a SIGTERM to the process group still saves.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing.managers import BaseProxy, SyncManager

_MANAGER: SyncManager | None = None
_PR_SET_PDEATHSIG = 1
_forker = {"pid": 0}   # the pid of the process about to fork, read by the child
_fork_hook = {"registered": False, "close": []}   # files a forked child closes at once


def _kill_me_with_parent(parent_pid: int) -> None:
    """SIGKILL from the kernel when the parent dies; exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the normal exit path still shuts it down
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _remember_forker() -> None:
    _forker["pid"] = os.getpid()


def _forked_child_dies_with_parent() -> None:
    _kill_me_with_parent(_forker["pid"])   # first: a child that holds none of the files is also doomed
    for f in _fork_hook["close"]:
        f.close()


def forked_children_die_with_this_process(*close) -> None:
    """From now on, every child this process forks (os.fork, multiprocessing's fork: megatron's
    checkpoint writer workers) is SIGKILLed by the kernel when its parent dies, and closes its
    copies of the files `close` (such as the run directory's lock, which lasts until every copy
    is closed) before anything else runs in it. Idempotent; each call adds its files."""
    _fork_hook["close"].extend(close)
    if not _fork_hook["registered"]:
        os.register_at_fork(before=_remember_forker, after_in_child=_forked_child_dies_with_parent)
        _fork_hook["registered"] = True


def reaped_checkpoint_queue() -> None:
    """Install the queue (idempotent). Call from the main thread: the kernel signals the child
    when the thread that started it ends, so it must be the thread that lives as long as the run."""
    global _MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _MANAGER is not None or filesystem_async._results_queue is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    # megatron forks its writer workers from the thread that saves: the main one (see above)
    forked_children_die_with_this_process()
    manager = _start_reaped_manager()
    filesystem_async._results_queue = manager.Queue()
    _MANAGER = manager


class _PickledQueueProxy(BaseProxy):
    """A `queue.Queue` in the server that holds each item as pickled bytes: the server never
    unpickles a write result, so it needs no torch. megatron's writers put and get; the rest is
    there for completeness. A full or empty queue raises queue.Full/queue.Empty as a Queue does."""

    def put(self, item, block=True, timeout=None):
        return self._callmethod("put", (pickle.dumps(item), block, timeout))

    def put_nowait(self, item):
        return self.put(item, False)

    def get(self, block=True, timeout=None):
        return pickle.loads(self._callmethod("get", (block, timeout)))

    def get_nowait(self):
        return self.get(False)

    def qsize(self):
        return self._callmethod("qsize")

    def empty(self):
        return self._callmethod("empty")

    def full(self):
        return self._callmethod("full")


class _ReapedManager(SyncManager):
    """The trainer's side: its Queue() is the server's queue.Queue behind `_PickledQueueProxy`."""


_ReapedManager.register("Queue", queue.Queue, _PickledQueueProxy)


def _start_reaped_manager() -> SyncManager:
    """A SyncManager server in a bare interpreter (`_serve` below), connected to. Its key is this
    process's multiprocessing authkey, so children multiprocessing starts can use the queue too."""
    from multiprocessing import connection, process, util

    authkey = bytes(process.current_process().authkey)
    address = connection.arbitrary_address("AF_UNIX")   # in this process's multiprocessing temp dir
    ready_r, ready_w = os.pipe()
    try:
        server = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
                                   address, str(ready_w)], stdin=subprocess.PIPE, pass_fds=(ready_w,))
    finally:
        os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        server.stdin.write(authkey)
        server.stdin.close()
        if ready.read(1) != b"1":   # it exits before listening only on an error it has printed
            raise RuntimeError(f"the checkpoint results queue's process exited with {server.wait()}")
    manager = _ReapedManager(address=address, authkey=authkey)
    manager.connect()
    util.Finalize(manager, _stop, args=(server,), exitpriority=0)   # at exit, after the queue's own finalizers
    return manager


def _stop(server: subprocess.Popen) -> None:
    server.kill()   # it ignores SIGTERM; it holds nothing but the queue
    server.wait()


def _serve(parent_pid: int, address: str, ready_fd: int) -> None:
    """The server process: `python -I -S reaping.py PARENT_PID ADDRESS READY_FD`, the authkey on
    stdin. SIGTERM is the job's stop signal: the trainer handles it by saving, which needs this
    process alive; SIGINT (a Ctrl-C to the terminal's process group) is the trainer's to handle too."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _kill_me_with_parent(parent_pid)
    server = SyncManager(address=address, authkey=sys.stdin.buffer.read()).get_server()   # listening now
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    server.serve_forever()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
