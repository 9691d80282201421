"""fp16 training through megatron's dynamic loss scaler: an injected gradient overflow skips the
update (weights unchanged) and halves the scale, and training goes on; and fp16 tracks fp32 on a
short run from the same weights and samples (fp32 engine in both, so the samples are identical)."""
import itertools
import json
import math
import os
import shutil

import pytest
import torch

from tests.distributed.test_rl_loop import BASE
from tests.spawn import run_ranks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.model.parity import random_hf_model
    from megatron_rl.model.presets import preset_arch

    path = str(tmp_path_factory.mktemp("hf"))
    random_hf_model(preset_arch("qwen3_moe", "tiny"), seed=0, std=0.2).save_pretrained(path)
    return path


def _run(rank, world, overrides, run_dir, overflow_at_step=None):
    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer import phases
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}", "rollout.dtype=fp32", "train.num_minibatches=1",
                                    "optim.lr=1e-3"] + overrides)
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    snapshots = []
    real_update = phases.update

    def update(ctx_, batch, old):  # inject inf into one gradient during the chosen step's backward
        snapshots.append({k: v.clone() for k, v in ctx_.policy.export()})
        handle = None
        if ctx_.policy_version + 1 == overflow_at_step:
            param = next(p for p in ctx_.policy.model.parameters() if p.requires_grad)
            handle = param.register_hook(lambda g: g * math.inf)
        try:
            return real_update(ctx_, batch, old)
        finally:
            if handle is not None:
                handle.remove()

    phases.update = update
    try:
        train(ctx)
        snapshots.append({k: v.clone() for k, v in ctx.policy.export()})
    finally:
        phases.update = real_update
        close(ctx)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    return steps, snapshots


@pytest.fixture(scope="module")
def fp16_overflow_run(tmp_path_factory, hf_dir):
    """(metrics rows, weight snapshots) of a 3-step fp16 run whose step-2 gradient overflows; its first
    step is an ordinary fp16 step (what test_fp16_tracks_fp32 compares with fp32)."""
    [(steps, snaps)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path_factory.mktemp("fp16")),
                                 overrides=["train.steps=3", "model.dtype=fp16", "optim.hysteresis=1",
                                            f"model.hf_dir={hf_dir}"], overflow_at_step=2)
    return steps, snaps


def test_fp16_overflow_skips_the_update_and_halves_the_scale(fp16_overflow_run):
    steps, snaps = fp16_overflow_run
    assert [s["optim/skipped_steps"] for s in steps] == [0, 1, 0]
    assert [s["optim/loss_scale"] for s in steps] == [65536.0, 32768.0, 32768.0]
    changed = [any(not torch.equal(a[k], b[k]) for k in a) for a, b in itertools.pairwise(snaps)]
    assert changed == [True, False, True]  # step 2 left the weights as they were
    assert all(math.isfinite(s["loss/policy"]) for s in steps)


def test_fp16_tracks_fp32(tmp_path, hf_dir, fp16_overflow_run):
    """Step 1 of the fp16 run above (before its overflow) against step 1 of the same run in fp32."""
    [(fp32, _)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "a"),
                            overrides=["train.steps=1", f"model.hf_dir={hf_dir}", "model.dtype=fp32"])
    a, b = fp32[0], fp16_overflow_run[0][0]
    assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # the same samples
    assert b["loss/policy"] == pytest.approx(a["loss/policy"], rel=2e-2, abs=1e-4)
    assert b["optim/grad_norm"] == pytest.approx(a["optim/grad_norm"], rel=2e-2)
    assert b["mismatch/kl_k3"] < 1e-4  # fp16 trainer vs fp32 engine: small, not zero


def test_non_finite_gradient_without_a_loss_scaler_skips_the_update(tmp_path, hf_dir):
    """bf16 has no loss scaler: the trainer skips the update itself (trainer/nonfinite.py) and goes on."""
    [(steps, snaps)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path),
                                 overrides=["train.steps=2", "model.dtype=bf16", f"model.hf_dir={hf_dir}"],
                                 overflow_at_step=1)
    assert [s["optim/nonfinite_updates"] for s in steps] == [1, 0]
    assert [s["optim/skipped_steps"] for s in steps] == [0, 0]  # not the fp16 loss scaler's
    changed = [any(not torch.equal(a[k], b[k]) for k in a) for a, b in itertools.pairwise(snaps)]
    assert changed == [False, True]  # step 1 left the weights as they were; step 2 trained


