"""The run: set up once, start (resume or warm start), then RL steps with evaluations, logs and
checkpoints, until train.steps, a stop signal or an engine failure.

    summary = run(cfg, groups, stop)   # inside torchrun / a single process; see pretrain_rl.py

The parts: trainer/setup.py builds the run (start-up checks in trainer/startup.py), trainer/resume.py
starts it, trainer/rl_step.py is one step, trainer/progress.py reports. This loop decides what a
step's outcome means for the run: log it, evaluate, save, or stop. An engine failure keeps what the
completed steps learned (a checkpoint) and stops the run naming how to go on; SIGTERM or Ctrl-C
finishes the step, saves and raises Stopped; a resumed run drops the metrics rows of the steps it
is about to redo.
"""
from __future__ import annotations

import signal

import torch.distributed as dist

from megatron_rl.config import RunConfig, config_to_dict
from megatron_rl.parallel import ParallelGroups
from megatron_rl.trainer.batch import model_device
from megatron_rl.trainer.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from megatron_rl.trainer.context import RunContext
from megatron_rl.trainer.evaluation import evaluate_both, heldout_examples
from megatron_rl.trainer.host_state import rng_state
from megatron_rl.trainer.progress import progress_bar, report_step, show_progress, summarize
from megatron_rl.trainer.resume import start
from megatron_rl.trainer.rl_step import RolloutFailed, rl_step
from megatron_rl.trainer.setup import setup
from megatron_rl.trainer.startup import checkpoint_root
from megatron_rl.trainer.stop import Stopped, StopSignals

CURVE_KEYS = ("rollout/reward_mean", "mismatch/kl_k3", "eval/heldout_accuracy", "eval/heldout_sampled_accuracy",
              "loss/policy")


def run(cfg: RunConfig, groups: ParallelGroups, stop: StopSignals | None = None) -> dict:
    """Run SFT (if configured and not resuming) and RL; return the summary (all ranks).
    Raises Stopped after saving when `stop` saw SIGTERM/SIGINT."""
    ctx = setup(cfg, groups, stop)
    try:
        return train(ctx)
    finally:
        close(ctx)


def close(ctx: RunContext) -> None:
    """End of a run: the engine, schedule and sink closed, the run dir unlocked, the policy released
    (its model and process groups freed, so a process that runs again does not accumulate them)."""
    try:
        ctx.schedule.close()
        ctx.sink.close()
        if ctx.engine is not None:
            ctx.engine.close()
        ctx.rewards.close()
    finally:
        ctx.policy.release()
        if ctx.run_dir_lock is not None:
            ctx.run_dir_lock.close()


def train(ctx: RunContext) -> dict:
    """The RL steps from where `start` puts the run; returns the summary."""
    cfg, root = ctx.cfg, checkpoint_root(ctx.cfg)
    heldout = heldout_examples(ctx)
    first = start(ctx, heldout)
    bar = progress_bar(cfg.train.steps, "RL", show_progress(cfg))
    if bar is not None:
        bar.update(first)
    last, saved = {}, first
    for step in range(first, cfg.train.steps):
        done = step + 1 == cfg.train.steps
        try:
            result = rl_step(ctx, step)
        except RolloutFailed as e:  # before the update: `step` steps are in the weights
            raise _engine_failed(ctx, e, step, saved, None, bar) from e
        ctx.policy_version, metrics = result.version, result.metrics
        if result.sync_failure is not None:  # after the update: this step counts
            raise _engine_failed(ctx, result.sync_failure, step + 1, saved, metrics, bar) from result.sync_failure
        if heldout and (done or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0)):
            try:
                ctx.schedule.ensure_synced(ctx.policy_version)  # staged: the engine may hold the stage's weights
                metrics.update(evaluate_both(ctx, heldout))
            except RolloutFailed as e:
                raise _engine_failed(ctx, e, step + 1, saved, metrics, bar) from e
        record(ctx, step + 1, metrics, bar)
        report_step(ctx, step + 1, metrics, bar)
        last = metrics
        if (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0) or done:
            save(ctx, root, step + 1)
            saved = step + 1
        if not done and ctx.stop.agreed(model_device()):
            path = save(ctx, root, step + 1) if saved != step + 1 else latest_checkpoint(root)
            raise stopped(ctx, step + 1, path)
    if bar is not None:
        bar.close()
    return summarize(ctx, last)


