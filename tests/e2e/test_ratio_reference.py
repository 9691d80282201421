"""loss.ratio_reference: the surrogate's ratio r is taken against π_old (the trainer's recomputation
at the start of the step) or against μ (the behaviour policy). On a stale batch (staged schedule,
one stage of two steps, fp32 engine so that μ differs from π_old only by the staleness) r ≡ 1 on a
step's only mini-batch with "old", while with "rollout" r carries the one version of staleness."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a 25-step SFT on sorting (about 35% accuracy) so that groups have mixed rewards and step 1 updates
BASE = ["--config", "examples/demo_cpu.yaml", "data.tasks=[sorting]", "sft.steps=25", "sft.eval_every=0",
        "sft.target_accuracy=null", "rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.dtype=fp32",
        "train.micro_batch_size=32", "train.num_minibatches=1", "train.eval_size=0", "train.steps=2",
        "train.schedule=staged", "train.stages=1", "optim.lr=1.0e-3", "log.tensorboard=false",
        "log.progress=false", "log.figure_every=0"]


def _r_ess(tmp_path, reference: str) -> list[float]:
    run_dir = tmp_path / reference
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, "pretrain_rl.py", *BASE, f"train.run_dir={run_dir}",
                           f"loss.ratio_reference={reference}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["mismatch/r/ess"] for r in rows if r.get("phase") == "rl"]


def test_ratio_against_the_behaviour_policy_sees_the_staleness(tmp_path):
    old, rollout = _r_ess(tmp_path, "old"), _r_ess(tmp_path, "rollout")
    assert len(old) == len(rollout) == 2
    assert old[0] == pytest.approx(1.0, abs=1e-6) and old[1] == pytest.approx(1.0, abs=1e-6)
    assert rollout[0] == pytest.approx(1.0, abs=1e-6)  # step 1: fresh data, fp32 engine: μ = π_old
    assert rollout[1] < 1.0 - 1e-4  # step 2: one version stale
