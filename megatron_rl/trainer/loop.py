"""The run: set up once, optionally warm-start with SFT, then RL steps with eval, logs, checkpoints.

    summary = run(cfg, groups, stop)   # inside torchrun / a single process; see pretrain_rl.py

Start-up refuses, before any step, what would fail or lose work later: prompts longer than the
model and engine take, a checkpoint directory that is not writable or lacks the space for one
checkpoint. A fresh run in a used run_dir moves the earlier run's checkpoints, metrics.jsonl and
TensorBoard events to run_dir/previous/<time>/ (nothing is deleted); a resumed run drops the
metrics rows of steps it is about to redo.
"""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig, config_to_dict
from megatron_rl.config.validate import weight_transport
from megatron_rl.data import CharTokenizer, JsonlPrompts, PromptStream, make_task
from megatron_rl.data.hf_tokenizer import make_tokenizer, padded_vocab
from megatron_rl.losses.setup import ResolvedLoss, resolve_loss
from megatron_rl.metrics.report import bucket_figure, bucket_rows
from megatron_rl.metrics.sink import MetricsSink
from megatron_rl.model.presets import preset_arch
from megatron_rl.parallel import ParallelGroups
from megatron_rl.rewards import RewardRunner
from megatron_rl.rollout import (
    ENGINES,
    ROLLOUT_FNS,
    EngineNeeds,
    EngineRequest,
    RolloutEngine,
    RolloutFn,
    RolloutFnInputs,
)
from megatron_rl.trainer import run_dir as run_files
from megatron_rl.trainer.batch import model_device
from megatron_rl.trainer.checkpoint import (
    CheckpointError,
    CorruptCheckpoint,
    folder_bytes,
    latest_checkpoint,
    load_checkpoint,
    partial_saves,
    read_rank0_tensors,
    resume_checkpoint,
    save_checkpoint,
    sweep_partial_saves,
)
from megatron_rl.trainer.evaluation import evaluate_both, heldout_examples
from megatron_rl.trainer.host_state import host_state_problem, rng_state, set_rng_state
from megatron_rl.trainer.nonfinite import check_parameters
from megatron_rl.trainer.policy import Policy, arch_from_config, build_policy
from megatron_rl.trainer.replay import NoReplay, make_replay
from megatron_rl.trainer.resume_check import config_changes, describe_changes
from megatron_rl.trainer.rl_step import RolloutFailed, rl_step
from megatron_rl.trainer.rollout_io import broadcast
from megatron_rl.trainer.schedule import SyncSchedule, make_schedule
from megatron_rl.trainer.sft import run_sft
from megatron_rl.trainer.stack import build_optimizer
from megatron_rl.trainer.stop import Stopped, StopSignals
from megatron_rl.trainer.transport import TRANSPORTS, TransportInputs, WeightTransport

STDOUT_KEYS = ("rollout/reward_mean", "rollout/accuracy", "mismatch/kl_k3", "loss/policy", "optim/grad_norm",
               "eval/heldout_accuracy", "timing/step", "sft/heldout_accuracy")


@dataclass
class RunContext:
    cfg: RunConfig
    groups: ParallelGroups
    tokenizer: object
    prompts: object
    rewards: RewardRunner
    policy: Policy
    engine: RolloutEngine | None
    sink: MetricsSink
    loss: ResolvedLoss
    rollout_fn: RolloutFn
    transport: WeightTransport
    replay: object = field(default_factory=NoReplay)  # the router replay strategy (none / R2 / R3)
    schedule: object = field(default_factory=SyncSchedule)  # when rollouts are generated / weights synced
    stop: StopSignals = field(default_factory=StopSignals)
    policy_version: int = 0
    run_id: str = ""  # names this run's checkpoints (retention never touches another run's)
    resuming: bool = False
    state: dict = field(default_factory=dict)  # carried across resume (before-RL accuracy, curves)
    run_dir_lock: object | None = None  # rank 0: the open, flock'ed run_dir/.lock (run_dir.lock_run_dir)


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


def max_sequence_length(cfg: RunConfig, arch) -> int:
    """The longest prompt + response the model and the rollout engine both take."""
    return min(arch.max_position_embeddings, ENGINES.get(cfg.rollout.backend).max_len(cfg.rollout, arch))


