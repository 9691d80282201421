"""DAPO over-sampling in whole runs of a tiny random model with the embedded engine: it fills every
step with groups that have reward variance where the plain filtered run trains on fewer, the
max_oversample bound stops it (the step pads with masked zero-variance groups), and a resumed run
reproduces the uninterrupted one bit for bit.

The reward (first response character a digit) leaves about half of the random policy's groups of
4 with equal rewards, so both the filled and the bounded cases happen in a step or two.
"""
import pytest
import torch

from megatron_rl.rewards import register_reward
from tests.distributed.test_schedules import _run as schedules_run
from tests.spawn import run_ranks


@register_reward("test_first_digit")
def first_digit(prompt: str, response: str, label: str) -> float:
    return float(response[:1].isdigit())


B = 4
BASE = ["model.arch=qwen3", "model.size=tiny", "rollout.dtype=fp32", f"rollout.prompts_per_step={B}",
        "rollout.group_size=4", "rollout.max_tokens=3", "data.reward=test_first_digit", "train.micro_batch_size=4",
        "train.num_minibatches=2", "train.eval_every=0", "optim.lr=1e-2", "log.tensorboard=false",
        "log.progress=false", "sft.steps=0", "loss.filter_zero_variance_groups=true"]
OVER = ["rollout.oversample=true", "rollout.max_oversample=4"]


def _run(rank, world, overrides, run_dir, stop_after_first=False):
    """test_schedules' run (SIGTERM after step 1 if asked), under this file's settings (later
    overrides win); a function of this module, so the ranks import it and its reward registers."""
    return schedules_run(rank, world, BASE + overrides, run_dir, stop_after_first)


def _one(tmp_path, name, overrides, stop_after_first=False):
    [(weights, rows)] = run_ranks(_run, world_size=1, timeout=300, overrides=overrides, run_dir=str(tmp_path / name),
                                  stop_after_first=stop_after_first)
    return weights, [row for row in rows if row.get("phase") == "rl"]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Three over-sampled steps, uninterrupted."""
    return _one(tmp_path_factory.mktemp("over"), "full", OVER + ["train.steps=3"])


def test_oversampling_fills_every_step_with_groups_that_vary(full, tmp_path):
    _, plain = _one(tmp_path, "plain", ["train.steps=1"])
    _, steps = full
    # the same first call (same weights, prompts and seed): the plain run trains on fewer groups
    assert plain[0]["rollout/zero_variance_groups"] > 0
    assert steps[0]["rollout/oversample_rounds"] >= 1
    for s in steps:
        assert s["rollout/zero_variance_groups"] == 0.0 and s["rollout/groups_padded"] == 0.0
        assert s["rollout/groups_generated"] - s["rollout/groups_dropped"] == B
        assert B <= s["rollout/groups_generated"] <= 4 * B


def test_the_bound_stops_oversampling(tmp_path):
    _, steps = _one(tmp_path, "bound", ["rollout.oversample=true", "rollout.max_oversample=1.25", "train.steps=1"])
    (s,) = steps
    assert s["rollout/groups_generated"] == 5 and s["rollout/oversample_rounds"] == 1  # floor(1.25 x 4)
    assert s["rollout/groups_padded"] > 0
    assert s["rollout/zero_variance_groups"] == s["rollout/groups_padded"] / B  # trained on, masked


@pytest.mark.mcore_api  # the checkpoint round trip of the whole stack
@pytest.mark.parametrize("schedule", [[], ["train.schedule=async", "train.max_staleness=1"]], ids=["sync", "async"])
def test_resume_reproduces_the_oversampled_run(full, tmp_path, schedule):
    """Stopped after step 1 as SIGTERM stops a run, then resumed. async: step 2's batch was
    over-sampled (on the main thread, after step 1's update) before the checkpoint, which carries
    it; step 3's is over-sampled after the resume."""
    overrides = OVER + schedule + ["train.steps=3"]
    w_full, s_full = _one(tmp_path, "full", overrides) if schedule else full
    _, s_part = _one(tmp_path, "part", overrides, stop_after_first=True)
    assert [s["step"] for s in s_part] == [1]
    w_res, s_res = _one(tmp_path, "part", overrides + ["train.resume=true"])
    assert [s["step"] for s in s_res] == [1, 2, 3] and s_full[2]["rollout/oversample_rounds"] >= 1
    for a, b in zip(s_full, s_res, strict=True):
        for k in ("loss/policy", "optim/grad_norm", "rollout/reward_mean", "rollout/groups_generated",
                  "rollout/oversample_rounds", "rewards/count"):
            assert a[k] == b[k], (a["step"], k)
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k
