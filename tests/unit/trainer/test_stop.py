"""StopSignals: the first SIGTERM or Ctrl-C asks for a stop after the step; a Ctrl-C after any
first signal stops at once; a SIGTERM after any first signal (a launcher repeating or forwarding
it) changes nothing. Real signals to this process: the handler runs before os.kill returns."""
import os
import signal

import pytest

from megatron_rl.trainer.stop import StopSignals


@pytest.fixture
def stop():
    s = StopSignals.install()
    yield s
    s.uninstall()


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT], ids=["after-sigterm", "after-ctrl-c"])
def test_a_later_sigterm_changes_nothing(stop, first, capfd):
    os.kill(os.getpid(), first)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == first
    assert stop.agreed()  # one process: no collective
    assert "SIGTERM received: already stopping" in capfd.readouterr().err


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT], ids=["after-sigterm", "after-ctrl-c"])
def test_a_later_ctrl_c_stops_at_once(stop, first):
    os.kill(os.getpid(), first)
    assert stop.signum == first
    with pytest.raises(KeyboardInterrupt, match=f"Ctrl-C after {signal.Signals(first).name}: stopping now"):
        os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_after_repeated_sigterms_still_stops_at_once(stop):
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_after_another_rank_was_signalled_stops_at_once(stop):
    """A rank that got no signal learns of the stop from agreed(); its own Ctrl-C then stops it."""
    stop.signum = signal.SIGTERM  # what agreed() sets from the all-reduce
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    s = StopSignals.install()
    assert signal.getsignal(signal.SIGTERM) != before
    s.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
