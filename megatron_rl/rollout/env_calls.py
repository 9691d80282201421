"""Environment calls with a deadline: a failing or hanging environment ends its trajectory, never the run.

    results = call_all([lambda: env.step(text, ids) for env, ... in ...], timeout_s=10.0)
    results[k].value            # what call k returned, or None when it failed
    results[k].failure          # None, "timeout", or "error: ValueError: ..."

Every call of a batch runs in its own worker thread (environments are plain Python on rank 0);
the batch waits at most `timeout_s` from submission for all of them. A call still running then is
abandoned: Python cannot stop a thread, so it keeps its thread until it returns (the pool is shut
down without waiting), and its result is never read. Cost: one thread per call per turn.
"""
from __future__ import annotations

import concurrent.futures as cf
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
    if not calls:
        return []
    pool = cf.ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="env")
    try:
        futures = [pool.submit(call) for call in calls]
        cf.wait(futures, timeout=timeout_s)
        return [_result(f) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _result(future: cf.Future) -> CallResult:
    if not future.done():
        return CallResult(failure="timeout")
    error = future.exception()
    if error is not None:
        return CallResult(failure=f"error: {type(error).__name__}: {error}")
    return CallResult(value=future.result())