def make_prompts(cfg: RunConfig, tokenizer, max_len: int):
    """The prompt source, with every prompt checked against `max_len` at start-up: prompt +
    rollout.max_tokens (and, before SFT, prompt + label + eos) must fit."""
    budget = max_len - cfg.rollout.max_tokens
    if cfg.data.jsonl:
        def fits(e):
            n = len(tokenizer.encode_prompt(e.prompt))
            if n > budget:
                return f"{n} prompt tokens + rollout.max_tokens={cfg.rollout.max_tokens} > {max_len}"
            if cfg.sft.steps and n + len(tokenizer.encode(e.label)) + 1 > max_len:
                return f"{n} prompt + {len(tokenizer.encode(e.label))} label tokens + eos > {max_len} (SFT)"
            return None

        prompts = JsonlPrompts(cfg.data.jsonl, seed=cfg.data.seed, tokenizer=tokenizer, fits=fits,
                               overlong=cfg.data.overlong_prompts)
        if prompts.skipped_overlong and dist.get_rank() == 0:
            print(f"data.overlong_prompts=skip: dropped {prompts.skipped_overlong} prompt(s) of {cfg.data.jsonl} "
                  f"longer than the model takes ({max_len} tokens with rollout.max_tokens={cfg.rollout.max_tokens})",
                  flush=True)
        return prompts
    stream = PromptStream([make_task(t, heldout_size=cfg.data.heldout_size) for t in cfg.data.tasks],
                          seed=cfg.data.seed)
    # task prompts are drawn as the run goes: bound their tokens by their characters
    prompt_tokens = tokenizer.token_bound(stream.max_prompt_len())
    label_tokens = tokenizer.token_bound(stream.max_label_len()) + 1 if cfg.sft.steps else 0
    if prompt_tokens + max(cfg.rollout.max_tokens, label_tokens) > max_len:
        raise ValueError(f"data.tasks={cfg.data.tasks}: prompts of up to {prompt_tokens} tokens + "
                         f"rollout.max_tokens={cfg.rollout.max_tokens} exceed the model's maximum length {max_len}; "
                         f"lower rollout.max_tokens or raise model.overrides.max_position_embeddings")
    return stream


def setup(cfg: RunConfig, groups: ParallelGroups, stop: StopSignals | None = None,
          synthetic: bool = False) -> RunContext:
    """Build everything the run needs, after checking what would otherwise fail later. The run
    directory is locked first (rank 0 holds the lock until `close`); a directory another live run
    holds raises RunDirInUse on every rank before anything in it is touched.
    synthetic=True: for a caller that drives the phases itself on synthetic rollouts (a benchmark).
    It never saves, so the room for a checkpoint is not checked, and it decodes no sampled id, so
    the model's vocabulary need not be the tokenizer's (a real preset's 151,936 rows beside the
    toy tasks' 64-symbol tokenizer)."""
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
        ctx = _build(cfg, groups, stop, synthetic)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    ctx.run_dir_lock = lock
    return ctx


def preset_vocab(model_section, tokenizer) -> int | None:
    """The vocabulary a preset model gets (model.overrides.vocab_size wins): the character
    tokenizer's 64, or for an HF tokenizer `hf_tokenizer.padded_vocab`; None with model.hf_dir,
    whose config.json brings its own."""
    if model_section.hf_dir:
        return None
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.vocab_size
    return padded_vocab(tokenizer.vocab_size, preset_arch(model_section.arch, model_section.size).vocab_size)


