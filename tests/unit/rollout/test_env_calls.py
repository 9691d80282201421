"""Environment calls with a deadline: values, errors and a hang (an Event the test sets once done)."""
import threading

from megatron_rl.rollout.env_calls import CallResult, call_all


def test_values_errors_and_a_hang_each_get_their_result_and_the_hung_thread_is_a_daemon():
    release = threading.Event()

    def boom():
        raise KeyError("tool")

    def hang():
        release.wait()
        return "late"

    try:
        out = call_all([lambda: 1, boom, hang, lambda: "x"], timeout_s=0.5)
        stuck = [t for t in threading.enumerate() if t.name == "env-call-2"]
        assert stuck and all(t.daemon for t in stuck)  # it cannot keep a finished run's process alive
    finally:
        release.set()
    assert out == [CallResult(1), CallResult(failure="error: KeyError: 'tool'"), CallResult(failure="timeout"),
                   CallResult("x")]
    assert call_all([], 0.5) == []
