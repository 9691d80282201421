"""How a run starts its RL steps: resume from the newest usable checkpoint, or warm-start.

    first_step = start(ctx, heldout)   # every rank; the engine holds the starting weights after it

A resume checks each candidate checkpoint before its weights are read: its host state must be
usable (else it is set aside and the one before it is tried), and the config, tokenizer and prompt
source must be the ones it was trained with (else a named refusal, unless
train.allow_config_change). It continues the run's version, state, RNG, counters and the
schedule's batches generated ahead, and drops the metrics rows of the steps it redoes. A fresh run
loads train.init_checkpoint, runs the SFT warm start (saved for reuse) and takes the before-RL
evaluation.
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from megatron_rl.config import RunConfig, config_to_dict
from megatron_rl.trainer.checkpoint import (
    CorruptCheckpoint,
    load_checkpoint,
    read_rank0_tensors,
    resume_checkpoint,
    save_checkpoint,
)
from megatron_rl.trainer.context import RunContext, RunState
from megatron_rl.trainer.evaluation import evaluate_both
from megatron_rl.trainer.host_state import host_state_problem, set_rng_state
from megatron_rl.trainer.nonfinite import check_parameters
from megatron_rl.trainer.progress import progress_bar, show_progress
from megatron_rl.trainer.resume_check import config_changes, describe_changes
from megatron_rl.trainer.sft import run_sft
from megatron_rl.trainer.stack import build_optimizer
from megatron_rl.trainer.startup import checkpoint_root


def start(ctx: RunContext, heldout) -> int:
    """Resume from the newest verified checkpoint, or warm-start (init checkpoint, SFT) and take
    the before-RL evaluation. Returns the first RL step to run."""
    cfg, rank0 = ctx.cfg, dist.get_rank() == 0
    if ctx.resuming:
        # each candidate is checked before its weights are read: a config it cannot continue under
        # is refused by name (not as a failed load), unusable host state sets it aside
        found = resume_checkpoint(checkpoint_root(cfg), ctx.policy.model, ctx.policy.optimizer,
                                  log=lambda msg: print(msg, file=sys.stderr, flush=True),
                                  check=lambda path, extra: check_resume(ctx, path, extra))
        if found is not None:
            path, extra = found
            first, ctx.policy_version = extra["step"], extra["policy_version"]
            ctx.state, ctx.run_id = RunState.from_dict(extra["state"]), extra["run_id"]
            set_rng_state(extra["rng"])
            counters = extra.get("counters", {})  # cumulative counts continue where they were
            ctx.schedule.load_stats(counters)
            ctx.rewards.load_stats(counters)
            ctx.sink.drop_rows_after(first)  # steps after the checkpoint run again
            if rank0:
                print(f"resumed from {path} at step {first}", flush=True)
            check_parameters(ctx.policy.model, f"the checkpoint {path}",
                             "It was written before checkpoints were checked: move it aside to resume from an "
                             "older one")
            ctx.transport.push(ctx.policy, ctx.engine, ctx.policy_version)
            return first
    if cfg.train.init_checkpoint:
        # refused before the weights are read: the record is in the host state's JSON
        load_checkpoint(cfg.train.init_checkpoint, ctx.policy.model,
                        check=lambda path, extra: check_tokenizer(ctx, path, extra, "train.init_checkpoint"))
        # bf16/fp16: the optimizer keeps fp32 master copies of the weights it was built with; a
        # fresh one starts from the loaded weights (else its first step would restore the old ones)
        ctx.policy.optimizer = build_optimizer(ctx.policy.model, ctx.policy.settings)
    if cfg.sft.steps > 0:
        bar = progress_bar(cfg.sft.steps, "SFT", show_progress(cfg))
        ctx.state.sft = run_sft(ctx, heldout, bar)
        if bar is not None:
            bar.close()
        # reusable warm start: `train.init_checkpoint=<run_dir>/sft/iter_...` skips SFT next time
        ctx.state.sft["checkpoint"] = save_checkpoint(
            os.path.join(cfg.train.run_dir, "sft"), ctx.state.sft["steps"], ctx.policy.model,
            extra={"step": 0, "sft": True, "arch": ctx.policy.arch.to_dict(), "tokenizer": ctx.tokenizer.fingerprint},
            run_id=ctx.run_id)
        ctx.policy.optimizer = build_optimizer(ctx.policy.model, ctx.policy.settings)  # fresh Adam for RL
    check_parameters(ctx.policy.model, f"the initial weights ({weights_source(cfg)})")  # before the engine has them
    ctx.transport.push(ctx.policy, ctx.engine, ctx.policy_version)
    if heldout:
        before = evaluate_both(ctx, heldout)
        ctx.state.before_rl_accuracy = before["eval/heldout_accuracy"]
        ctx.state.before_rl_sampled_accuracy = before["eval/heldout_sampled_accuracy"]
    ctx.state.curve = []
    return 0


def check_resume(ctx: RunContext, path: str, extra: dict) -> None:
    """Before checkpoint `path`'s weights are read (every rank): its host state must be usable
    (else CorruptCheckpoint: set aside, the previous checkpoint is tried), the config must allow
    continuing it (else ValueError), and rank 0 takes the schedule's queued batches from it."""
    problem = host_state_problem(extra)
    if problem:
        raise CorruptCheckpoint(f"checkpoint {path} cannot be resumed: its host state (extra/rank_*.json) is "
                                f"unusable: {problem}")
    check_resumable(ctx, path, extra)
    if dist.get_rank() == 0:  # batches generated ahead by the schedule: trained on as they were
        try:
            ctx.schedule.load_state_dict(read_rank0_tensors(path, "schedule") or {})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpoint(f"{path}/extra/schedule.pt does not hold a schedule's batches ({type(e).__name__}: "
                                    f"{e})") from None


