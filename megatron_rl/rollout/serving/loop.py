"""An asyncio event loop in a thread of its own: where an engine's requests run as coroutines.

    loop = LoopThread("serving-requests")
    future = loop.submit(coroutine)      # from any thread: a concurrent.futures.Future
    value = loop.call(coroutine)         # ... and wait for it
    loop.close()                         # cancels what still runs, then stops the thread

    requests = RequestLoop("serving-requests")     # an engine's: the loop (started on first use) and its HTTP session
    answer = requests.call(requests.json(url, body, timeout=..., api_key=...))   # from any thread but the loop's
    requests.close()

Callers on another event loop await `asyncio.wrap_future(loop.submit(c))`: cancelling that await
cancels the coroutine here too.

Cost: one thread for the engine's lifetime, whatever the requests in flight; one HTTP session
(its idle connections, one per request in flight at most).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine

from megatron_rl.rollout.serving import ahttp
from megatron_rl.rollout.serving.errors import ServingError


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


class RequestLoop:
    """An engine's request loop: a LoopThread started on first use and the HTTP session its
    coroutines share (made on the loop). Generation, warm-up, control, version-label and probe
    requests all run here (generation.py, fleet.py, updates.py); a thread waits for its own with
    `call`. Closed once: a later call raises ServingError."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._thread: LoopThread | None = None
        self._session = None
        self.closed = False

    def started(self) -> LoopThread:
        with self._lock:
            if self.closed:
                raise ServingError(f"the engine's request loop ({self.name}) is closed")
            if self._thread is None:
                self._thread = LoopThread(self.name)
            return self._thread

    @property
    def running(self) -> LoopThread | None:
        """The loop's thread once started (None before, and after close)."""
        return self._thread

    def call(self, coroutine: Coroutine):
        """Run `coroutine` on the loop and wait for it (never from the loop's own thread)."""
        return self.started().call(coroutine)

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        return self.started().submit(coroutine)

    def http(self):
        """The loop's HTTP session (made on first use; on the loop)."""
        if self._session is None:
            self._session = ahttp.session()
        return self._session

    async def json(self, url: str, body: dict | None = None, **kwargs):
        """ahttp.request_json over the loop's session (awaited on the loop)."""
        return await ahttp.request_json(self.http(), url, body, **kwargs)

    def close(self) -> None:
        """Cancel what still runs, close the session, stop the thread."""
        with self._lock:
            loop, self._thread, self.closed = self._thread, None, True
        if loop is not None:
            session = self._session
            loop.close(session.close() if session is not None else None)
