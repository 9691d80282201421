"""Context parallelism in the real RL loop on GPUs: CP=2 against CP=1 (GPU lane, never run on CPU).

Needs 2 CUDA devices and Transformer Engine (megatron-core's CP attention). Both runs start from
the same random HF checkpoint, train the same rows (DP=1 in both) for one step in bf16 (TE's CP
attention needs fused/flash attention), and must report the same loss, gradient norm and
mismatch within bf16 tolerance. Untested in this repository's CI (CPU only); see the README.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

OVERRIDES = ["model.size=tiny", "model.dtype=bf16", "rollout.dtype=bf16",
             "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_tokens=8", "train.steps=1",
             "train.micro_batch_size=2", "train.num_minibatches=1", "train.eval_every=0", "sft.steps=0",
             "log.tensorboard=false", "log.progress=false"]


def _have_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _run(tmp_path, name, nproc, extra):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "pretrain_rl.py", "--config", "examples/demo_cpu.yaml", "--summary-json", str(out),
           f"train.run_dir={tmp_path / name}", *OVERRIDES, *extra]
    subprocess.run(cmd, check=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "4"})
    return json.loads(out.read_text())["last"]


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not _have_te(), reason="needs 2 GPUs and Transformer Engine")
def test_cp2_step_matches_cp1(tmp_path):
    from megatron_rl.model.parity import random_hf_model
    from megatron_rl.model.presets import preset_arch

    hf = tmp_path / "hf"
    random_hf_model(preset_arch("qwen3_moe", "tiny"), seed=0, std=0.2).save_pretrained(hf)
    one = _run(tmp_path, "cp1", 1, [f"model.hf_dir={hf}"])
    two = _run(tmp_path, "cp2", 2, [f"model.hf_dir={hf}", "--context-parallel-size", "2"])
    for key in ("loss/policy", "optim/grad_norm", "mismatch/kl_k3", "rollout/reward_mean"):
        assert two[key] == pytest.approx(one[key], rel=3e-2, abs=1e-4), key
