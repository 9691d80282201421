"""Environment calls with a deadline: a failing or hanging environment ends its trajectory, never the run.

    results = call_all([lambda: env.step(text, ids) for env, ... in ...], timeout_s=10.0)
    results[k].value            # what call k returned, or None when it failed
    results[k].failure          # None, "timeout", or "error: ValueError: ..."

Every call of a batch runs in its own daemon thread (environments are plain Python on rank 0);
the batch waits at most `timeout_s` from the start for all of them. A call still running then is
abandoned: Python cannot stop a thread, so it keeps its thread until it returns and its result is
never read. Daemon threads, not a ThreadPoolExecutor, whose workers the interpreter joins at exit:
a call that never returns must not keep the finished run's process alive. Cost: one thread per
call per turn.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallResult:
    """value: the call's return value (None on failure); failure: None, "timeout", or
    "error: <exception type>: <message>"."""

    value: Any = None
    failure: str | None = None


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[CallResult]:
    """Run `calls` concurrently; result k is call k's value or why it has none."""
    results: list[CallResult | None] = [None] * len(calls)

    def run(k: int) -> None:
        try:
            results[k] = CallResult(value=calls[k]())
        except Exception as e:  # noqa: BLE001 - any failure of the environment's code, reported for its trajectory
            results[k] = CallResult(failure=f"error: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(k,), name=f"env-call-{k}", daemon=True) for k in range(len(calls))]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    # a finished thread has written its result before it ended; a running one is abandoned
    return [CallResult(failure="timeout") if t.is_alive() else (r or CallResult(failure="error: the call did not return"))
            for t, r in zip(threads, results, strict=True)]
