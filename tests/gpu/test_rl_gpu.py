"""The RL loop on one GPU (NCCL) through pretrain_rl.py: the demo in fp32, bf16 and fp16, every loss
recipe, router replay R2 and R3, SFT, and resume (GPU lane: skipped without CUDA).

Each test asserts that the runs complete and report finite losses and metrics; the resume test
that a resumed run continues like the uninterrupted one. tools/gpu_check.py runs them on a GPU
machine; CI runs the same tests on the CPU (tests/e2e/test_gpu_lane_on_cpu.py), which checks the
tests themselves, not the GPU.
"""
import math

import pytest

from megatron_rl.losses import RECIPES
from tests.gpu.runs import DEMO_SHORT, DENSE_REWARD, ONE_STEP, STEP_KEYS, launch, launch_many

pytestmark = pytest.mark.gpu


def _finite(metrics: dict, keys=STEP_KEYS) -> None:
    for k in keys:
        assert k in metrics, (k, sorted(metrics))
        assert math.isfinite(metrics[k]), (k, metrics[k])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_demo_short(tmp_path, dtype):
    summary, steps = launch(tmp_path, f"demo_{dtype}", DEMO_SHORT + [f"model.dtype={dtype}"])
    assert summary["steps"] == 3 and len(steps) == 3
    assert summary["sft"]["steps"] >= 1 and math.isfinite(summary["sft"]["heldout_accuracy"])
    for row in steps:
        _finite(row)
        # fp16: the dynamic loss scaler may skip a step that overflowed (then no grad norm)
        assert math.isfinite(row["optim/grad_norm"]) or (dtype == "fp16" and row["optim/skipped_steps"] > 0), row
    if dtype != "fp16":
        assert all(row["optim/skipped_steps"] == 0 for row in steps)
    assert summary["after_rl_accuracy"] is not None and math.isfinite(summary["after_rl_accuracy"])


def test_every_recipe_one_step(tmp_path):
    names = sorted(RECIPES.names())
    out = launch_many(tmp_path, {name: ONE_STEP + DENSE_REWARD + [f"loss.recipe={name}", "model.dtype=bf16"]
                                 for name in names})
    failed = {name: r for name, r in out.items() if isinstance(r, str)}
    assert not failed, "\n\n".join(f"--- {name}\n{err[-6000:]}" for name, err in failed.items())
    for name, (summary, steps) in out.items():
        assert len(steps) == 1, name
        _finite(steps[0])
        assert math.isfinite(steps[0]["optim/grad_norm"]) and steps[0]["optim/grad_norm"] > 0, (name, steps[0])


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_router_replay(tmp_path, mode):
    _, steps = launch(tmp_path, mode, ONE_STEP + ["--router-replay", mode, "model.dtype=bf16"])
    _finite(steps[0], STEP_KEYS + ("optim/grad_norm",))
    if mode == "r2":
        assert 0.0 < steps[0]["moe/route_agree_old_new"] <= 1.0
    else:
        assert steps[0]["moe/replayed_token_fraction"] > 0.5
        assert 0.0 < steps[0]["moe/route_agree_rollout_train"] <= 1.0


def test_sft_only(tmp_path):
    summary, steps = launch(tmp_path, "sft", ONE_STEP + ["train.steps=0", "sft.steps=6", "sft.batch_size=16",
                                                         "sft.eval_every=3", "train.eval_size=32"])
    assert steps == []
    sft = summary["sft"]
    assert sft["steps"] >= 1 and math.isfinite(sft["heldout_accuracy"])
    assert sft["checkpoint"]


def test_resume_continues_like_the_uninterrupted_run(tmp_path):
    """3 steps at once vs 2 steps, stop, resume for the 3rd: the 3rd step matches. Tolerance, not
    equality: CUDA kernels with atomics (embedding and MoE scatter backward) are not bitwise
    reproducible, so the two runs' first two steps may differ in the last bits."""
    common = [*ONE_STEP, "model.dtype=fp32", "rollout.dtype=fp32"]
    _, full = launch(tmp_path, "full", common + ["train.steps=3"])
    launch(tmp_path, "part", common + ["train.steps=2"])
    # same run directory: the second launch resumes from its checkpoint
    _, resumed = launch(tmp_path, "part", common + ["train.steps=3", "train.resume=true"])
    assert len(full) == 3 and len(resumed) == 3  # metrics.jsonl is appended by the resumed run
    for k in ("loss/policy", "optim/grad_norm", "rollout/reward_mean", "mismatch/kl_k3"):
        assert resumed[2][k] == pytest.approx(full[2][k], rel=1e-3, abs=1e-5), k
