"""Non-finite numbers in the real RL loop (fp32, no loss scaler): an update whose loss or gradient
norm is inf/NaN is skipped on every rank alike and leaves weights and Adam state as they were; the
run stops at train.max_nonfinite_updates in a row (a count the checkpoints keep); an update that
writes NaN weights stops the run before the engine or a checkpoint sees them.

Faults are injected into one chosen RL step: a NaN loss value on ONE data-parallel rank (its
gradients finite: only the all-reduced verdict makes the other rank skip too), a NaN gradient
(a parameter hook), or NaN written into a weight right after an update (as optim.lr=inf did).
"""
import contextlib
import io
import itertools
import json
import math
import os

import torch

from tests.distributed.test_rl_loop import BASE
from tests.spawn import run_ranks


def _adam_steps(optimizer) -> list[int]:
    """The inner torch optimizer's step count of each parameter (how many updates it applied)."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return sorted({int(s["step"]) for o in inner for s in o.state.values()})


def _run(rank, world, run_dir, overrides, nan_loss_at=(), nan_grad_from=None, nan_weights_at=None):
    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer import phases
    from megatron_rl.trainer.loop import close, save, train
    from megatron_rl.trainer.nonfinite import NonFiniteUpdates, NonFiniteWeights
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}", "loss.head_gradients=recompute"] + overrides)
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    now = {"step": 0}
    snapshots, adam = [], []
    real_update, real_loss_fn, real_step = phases.update, phases.policy_loss_fn, phases.guarded_step

    def update(ctx_, batch, old):
        now["step"] = ctx_.policy_version + 1
        snapshots.append({k: v.clone() for k, v in ctx_.policy.export()})
        handle = None
        if nan_grad_from is not None and now["step"] >= nan_grad_from:
            param = next(p for p in ctx_.policy.model.parameters() if p.requires_grad)
            handle = param.register_hook(lambda g: g * math.nan)
        try:
            return real_update(ctx_, batch, old)
        finally:
            adam.append(_adam_steps(ctx_.policy.optimizer))
            if handle is not None:
                handle.remove()

    def policy_loss_fn(*args, **kwargs):  # the loss VALUE on rank 1 only; its gradient stays finite
        fn = real_loss_fn(*args, **kwargs)

        def loss_fn(mb, logprobs, entropy):
            loss, values = fn(mb, logprobs, entropy)
            if now["step"] in nan_loss_at and rank == world - 1:
                values["loss/value/sum"] = values["loss/value/sum"] * math.nan
            return loss, values
        return loss_fn

    def guarded_step(optimizer, loss_finite=True):  # an update that writes NaN, as optim.lr=inf did
        outcome = real_step(optimizer, loss_finite)
        if now["step"] == nan_weights_at:
            with torch.no_grad():
                next(ctx.policy.model.parameters()).view(-1)[0] = math.nan
        return outcome

    phases.update, phases.policy_loss_fn, phases.guarded_step = update, policy_loss_fn, guarded_step
    err, stopped, refused = io.StringIO(), None, None
    try:
        with contextlib.redirect_stderr(err):
            try:
                train(ctx)
            except NonFiniteUpdates as e:
                stopped = f"{type(e).__name__}: {e}"
            except NonFiniteWeights as e:
                stopped = f"{type(e).__name__}: {e}"
                try:  # what a save (the loop's, on an engine failure) would do with these weights
                    save(ctx, os.path.join(run_dir, "checkpoints"), 99)
                except NonFiniteWeights as e2:
                    refused = str(e2)
        snapshots.append({k: v.clone() for k, v in ctx.policy.export()})
        state = ctx.state.to_dict()
    finally:
        phases.update, phases.policy_loss_fn, phases.guarded_step = real_update, real_loss_fn, real_step
        close(ctx)
    steps = []
    if rank == 0 and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
    return {"steps": steps, "snapshots": snapshots, "adam": adam, "stderr": err.getvalue(), "stopped": stopped,
            "refused": refused, "in_a_row": state.get("nonfinite_in_a_row")}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_nonfinite_loss_on_one_rank_skips_the_update_on_every_rank(tmp_path):
    """Step 2's loss is NaN on rank 1 only: both of its updates are skipped on both ranks (the
    weights stay equal across ranks and as before step 2), step 3 trains again."""
    runs = run_ranks(_run, world_size=2, timeout=400, run_dir=str(tmp_path), nan_loss_at=(2,),
                     overrides=["train.steps=3"])
    for out in runs:
        snaps = out["snapshots"]  # before steps 1, 2, 3 and at the end
        assert [_same(a, b) for a, b in itertools.pairwise(snaps)] == [False, True, False]
        assert out["adam"] == [[2], [2], [4]]  # Adam applied 2 updates per good step, none in step 2
        assert out["stopped"] is None and out["in_a_row"] == 0
    assert _same(runs[0]["snapshots"][-1], runs[1]["snapshots"][-1])
    steps = runs[0]["steps"]
    assert [s["optim/nonfinite_updates"] for s in steps] == [0, 2, 0]
    assert math.isnan(steps[1]["loss/policy"]) and math.isfinite(steps[1]["optim/grad_norm"])
    assert ("warning: step 2: 2 of 2 updates skipped: their loss or gradient norm was not finite"
            in runs[0]["stderr"]), runs[0]["stderr"]


def test_nonfinite_updates_in_a_row_stop_the_run_and_the_count_survives_a_resume(tmp_path):
    """NaN gradients from step 2 on, limit 3: step 2 skips 2 updates and is saved (its weights are
    step 1's), step 3's first update is the third in a row and stops the run; a resume from step 2's
    checkpoint continues the count, so it stops at that same update."""
    common = ["train.steps=4", "train.save_every=1", "train.max_nonfinite_updates=3"]
    [out] = run_ranks(_run, world_size=1, timeout=400, run_dir=str(tmp_path), nan_grad_from=2, overrides=common)
    assert out["stopped"].startswith("NonFiniteUpdates: RL step 3, update 1 of 2: the gradient norm is not finite")
    assert "3 update(s) in a row skipped" in out["stopped"] and "train.max_nonfinite_updates=3" in out["stopped"]
    assert [s["optim/nonfinite_updates"] for s in out["steps"]] == [0, 2]
    assert _same(out["snapshots"][1], out["snapshots"][-1])  # the weights after step 1, finite
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_0000001", "iter_0000002", "latest"]
    [again] = run_ranks(_run, world_size=1, timeout=400, run_dir=str(tmp_path), nan_grad_from=2,
                        overrides=[*common, "train.resume=true"])
    assert again["stopped"].startswith("NonFiniteUpdates: RL step 3, update 1 of 2"), again["stopped"]


def test_an_update_that_writes_nan_weights_stops_before_anything_sees_them(tmp_path):
    [out] = run_ranks(_run, world_size=1, timeout=400, run_dir=str(tmp_path), nan_weights_at=2,
                      overrides=["train.steps=3", "train.save_every=1"])
    assert out["stopped"].startswith("NonFiniteWeights: the optimizer update of RL step 2, update 1 of 2 (finite "
                                     "loss, gradient norm"), out["stopped"]
    assert "left inf or NaN in 1 parameter tensor(s)" in out["stopped"] and "optim.lr=0.01" in out["stopped"]
    assert out["refused"].startswith("not saving ") and "iter_0000099: the weights left inf or NaN" in out["refused"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_0000001", "latest"]
    assert [s["step"] for s in out["steps"]] == [1]
