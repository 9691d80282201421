"""Start-up checks: what would otherwise fail later, refused before any step (every rank alike).

    limit = max_sequence_length(cfg, arch)          # the model's and the engine's (EngineSpec.max_len)
    prompts = make_prompts(cfg, tokenizer, limit)   # every prompt fits prompt + rollout.max_tokens
    check_vocab(cfg, arch.vocab_size, tokenizer)    # the model reads every id the tokenizer makes
    prepare_saves(cfg, policy, groups)              # cut-short saves removed; room for one checkpoint

Prompts longer than the model and engine take, a vocabulary that cannot hold the tokenizer's ids,
a checkpoint directory that is not writable or lacks the space for one checkpoint, an init
checkpoint that is a folder of them: each is named here with its fix.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from megatron_rl.config import RunConfig
from megatron_rl.data import CharTokenizer, JsonlPrompts, PromptStream, make_task
from megatron_rl.data.byte_tokenizer import ByteTokenizer
from megatron_rl.data.hf_tokenizer import padded_vocab
from megatron_rl.model.presets import preset_arch
from megatron_rl.parallel import ParallelGroups
from megatron_rl.rollout import ENGINES, ROLLOUT_FNS
from megatron_rl.trainer import run_dir as run_files
from megatron_rl.trainer.checkpoint import folder_bytes, latest_checkpoint, partial_saves, sweep_partial_saves
from megatron_rl.trainer.policy import Policy
from megatron_rl.trainer.rollout_io import broadcast


def checkpoint_root(cfg: RunConfig) -> str:
    """Where the run's RL checkpoints go."""
    return os.path.join(cfg.train.run_dir, "checkpoints")


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
        check_row_envs(prompts.examples, cfg)
        if prompts.skipped_overlong and dist.get_rank() == 0:
            print(f"data.overlong_prompts=skip: dropped {prompts.skipped_overlong} prompt(s) of {cfg.data.jsonl} "
                  f"longer than the model takes ({max_len} tokens with rollout.max_tokens={cfg.rollout.max_tokens})",
                  flush=True)
        return prompts
    stream = PromptStream([make_task(t, **cfg.data.settings_of(t)) for t in cfg.data.tasks], seed=cfg.data.seed)
    check_encodable(stream, tokenizer, cfg.data.tokenizer)
    # task prompts are drawn as the run goes: bound their tokens by their characters
    prompt_tokens = tokenizer.token_bound(stream.max_prompt_len())
    label_tokens = tokenizer.token_bound(stream.max_label_len()) + 1 if cfg.sft.steps else 0
    if prompt_tokens + max(cfg.rollout.max_tokens, label_tokens) > max_len:
        raise ValueError(f"data.tasks={cfg.data.tasks}: prompts of up to {prompt_tokens} tokens + "
                         f"rollout.max_tokens={cfg.rollout.max_tokens} exceed the model's maximum length {max_len}; "
                         f"lower rollout.max_tokens or raise model.overrides.max_position_embeddings")
    return stream


def check_encodable(stream: PromptStream, tokenizer, choice: str) -> None:
    """The tasks' held-out problems (the text a run will see) must be text the tokenizer encodes."""
    for e in stream.heldout():
        try:
            tokenizer.encode_prompt(e.prompt)
            tokenizer.encode(e.label)
        except ValueError as err:
            raise ValueError(f"data.tasks: task {e.task}'s problem {e.prompt!r} -> {e.label!r} cannot be encoded by "
                             f"data.tokenizer={choice} ({err}); use "
                             f"data.tokenizer=byte (any text) or the model's own tokenizer") from None


def check_row_envs(examples, cfg: RunConfig) -> None:
    """Rows that name their own environment ("env") need a rollout function that runs
    environments: another would silently train them as single-turn prompts."""
    named = next((e for e in examples if e.env is not None), None)
    if named is not None and not ROLLOUT_FNS.get(cfg.rollout.function).runs_envs:
        raise ValueError(f"data.jsonl={cfg.data.jsonl}: rows name an environment (e.g. \"env\": {named.env!r} for "
                         f"{named.prompt!r}) but rollout.function={cfg.rollout.function} runs none; set "
                         f"rollout.function=multi_turn, or drop the rows' \"env\"")


def preset_vocab(model_section, tokenizer) -> int | None:
    """The vocabulary a preset model gets (model.overrides.vocab_size wins): the character
    tokenizer's 64, the byte tokenizer's 264, or for an HF tokenizer `hf_tokenizer.padded_vocab`; None with model.hf_dir,
    whose config.json brings its own."""
    if model_section.hf_dir:
        return None
    if isinstance(tokenizer, CharTokenizer | ByteTokenizer):  # models trained from scratch: no padding
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


def prepare_saves(cfg: RunConfig, policy: Policy, groups: ParallelGroups) -> None:
    """Remove the folders of saves a crash cut short (rank 0), then check that one checkpoint fits."""
    if dist.get_rank() == 0:  # before the space check: a failed save's folder must not be what fills the disk
        for root in (checkpoint_root(cfg), os.path.join(cfg.train.run_dir, "sft")):
            for path in sweep_partial_saves(root):
                print(f"removed {path}: a save that a crash or a failed write cut short", flush=True)
    check_checkpoint_dirs(cfg, policy, groups)


def check_checkpoint_dirs(cfg: RunConfig, policy: Policy, groups: ParallelGroups) -> None:
    """Every rank raises the same error when a checkpoint could not be written (rank 0 decides)."""
    need = run_files.checkpoint_bytes(policy.model, groups, policy.model.module.config.params_dtype)
    problem = None
    if dist.get_rank() == 0:
        held = [(p, folder_bytes(p)) for p in _unfinished_saves(cfg.train.run_dir)]
        problem = run_files.check_writable(checkpoint_root(cfg), need, "train.run_dir", held)
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
