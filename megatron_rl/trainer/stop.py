"""Graceful stop on SIGTERM and Ctrl-C: finish the step, save, exit; a second Ctrl-C stops at once.

    stop = StopSignals.install()       # main thread, before the run
    ...
    if stop.agreed(device):            # at a step boundary, on every rank (one all-reduce)
        save(); raise Stopped(stop.signum)
    stop.uninstall()

SLURM and torchrun send SIGTERM to every rank before they kill it; a user presses Ctrl-C. Both
set a flag: the loop finishes the step in flight (so no half-applied update is ever saved), all
ranks agree on the flag with one MAX all-reduce, save a checkpoint of the completed steps, and
raise `Stopped`.

Which later signal stops at once. A Ctrl-C (SIGINT) after any first signal, SIGTERM or Ctrl-C,
raises KeyboardInterrupt at once: nothing is saved, and the exit paths (finally blocks, atexit)
still stop the rollout engine and reap child processes. This is how a person gets out of a stop
that hangs (e.g. a rollout request waiting out its timeout after SIGTERM). A later SIGTERM never
does, it is logged and changes nothing: SIGTERM is the launchers' signal, and they send it more
than once for one stop. SLURM signals every process of a step, at preemption and at the time
limit; torchrun forwards the signal it got to its workers, and SIGTERMs them again when it
shuts down: when a second Ctrl-C reaches it, and when one rank has exited with an error code (a
stopped rank exits with 128 + signal) while the others still save. Stopping at once on any of
these would lose the save. Every launcher follows its SIGTERM with SIGKILL after a grace
period (torchrun: 30 s; SLURM: KillWait), which bounds how long the step may take to finish and
save.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """The run stopped early on a signal after saving its completed steps."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """The SIGTERM/SIGINT flag. `signum` is the first signal received (None: none yet).
    `then`: what a stop does, as the first signal's notice says it; a phase that stops otherwise
    (the SFT warm start saves nothing) sets it for its duration (`while_`)."""

    SAVES = "stopping after the current step and saving a checkpoint"

    def __init__(self):
        self.signum: int | None = None
        self.then = self.SAVES
        self._previous: dict[int, object] = {}

    @contextlib.contextmanager
    def while_(self, then: str):
        """`then` is what a stop does inside the block."""
        before, self.then = self.then, then
        try:
            yield self
        finally:
            self.then = before

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
            self._again(signum)
            return
        self.signum = signum
        # os.write, not print: a signal handler may interrupt a print (a tqdm bar) on stderr
        os.write(2, f"\n{_name(signum)} received: {self.then} (Ctrl-C to stop at once without saving)\n".encode())

    def _again(self, signum: int) -> None:
        """A signal after the first: Ctrl-C stops at once, SIGTERM is the same request again (see
        the module docstring for why a repeated SIGTERM must not lose the save)."""
        if signum == signal.SIGINT:
            raise KeyboardInterrupt(f"Ctrl-C after {_name(self.signum)}: stopping now without saving")
        os.write(2, f"\n{_name(signum)} received: already stopping after the current step "
                    f"(Ctrl-C to stop at once without saving)\n".encode())

    def agreed(self, device: torch.device | str = "cpu") -> bool:
        """Collective over the world: True on every rank when any rank got a signal."""
        flag = torch.tensor([0 if self.signum is None else self.signum], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())
        return bool(flag.item())
