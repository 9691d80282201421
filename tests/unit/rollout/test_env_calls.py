"""Environment calls with a deadline: values, errors and a hang (an Event the test sets once done)."""
import threading

import pytest

from megatron_rl.rollout.env_calls import CallResult, EnvCalls, StuckEnvironment


def test_values_errors_and_a_hang_each_get_their_result_and_the_hung_thread_is_a_daemon():
    release = threading.Event()

    def boom():
        raise KeyError("tool")

    def hang():
        release.wait()
        return "late"

    try:
        out = EnvCalls(timeout_s=0.5, max_stuck=1).run([lambda: 1, boom, hang, lambda: "x"], "abcd")
        stuck = [t for t in threading.enumerate() if t.name == "env-call c"]
        assert stuck and all(t.daemon for t in stuck)  # it cannot keep a finished run's process alive
    finally:
        release.set()
    assert out == [CallResult(1), CallResult(failure="error: KeyError: 'tool'"), CallResult(failure="timeout"),
                   CallResult("x")]
    assert EnvCalls(0.5, 0).run([], []) == []


def test_abandoned_calls_are_bounded_named_and_forgotten_once_they_return():
    release = threading.Event()
    calls = EnvCalls(timeout_s=0.05, max_stuck=2)
    try:
        assert calls.run([release.wait, lambda: 2], ["a.step", "b.step"]) == [CallResult(failure="timeout"), CallResult(2)]
        assert calls.stuck() == 1
        assert calls.run([release.wait], ["a.reset"]) == [CallResult(failure="timeout")]
        with pytest.raises(StuckEnvironment, match=r"^3 environment calls are still running past env.timeout_s=0.05 s "
                                                   r"\(a.step x2, a.reset x1\), more than env.max_stuck_calls=2"):
            calls.run([release.wait], ["a.step"])
    finally:
        release.set()
    for t, _ in calls._stuck:  # they return once released
        t.join()
    assert calls.stuck() == 0
    assert calls.run([lambda: 1], ["a.step"]) == [CallResult(1)]


GUARD_S = 60.0  # hang guard only: the calls below return when the test releases them


def test_at_most_max_in_flight_calls_run_and_the_others_wait_for_a_place():
    """Five calls, two places: until the test releases them, exactly two have started (a third
    could start only once one ends, and none can end before the release); then all five end, in
    their order, and never more than two ran at once."""
    import asyncio

    release, lock = threading.Event(), threading.Lock()
    state = {"running": 0, "peak": 0, "started": 0}

    def call(k):
        def run():
            with lock:
                state["running"] += 1
                state["started"] += 1
                state["peak"] = max(state["peak"], state["running"])
            assert release.wait(GUARD_S)
            with lock:
                state["running"] -= 1
            return k
        return run

    calls = EnvCalls(timeout_s=GUARD_S, max_stuck=0, max_in_flight=2)

    async def main():
        tasks = [asyncio.ensure_future(calls.call(call(k), "e.step")) for k in range(5)]
        while state["started"] < 2:  # the two placed calls' threads start
            await asyncio.sleep(0.001)
        for _ in range(20):  # every waiting call has had its turns on the loop
            await asyncio.sleep(0)
        started = state["started"]
        release.set()
        return started, await asyncio.gather(*tasks)

    try:
        started, out = asyncio.run(main())
    finally:
        release.set()
    assert started == 2 and state["peak"] == 2
    assert out == [CallResult(k) for k in range(5)]


def test_a_call_abandoned_at_its_deadline_frees_its_place():
    """One place: the hung call times out and the next call then runs (it could not while the hung
    one held the place); the hung thread stays counted as stuck, not as in flight."""
    release = threading.Event()
    calls = EnvCalls(timeout_s=0.05, max_stuck=1, max_in_flight=1)
    try:
        assert calls.run([lambda: release.wait(GUARD_S), lambda: 2], ["a.step", "b.step"]) == [
            CallResult(failure="timeout"), CallResult(2)]
        assert calls.stuck() == 1
    finally:
        release.set()
    with pytest.raises(ValueError, match="max_in_flight=0"):
        EnvCalls(1.0, 0, max_in_flight=0)
