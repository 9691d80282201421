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
CONFIG = """
model: {{arch: qwen3, size: tiny, overrides: {{head_dim: 32}}, dtype: fp32}}
rollout: {{backend: vllm, dtype: fp32, prompts_per_step: 8, group_size: 4, temperature: 1.0, max_tokens: 8}}
data: {{tasks: [addition], heldout_size: 32}}
loss: {{recipe: grpo}}
train: {{steps: 2, num_minibatches: 2, micro_batch_size: 16, eval_every: 2, eval_size: 32, run_dir: {run_dir},
        resume: false}}
sft: {{steps: 0}}
log: {{progress: false}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rl_steps_with_the_vllm_backend(tmp_path, vllm_python):
    summary_path = tmp_path / "summary.json"
    config = tmp_path / "vllm_cpu.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run"))
    cmd = [sys.executable, "pretrain_rl.py", "--config", str(config), "--summary-json", str(summary_path)]
    env = dict(os.environ, OMP_NUM_THREADS="2", TORCHDYNAMO_DISABLE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), MEGATRON_RL_VLLM_PYTHON=vllm_python)
    run = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2
    assert summary["last"]["mismatch/abs_logprob_diff"] < 1e-4, summary["last"]
    assert os.path.exists(tmp_path / "run" / "vllm" / "server.log")
    assert not os.listdir(tmp_path / "run" / "vllm" / "weights")  # close() removed the exported weights
