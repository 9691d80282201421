"""Environment calls with a deadline: a failing or hanging environment ends its trajectory, never the run,
until so many of its calls are stuck that it would take the trainer down with it.

    calls = EnvCalls(timeout_s=10.0, max_stuck=32, max_in_flight=64)
    result = await calls.call(lambda: env.step(text, ids), "calculator.step")   # in a coroutine
    result.value                # what the call returned, or None when it failed
    result.failure              # None, "timeout", or "error: ValueError: ..."
    calls.run([...], [...])     # a batch of calls at once, from outside an event loop
    calls.stuck()               # calls past their deadline that are still running

Every call runs in its own daemon thread (environments are plain Python on rank 0) and is awaited
for at most `timeout_s`, so the event loop (the other trajectories, the engine's requests) goes on
meanwhile. At most `max_in_flight` calls run at once (env.max_calls_in_flight): the others wait
for a place, in the order they were made, before their deadline starts. A call still running then is abandoned: its trajectory fails ("timeout"), but Python
cannot stop a thread, so the call keeps its thread, and a busy-looping one keeps a share of the
interpreter's lock, until it returns. `EnvCalls` keeps the abandoned calls it has not seen end;
when one more is abandoned while max_stuck of them still run, it raises `StuckEnvironment`
naming the environments (by label) and the settings (env.timeout_s, env.max_stuck_calls): a
hanging environment then costs at most max_stuck + the calls in flight (one per running
trajectory) of threads, instead of a thread per trajectory per step for the rest of the run. A
call that returns late frees its place.

Why threads and a bound rather than a killable worker process per environment: an environment is
a stateful object per trajectory, registered in the trainer's process (register_env, from any
module, a test's too) and fed examples; a process would need every environment and example to
pickle and its registration to happen again in the child, and the trainer's rank 0 (CUDA, gloo and
megatron's threads) can only start children by spawn, an interpreter start with torch per worker,
then IPC for every reset and step. A correct environment returns within env.timeout_s and costs
nothing more here; a broken one stops the run with its name. What neither bounds: one call that
holds the interpreter's lock inside C code (a huge integer power) stalls everything, which is why
an environment bounds such work itself (the calculator takes 9-digit operands).

Daemon threads, not a ThreadPoolExecutor, whose workers the interpreter joins at exit: a call that
never returns must not keep the finished run's process alive. Cost: one thread per call (a trajectory's reset, each of its steps),
at most max_in_flight at once, plus the abandoned ones (at most max_stuck more).
"""
from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallResult:
    """value: the call's return value (None on failure); failure: None, "timeout", or
    "error: <exception type>: <message>"."""

    value: Any = None
    failure: str | None = None


class StuckEnvironment(RuntimeError):
    """More environment calls are running past their deadline than the run allows."""


class EnvCalls:
    """Batches of environment calls under one deadline each, and the calls they abandoned.
    timeout_s: a call's deadline (env.timeout_s); max_stuck: the most abandoned calls that may
    still run after a batch (env.max_stuck_calls); max_in_flight: the most calls running at once
    (env.max_calls_in_flight)."""

    def __init__(self, timeout_s: float, max_stuck: int, max_in_flight: int = 64):
        if max_in_flight < 1:
            raise ValueError(f"EnvCalls: max_in_flight={max_in_flight}, needs at least 1")
        self.timeout_s, self.max_stuck, self.max_in_flight = timeout_s, max_stuck, max_in_flight
        self._stuck: list[tuple[threading.Thread, str]] = []
        # an asyncio.Semaphore belongs to the loop that first waits on it; each rollout runs its own
        self._places: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._places is None or self._places[0] is not loop:
            self._places = (loop, asyncio.Semaphore(self.max_in_flight))
        return self._places[1]

    def stuck(self) -> int:
        """Abandoned calls still running (those that ended since are forgotten)."""
        self._stuck = [(t, label) for t, label in self._stuck if t.is_alive()]
        return len(self._stuck)

    async def call(self, fn: Callable[[], Any], label: str) -> CallResult:
        """Run `fn` in its own daemon thread and await it for at most timeout_s (label names its
        environment and method, e.g. "calculator.step"): its value, or why it has none. A call
        past its deadline is abandoned ("timeout") and kept; raises StuckEnvironment when more
        than max_stuck abandoned calls then still run. Waits first for one of max_in_flight places."""
        async with self._semaphore():
            return await self._call(fn, label)

    async def _call(self, fn: Callable[[], Any], label: str) -> CallResult:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = CallResult(value=fn())
            except Exception as e:  # noqa: BLE001 - any failure of the environment's code, reported for its trajectory
                result = CallResult(failure=f"error: {type(e).__name__}: {e}")
            try:
                loop.call_soon_threadsafe(_settle, future, result)
            except RuntimeError:  # an abandoned call that ended after its rollout's loop closed
                pass

        thread = threading.Thread(target=run, name=f"env-call {label}", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            self._stuck.append((thread, label))
            self._check()
            return CallResult(failure="timeout")

    def run(self, calls: Sequence[Callable[[], Any]], labels: Sequence[str]) -> list[CallResult]:
        """`call` for each of `calls` at once, from outside an event loop; result k is call k's."""
        async def all_calls():
            return await asyncio.gather(*(self.call(c, label) for c, label in zip(calls, labels, strict=True)))

        return list(asyncio.run(all_calls()))

    def _check(self) -> None:
        if self.stuck() > self.max_stuck:
            which = ", ".join(f"{label} x{n}" for label, n in Counter(label for _, label in self._stuck).most_common())
            raise StuckEnvironment(
                f"{len(self._stuck)} environment calls are still running past env.timeout_s={self.timeout_s:g} s "
                f"({which}), more than env.max_stuck_calls={self.max_stuck}: a call that hangs or loops cannot be "
                f"stopped, keeps its thread and slows the trainer. Fix the environment (every reset and step must "
                f"return within env.timeout_s), raise env.timeout_s if it is only slow, or raise "
                f"env.max_stuck_calls")


def _settle(future, result: CallResult) -> None:
    if not future.done():
        future.set_result(result)
