"""StopSignals: the first SIGTERM or Ctrl-C asks for a stop after the step; a duplicate SIGTERM (a
launcher forwarding it) changes nothing; a second Ctrl-C stops at once."""
import os
import signal

import pytest

from megatron_rl.trainer.stop import StopSignals


@pytest.fixture
def stop():
    s = StopSignals.install()
    yield s
    s.uninstall()


def test_repeated_sigterm_is_one_request(stop):
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGTERM
    assert stop.agreed()  # one process: no collective


def test_second_ctrl_c_stops_at_once(stop):
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.signum == signal.SIGINT
    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
        os.kill(os.getpid(), signal.SIGINT)


def test_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    s = StopSignals.install()
    assert signal.getsignal(signal.SIGTERM) != before
    s.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
