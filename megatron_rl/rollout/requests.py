"""Requests as coroutines: a trajectory awaits its own sample; the engine batches what is pending.

    queue = RequestQueue(engine, together=False)
    async def trajectory(...):
        async with queue.member():                  # a live trajectory (counted for together=True)
            sample = await queue.sample(Request(ids, params, stream=(k, turn)))

Dispatch. A request waits in `pending`. When no engine call runs, every pending request goes out
as one `engine.generate_requests` call (rollout/types.py `Request`; the engine groups them by
sampling settings and batches them), run in a worker thread so the event loop keeps serving the
environments meanwhile; requests that arrive while it runs wait for the next call.

    together=False ("async"): a call starts as soon as the engine is free and anything is pending,
        so a trajectory whose environment answered goes on at once, beside trajectories at other
        turns; none waits for the slowest environment. Which requests share a call depends on when
        the environments answer, so a sample's numbers can move by the engine's batch-shape
        dependence (fp32: ~1e-6; its tokens only at a near-tie): runs are reproducible up to that.
    together=True ("lockstep"): a call starts only when every live member is waiting on it, so
        each call holds one request of every running trajectory, whatever the timing: calls are
        deterministic (bit-exact resume), at the cost of waiting for the slowest environment.

Requests submitted in one pass of the event loop (the first turns of every trajectory, started
together) go out in one call, after that pass: the engine sees them as one batch.

An engine error (GenerationAborted for a weight update, a dead server) is raised in every request
of its call; the caller's task group then cancels the others (multi_turn raises it as the
lockstep path did).

Cost: O(pending requests) host memory; one worker thread, reused, for the engine call; no thread
per request (the engine's own requests are its business: vLLM's pool, rollout/vllm/generation.py).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from megatron_rl.rollout.types import Request, Sample


class RequestQueue:
    """See the module docstring. engine: anything with `generate_requests(list[Request]) ->
    list[Sample]`; together: lockstep dispatch. Lives inside one event loop (one rollout call)."""

    def __init__(self, engine, together: bool = False):
        self.engine, self.together = engine, together
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._members = 0
        self._running = False
        self._scheduled = False
        self.calls: list[int] = []  # requests per engine call, in order (benchmarks, tests)

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
        """The engine's sample for `request`, once a call that holds it returns."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._kick()
        return await future

    def _ready(self) -> bool:
        if self._running or not self._pending:
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
        if self.together:  # arrival order follows the environments' timing; the call must not
            batch.sort(key=lambda pending: pending[0].stream)
        self._running = True
        self.calls.append(len(batch))
        asyncio.get_running_loop().create_task(self._call(batch))

    async def _call(self, batch: list[tuple[Request, asyncio.Future]]) -> None:
        try:
            samples = await asyncio.to_thread(self.engine.generate_requests, [r for r, _ in batch])
        except BaseException as e:  # noqa: BLE001 - handed to every request of the call
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
        else:
            for (_, future), sample in zip(batch, samples, strict=True):
                if not future.done():
                    future.set_result(sample)
        finally:
            self._running = False
            self._kick()
