"""examples/repro/*.py --quick: each reproduction script checks every arm's configuration (the
product's config loading and checks), runs its QUICK arms end to end (a few steps, one seed) and
writes its table, its plot and those arms' TensorBoard logs. This keeps the scripts from rotting;
the claims themselves are in their full runs (examples/repro/README.md). Every loss recipe the arms
name also runs through the real RL step in tests/e2e/test_golden.py. The five scripts run one after
another in one interpreter (tests/e2e/repro_driver.py), each as `__main__`; their arms'
pretrain_rl.py runs are processes of their own, as always."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.cores import share

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# script -> (arms whose config --quick checks, arms it runs)
SCRIPTS = {"collapse": (8, 2), "minirl": (11, 1), "mu_grpo": (5, 1), "p3o": (5, 1), "tim": (12, 2)}


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> tuple[dict[str, dict], object]:
    """Every script's --quick in one interpreter (tests.e2e.repro_driver; each script as `__main__`, the
    runs it starts processes of their own), one warm start for all (each after the first finds it
    cached, common.warm_start): (script -> its exit code and output, the output root)."""
    root = tmp_path_factory.mktemp("repro")
    # one arm at a time per core of this module's share, each on one thread
    spec = {script: ["--quick", "--out", str(root / script), "--sft-dir", str(root / "sft"),
                     "--jobs", str(min(2, share()))] for script in sorted(SCRIPTS)}
    (root / "runs.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, "-m", "tests.e2e.repro_driver", str(root / "runs.json"),
                           str(root / "results.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600, check=False)
    assert (root / "results.json").exists(), f"driver died: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return json.loads((root / "results.json").read_text()), root


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_repro_script_quick(script, quick_runs):
    results, root = quick_runs
    out, proc = root / script, results[script]
    assert proc["code"] == 0, proc["stdout"][-3000:] + proc["stderr"][-3000:]
    quick = re.findall(r"^--quick: checked the config of (\d+) arms; running (\d+): (.*)$", proc["stdout"], re.MULTILINE)
    checked, ran = SCRIPTS[script]
    assert sum(int(n) for n, _, _ in quick) == checked, quick
    names = [a for _, k, listed in quick for a in listed.split(", ")]
    assert len(names) == sum(int(k) for _, k, _ in quick) == ran, quick
    report = (out / "results.md").read_text()
    assert report.startswith("# ") and "| arm |" in report
    assert (out / "curves.png").stat().st_size > 10_000
    arms = sorted(p.name for p in (out / "runs").iterdir())
    assert arms == sorted(a.replace(" ", "_").replace("/", "-") for a in names), (arms, names)
    for arm in arms:
        assert any((out / "runs" / arm / "seed0" / "tensorboard").iterdir()), arm
    if script in ("tim", "collapse"):
        assert (out / "buckets.png").stat().st_size > 10_000
    if script == "collapse":  # the verdict column and the mismatch pattern of the FP8 arm
        assert "| control |" in report and "Mismatch pattern of the uncorrected FP8 engine" in report


def test_quick_check_names_a_broken_arm(tmp_path, monkeypatch):
    """What --quick does for the arms it does not run: a broken override stops the script, naming
    the arm, before any run (in this process, no pretrain_rl.py started)."""
    spec = importlib.util.spec_from_file_location("repro_common", os.path.join(ROOT, "examples", "repro", "common.py"))
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, common)  # dataclasses look their module up there
    spec.loader.exec_module(common)
    scale = common.Scale(steps=2, seeds=(0,), eval_size=16, eval_every=0, quick=True)
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    common.check_arms(str(tmp_path), ckpt, {"fine": ["loss.recipe=minirl_r3", "train.num_minibatches=4"]}, scale)
    broken = {"fine": ["loss.recipe=grpo"], "renamed": ["loss.recipe=grpo", "loss.no_such_field=1"]}
    with pytest.raises(SystemExit, match="arm 'renamed': config error: .*no_such_field"):
        common.check_arms(str(tmp_path), ckpt, broken, scale)
    with pytest.raises(SystemExit, match="arm 'gone': config error: .*train.init_checkpoint"):
        common.check_arms(str(tmp_path), str(tmp_path / "missing"), {"gone": []}, scale)