def _save_init(rank, world, hf_dir, root):
    """An fp32 checkpoint of the HF weights (as an SFT warm start leaves one)."""
    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.loop import close
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={root}/run", f"model.hf_dir={hf_dir}"])
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    try:
        path = save_checkpoint(f"{root}/init", 0, ctx.policy.model)
        return path, {k: v.clone() for k, v in ctx.policy.export()}
    finally:
        close(ctx)


@pytest.fixture(scope="module")
def init_checkpoint(tmp_path_factory, hf_dir):
    """(path, weights) of _save_init's checkpoint, shared by the dtypes that start from it (read only)."""
    [(path, init)] = run_ranks(_save_init, world_size=1, timeout=300, hf_dir=hf_dir,
                               root=str(tmp_path_factory.mktemp("init")))
    return path, init


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_init_checkpoint_reaches_the_master_weights(tmp_path, init_checkpoint, dtype):
    """A bf16/fp16 model started from train.init_checkpoint trains from those weights: the
    optimizer's fp32 master copies are made after the load (not from the random init)."""
    path, init = init_checkpoint
    [(_, snaps)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "rl"),
                             overrides=["train.steps=1", f"model.dtype={dtype}", f"train.init_checkpoint={path}",
                                        "optim.lr=1e-6"])
    after = snaps[-1]
    worst = max(float((after[k].float() - init[k].float()).abs().max()) for k in init)
    assert worst < 0.02, worst  # a step of lr 1e-6 from the checkpoint; the random init is ~0.2 away


def _resume_from_step(tmp_path, overrides: list[str], step: int):
    """The run of `overrides` (train.save_every=1) uninterrupted in tmp_path/f, and again resumed from
    that run's step-`step` checkpoint in a run folder of its own, tmp_path/p: ((rows, snapshots) of
    each). (tests/distributed/test_rl_loop.py resumes a run stopped at the end of its train.steps.)"""
    overrides = [*overrides, "train.save_every=1"]
    [full] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "f"), overrides=overrides)
    name = f"iter_{step:07d}"
    shutil.copytree(tmp_path / "f" / "checkpoints" / name, tmp_path / "p" / "checkpoints" / name)
    [resumed] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "p"),
                          overrides=[*overrides, "train.resume=true"])
    return full, resumed


@pytest.mark.mcore_api  # the bf16 optimizer's sharded_state_dict and bf16 routing (0.19)
def test_bf16_resume_reproduces_the_uninterrupted_run(tmp_path, hf_dir):
    """The fp32 master weights and Adam state travel in the checkpoint: a resumed bf16 run is the
    uninterrupted one, bit for bit."""
    (full, w_full), (res, w_res) = _resume_from_step(
        tmp_path, [f"model.hf_dir={hf_dir}", "model.dtype=bf16", "train.steps=3"], step=2)
    [resumed] = res  # only step 3 ran
    assert resumed["step"] == full[2]["step"]
    assert resumed["loss/policy"] == full[2]["loss/policy"] and resumed["optim/grad_norm"] == full[2]["optim/grad_norm"]
    for k in w_full[-1]:
        assert torch.equal(w_full[-1][k], w_res[-1][k]), k


@pytest.mark.mcore_api  # as the bf16 resume above
@pytest.mark.parametrize("recipe", ["fp8_tensor", "fp8_block", "mxfp8"])
def test_fp8_rollout_resume_reproduces_the_uninterrupted_run(tmp_path, hf_dir, recipe):
    """An FP8 engine quantizes the weights it is synced, on resume as at every step: the resumed run's
    step 2 samples with the same μ (its mismatch KL) and makes the same update as the uninterrupted run's."""
    (full, w_full), (res, w_res) = _resume_from_step(
        tmp_path, [f"model.hf_dir={hf_dir}", f"precision.recipe={recipe}", "rollout.dtype=bf16", "train.steps=2"],
        step=1)
    assert full[1]["mismatch/kl_k3"] > 0
    [resumed] = res  # only step 2 ran
    for key in ("step", "mismatch/kl_k3", "loss/policy", "optim/grad_norm"):
        assert resumed[key] == full[1][key], key
    for k in w_full[-1]:
        assert torch.equal(w_full[-1][k], w_res[-1][k]), k
