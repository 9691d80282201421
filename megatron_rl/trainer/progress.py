"""What a run shows as it goes and when it ends: progress bars, per-step notices, the summary.

    bar = progress_bar(cfg.train.steps, "RL", show_progress(cfg))
    report_step(ctx, step, metrics, bar)     # rank 0: skipped-update notices, figures, the bar
    summary = summarize(ctx, last_metrics)
"""
from __future__ import annotations

import math
import sys
import time

import torch.distributed as dist

from megatron_rl.config import RunConfig
from megatron_rl.metrics.report import bucket_figure, bucket_rows

# what each step's line on stdout shows (the metrics sink prints them when there is no bar)
STDOUT_KEYS = ("rollout/reward_mean", "rollout/accuracy", "mismatch/kl_k3", "loss/policy", "optim/grad_norm",
               "eval/heldout_accuracy", "timing/step", "sft/heldout_accuracy")


def show_progress(cfg: RunConfig) -> bool:
    """tqdm bars on rank 0 when log.progress says so; by default only when stdout and stderr are
    both terminals: the bars go to stderr and replace the step lines on stdout, so `> log` or
    `| tee log` with stderr still on a terminal would otherwise leave the log without them."""
    wanted = cfg.log.progress if cfg.log.progress is not None else (sys.stderr.isatty() and sys.stdout.isatty())
    return wanted and dist.get_rank() == 0


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=True)


def report_step(ctx, completed_steps: int, metrics: dict, bar) -> None:
    """Rank 0, after step `completed_steps` was logged: say which updates were skipped and why,
    draw the mismatch figure when due, move the bar."""
    cfg = ctx.cfg
    n, step = cfg.train.num_minibatches, completed_steps
    if metrics["optim/nonfinite_updates"] and ctx.sink.enabled:
        print(f"warning: step {step}: {metrics['optim/nonfinite_updates']:.0f} of {n} updates skipped: their loss or "
              f"gradient norm was not finite (loss/policy {metrics.get('loss/policy', math.nan):g}, optim/grad_norm "
              f"{metrics['optim/grad_norm']:g}); the weights and optimizer state are as before them. "
              f"{ctx.state.nonfinite_in_a_row} in a row; the run stops at train.max_nonfinite_updates="
              f"{cfg.train.max_nonfinite_updates}", file=sys.stderr, flush=True)
    if metrics["optim/skipped_steps"] and ctx.sink.enabled:
        print(f"step {step}: {metrics['optim/skipped_steps']:.0f} of {n} updates skipped (fp16 gradient overflow: "
              f"weights unchanged); loss scale now {metrics.get('optim/loss_scale', float('nan')):g}",
              file=sys.stderr, flush=True)
    if cfg.log.figure_every and step % cfg.log.figure_every == 0 and ctx.sink.enabled:
        figure = bucket_figure(bucket_rows(metrics), step)
        if figure is not None:
            ctx.sink.log_figure("mismatch/by_rollout_probability", figure, step)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl=f"{metrics.get('mismatch/kl_k3', 0):.2e}")


def summarize(ctx, last: dict) -> dict:
    """The run's summary (every rank): SFT, accuracies before and after RL, the reward and KL curve's
    ends, the last step's metrics."""
    curve = ctx.state.curve
    rewards = [c["rollout/reward_mean"] for c in curve]
    k = max(1, min(10, len(rewards) // 4 or 1))
    evals = [c["eval/heldout_accuracy"] for c in curve if "eval/heldout_accuracy" in c]
    sampled = [c["eval/heldout_sampled_accuracy"] for c in curve if "eval/heldout_sampled_accuracy" in c]
    kls = [c["mismatch/kl_k3"] for c in curve if "mismatch/kl_k3" in c]
    return {
        "sft": ctx.state.sft,
        "before_rl_accuracy": ctx.state.before_rl_accuracy,
        "after_rl_accuracy": evals[-1] if evals else None,
        "before_rl_sampled_accuracy": ctx.state.before_rl_sampled_accuracy,
        "after_rl_sampled_accuracy": sampled[-1] if sampled else None,
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "steps": len(curve),
        "kl_k3_mean": sum(kls) / len(kls) if kls else None,
        "kl_k3_last": kls[-1] if kls else None,
        "tensorboard": ctx.sink.tensorboard_dir,
        "last": last,
        "time": time.time(),
    }
