"""Requests as coroutines: a trajectory awaits its own sample; the engine batches what is pending.

    async with RequestQueue(engine, together=False) as queue:
        async def trajectory(...):
            async with queue.member():              # a live trajectory (counted for together=True)
                sample = await queue.sample(Request(ids, params, stream=(k, turn)))

Requests made in one pass of the event loop (the first turns of every trajectory, started
together) are handed to the engine together, after that pass: the engine sees them as one batch.

    together=False ("async"), an engine that serves (engine.py `Serves`: the embedded engine): the
        requests go to the engine's inbox at once and join its running batch at the next decode
        step (continuous batching, rollout/decoding.py); each sample comes back as soon as its
        sequence ends. A trajectory whose environment answered goes on at once, beside
        trajectories at other turns: none waits for the slowest environment or the longest answer.
    together=False, an engine whose requests are coroutines (engine.py `SamplesEach`: the vLLM
        engine): each request is awaited on its own as it comes (`engine.sample`, one HTTP request
        on the engine's loop, rollout/serving/generation.py); its sample comes back as soon as its
        answer does, while the others run on.
    together=False, any other engine: whenever no engine call runs, every pending request goes out
        as one `engine.generate_requests` call in a worker thread (the event loop keeps serving the
        environments meanwhile).
        Either way, which requests share a batch depends on when the environments answer, so a
        sample's numbers can move by the engine's batch-shape noise (fp32: ~1e-6; its tokens only
        at a near-tie): runs are reproducible up to that.
    together=True ("lockstep"): one `generate_requests` call once every live member waits on it,
        its requests in stream order, so each call holds one request of every running trajectory,
        whatever the timing: deterministic calls (bit-exact resume), each waiting for the slowest
        environment.

An engine error (GenerationAborted for a weight update, a dead server) is raised in every request
it leaves unfinished; the caller's task group then cancels the others (multi_turn raises it).

Cost: O(pending requests) host memory; one worker thread for the engine (a call, or the serving
loop for the whole rollout), none for a `SamplesEach` engine (its requests run on its own loop:
one thread for the engine, whatever the requests in flight); no thread per request.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Self

from megatron_rl.rollout.decoding import Inbox
from megatron_rl.rollout.engine import SamplesEach, Serves
from megatron_rl.rollout.types import Request, Sample


class RequestQueue:
    """See the module docstring. engine: has `generate_requests(list[Request]) -> list[Sample]`, and
    may serve (engine.py `Serves`) or take each request as a coroutine (`SamplesEach`); together: lockstep dispatch. Lives inside one event loop (one
    rollout call): `async with` it, so a serving engine's loop ends with the block."""

    def __init__(self, engine, together: bool = False):
        self.engine, self.together = engine, together
        self.streaming = not together and isinstance(engine, Serves)
        self.each = not together and not self.streaming and isinstance(engine, SamplesEach)
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._members = 0
        self._running = False
        self._scheduled = False
        self._inbox = Inbox() if self.streaming else None
        self._server: asyncio.Task | None = None
        self.calls: list[int] = []  # requests per engine call (or per hand-over to a serving engine), in order

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind, error, trace) -> None:
        if self._server is not None:
            self._inbox.close()
            try:
                await self._server
            except BaseException:
                if error is None:
                    raise

    @contextlib.asynccontextmanager
    async def member(self) -> AsyncIterator[None]:
        """A live trajectory for the span of the block (together=True waits for all of them)."""
        self._members += 1
        try:
            yield
        finally:
            self._members -= 1
            self._kick()  # one fewer to wait for

    async def sample(self, request: Request) -> Sample:
        """The engine's sample for `request`."""
        if self.each:
            self.calls.append(1)
            return await self.engine.sample(request)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._kick()
        return await future

    def _ready(self) -> bool:
        if not self._pending or (self._running and not self.streaming):
            return False
        return not self.together or len(self._pending) >= self._members

    def _kick(self) -> None:
        """Dispatch after the current pass of the loop (requests made in it go out together)."""
        if not self._scheduled and self._ready():
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        if not self._ready():
            return
        batch, self._pending = self._pending, []
        self.calls.append(len(batch))
        loop = asyncio.get_running_loop()
        if self.streaming:
            self._inbox.put([(r, functools.partial(_deliver, loop, f)) for r, f in batch])
            if self._server is None:
                self._server = loop.create_task(asyncio.to_thread(self.engine.serve, self._inbox))
            return
        if self.together:  # arrival order follows the environments' timing; the call must not
            batch.sort(key=lambda pending: pending[0].stream)
        self._running = True
        loop.create_task(self._call(batch))

    async def _call(self, batch: list[tuple[Request, asyncio.Future]]) -> None:
        try:
            samples = await asyncio.to_thread(self.engine.generate_requests, [r for r, _ in batch])
        except BaseException as e:  # noqa: BLE001 - handed to every request of the call
            for _, future in batch:
                _settle(future, e)
        else:
            for (_, future), sample in zip(batch, samples, strict=True):
                _settle(future, sample)
        finally:
            self._running = False
            self._kick()


def _settle(future: asyncio.Future, outcome) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future, outcome) -> None:
    """From the serving engine's thread: settle `future` on its loop (a loop already closed: the
    rollout ended, nobody waits)."""
    try:
        loop.call_soon_threadsafe(_settle, future, outcome)
    except RuntimeError:
        pass
