"""An asyncio event loop in a thread of its own: where a VllmEngine's requests run as coroutines.

    loop = LoopThread("vllm-requests")
    future = loop.submit(coroutine)      # from any thread: a concurrent.futures.Future
    value = loop.call(coroutine)         # ... and wait for it
    loop.close()                         # cancels what still runs, then stops the thread

Callers on another event loop await `asyncio.wrap_future(loop.submit(c))`: cancelling that await
cancels the coroutine here too.

Cost: one thread for the engine's lifetime, whatever the requests in flight.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine


class LoopThread:
    """See the module docstring."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine):
        return self.submit(coroutine).result()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, last: Coroutine | None = None) -> None:
        """Cancel the tasks still running, run `last` (e.g. closing an HTTP session), stop the loop."""
        async def finish():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if last is not None:
                await last

        if self.loop.is_closed():
            return
        try:
            self.call(finish())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
