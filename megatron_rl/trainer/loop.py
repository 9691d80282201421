"""The run: set up once, optionally warm-start with SFT, then RL steps with eval, logs, checkpoints.

    summary = run(cfg)      # inside torchrun / a single process; see pretrain_rl.py
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig, config_to_dict
from megatron_rl.data import CharTokenizer, JsonlPrompts, PromptStream, make_task
from megatron_rl.metrics.report import bucket_figure, bucket_rows
from megatron_rl.metrics.sink import MetricsSink
from megatron_rl.parallel import ParallelGroups
from megatron_rl.rewards import RewardRunner
from megatron_rl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.trainer.loss_setup import ResolvedLoss, resolve_loss
from megatron_rl.trainer.policy import Policy, arch_from_config, build_policy
from megatron_rl.trainer.rl_step import RolloutFailed, rl_step
from megatron_rl.trainer.rollout_io import evaluate, sync_weights
from megatron_rl.trainer.sft import run_sft
from megatron_rl.trainer.stack import build_optimizer

STDOUT_KEYS = ("rollout/reward_mean", "rollout/accuracy", "mismatch/kl_k3", "loss/policy", "optim/grad_norm",
               "eval/heldout_accuracy", "timing/step")


@dataclass
class RunContext:
    cfg: RunConfig
    groups: ParallelGroups
    tokenizer: object
    prompts: object
    rewards: RewardRunner
    policy: Policy
    engine: object | None
    sink: MetricsSink
    loss: ResolvedLoss
    scheduler: object | None = None
    replay: object | None = None  # RouterReplayController when moe.router_replay != none
    router_replay: str = "none"
    policy_version: int = 0
    state: dict = field(default_factory=dict)  # carried across resume (before-RL accuracy, curves)


def make_engine(cfg: RunConfig, arch, run_dir: str):
    """The rollout engine, on global rank 0 only."""
    if dist.get_rank() != 0:
        return None
    if cfg.rollout.backend == "embedded":
        from megatron_rl.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(arch, dtype=cfg.rollout.dtype, max_batch_size=cfg.rollout.max_batch_size)
    from megatron_rl.rollout.vllm import make_vllm_engine

    return make_vllm_engine(cfg, arch, run_dir)


def make_prompts(cfg: RunConfig, tokenizer):
    if cfg.data.jsonl:
        return JsonlPrompts(cfg.data.jsonl, seed=cfg.data.seed, tokenizer=tokenizer)
    return PromptStream([make_task(t) for t in cfg.data.tasks], seed=cfg.data.seed)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def setup(cfg: RunConfig, groups: ParallelGroups) -> RunContext:
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    tokenizer = CharTokenizer()
    prompts = make_prompts(cfg, tokenizer)
    if cfg.data.reward is not None:
        rewards = RewardRunner(cfg.data.reward)
    else:  # each task's own reward; JSONL rows use exact match
        rewards = RewardRunner(prompts.rewards() if hasattr(prompts, "rewards") else {}, default="exact_match")
    arch = arch_from_config(cfg.model, vocab_size=tokenizer.vocab_size)
    mode = cfg.moe.router_replay
    if mode != "none" and not arch.is_moe:
        raise ValueError(f"moe.router_replay={mode} needs a MoE model; model arch is {arch.arch}")
    if mode != "none":
        from megatron_rl.moe import RouterReplayController

        RouterReplayController.forget_global_instances()  # megatron keeps them process-wide
    policy = build_policy(cfg.model, cfg.optim, groups, arch, seed=cfg.train.seed, routing_replay=mode != "none")
    loss = resolve_loss(cfg.loss, cfg.rollout.max_tokens)
    sink = MetricsSink(cfg.train.run_dir, enabled=dist.get_rank() == 0, tensorboard=cfg.log.tensorboard,
                       jsonl=cfg.log.jsonl, stdout_keys=STDOUT_KEYS)
    engine = make_engine(cfg, arch, cfg.train.run_dir)
    ctx = RunContext(cfg, groups, tokenizer, prompts, rewards, policy, engine, sink, loss, router_replay=mode)
    if mode != "none":
        from megatron_rl.moe import RouterReplayController

        ctx.replay = RouterReplayController(policy.model)
    return ctx


def _heldout(ctx: RunContext):
    examples = ctx.prompts.heldout() if hasattr(ctx.prompts, "heldout") else []
    return examples[: ctx.cfg.train.eval_size]


def _evaluate_both(ctx: RunContext, heldout) -> dict[str, float]:
    """Greedy and sampled (rollout temperature, fixed seed) held-out accuracy."""
    cfg = ctx.cfg
    return {"eval/heldout_accuracy": evaluate(ctx.engine, ctx.tokenizer, heldout, ctx.rewards, cfg.rollout.max_tokens),
            "eval/heldout_sampled_accuracy": evaluate(ctx.engine, ctx.tokenizer, heldout, ctx.rewards,
                                                      cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                                                      seed=cfg.train.seed)}


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=True)


def run(cfg: RunConfig, groups: ParallelGroups) -> dict:
    """Run SFT (if configured and not resuming) and RL; return the summary (all ranks)."""
    ctx = setup(cfg, groups)
    try:
        return train(ctx)
    finally:
        close(ctx)


def close(ctx: RunContext) -> None:
    ctx.sink.close()
    if ctx.engine is not None:
        ctx.engine.close()


def train(ctx: RunContext) -> dict:
    cfg = ctx.cfg
    rank0 = dist.get_rank() == 0
    ckpt_root = os.path.join(cfg.train.run_dir, "checkpoints")
    heldout = _heldout(ctx)
    start = 0
    resume_from = latest_checkpoint(ckpt_root) if cfg.train.resume else None
    if resume_from:
        extra = load_checkpoint(resume_from, ctx.policy.model, ctx.policy.optimizer)
        start, ctx.policy_version, ctx.state = extra["step"], extra["policy_version"], extra["state"]
        _set_rng_state(extra["rng"])
        if rank0:
            print(f"resumed from {resume_from} at step {start}", flush=True)
    else:
        if cfg.train.init_checkpoint:
            load_checkpoint(cfg.train.init_checkpoint, ctx.policy.model)
        if cfg.sft.steps > 0:
            bar = _progress(cfg.sft.steps, "SFT", rank0 and cfg.log.progress)
            ctx.state["sft"] = run_sft(ctx, heldout, bar)
            if bar is not None:
                bar.close()
            # reusable warm start: `train.init_checkpoint=<run_dir>/sft/iter_...` skips SFT next time
            ctx.state["sft"]["checkpoint"] = save_checkpoint(
                os.path.join(cfg.train.run_dir, "sft"), ctx.state["sft"]["steps"], ctx.policy.model,
                extra={"step": 0, "sft": True})
            ctx.policy.optimizer = build_optimizer(ctx.policy.model, ctx.policy.settings)  # fresh Adam for RL
        sync_weights(ctx.policy, ctx.engine, ctx.policy_version)
        if heldout:
            before = _evaluate_both(ctx, heldout)
            ctx.state["before_rl_accuracy"] = before["eval/heldout_accuracy"]
            ctx.state["before_rl_sampled_accuracy"] = before["eval/heldout_sampled_accuracy"]
        ctx.state["curve"] = []
    if resume_from:
        sync_weights(ctx.policy, ctx.engine, ctx.policy_version)

    bar = _progress(cfg.train.steps, "RL", rank0 and cfg.log.progress)
    if bar is not None:
        bar.update(start)
    last = {}
    for step in range(start, cfg.train.steps):
        try:
            metrics = rl_step(ctx, step)
        except RolloutFailed as e:
            # nothing of this step was applied yet: keep what the previous steps learned
            path = _save(ctx, ckpt_root, step)
            raise RolloutFailed(f"{e}. Saved a checkpoint of the {step} completed steps to {path}; fix the "
                                f"engine and rerun with train.resume=true") from e
        if heldout and cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
            metrics.update(_evaluate_both(ctx, heldout))
        ctx.state["curve"].append({k: metrics[k] for k in ("rollout/reward_mean", "mismatch/kl_k3",
                                                          "eval/heldout_accuracy", "eval/heldout_sampled_accuracy",
                                                          "loss/policy") if k in metrics})
        ctx.sink.log(step + 1, metrics, echo=None if bar is not None else f"step {step + 1}")
        if cfg.log.figure_every and (step + 1) % cfg.log.figure_every == 0 and ctx.sink.enabled:
            figure = bucket_figure(bucket_rows(metrics), step + 1)
            if figure is not None:
                ctx.sink.log_figure("mismatch/by_rollout_probability", figure, step + 1)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}",
                            kl=f"{metrics.get('mismatch/kl_k3', 0):.2e}")
        last = metrics
        done = step + 1 == cfg.train.steps
        if (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0) or done:
            _save(ctx, ckpt_root, step + 1)
    if bar is not None:
        bar.close()
    return summarize(ctx, last)


def _save(ctx: RunContext, root: str, completed_steps: int) -> str:
    return save_checkpoint(root, completed_steps, ctx.policy.model, ctx.policy.optimizer,
                           extra={"step": completed_steps, "policy_version": ctx.policy_version, "state": ctx.state,
                                  "rng": _rng_state(), "config": config_to_dict(ctx.cfg)})


def summarize(ctx: RunContext, last: dict) -> dict:
    curve = ctx.state.get("curve", [])
    rewards = [c["rollout/reward_mean"] for c in curve]
    k = max(1, min(10, len(rewards) // 4 or 1))
    evals = [c["eval/heldout_accuracy"] for c in curve if "eval/heldout_accuracy" in c]
    sampled = [c["eval/heldout_sampled_accuracy"] for c in curve if "eval/heldout_sampled_accuracy" in c]
    kls = [c["mismatch/kl_k3"] for c in curve if "mismatch/kl_k3" in c]
    return {
        "sft": ctx.state.get("sft"),
        "before_rl_accuracy": ctx.state.get("before_rl_accuracy"),
        "after_rl_accuracy": evals[-1] if evals else None,
        "before_rl_sampled_accuracy": ctx.state.get("before_rl_sampled_accuracy"),
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
