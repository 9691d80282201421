"""Build a run: `setup` for pretrain_rl.py's runs, `build_context` for a caller that drives the
phases itself (a benchmark on synthetic rollouts).

    ctx = setup(cfg, groups, stop)            # lock run_dir, check, build; close(ctx) releases it
    ctx = build_context(cfg, groups)          # the parts only: no lock, no run checks

The run directory is locked first (rank 0 holds the lock until `close`); a directory another live
run holds raises RunDirInUse on every rank before anything in it is touched. Only once the model
and the engine are built is the run directory changed: a fresh run in a used run_dir moves the
earlier run's checkpoints, metrics.jsonl and TensorBoard events to run_dir/previous/<time>/
(nothing is deleted), so a start that fails before (a GPU-only setting, a missing vLLM) leaves
the earlier run where a resume finds it.
"""
from __future__ import annotations

import os
import random
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig
from megatron_rl.data.hf_tokenizer import make_tokenizer
from megatron_rl.losses.setup import resolve_loss
from megatron_rl.metrics.sink import MetricsSink
from megatron_rl.parallel import ParallelGroups
from megatron_rl.rewards import RewardRunner
from megatron_rl.rollout import (
    ENGINES,
    ROLLOUT_FNS,
    EngineNeeds,
    EngineRequest,
    RolloutEngine,
    RolloutFnInputs,
)
from megatron_rl.rollout.engine import WEIGHT_SYNCS, weight_sync
from megatron_rl.rollout.function import max_trained
from megatron_rl.trainer import run_dir as run_files
from megatron_rl.trainer.batch import model_device
from megatron_rl.trainer.checkpoint import latest_checkpoint
from megatron_rl.trainer.context import RunContext
from megatron_rl.trainer.policy import Policy, arch_from_config, build_policy
from megatron_rl.trainer.progress import STDOUT_KEYS
from megatron_rl.trainer.replay import make_replay
from megatron_rl.trainer.rollout_io import broadcast
from megatron_rl.trainer.rollouts import Batches, EngineWeights
from megatron_rl.trainer.schedule import SCHEDULES, ScheduleInputs
from megatron_rl.trainer.startup import (
    check_vocab,
    checkpoint_root,
    init_checkpoint_problem,
    make_prompts,
    max_sequence_length,
    prepare_saves,
    preset_vocab,
)
from megatron_rl.trainer.stop import StopSignals
from megatron_rl.trainer.transport import TRANSPORTS, TransportInputs


@dataclass(frozen=True)
class RunChecks:
    """Checks a run makes while it is built, beyond what every build does. vocab(cfg, arch,
    tokenizer): before the model is built; saves(cfg, policy, groups): once it is."""

    vocab: Callable[..., None] = lambda cfg, arch, tokenizer: None
    saves: Callable[..., None] = lambda cfg, policy, groups: None


# a run decodes every sampled id (the model's vocabulary must be the tokenizer's) and saves
RUN = RunChecks(vocab=lambda cfg, arch, tokenizer: check_vocab(cfg, arch.vocab_size, tokenizer), saves=prepare_saves)


def setup(cfg: RunConfig, groups: ParallelGroups, stop: StopSignals | None = None) -> RunContext:
    """Lock the run directory, then build everything the run needs after checking what would
    otherwise fail later (`RUN`)."""
    lock, problem = None, None
    if dist.get_rank() == 0:
        try:
            lock = run_files.lock_run_dir(cfg.train.run_dir)
        except run_files.RunDirRefused as e:
            problem = (isinstance(e, run_files.RunDirInUse), str(e))
    problem = broadcast(problem)
    if problem:
        raise (run_files.RunDirInUse if problem[0] else run_files.RunDirRefused)(problem[1])
    try:
        ctx = build_context(cfg, groups, stop, RUN)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    ctx.run_dir_lock = lock
    return ctx


def build_context(cfg: RunConfig, groups: ParallelGroups, stop: StopSignals | None = None,
                  checks: RunChecks = RunChecks()) -> RunContext:
    """Every part of the run, on every rank (the engine on rank 0). Without `checks` (a benchmark
    that never saves and decodes no sampled id) a real preset's 151,936-row vocabulary may sit
    beside the toy tasks' 64-symbol tokenizer and no room for a checkpoint is needed."""
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    rank0 = dist.get_rank() == 0
    tokenizer = make_tokenizer(cfg.data.tokenizer, cfg.model.hf_dir)
    arch = arch_from_config(cfg.model, vocab_size=preset_vocab(cfg.model, tokenizer))
    checks.vocab(cfg, arch, tokenizer)
    if groups.config.ep > 1 and not arch.is_moe:
        raise ValueError(f"--expert-model-parallel-size {groups.config.ep} (parallel.expert_model_parallel_size) splits "
                         f"experts, and model {arch.arch} has none; use a MoE model or expert parallel size 1")
    if cfg.model.hf_dir and cfg.model.overrides and rank0:
        print(f"model.overrides {sorted(cfg.model.overrides)} ignored: model.hf_dir's config.json sets the "
              f"architecture", file=sys.stderr, flush=True)
    prompts = make_prompts(cfg, tokenizer, max_sequence_length(cfg, arch))
    rewards = make_rewards(cfg, prompts, rank0)
    mode = cfg.moe.router_replay
    if mode != "none" and not arch.is_moe:
        raise ValueError(f"moe.router_replay={mode} needs a MoE model; model arch is {arch.arch}")
    resuming = _check_start(cfg)
    if mode != "none":
        from megatron_rl.moe import RouterReplayController

        RouterReplayController.forget_global_instances()  # megatron keeps them process-wide
    policy = build_policy(cfg.model, cfg.optim, groups, arch, seed=cfg.train.seed, routing_replay=mode != "none",
                          precision=cfg.precision)
    checks.saves(cfg, policy, groups)
    stop = stop or StopSignals()
    engine = make_engine(cfg, arch, cfg.train.run_dir, stop)
    if rank0 and not resuming:
        moved = run_files.archive_previous_run(cfg.train.run_dir)
        if moved:
            print(f"fresh run (train.resume={cfg.train.resume}): moved the earlier run's checkpoints and logs in "
                  f"{cfg.train.run_dir} to {moved}", flush=True)
    dist.barrier()
    return _assemble(cfg, groups, tokenizer, prompts, rewards, policy, engine, stop, resuming)