def check_vocab(cfg: RunConfig, vocab_size: int, tokenizer) -> None:
    """The model's vocabulary must hold every id of the tokenizer; the character tokenizer's must
    match it exactly (its decode refuses ids past its 64, which the model would sample). An HF
    tokenizer's model may be larger (a padded vocabulary): ids past the tokenizer decode as U+FFFD."""
    source = f"model.hf_dir={cfg.model.hf_dir}" if cfg.model.hf_dir else "model.overrides"
    if isinstance(tokenizer, CharTokenizer) and vocab_size != tokenizer.vocab_size:
        own = "data.tokenizer=hf" if cfg.model.hf_dir else "data.tokenizer=/path/to/its/tokenizer/folder"
        raise ValueError(f"{source}: vocab_size={vocab_size}, but data.tokenizer=char is the {tokenizer.vocab_size}-"
                         f"symbol character tokenizer of the toy tasks (megatron_rl/data/tokenizer.py); use a model "
                         f"with vocab_size={tokenizer.vocab_size}, or the model's own tokenizer ({own})")
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"{source}: vocab_size={vocab_size} is smaller than data.tokenizer={cfg.data.tokenizer}'s "
                         f"{tokenizer.vocab_size} tokens: the model cannot read every prompt; use the model's own "
                         f"tokenizer")


def _build(cfg: RunConfig, groups: ParallelGroups, stop: StopSignals | None, synthetic: bool) -> RunContext:
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    rank0 = dist.get_rank() == 0
    tokenizer = make_tokenizer(cfg.data.tokenizer, cfg.model.hf_dir)
    arch = arch_from_config(cfg.model, vocab_size=preset_vocab(cfg.model, tokenizer))
    if not synthetic:
        check_vocab(cfg, arch.vocab_size, tokenizer)
    if groups.config.ep > 1 and not arch.is_moe:
        raise ValueError(f"--expert-model-parallel-size {groups.config.ep} (parallel.expert_model_parallel_size) splits "
                         f"experts, and model {arch.arch} has none; use a MoE model or expert parallel size 1")
    if cfg.model.hf_dir and cfg.model.overrides and rank0:
        print(f"model.overrides {sorted(cfg.model.overrides)} ignored: model.hf_dir's config.json sets the "
              f"architecture", file=sys.stderr, flush=True)
    prompts = make_prompts(cfg, tokenizer, max_sequence_length(cfg, arch))
    if cfg.data.reward is not None:
        rewards = RewardRunner(cfg.data.reward)
    else:  # each task's own reward; JSONL rows use exact match
        rewards = RewardRunner(prompts.rewards(), default="exact_match")
    mode = cfg.moe.router_replay
    if mode != "none" and not arch.is_moe:
        raise ValueError(f"moe.router_replay={mode} needs a MoE model; model arch is {arch.arch}")
    resuming = cfg.train.resume and latest_checkpoint(_ckpt_root(cfg)) is not None
    init = cfg.train.init_checkpoint
    if not resuming and init and os.path.realpath(init).startswith(os.path.realpath(_ckpt_root(cfg)) + os.sep):
        raise ValueError(f"train.init_checkpoint={init} lies in {_ckpt_root(cfg)}, which a fresh run moves to "
                         f"{cfg.train.run_dir}/previous/ before it starts; copy the checkpoint elsewhere, or "
                         f"continue that run with train.resume=true")
    if not resuming and init:
        problem = init_checkpoint_problem(init)
        if problem:
            raise ValueError(problem)
    if mode != "none":
        from megatron_rl.moe import RouterReplayController

        RouterReplayController.forget_global_instances()  # megatron keeps them process-wide
    policy = build_policy(cfg.model, cfg.optim, groups, arch, seed=cfg.train.seed, routing_replay=mode != "none",
                          precision=cfg.precision)
    if not synthetic:
        if rank0:  # before the space check: a failed save's folder must not be what fills the disk
            for root in (_ckpt_root(cfg), os.path.join(cfg.train.run_dir, "sft")):
                for path in sweep_partial_saves(root):
                    print(f"removed {path}: a save that a crash or a failed write cut short", flush=True)
        _check_checkpoint_dirs(cfg, policy, groups)
    loss = resolve_loss(cfg.loss, cfg.rollout.max_tokens)
    stop = stop or StopSignals()
    engine = make_engine(cfg, arch, cfg.train.run_dir, stop)
    # Only now, with the model and the engine built, is the run dir changed: a start that fails
    # before (a GPU-only setting, a missing vLLM) leaves the earlier run where a resume finds it
    if rank0 and not resuming:
        moved = run_files.archive_previous_run(cfg.train.run_dir)
        if moved:
            print(f"fresh run (train.resume={cfg.train.resume}): moved the earlier run's checkpoints and logs in "
                  f"{cfg.train.run_dir} to {moved}", flush=True)
    dist.barrier()
    sink = MetricsSink(cfg.train.run_dir, enabled=rank0, tensorboard=cfg.log.tensorboard,
                       jsonl=cfg.log.jsonl, stdout_keys=STDOUT_KEYS)
    rollout_fn = ROLLOUT_FNS.get(cfg.rollout.function).make(RolloutFnInputs(tokenizer, rewards))
    transport = TRANSPORTS.get(weight_transport(cfg)).make(TransportInputs(groups, arch, cfg.train.run_dir))
    return RunContext(cfg, groups, tokenizer, prompts, rewards, policy, engine, sink, loss, rollout_fn, transport,
                      replay=make_replay(mode, policy.model), schedule=make_schedule(cfg),
                      stop=stop, resuming=resuming,
                      run_id=broadcast(uuid.uuid4().hex[:12] if rank0 else None))


