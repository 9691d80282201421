"""examples/multiturn_cpu.yaml runs through pretrain_rl.py, shortened: 2 SFT steps on the calculator's
demonstrations, 2 RL steps of multi-turn rollouts, the env/* statistics (per-turn rewards included) and the render
check in metrics.jsonl."""
import json

from tests.e2e.runner import ENV, HANG_GUARD_S, run_pretrain


def test_the_multiturn_example_runs(tmp_path):
    proc = run_pretrain(["--config", "examples/multiturn_cpu.yaml",
                         f"train.run_dir={tmp_path}", "train.steps=2", "train.eval_every=2", "train.eval_size=8",
                         "rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=16",
                         "train.num_minibatches=1", "sft.steps=2", "sft.batch_size=16", "data.heldout_size=100",
                         "log.progress=false"], ENV, HANG_GUARD_S)   # tests/e2e/runner.py
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert len(rl) == 2 and len([r for r in rows if "sft/nll" in r]) == 2
    for r in rl:
        assert r["env/failures"] == 0 and 1 <= r["env/turns"] <= 3
        assert 0 <= r["env/render_unencodable"] <= r["env/render_drift"] <= 16  # 4 prompts x 4 samples
        assert r["mismatch/tokens"] > 0
        assert r["env/turn/0/turns"] == 16 and 0 <= r["env/turn/0/reward"] <= 1  # every trajectory's first turn
    assert "eval/heldout_accuracy" in rl[-1]