def weights_source(cfg: RunConfig) -> str:
    """Where the weights RL starts from come from, for an error message."""
    if cfg.sft.steps > 0:
        return f"the SFT warm start of sft.steps={cfg.sft.steps}"
    if cfg.train.init_checkpoint:
        return f"train.init_checkpoint={cfg.train.init_checkpoint}"
    if cfg.model.hf_dir:
        return f"model.hf_dir={cfg.model.hf_dir}"
    return f"random init with model.init_std={cfg.model.init_std:g}"


def check_resumable(ctx: RunContext, path: str, extra: dict) -> None:
    """Refuse (ValueError, every rank alike) to continue checkpoint `path` under a config, tokenizer
    or prompt source that changes what the remaining steps compute, unless train.allow_config_change."""
    if ctx.cfg.train.allow_config_change:
        return
    changes = config_changes(extra.get("config", {}), config_to_dict(ctx.cfg))
    if changes:
        raise ValueError(describe_changes(changes, path))
    check_tokenizer(ctx, path, extra, "train.resume")
    if "data" in extra:  # rows, seed, content: step k must map to the same prompts as before
        try:
            ctx.prompts.load_state_dict(extra["data"])
        except ValueError as e:
            raise ValueError(f"train.resume: {path}: {e} (or pass train.allow_config_change=true)") from None


def check_tokenizer(ctx: RunContext, path: str, extra: dict, field: str) -> None:
    """Refuse (ValueError) checkpoint `path` when it was trained with other token ids than
    data.tokenizer gives now: the same setting can name changed files (an edited tokenizer.json, other
    end tokens), and the weights would then read other text. A checkpoint that records no tokenizer
    (older, or converted from a folder without a usable tokenizer) is not checked;
    train.allow_config_change skips it."""
    saved = extra.get("tokenizer")
    if ctx.cfg.train.allow_config_change or saved is None or saved == ctx.tokenizer.fingerprint:
        return
    raise ValueError(f"{field}: {path} was trained with another tokenizer ({saved}; data.tokenizer="
                     f"{ctx.cfg.data.tokenizer} is {ctx.tokenizer.fingerprint} now: other token ids or end tokens); "
                     f"restore the tokenizer files it was trained with, start a fresh run, or pass "
                     f"train.allow_config_change=true")
