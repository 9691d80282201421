"""Graceful stop on SIGTERM and Ctrl-C: finish the step, save, exit; a second signal stops at once.

    stop = StopSignals.install()       # main thread, before the run
    ...
    if stop.agreed(device):            # at a step boundary, on every rank (one all-reduce)
        save(); raise Stopped(stop.signum)
    stop.uninstall()

SLURM and torchrun send SIGTERM to every rank before they kill it; a user presses Ctrl-C. Both
set a flag: the loop finishes the step in flight (so no half-applied update is ever saved), all
ranks agree on the flag with one MAX all-reduce, save a checkpoint of the completed steps, and
raise `Stopped`. A second Ctrl-C raises KeyboardInterrupt at once: nothing is saved, and the exit
paths (finally blocks, atexit) still stop the rollout engine and reap child processes. Repeated
SIGTERMs are one request: SLURM signals every process of a step and torchrun forwards the signal
to its workers, so a rank may get it twice in a row. The launcher's own grace period (torchrun:
30 s before SIGKILL; SLURM: KillWait) bounds how long the step may take to finish and save.
"""
from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped early on a signal after saving its completed steps."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """The SIGTERM/SIGINT flag. `signum` is the first signal received (None: none yet)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @classmethod
    def install(cls) -> StopSignals:
        stop = cls()
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in _SIGNALS:
                stop._previous[sig] = signal.signal(sig, stop._handle)
        return stop

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT and self.signum == signal.SIGINT:
                raise KeyboardInterrupt("second Ctrl-C: stopping now without saving")
            return  # a duplicate SIGTERM from the launcher: the first one is being honoured
        self.signum = signum
        again = " (Ctrl-C again to stop at once without saving)" if signum == signal.SIGINT else ""
        # os.write, not print: a signal handler may interrupt a print (a tqdm bar) on stderr
        os.write(2, f"\n{signal.Signals(signum).name} received: stopping after the current step and saving a "
                    f"checkpoint{again}\n".encode())

    def agreed(self, device: torch.device | str = "cpu") -> bool:
        """Collective over the world: True on every rank when any rank got a signal."""
        flag = torch.tensor([0 if self.signum is None else self.signum], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())
        return bool(flag.item())