def _engine_failed(ctx: RunContext, error: RolloutFailed, completed: int, saved: int, metrics: dict | None,
                   bar) -> BaseException:
    """The engine failed with `completed` steps in the weights (`metrics`: the last one's, not yet
    logged, when it failed after its update): keep what they learned, then the error to raise:
    Stopped when a stop signal took the engine down with the run, else RolloutFailed saying how
    to go on."""
    root = checkpoint_root(ctx.cfg)
    if metrics is not None:  # the step was applied: its row and curve point go with it
        record(ctx, completed, metrics, bar)
    path = save(ctx, root, completed) if completed != saved else latest_checkpoint(root)
    if ctx.stop.agreed(model_device()):  # the engine went down with the run (SLURM signals it too)
        return stopped(ctx, completed, path)
    return RolloutFailed(engine_failure_message(error, completed, path))


def engine_failure_message(error: BaseException, completed_steps: int, path: str | None) -> str:
    """The rollout engine failed: what was kept and how to go on. `path` is None when no step
    completed and no checkpoint existed (a failure in the first step of a fresh run): there is
    nothing to resume then, so the message says so instead of naming a checkpoint."""
    if path is None:
        return f"{error}. No RL step completed, so nothing was saved; fix the engine and rerun"
    return (f"{error}. Saved a checkpoint of the {completed_steps} completed steps to {path}; fix the engine and "
            f"rerun with train.resume=true")


def stopped(ctx: RunContext, completed_steps: int, path: str | None) -> Stopped:
    """`path` is None when nothing was saved (see engine_failure_message)."""
    then = (f"checkpoint {path}; rerun with train.resume=true to continue" if path is not None
            else "nothing was saved: rerun to start over")
    return Stopped(ctx.stop.signum, f"stopped by {signal.Signals(ctx.stop.signum).name} after step {completed_steps} "
                                    f"of {ctx.cfg.train.steps}; {then}")


def record(ctx: RunContext, completed_steps: int, metrics: dict, bar) -> None:
    """Step `completed_steps`'s point on the run's curve (saved with checkpoints) and its metrics row."""
    ctx.state.curve.append({k: metrics[k] for k in CURVE_KEYS if k in metrics})
    ctx.sink.log(completed_steps, metrics, echo=None if bar is not None else f"step {completed_steps}")


def save(ctx: RunContext, root: str, completed_steps: int) -> str:
    """Save the completed steps; a save that fails stops the run naming the newest checkpoint."""
    ctx.sink.sync()
    try:
        return save_checkpoint(
            root, completed_steps, ctx.policy.model, ctx.policy.optimizer,
            extra={"step": completed_steps, "policy_version": ctx.policy_version, "state": ctx.state.to_dict(),
                   "rng": rng_state(), "run_id": ctx.run_id, "config": config_to_dict(ctx.cfg),
                   "data": ctx.prompts.state_dict(), "tokenizer": ctx.tokenizer.fingerprint,
                   "counters": {**ctx.schedule.stats(), **ctx.rewards.stats()},
                   "arch": ctx.policy.arch.to_dict()},  # tools/convert_hf_to_mcore.py --reverse
            keep=ctx.cfg.train.keep_checkpoints, run_id=ctx.run_id,
            rank0_tensors={"schedule": ctx.schedule.state_dict()} if dist.get_rank() == 0 else None)
    except CheckpointError as e:
        newest = latest_checkpoint(root)
        then = (f"the newest checkpoint is {newest}: rerun with train.resume=true to continue from it" if newest
                else "no checkpoint was saved: rerun to start over")
        raise CheckpointError(f"{e}. The run stopped: {then}") from e