def init_checkpoint_problem(path: str) -> str | None:
    """Why train.init_checkpoint=`path` cannot be loaded as one checkpoint, or None. Checked before
    the model is built, since the load comes after the build and would only report a missing
    manifest.json. A folder of checkpoints (a run's sft/ or checkpoints/) names its newest one."""
    if not os.path.isdir(path):
        return (f"train.init_checkpoint={path}: no such directory; point it at one checkpoint, e.g. "
                f"<run_dir>/sft/iter_0000100")
    newest = latest_checkpoint(path)
    if newest is not None:
        return (f"train.init_checkpoint={path} holds checkpoints rather than being one: use "
                f"train.init_checkpoint={newest} (the newest)")
    return None


def _ckpt_root(cfg: RunConfig) -> str:
    return os.path.join(cfg.train.run_dir, "checkpoints")


def _check_checkpoint_dirs(cfg: RunConfig, policy: Policy, groups: ParallelGroups) -> None:
    """Every rank raises the same error when a checkpoint could not be written (rank 0 decides)."""
    need = run_files.checkpoint_bytes(policy.model, groups, policy.model.module.config.params_dtype)
    problem = None
    if dist.get_rank() == 0:
        held = [(p, folder_bytes(p)) for p in _unfinished_saves(cfg.train.run_dir)]
        problem = run_files.check_writable(_ckpt_root(cfg), need, "train.run_dir", held)
        if problem is None and cfg.sft.steps > 0 and not cfg.train.resume:
            problem = run_files.check_writable(os.path.join(cfg.train.run_dir, "sft"), need, "train.run_dir", held)
    problem = broadcast(problem)
    if problem:
        raise OSError(problem)


def _unfinished_saves(run_dir: str) -> list[str]:
    """The `iter_*.tmp` folders under `run_dir`: its own checkpoint folders' (swept at start-up,
    unless that failed) and those earlier runs, moved to previous/ by a fresh run, took along."""
    roots = [os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, "sft")]
    previous = os.path.join(run_dir, "previous")
    if os.path.isdir(previous):
        roots += [os.path.join(previous, d, "checkpoints") for d in sorted(os.listdir(previous))]
    return [p for root in roots for p in partial_saves(root)]


def show_progress(cfg: RunConfig) -> bool:
    """tqdm bars on rank 0 when log.progress says so; by default only when stdout and stderr are
    both terminals: the bars go to stderr and replace the step lines on stdout, so `> log` or
    `| tee log` with stderr still on a terminal would otherwise leave the log without them."""
    wanted = cfg.log.progress if cfg.log.progress is not None else (sys.stderr.isatty() and sys.stdout.isatty())
    return wanted and dist.get_rank() == 0


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=True)


def run(cfg: RunConfig, groups: ParallelGroups, stop: StopSignals | None = None) -> dict:
    """Run SFT (if configured and not resuming) and RL; return the summary (all ranks).
    Raises Stopped after saving when `stop` saw SIGTERM/SIGINT."""
    ctx = setup(cfg, groups, stop)
    try:
        return train(ctx)
    finally:
        close(ctx)


