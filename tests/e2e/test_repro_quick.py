"""examples/repro/*.py --quick: each reproduction script runs end to end (a few steps per arm, one
seed) and writes its table, its plot and every arm's TensorBoard logs. This keeps the scripts from
rotting; the claims themselves are in their full runs (examples/repro/README.md)."""
import os
import subprocess
import sys

import pytest

from tests.cores import share

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = {"minirl": 11, "mu_grpo": 5, "p3o": 5, "tim": 12}  # script -> arms it runs


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """One quick warm start for the four scripts: each finds it cached (common.warm_start)."""
    return tmp_path_factory.mktemp("sft")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_repro_script_quick(script, tmp_path, sft_dir):
    out = tmp_path / script
    # one arm at a time per core of this test's share, each on one thread
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, f"examples/repro/{script}.py", "--quick", "--out", str(out),
                           "--sft-dir", str(sft_dir), "--jobs", str(min(2, share()))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "results.md").read_text()
    assert report.startswith("# ") and "| arm |" in report
    assert (out / "curves.png").stat().st_size > 10_000
    arms = sorted(p.name for p in (out / "runs").iterdir())
    assert len(arms) == SCRIPTS[script], arms
    for arm in arms:
        assert any((out / "runs" / arm / "seed0" / "tensorboard").iterdir()), arm
    if script == "tim":
        assert (out / "buckets.png").stat().st_size > 10_000
