"""The RL loop with rollout.backend=vllm: pretrain_rl.py for a few steps on a dense tiny Qwen3,
fp32 server against the fp32 megatron trainer (so the engine-trainer mismatch is ~0)."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rl_steps_with_the_vllm_backend(tmp_path, vllm_python):
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "pretrain_rl.py", "--config", "examples/demo_cpu.yaml", "model.arch=qwen3",
           "rollout.backend=vllm", "rollout.dtype=fp32", "rollout.prompts_per_step=8", "train.micro_batch_size=32",
           "train.steps=2", "train.eval_every=2", "train.eval_size=32", "data.heldout_size=32", "sft.steps=0",
           "log.progress=false", f"train.run_dir={tmp_path / 'run'}", "--summary-json", str(summary_path)]
    env = dict(os.environ, OMP_NUM_THREADS="2", TORCHDYNAMO_DISABLE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), MEGATRON_RL_VLLM_PYTHON=vllm_python)
    run = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2
    assert summary["last"]["mismatch/abs_logprob_diff"] < 1e-4, summary["last"]
    assert os.path.exists(tmp_path / "run" / "vllm" / "server.log")
    assert not os.listdir(tmp_path / "run" / "vllm" / "weights")  # close() removed the exported weights