def close(ctx: RunContext) -> None:
    try:
        ctx.schedule.close()
        ctx.sink.close()
        if ctx.engine is not None:
            ctx.engine.close()
    finally:
        if ctx.run_dir_lock is not None:
            ctx.run_dir_lock.close()


def _start(ctx: RunContext, heldout) -> int:
    """Resume from the newest verified checkpoint, or warm-start (init checkpoint, SFT) and take
    the before-RL evaluation. Returns the first RL step to run."""
    cfg, rank0 = ctx.cfg, dist.get_rank() == 0
    if ctx.resuming:
        # each candidate is checked before its weights are read: a config it cannot continue under
        # is refused by name (not as a failed load), unusable host state sets it aside
        found = resume_checkpoint(_ckpt_root(cfg), ctx.policy.model, ctx.policy.optimizer,
                                  log=lambda msg: print(msg, file=sys.stderr, flush=True),
                                  check=lambda path, extra: _check_resume(ctx, path, extra))
        if found is not None:
            path, extra = found
            start, ctx.policy_version, ctx.state = extra["step"], extra["policy_version"], extra["state"]
            ctx.state.setdefault("curve", [])
            ctx.run_id = extra["run_id"]
            set_rng_state(extra["rng"])
            counters = extra.get("counters", {})  # cumulative counts continue where they were
            ctx.schedule.load_stats(counters)
            ctx.rewards.load_stats(counters)
            ctx.sink.drop_rows_after(start)  # steps after the checkpoint run again
            if rank0:
                print(f"resumed from {path} at step {start}", flush=True)
            check_parameters(ctx.policy.model, f"the checkpoint {path}",
                             "It was written before checkpoints were checked: move it aside to resume from an "
                             "older one")
            ctx.transport.push(ctx.policy, ctx.engine, ctx.policy_version)
            return start
    if cfg.train.init_checkpoint:
        # refused before the weights are read: the record is in the host state's JSON
        load_checkpoint(cfg.train.init_checkpoint, ctx.policy.model,
                        check=lambda path, extra: _check_tokenizer(ctx, path, extra, "train.init_checkpoint"))
        # bf16/fp16: the optimizer keeps fp32 master copies of the weights it was built with; a
        # fresh one starts from the loaded weights (else its first step would restore the old ones)
        ctx.policy.optimizer = build_optimizer(ctx.policy.model, ctx.policy.settings)
    if cfg.sft.steps > 0:
        bar = _progress(cfg.sft.steps, "SFT", show_progress(cfg))
        ctx.state["sft"] = run_sft(ctx, heldout, bar)
        if bar is not None:
            bar.close()
        # reusable warm start: `train.init_checkpoint=<run_dir>/sft/iter_...` skips SFT next time
        ctx.state["sft"]["checkpoint"] = save_checkpoint(
            os.path.join(cfg.train.run_dir, "sft"), ctx.state["sft"]["steps"], ctx.policy.model,
            extra={"step": 0, "sft": True, "arch": ctx.policy.arch.to_dict(), "tokenizer": ctx.tokenizer.fingerprint},
            run_id=ctx.run_id)
        ctx.policy.optimizer = build_optimizer(ctx.policy.model, ctx.policy.settings)  # fresh Adam for RL
    check_parameters(ctx.policy.model, f"the initial weights ({_weights_source(cfg)})")  # before the engine has them
    ctx.transport.push(ctx.policy, ctx.engine, ctx.policy_version)
    if heldout:
        before = evaluate_both(ctx, heldout)
        ctx.state["before_rl_accuracy"] = before["eval/heldout_accuracy"]
        ctx.state["before_rl_sampled_accuracy"] = before["eval/heldout_sampled_accuracy"]
    ctx.state["curve"] = []
    return 0


def _check_resume(ctx: RunContext, path: str, extra: dict) -> None:
    """Before checkpoint `path`'s weights are read (every rank): its host state must be usable
    (else CorruptCheckpoint: set aside, the previous checkpoint is tried), the config must allow
    continuing it (else ValueError), and rank 0 takes the schedule's queued batches from it."""
    problem = host_state_problem(extra)
    if problem:
        raise CorruptCheckpoint(f"checkpoint {path} cannot be resumed: its host state (extra/rank_*.json) is "
                                f"unusable: {problem}")
    _check_resumable(ctx, path, extra)
    if dist.get_rank() == 0:  # batches generated ahead by the schedule: trained on as they were
        try:
            ctx.schedule.load_state_dict(read_rank0_tensors(path, "schedule") or {})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpoint(f"{path}/extra/schedule.pt does not hold a schedule's batches ({type(e).__name__}: "
                                    f"{e})") from None