def _check_start(cfg: RunConfig) -> bool:
    """Whether the run resumes; a fresh run's init checkpoint must be one checkpoint, outside the
    checkpoints a fresh run moves aside."""
    root, init = checkpoint_root(cfg), cfg.train.init_checkpoint
    resuming = cfg.train.resume and latest_checkpoint(root) is not None
    if not resuming and init and os.path.realpath(init).startswith(os.path.realpath(root) + os.sep):
        raise ValueError(f"train.init_checkpoint={init} lies in {root}, which a fresh run moves to "
                         f"{cfg.train.run_dir}/previous/ before it starts; copy the checkpoint elsewhere, or "
                         f"continue that run with train.resume=true")
    if not resuming and init and (problem := init_checkpoint_problem(init)):
        raise ValueError(problem)
    return resuming


def make_rewards(cfg: RunConfig, prompts, rank0: bool) -> RewardRunner:
    """data.reward for every row, else each task's own reward (JSONL rows: exact match). The judge
    (data.reward=judge) is launched, or reached, on rank 0 alone, where rollouts are scored."""
    if cfg.data.reward == "judge":
        if not rank0:
            return RewardRunner(_scored_on_rank0)
        from megatron_rl.rollout.vllm.judge import Judge

        return RewardRunner(Judge(cfg.judge, cfg.train.run_dir))
    if cfg.data.reward is not None:
        return RewardRunner(cfg.data.reward)
    return RewardRunner(prompts.rewards(), default="exact_match")


def _scored_on_rank0(prompt: str, response: str, label: str) -> float:
    raise RuntimeError("the judge scores on rank 0 only")


def _assemble(cfg: RunConfig, groups: ParallelGroups, tokenizer, prompts, rewards: RewardRunner, policy: Policy,
              engine: RolloutEngine | None, stop: StopSignals, resuming: bool) -> RunContext:
    """The seams' parts from their registries, and the context holding them."""
    rank0 = dist.get_rank() == 0
    sink = MetricsSink(cfg.train.run_dir, enabled=rank0, tensorboard=cfg.log.tensorboard, jsonl=cfg.log.jsonl,
                       stdout_keys=STDOUT_KEYS)
    rollout_fn = ROLLOUT_FNS.get(cfg.rollout.function).make(RolloutFnInputs(tokenizer, rewards, cfg.env))
    sent_by = WEIGHT_SYNCS.get(weight_sync(cfg.rollout)).transport   # rollout.weight_sync's trainer side
    transport = TRANSPORTS.get(sent_by).make(TransportInputs(groups, policy.arch, cfg.train.run_dir))
    batches = Batches(cfg, prompts, tokenizer, rollout_fn, rewards, engine)
    schedule = SCHEDULES.get(cfg.train.schedule).make(ScheduleInputs(cfg.train, batches,
                                                                     EngineWeights(policy, transport, engine)))
    return RunContext(cfg, groups, tokenizer, prompts, rewards, policy, engine, sink, resolve_loss(cfg.loss,
                      max_trained(cfg)), rollout_fn, transport, make_replay(cfg.moe.router_replay, policy.model),
                      schedule, stop=stop, resuming=resuming, run_id=broadcast(uuid.uuid4().hex[:12] if rank0 else None))


def make_engine(cfg: RunConfig, arch, run_dir: str, stop: StopSignals) -> RolloutEngine | None:
    """The rollout engine (cfg.rollout.backend's ENGINES entry), on global rank 0 only; a failure
    to build it raises on every rank. An engine whose server dies once `stop` has a signal does not
    restart it (the run is about to save and exit)."""
    engine, problem = None, None
    if dist.get_rank() == 0:
        request = EngineRequest(arch, cfg.rollout, run_dir, needs=EngineNeeds.of(cfg), device=str(model_device()),
                                stopping=lambda: stop.signum is not None)
        try:
            engine = ENGINES.get(cfg.rollout.backend).make(request)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
            raise
        finally:
            broadcast(problem)
    elif (problem := broadcast(None)) is not None:
        raise RuntimeError(f"the rollout engine could not be built on rank 0: {problem}")
    return engine
