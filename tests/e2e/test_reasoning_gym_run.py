"""examples/reasoning_gym_cpu.yaml through pretrain_rl.py, cut to a few steps: a reasoning-gym task
(the optional extra; skipped where it is not installed) trains with the byte tokenizer, SFT on the
generator's answers then RL scored by the package's own scorer, every reward scored without an
error; tools/mismatch_report.py reads the run. An unknown dataset is refused at start-up (exit 2)."""
import json
import os

import pytest

from tests.e2e.runner import ENV, HANG_GUARD_S, run_pretrain

pytest.importorskip("reasoning_gym")

CONFIG = ["--config", "examples/reasoning_gym_cpu.yaml", "model.overrides={num_layers: 1}", "sft.steps=2",
          "sft.batch_size=8", "sft.eval_size=4", "sft.eval_every=0", "train.steps=2", "rollout.prompts_per_step=4",
          "rollout.group_size=2", "train.micro_batch_size=8", "train.num_minibatches=1", "train.eval_size=8",
          "train.eval_every=0", "data.heldout_size=50", "log.tensorboard=false", "log.progress=false"]


def test_a_reasoning_gym_task_trains_and_reports(tmp_path, capsys):
    run_dir = tmp_path / "run"
    proc = run_pretrain([*CONFIG, f"train.run_dir={run_dir}"], ENV, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert len(rl) == 2
    # 2 steps x 4 prompts x 2 samples, and the held-out evaluations: every one scored by the package's scorer
    assert rl[-1]["rewards/count"] >= 16 and all(r["rewards/errors"] == 0 for r in rl)
    assert "held-out accuracy, greedy: before -> after RL" in proc.stdout

    from tools.mismatch_report import main

    assert main([str(run_dir)]) == 0
    assert "kl" in capsys.readouterr().out.lower()


def test_an_unknown_dataset_is_refused_at_start_up(tmp_path):
    proc = run_pretrain([*CONFIG, f"train.run_dir={tmp_path}", "data.tasks=['reasoning_gym:no_such_set']"], ENV,
                        timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.tasks[0]='reasoning_gym:no_such_set'" in proc.stderr + proc.stdout
    assert not os.path.exists(tmp_path / "metrics.jsonl")
