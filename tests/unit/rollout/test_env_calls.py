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
