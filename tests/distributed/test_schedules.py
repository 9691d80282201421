"""Off-policy schedules through the real loop: staleness per step, a resume mid-stage / mid-async
that reproduces the uninterrupted run bit for bit (the queued batches travel in the checkpoint),
and 2 data-parallel ranks against one.

The interrupted run is stopped the way SIGTERM stops it (the stop flag, checked at the end of a
step): after step 1, with the rest of the stage (staged) or the next batch (async) generated and
not yet trained on.
"""
import json
import os
import signal

import pytest
import torch

from tests.distributed.test_rl_loop import BASE
from tests.spawn import run_ranks

SCHEDULES = {
    "staged": ["train.schedule=staged", "train.stages=2", "loss.recipe=mu_grpo"],
    "async": ["train.schedule=async", "train.max_staleness=1", "loss.recipe=decoupled_ppo"],
}
STEPS = ["train.steps=4", "train.save_every=1"]


def _run(rank, world, overrides, run_dir, stop_after_first=False):
    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.setup import setup
    from megatron_rl.trainer.stop import Stopped

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}"] + overrides)
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    if stop_after_first:
        ctx.stop.signum = signal.SIGTERM  # as if SIGTERM arrived during the first step
    try:
        train(ctx)
    except Stopped:
        pass
    finally:
        close(ctx)
    weights = dict(ctx.policy.export())
    steps = []
    if rank == 0:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
    return weights, steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """name -> (weights, metrics rows) of the schedule's uninterrupted single-rank run (SCHEDULES +
    STEPS), made on first use and shared: the resumed run, the two-rank run and the policy check
    all compare with it."""
    runs = {}

    def get(name):
        if name not in runs:
            [runs[name]] = run_ranks(_run, world_size=1, timeout=300, overrides=SCHEDULES[name] + STEPS,
                                     run_dir=str(tmp_path_factory.mktemp(name)))
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_resume_mid_schedule_reproduces_the_uninterrupted_run(tmp_path, name, uninterrupted):
    overrides = SCHEDULES[name] + STEPS
    w_full, s_full = uninterrupted(name)
    [(_, s_part)] = run_ranks(_run, world_size=1, timeout=300, overrides=overrides, run_dir=str(tmp_path / "p"),
                              stop_after_first=True)
    assert [s["step"] for s in s_part] == [1]
    [(w_res, s_res)] = run_ranks(_run, world_size=1, timeout=300, overrides=overrides + ["train.resume=true"],
                                 run_dir=str(tmp_path / "p"))
    assert [s["step"] for s in s_res] == [1, 2, 3, 4]
    want = {"sync": [0, 0, 0, 0], "staged": [0, 1, 0, 1], "async": [0, 1, 1, 1]}[name]
    assert [s["schedule/staleness_max"] for s in s_full] == want
    # in optimizer updates (BASE: 2 mini-batches): a sample s versions old is trained 2s and 2s + 1 updates later
    assert [s["schedule/staleness_updates_max"] for s in s_full] == [2 * w + 1 for w in want]
    assert [s["schedule/staleness_updates_mean"] for s in s_full] == [2 * w + 0.5 for w in want]
    for a, b in zip(s_full, s_res, strict=True):
        for k in ("loss/policy", "optim/grad_norm", "rollout/reward_mean", "mismatch/kl_k3", "schedule/staleness_mean",
                  "schedule/generate_calls", "schedule/weight_syncs", "rewards/count"):  # the counters continue too
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))  # staged: rewards/count per stage
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_two_data_parallel_ranks_match_one(tmp_path, name, uninterrupted):
    overrides = SCHEDULES[name] + STEPS
    w1, s1 = uninterrupted(name)
    (w2, s2), _ = run_ranks(_run, world_size=2, timeout=600, overrides=overrides, run_dir=str(tmp_path / "two"))
    for a, b in zip(s1, s2, strict=True):
        assert a["schedule/staleness_mean"] == b["schedule/staleness_mean"]
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # the same samples
        for k in ("loss/policy", "optim/grad_norm", "mismatch/kl_k3"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), (a["step"], k)
    # Adam divides each update by sqrt(v) + eps, so a coordinate whose gradient is near zero turns the
    # last-bit difference of a 2-rank sum into an update difference up to lr * |dg| / eps: seen up to
    # 4.4e-6 (lr 1e-2, 4 steps, an AVX-512 CPU). A wrong split (lost or doubled samples) moves
    # weights by O(lr) = 1e-2, and the metrics above catch a mis-scaled gradient.
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=2e-5, msg=k)


@pytest.mark.parametrize("name,stale_steps", [
    ("sync", []), ("staged", [2, 4]),
    ("async", [2, 3, 4])])
def test_which_policies_the_losses_compare(tmp_path, name, stale_steps, uninterrupted):
    """fp32 engine and trainer: μ and π_old agree to ~1e-6 when the batch comes from the current
    weights; a stale batch keeps its behaviour μ (an older version) while π_old is recomputed with the
    current weights, so |log π_old − log μ| is the staleness (lr 1e-2 moves it well above 1e-3),
    all of it in the staleness-1 split. Staged and async: the shared uninterrupted runs (2 stages of
    2 steps; at most 1 version stale; the loss recipe does not enter π_old or μ)."""
    if name == "sync":
        [(_, steps)] = run_ranks(_run, world_size=1, timeout=300, overrides=["train.steps=2"], run_dir=str(tmp_path))
    else:
        _, steps = uninterrupted(name)
    assert [s["step"] for s in steps] == ([1, 2] if name == "sync" else [1, 2, 3, 4])
    for s in steps:
        gap = s["mismatch/abs_logprob_diff"]
        if s["step"] in stale_steps:
            assert gap > 1e-3, (s["step"], gap)
            assert s["mismatch/staleness_1/abs_logprob_diff"] == pytest.approx(gap, rel=1e-9)
        else:
            assert gap < 1e-5, (s["step"], gap)
