"""Drill: an infinite number in the config is a start-up error through `pretrain_rl.py`.

`optim.lr=inf` was accepted: the first update wrote NaN into every weight, the engine failed on
them, and the run saved a checkpoint of NaN tensors, blaming the engine. Now the config refuses it
(exit 2, naming the field) before a model exists; the run-time checks that keep non-finite
weights out of checkpoints are in tests/distributed/test_nonfinite_updates.py.
"""
import pytest

from tests.e2e.runner import ENV, HANG_GUARD_S, run_pretrain


@pytest.mark.parametrize("override,field", [("optim.lr=inf", "optim.lr"), ("model.init_std=.inf", "model.init_std"),
                                            ("sft.lr=-.inf", "sft.lr")])
def test_an_infinite_number_is_refused_at_start_up(tmp_path, override, field):
    proc = run_pretrain(["--config", "examples/demo_cpu.yaml", f"train.run_dir={tmp_path / 'R'}", override],
                        ENV, HANG_GUARD_S)   # tests/e2e/runner.py: as `python pretrain_rl.py` runs it
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"config error: {field}=" in proc.stderr and "must be a" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "R").exists()  # nothing started
