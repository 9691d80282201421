"""What a resume may change: the config a checkpoint was trained with against the one resuming it.

A resumed run is the same experiment continued, so the fields that decide what the remaining
steps compute (model, data, loss, sampling, optimizer, seeds, schedule, precision, router replay)
must match the checkpoint's. Without this check a reused `train.run_dir` (`train.resume` is on by
default) would quietly continue an old run under a new config.

`MAY_CHANGE` lists what a resume may change, by dotted name or section prefix: where and how
often to log, save and evaluate; how many non-finite updates in a row stop the run; the parallel layout (checkpoints reshard); the micro-batch size,
activation recompute and loss.head_gradients (memory and speed settings: the same gradient,
summed in other groupings or recomputed); SFT (it ran before the checkpoint); the engine's
placement and server address (an engine's own section, `rollout.<engine>`, lists what may change
in its EngineSpec's `may_change`: for vLLM where the server runs and how it is reached, restarted
and probed; not its dtype, quantization, log-prob mode, seed, lengths or extra arguments; compared
field by field with their defaults filled in); and `train.steps` (to extend or shorten the run),
except under `train.schedule=staged`, where it sets the stages' length.
Anything not listed must match; `train.allow_config_change=true` continues anyway.
"""
from __future__ import annotations

from dataclasses import asdict

from megatron_rl.rollout import ENGINES

MAY_CHANGE = (
    "train.steps", "train.eval_every", "train.eval_size", "train.save_every", "train.keep_checkpoints",
    "train.run_dir", "train.resume", "train.init_checkpoint", "train.allow_config_change",
    "train.micro_batch_size", "train.max_nonfinite_updates", "model.recompute", "loss.head_gradients", "data.heldout_size",
    "rollout.max_batch_size", "rollout.device", "rollout.weight_sync", "env.max_stuck_calls", "env.max_calls_in_flight",
    "parallel", "log", "sft",
)


def engine_may_change() -> tuple[str, ...]:
    """`rollout.<engine>.<field>` for every field a registered engine says a resume may change."""
    return tuple(f"rollout.{name}.{f}" for name in ENGINES.names() for f in ENGINES.get(name).may_change)


def fields(config: dict) -> dict[str, object]:
    """`{"train": {"steps": 3}}` -> `{"train.steps": 3}` (section.field; a mapping-valued field
    such as `model.overrides` stays one value). An engine's section (`rollout.vllm`) is spread into
    `rollout.<engine>.<field>`, with the defaults of the fields an older checkpoint does not hold.
    A top-level value that is not a section (`plugins`) is one value under its own name. Nothing
    here imports what a name refers to: a checkpoint's plugins are compared as text, never loaded."""
    out = {}
    for section, values in config.items():
        if isinstance(values, dict):
            out.update({f"{section}.{name}": value for name, value in values.items()})
        else:
            out[section] = values
    for engine in ENGINES.names():
        settings = ENGINES.get(engine).settings
        values = out.pop(f"rollout.{engine}", None)
        if settings is None or not isinstance(values, dict):
            continue
        try:
            values = asdict(settings(**values))
        except (TypeError, ValueError):   # a checkpoint's keys from another version: compare what is there
            pass
        out.update({f"rollout.{engine}.{name}": value for name, value in values.items()})
    return out


def may_change(name: str, now: dict[str, object]) -> bool:
    if name == "train.steps":
        return now.get("train.schedule") != "staged"
    return any(name == p or name.startswith(p + ".") for p in MAY_CHANGE + engine_may_change())


def config_changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """`(name, checkpoint's value, current value)` of every field that differs and may not change
    on resume, sorted by name. `saved`, `now`: `config_to_dict` trees. A field only one side has
    (a checkpoint from before the field existed) is not compared."""
    a, b = fields(saved), fields(now)
    return sorted((k, a[k], b[k]) for k in a.keys() & b.keys() if a[k] != b[k] and not may_change(k, b))


def describe_changes(changes: list[tuple[str, object, object]], checkpoint: str) -> str:
    """The start-up error for `changes` (non-empty)."""
    listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes[:8])
    more = f" (and {len(changes) - 8} more)" if len(changes) > 8 else ""
    return (f"train.resume: {checkpoint} was trained with another config ({listed}{more}); these change what the "
            f"remaining steps compute. Resume with the checkpoint's values, start a fresh run (train.resume=false "
            f"or another train.run_dir), or pass train.allow_config_change=true to continue with the new ones")
