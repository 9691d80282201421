"""The notice a stop signal prints says what the stop will do: during the SFT warm start, which saves
nothing part-way, it said "saving a checkpoint"."""
import os
import signal
from types import SimpleNamespace

import pytest

from megatron_rl.trainer import sft
from megatron_rl.trainer.stop import StopSignals


@pytest.fixture
def stop():
    s = StopSignals.install()
    yield s
    s.uninstall()


def test_the_notice_says_what_the_phase_does(stop, capfd):
    with stop.while_(sft.SFT_STOP):
        os.kill(os.getpid(), signal.SIGTERM)
    err = capfd.readouterr().err
    assert "SIGTERM received: stopping after the current SFT step, without saving" in err
    assert "saving a checkpoint" not in err
    assert stop.then == StopSignals.SAVES   # RL steps after SFT save again


def test_rl_steps_still_say_they_save(stop, capfd):
    os.kill(os.getpid(), signal.SIGTERM)
    assert "SIGTERM received: stopping after the current step and saving a checkpoint" in capfd.readouterr().err


def test_run_sft_announces_its_stop(monkeypatch):
    seen = []
    monkeypatch.setattr(sft, "_sft_steps", lambda ctx, examples, progress: seen.append(ctx.stop.then) or {})
    ctx = SimpleNamespace(stop=StopSignals())
    sft.run_sft(ctx, [])
    assert seen == [sft.SFT_STOP] and ctx.stop.then == StopSignals.SAVES
