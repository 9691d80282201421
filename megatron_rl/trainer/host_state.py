"""The host state a checkpoint keeps for a resume (extra/rank_XXXXX.json), and its check.

    extra = {"step": 12, "policy_version": 12, "run_id": "3f2a...", "state": {"curve": [...], ...},
             "rng": rng_state(), "config": {...}, "data": {...}, "tokenizer": "...", "arch": {...},
             "counters": {"schedule/generate_calls": 12, "rewards/count": 384, ...}}

Each rank writes its own (its RNG streams are its own). A resume reads every field back, so
`host_state_problem` checks each one's type and range before anything is used. The manifest's
hashes only say the bytes are the ones written: a checkpoint of another version, or one edited
and re-signed, can still hold `"step": "2"`, and that must not stop a resume as a raw TypeError
three calls later. A checkpoint with such a field is set aside like a corrupt one.
"""
from __future__ import annotations

import math
import random

import torch


def rng_state() -> dict:
    """Host RNG streams as JSON (the torch CPU generator and this rank's CUDA device's, as byte
    lists; only the rank's own device, so a resume may see a different number of GPUs)."""
    state = {"torch": torch.get_rng_state().tolist(), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _jsonable(obj):
    return [_jsonable(o) for o in obj] if isinstance(obj, (tuple, list)) else obj


def _count(v) -> bool:
    return type(v) is int and v >= 0


def _number(v) -> bool:
    return type(v) in (int, float)


def _bytes(v, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(type(b) is int and 0 <= b < 256 for b in v)


def host_state_problem(extra: dict) -> str | None:
    """What makes `extra` (one rank's host state) unusable for a resume, naming the field; None
    when every field a resume reads is there with its type. Fields a checkpoint may lack (written
    before they existed: config, data, tokenizer, counters) are checked only when present."""
    for name in ("step", "policy_version"):
        if not _count(extra.get(name)):
            return f"{name} is {extra.get(name)!r}, not a count"
    if not isinstance(extra.get("run_id"), str):
        return f"run_id is {extra.get('run_id')!r}, not a string"
    problem = _state_problem(extra.get("state")) or _rng_problem(extra.get("rng"))
    if problem:
        return problem
    config = extra.get("config", {})
    if not (isinstance(config, dict) and all(isinstance(v, dict) for k, v in config.items() if k != "plugins")):
        return "config is not a mapping of sections"
    plugins = config.get("plugins", [])
    if not (isinstance(plugins, list) and all(isinstance(m, str) for m in plugins)):
        return "config.plugins is not a list of module names"
    if not isinstance(extra.get("data", {}), dict):
        return "data is not a mapping"
    counters = extra.get("counters", {})
    if not (isinstance(counters, dict) and all(isinstance(k, str) and _count(v) for k, v in counters.items())):
        return "counters is not a mapping of names to counts"
    return None


def _state_problem(state) -> str | None:
    if not isinstance(state, dict):
        return "state is not a mapping"
    curve = state.get("curve", [])
    if not isinstance(curve, list):
        return "state.curve is not a list"
    for i, point in enumerate(curve):
        if not (isinstance(point, dict) and _number(point.get("rollout/reward_mean"))
                and all(isinstance(k, str) and _number(v) for k, v in point.items())):
            return f"state.curve[{i}] is not a point of the curve (names to numbers, rollout/reward_mean among them)"
    for name in ("before_rl_accuracy", "before_rl_sampled_accuracy"):
        if state.get(name) is not None and not _number(state[name]):
            return f"state.{name} is {state[name]!r}, not a number"
    if state.get("sft") is not None and not isinstance(state["sft"], dict):
        return "state.sft is not a mapping"
    return None


def _rng_problem(rng) -> str | None:
    if not isinstance(rng, dict):
        return "rng is not a mapping"
    if not _bytes(rng.get("torch"), torch.get_rng_state().numel()):
        return "rng.torch is not the torch generator's state"
    if "cuda" in rng and torch.cuda.is_available() and not _bytes(rng["cuda"], torch.cuda.get_rng_state().numel()):
        return "rng.cuda is not a CUDA generator's state"
    python = rng.get("python")
    try:
        version, internal, gauss = python
        if gauss is not None and not (_number(gauss) and math.isfinite(gauss)):
            raise TypeError(gauss)
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError, OverflowError):
        return "rng.python is not Python's random state"
    return None
