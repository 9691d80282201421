"""The RL loop with rollout.backend=vllm: pretrain_rl.py for a few steps on a dense tiny Qwen3 under
the async schedule with a server it launches (the staged schedule runs in test_pool.py, against a
pool of two servers as URLs: one launch fewer), fp32 server against the fp32 megatron trainer (so
the engine-trainer mismatch of the tokens from the current weights is ~0); and a trainer stopped by
SIGTERM mid-run leaves no process of its vLLM server behind."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.cores import share
from tests.vllm.conftest import ONE_PROCESS_ENGINE
from tests.vllm.test_launcher import group

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


def _env(vllm_python):
    # MASTER_PORT=0: the one rank's store listens on a port the kernel picks when it binds (no port
    # chosen here and bound later, which a test running beside this one could take in between)
    return dict(os.environ, OMP_NUM_THREADS=str(min(2, share())), TORCHDYNAMO_DISABLE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT="0", MEGATRON_RL_VLLM_PYTHON=vllm_python)


def check_schedule(run_dir, staleness, generate_calls, evaluates: bool) -> list:
    """The off-policy schedule's record in a run's metrics.jsonl: the staleness of each step's
    batch, the generate() calls, the tokens split by staleness, and the tokens generated from the
    weights being trained (staleness 0) matching the fp32 trainer. Returns the rl rows."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if json.loads(line).get("phase") == "rl"]
    assert [r["schedule/staleness_max"] for r in rows] == staleness
    assert rows[-1]["schedule/generate_calls"] == generate_calls
    assert all(r["mismatch/staleness_0/tokens"] + r["mismatch/staleness_1/tokens"] == r["mismatch/tokens"]
               for r in rows)
    fresh = [r for r in rows if r["mismatch/staleness_0/tokens"]]
    assert fresh and all(r["mismatch/staleness_0/abs_logprob_diff"] < 1e-4 for r in fresh), fresh
    if evaluates:
        assert "eval/heldout_accuracy" in rows[-1]
    return rows


# staged generation (a stage's batches in one request burst, then held-out evaluations) runs in
# test_pool.py, against that module's two launched servers as a pool of URLs: [0, 1, 0, 1], 2 calls
ASYNC = ["train.schedule=async", "train.max_staleness=1", "train.eval_size=0"]


def test_rl_steps_with_the_vllm_backend_async(tmp_path, vllm_python):
    """pretrain_rl.py against a server it launches under the async schedule (the client in a
    background thread while the trainer updates). The tokens generated from the weights being
    trained (staleness 0) match the fp32 trainer."""
    summary_path = tmp_path / "summary.json"
    config = tmp_path / "vllm_cpu.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run").replace("steps: 2,", "steps: 4,"))
    cmd = [sys.executable, "pretrain_rl.py", "--config", str(config), "--summary-json", str(summary_path), *ASYNC]
    env = dict(_env(vllm_python), **ONE_PROCESS_ENGINE)  # its server inherits the trainer's environment
    run = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(summary_path.read_text())["steps"] == 4
    assert os.path.exists(tmp_path / "run" / "vllm" / "server.log")
    assert not os.path.exists(tmp_path / "run" / "weights")  # weights went in memory (the default): no file
    check_schedule(tmp_path / "run", [0, 1, 1, 1], 4, evaluates=False)


def test_sigterm_mid_run_leaves_no_server_process(tmp_path, vllm_python):
    """SIGTERM to pretrain_rl.py once its vLLM server is up (the event: the server's log says
    so): the trainer ends and every process of the server's group is gone (the production layout:
    API server, engine core and its worker process). (Whether it stops at
    once or after finishing and saving its step is the trainer's business: either is fine here.)"""
    run_dir = tmp_path / "run"
    config = tmp_path / "vllm_cpu.yaml"
    config.write_text(CONFIG.format(run_dir=run_dir).replace("steps: 2,", "steps: 1000,"))
    log = run_dir / "vllm" / "server.log"
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err:  # a file, not a pipe nobody reads while the trainer runs
        trainer = subprocess.Popen([sys.executable, "pretrain_rl.py", "--config", str(config)], cwd=ROOT,
                                   env=_env(vllm_python), stdout=subprocess.DEVNULL, stderr=err)
    pid = None
    try:
        deadline = time.monotonic() + 900  # a hang guard: the server's start is ~1 min here
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            if "Application startup complete" in text:
                break
            assert trainer.poll() is None, f"the trainer ended first: {errors.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the vLLM server did not come up"
            time.sleep(0.2)
        pid = int(re.search(r"APIServer pid=(\d+)", text).group(1))
        assert pid in group(pid)
        trainer.send_signal(signal.SIGTERM)
        code = trainer.wait(timeout=900)
        assert code != 0, "a SIGTERM-stopped run must not look like a finished one"
        deadline = time.monotonic() + 120
        while group(pid):
            assert time.monotonic() < deadline, f"server processes left after the trainer ended: {group(pid)}"
            time.sleep(0.1)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for p in group(pid) if pid else []:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
