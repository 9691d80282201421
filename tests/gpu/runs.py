"""Short runs of pretrain_rl.py for the GPU tests: the shrunk demo, their overrides, and how to launch them.

The demo (examples/demo_cpu.yaml: a tiny Qwen3-MoE learning reversed addition, embedded engine)
shrunk to a few steps and small batches. `launch` runs pretrain_rl.py under torchrun with one
process (NCCL on the GPU); `launch_many` runs several in one process through tests.gpu.driver
(`pretrain_rl.main` once per run) to save the start-up time of each.

Both pass --debug (pretrain_rl.py then prints an error's traceback on stderr, not only one line)
and a failure's message carries stderr's tail and run_dir/error-rank0.log: the run directories
live under pytest's tmp dir on the machine that ran them, and only the test output comes back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.golden import REWARD

ROOT = Path(__file__).resolve().parents[2]
DEMO = "examples/demo_cpu.yaml"
QUIET = ["log.tensorboard=false", "log.progress=false", "log.figure_every=0"]
# a few RL steps on 8 prompts x 4 samples (2 mini-batches of 16 rows, micro-batches of 8), a short
# SFT warm start, one held-out evaluation on 32 problems
DEMO_SHORT = ["train.steps=3", "rollout.prompts_per_step=8", "rollout.group_size=4", "train.micro_batch_size=8",
              "train.num_minibatches=2", "train.eval_every=3", "train.eval_size=32", "data.heldout_size=32",
              "sft.steps=4", "sft.batch_size=16", "sft.eval_every=2", *QUIET]
# one RL step, no SFT, no evaluation
ONE_STEP = ["train.steps=1", "rollout.prompts_per_step=8", "rollout.group_size=4", "train.micro_batch_size=8",
            "train.num_minibatches=2", "train.eval_size=0", "data.heldout_size=32", "sft.steps=0", *QUIET]
# the dense test reward (fraction of digits in the response, tests/golden.py): mixed rewards in every
# group from the first step, so every recipe's update is non-zero without an SFT warm start (exact
# match on the untrained demo model rewards nothing). Registered in-process: launch_many only.
DENSE_REWARD = [f"data.reward={REWARD}"]
# metrics every RL step reports, all of which must be finite
STEP_KEYS = ("loss/policy", "rollout/reward_mean", "mismatch/kl_k3")


def _env() -> dict:
    """The runs' environment, with torch.compile as pretrain_rl.py has it: on beside a GPU (the CPU
    lane's off switch dropped), off without one (tests/e2e/test_gpu_lane_on_cpu.py runs these runs
    on the CPU, where megatron's fusions would take minutes to compile)."""
    import torch

    cuda = torch.cuda.is_available()
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    if not cuda:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return {**env, "OMP_NUM_THREADS": "4" if cuda else "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _read(run_dir: Path, summary: Path) -> tuple[dict, list[dict]]:
    """(summary, the RL steps' rows of metrics.jsonl): the SFT warm start logs there too, as
    rows with phase "sft"."""
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return json.loads(summary.read_text()), [row for row in rows if row.get("phase") == "rl"]


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def error_log(run_dir: Path, shown: str = "") -> str:
    """run_dir/error-rank0.log (pretrain_rl.py's traceback of a failed run), unless `shown` has it."""
    log = run_dir / "error-rank0.log"
    if not log.exists():
        return ""
    trace = log.read_text(errors="replace")
    return "" if trace.strip() in shown else f"\n--- {log}:\n{trace}"


def launch(tmp_path: Path, name: str, overrides: list[str], timeout: int = 900) -> tuple[dict, list[dict]]:
    """`torchrun --nproc-per-node=1 pretrain_rl.py --config DEMO --debug ...`; (summary, RL steps' rows)."""
    run_dir, summary = tmp_path / name, tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "pretrain_rl.py",
           "--config", DEMO, "--debug", "--summary-json", str(summary), f"train.run_dir={run_dir}", *overrides]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        out, err = _text(e.stdout), _text(e.stderr)
        raise AssertionError(f"{name}: still running after {timeout} s\n--- stdout:\n{out[-3000:]}\n"
                             f"--- stderr:\n{err[-6000:]}") from None
    assert proc.returncode == 0, (f"{name}: exit {proc.returncode}\n--- stdout:\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr:\n{proc.stderr[-6000:]}{error_log(run_dir, proc.stderr[-6000:])}")
    return _read(run_dir, summary)


def launch_many(tmp_path: Path, runs: dict[str, list[str]], timeout: int = 1800) -> dict[str, tuple | str]:
    """Several runs in one process (tests.gpu.driver): name -> (summary, rows), or the error text."""
    spec = {name: ["--config", DEMO, "--debug", "--summary-json", str(tmp_path / f"{name}.json"),
                   f"train.run_dir={tmp_path / name}", *overrides] for name, overrides in runs.items()}
    spec_file, result_file = tmp_path / "runs.json", tmp_path / "results.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "tests.gpu.driver", str(spec_file), str(result_file)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"driver still running after {timeout} s\n--- stdout:\n{_text(e.stdout)[-3000:]}\n"
                             f"--- stderr:\n{_text(e.stderr)[-6000:]}") from None
    assert result_file.exists(), (f"driver died: exit {proc.returncode}\n--- stdout:\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr:\n{proc.stderr[-6000:]}")
    errors = json.loads(result_file.read_text())
    return {name: errors[name] or _read(tmp_path / name, tmp_path / f"{name}.json") for name in runs}