def _weights_source(cfg: RunConfig) -> str:
    """Where the weights RL starts from come from, for an error message."""
    if cfg.sft.steps > 0:
        return f"the SFT warm start of sft.steps={cfg.sft.steps}"
    if cfg.train.init_checkpoint:
        return f"train.init_checkpoint={cfg.train.init_checkpoint}"
    if cfg.model.hf_dir:
        return f"model.hf_dir={cfg.model.hf_dir}"
    return f"random init with model.init_std={cfg.model.init_std:g}"


def _check_resumable(ctx: RunContext, path: str, extra: dict) -> None:
    """Refuse (ValueError, every rank alike) to continue checkpoint `path` under a config, tokenizer
    or prompt source that changes what the remaining steps compute, unless train.allow_config_change."""
    if ctx.cfg.train.allow_config_change:
        return
    changes = config_changes(extra.get("config", {}), config_to_dict(ctx.cfg))
    if changes:
        raise ValueError(describe_changes(changes, path))
    _check_tokenizer(ctx, path, extra, "train.resume")
    if "data" in extra:  # rows, seed, content: step k must map to the same prompts as before
        try:
            ctx.prompts.load_state_dict(extra["data"])
        except ValueError as e:
            raise ValueError(f"train.resume: {path}: {e} (or pass train.allow_config_change=true)") from None


def _check_tokenizer(ctx: RunContext, path: str, extra: dict, field: str) -> None:
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


def train(ctx: RunContext) -> dict:
    cfg = ctx.cfg
    ckpt_root = _ckpt_root(cfg)
    heldout = heldout_examples(ctx)
    start = _start(ctx, heldout)
    bar = _progress(cfg.train.steps, "RL", show_progress(cfg))
    if bar is not None:
        bar.update(start)
    last, saved = {}, start
    for step in range(start, cfg.train.steps):
        done = step + 1 == cfg.train.steps
        try:
            metrics = rl_step(ctx, step)
            if heldout and (done or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0)):
                try:
                    ctx.schedule.ensure_synced(ctx)  # staged: the engine may still hold the stage's weights
                    metrics.update(evaluate_both(ctx, heldout))
                except RolloutFailed as e:
                    e.completed_steps, e.metrics = step + 1, metrics
                    raise
        except RolloutFailed as e:
            # keep what the completed steps learned (a failure before the update leaves `step` of them)
            completed = e.completed_steps if e.completed_steps is not None else step
            if e.metrics is not None:  # the step was applied: its row and curve point go with it
                _record(ctx, completed, e.metrics, bar)
            path = _save(ctx, ckpt_root, completed) if completed != saved else latest_checkpoint(ckpt_root)
            if ctx.stop.agreed(model_device()):  # the engine went down with the run (SLURM signals it too)
                raise _stopped(ctx, completed, path) from e
            raise RolloutFailed(engine_failure_message(e, completed, path), completed) from e
        _record(ctx, step + 1, metrics, bar)
        if metrics["optim/nonfinite_updates"] and ctx.sink.enabled:
            print(f"warning: step {step + 1}: {metrics['optim/nonfinite_updates']:.0f} of {cfg.train.num_minibatches} "
                  f"updates skipped: their loss or gradient norm was not finite (loss/policy "
                  f"{metrics.get('loss/policy', math.nan):g}, optim/grad_norm {metrics['optim/grad_norm']:g}); the weights and "
                  f"optimizer state are as before them. {ctx.state.get('nonfinite_in_a_row', 0)} in a row; the run "
                  f"stops at train.max_nonfinite_updates={cfg.train.max_nonfinite_updates}", file=sys.stderr,
                  flush=True)
        if metrics["optim/skipped_steps"] and ctx.sink.enabled:
            print(f"step {step + 1}: {metrics['optim/skipped_steps']:.0f} of {cfg.train.num_minibatches} updates "
                  f"skipped (fp16 gradient overflow: weights unchanged); loss scale now "
                  f"{metrics.get('optim/loss_scale', float('nan')):g}", file=sys.stderr, flush=True)
        if cfg.log.figure_every and (step + 1) % cfg.log.figure_every == 0 and ctx.sink.enabled:
            figure = bucket_figure(bucket_rows(metrics), step + 1)
            if figure is not None:
                ctx.sink.log_figure("mismatch/by_rollout_probability", figure, step + 1)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}",
                            kl=f"{metrics.get('mismatch/kl_k3', 0):.2e}")
        last = metrics
        if (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0) or done:
            _save(ctx, ckpt_root, step + 1)
            saved = step + 1
        if not done and ctx.stop.agreed(model_device()):
            path = _save(ctx, ckpt_root, step + 1) if saved != step + 1 else latest_checkpoint(ckpt_root)
            raise _stopped(ctx, step + 1, path)
    if bar is not None:
        bar.close()
    return summarize(ctx, last)


