"""Parking a decode loop at a step boundary, so its weights can change mid-generation (partial
rollouts, train.in_flight_update): the thread-safe gate an in-process engine checks between two
decode steps.

    gate = DecodeGate()
    # decode thread (engine.generate):         # trainer thread (the schedule's weight push):
    with gate.generating():                    gate.pause()         # returns once parked or idle
        for t in range(steps):                 push the weights     # the engine is not reading them
            ...sample token t...               gate.resume()        # decoding goes on
            if gate.boundary(t): refresh()
    # abort instead: gate.abort() parks the loop and makes boundary() raise GenerationAborted there

`boundary` returns True when the loop was parked (its caller then checks whether the weights
changed and recomputes what depends on them). `park_after(k)` makes the loop park by itself
after decode step k of the generation in flight (or the next one): a pause point fixed by an
event, not by timing, for tests; `wait_parked` waits for it. A pause requested before a
generation starts holds that generation's start until resume.

Cost: one uncontended lock per decode step.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["DecodeGate", "GenerationAborted"]


class GenerationAborted(RuntimeError):
    """The generation in flight was abandoned at a step boundary (DecodeGate.abort): its samples
    are lost; the caller generates them again with the new weights."""


class DecodeGate:
    """See the module docstring. One generation at a time goes through a gate."""

    def __init__(self):
        self._cond = threading.Condition()
        self._paused = False
        self._abort = False
        self._active = False
        self._parked = False
        self._park_at: int | None = None

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Around one generation: pause() waits for it to park or to end."""
        with self._cond:
            self._cond.wait_for(lambda: not self._paused)  # a generation never starts during an update
            self._active = True
        try:
            yield
        finally:
            with self._cond:
                self._active, self._park_at = False, None
                self._cond.notify_all()

    def park_after(self, step: int | None) -> None:
        """The next (or current) generation parks by itself after decode step `step` (None: never)."""
        with self._cond:
            self._park_at = step

    def boundary(self, step: int) -> bool:
        """Decode thread, after step `step`: park while paused. True when it parked; raises
        GenerationAborted when the pause was an abort."""
        with self._cond:
            if self._park_at is not None and step >= self._park_at:
                self._paused, self._park_at = True, None
            if not self._paused:
                return False
            self._parked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._paused or self._abort)
            self._parked = False
            if self._abort:
                raise GenerationAborted(f"generation aborted after decode step {step} for a weight update")
            return True

    def pause(self) -> None:
        """Trainer thread: returns once the generation in flight is parked, or at once when none is;
        a generation that starts before resume() waits for it."""
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._active or self._parked)

    def abort(self) -> None:
        """Trainer thread: pause, and make the parked generation give up (it raises GenerationAborted
        in its thread); returns once it has ended. resume() lets generations start again."""
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._active or self._parked)
            self._abort = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._active)
            self._abort = False

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def parked(self) -> bool:
        with self._cond:
            return self._parked

    def wait_parked(self, timeout: float | None = None) -> bool:
        """Until a generation is parked (True) or `timeout` seconds passed (False): how a caller
        that armed `park_after` knows the pause point was reached."""
        with self._cond:
            return self._cond.wait_for(lambda: self._parked, timeout)