def engine_failure_message(error: BaseException, completed_steps: int, path: str | None) -> str:
    """The rollout engine failed: what was kept and how to go on. `path` is None when no step
    completed and no checkpoint existed (a failure in the first step of a fresh run): there is
    nothing to resume then, so the message says so instead of naming a checkpoint."""
    if path is None:
        return f"{error}. No RL step completed, so nothing was saved; fix the engine and rerun"
    return (f"{error}. Saved a checkpoint of the {completed_steps} completed steps to {path}; fix the engine and "
            f"rerun with train.resume=true")


def _stopped(ctx: RunContext, completed_steps: int, path: str | None) -> Stopped:
    """`path` is None when nothing was saved (see engine_failure_message)."""
    then = (f"checkpoint {path}; rerun with train.resume=true to continue" if path is not None
            else "nothing was saved: rerun to start over")
    return Stopped(ctx.stop.signum, f"stopped by {signal.Signals(ctx.stop.signum).name} after step {completed_steps} "
                                    f"of {ctx.cfg.train.steps}; {then}")


def _record(ctx: RunContext, completed_steps: int, metrics: dict, bar) -> None:
    """Step `completed_steps`'s point on the run's curve (saved with checkpoints) and its metrics row."""
    ctx.state["curve"].append({k: metrics[k] for k in ("rollout/reward_mean", "mismatch/kl_k3",
                                                      "eval/heldout_accuracy", "eval/heldout_sampled_accuracy",
                                                      "loss/policy") if k in metrics})
    ctx.sink.log(completed_steps, metrics, echo=None if bar is not None else f"step {completed_steps}")


def _save(ctx: RunContext, root: str, completed_steps: int) -> str:
    """Save the completed steps; a save that fails stops the run naming the newest checkpoint."""
    ctx.sink.sync()
    try:
        return _save_checkpoint(ctx, root, completed_steps)
    except CheckpointError as e:
        newest = latest_checkpoint(root)
        then = (f"the newest checkpoint is {newest}: rerun with train.resume=true to continue from it" if newest
                else "no checkpoint was saved: rerun to start over")
        raise CheckpointError(f"{e}. The run stopped: {then}") from e


def _save_checkpoint(ctx: RunContext, root: str, completed_steps: int) -> str:
    return save_checkpoint(root, completed_steps, ctx.policy.model, ctx.policy.optimizer,
                           extra={"step": completed_steps, "policy_version": ctx.policy_version, "state": ctx.state,
                                  "rng": rng_state(), "run_id": ctx.run_id, "config": config_to_dict(ctx.cfg),
                                  "data": ctx.prompts.state_dict(), "tokenizer": ctx.tokenizer.fingerprint,
                                  "counters": {**ctx.schedule.stats(), **ctx.rewards.stats()},
                                  "arch": ctx.policy.arch.to_dict()},  # tools/convert_hf_to_mcore.py --reverse
                           keep=ctx.cfg.train.keep_checkpoints, run_id=ctx.run_id,
                           rank0_tensors={"schedule": ctx.schedule.state_dict()} if dist.get_rank() == 0 else None)


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
