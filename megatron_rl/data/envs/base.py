"""The environment contract and the environment registry: what a multi-turn rollout talks to.

    env = make_env("calculator")            # a fresh instance per trajectory (it may keep state)
    text = env.reset(example)               # the first observation: the prompt the policy reads
    step = env.step(generated_text, ids)    # Step(observation, reward or None, done)

An environment is plain Python run in the trainer's process on rank 0 (the multi-turn rollout
function calls it from worker threads with a timeout, rollout/env_calls.py). It sees the decoded
text of each policy turn and that turn's sampled token ids; it answers with the text of its next
observation (the rollout tokenizes it alone and appends its ids: the trajectory is never
re-tokenized), an optional reward, and whether the trajectory is over.

Rewards: a trajectory's reward is the sum of the rewards its environment returned (None counts as
0), so an environment that only scores the final answer returns None until then; each turn's reward
is also logged by turn (env/turn/{k}/reward). `max_turns` is the
environment's own cap on policy turns; the run's `env.max_turns` and token budget can end a
trajectory earlier (rollout/multi_turn.py).

A new environment subclasses `Environment` (a dataclass of its settings, which `env.settings` in
the config sets; a setting annotated str, int, float or bool, or one of them | None, is refused
when it holds another type, naming it) and registers itself with `@register_env("name")`.
Building one must be cheap and do nothing else (the config check builds one to check the
settings); work belongs in reset. Each reset and step must return within env.timeout_s and must
not hold the interpreter's lock for long in one C call (rollout/env_calls.py: a call past its
deadline keeps its thread, and enough of them stop the run). A config may also name an
Environment subclass by import path (`env.name: my_envs:Countdown`, megatron_rl/plugins.py):
`ENV_PLUGINS` registers it under that name.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from megatron_rl.data.types import Example
from megatron_rl.plugins import class_slot

T = TypeVar("T", bound=type)

ENVS: dict[str, type[Environment]] = {}


@dataclass(frozen=True)
class Step:
    """An environment's answer to one policy turn. observation: text appended to the trajectory
    before the next turn ("" for none; ignored once done); reward: this turn's reward or None;
    done: the trajectory is over."""

    observation: str
    reward: float | None
    done: bool


class Environment(ABC):
    """Base class; one instance serves one trajectory (reset once, then step per policy turn)."""

    name: ClassVar[str] = ""
    max_turns: ClassVar[int] = 1
    observation_role: ClassVar[str] = "user"  # its observations' chat role ("tool" for a tool's results)

    @abstractmethod
    def reset(self, example: Example) -> str:
        """The first observation for `example`: the text of the trajectory's prompt."""

    @abstractmethod
    def step(self, generated_text: str, generated_ids: Sequence[int]) -> Step:
        """React to one policy turn: its decoded text (what a reward reads: up to the stop token)
        and the token ids the engine sampled (stop token included)."""

    def demonstrate(self, example: Example) -> list[str] | None:
        """The policy's turns (texts, without the stop token) of a trajectory that solves `example`,
        for the SFT warm start (rollout/multi_turn.py: supervised); None when the environment has
        none. Called on an instance that was just reset with `example`."""
        return None


def register_env(name: str) -> Callable[[T], T]:
    """Class decorator: make the environment constructible as make_env(name, **settings)."""

    def deco(cls: T) -> T:
        if name in ENVS:
            raise ValueError(f"environment {name!r} is already registered")
        cls.name = name
        ENVS[name] = cls
        return cls

    return deco


def make_env(name: str, **settings) -> Environment:
    """A fresh instance of a registered environment; unknown names raise KeyError listing the
    registered ones, unknown settings and settings of the wrong type TypeError (check_setting)."""
    try:
        cls = ENVS[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown environment {name!r}; available: {', '.join(sorted(ENVS))}") from None
    kinds = _setting_kinds(cls)
    for key, value in settings.items():
        if key in kinds:
            check_setting(name, key, value, kinds[key])
        elif dataclasses.is_dataclass(cls):
            raise TypeError(f"{name} takes no setting {key!r}; its settings: {', '.join(kinds) or 'none'}")
    return cls(**settings)


_KINDS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _setting_kinds(cls: type) -> dict[str, str]:
    """Each dataclass field's annotation as text ("str", "int | None", ...); {} for a class that is
    no dataclass."""
    if not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f.type.__name__ if isinstance(f.type, type) else str(f.type) for f in dataclasses.fields(cls)
            if f.init}


def check_setting(env: str, key: str, value, annotation: str) -> None:
    """A setting holds its field's type when that is str, int, float or bool (or one of them | None):
    `call_open: 5` in a config or a JSONL row would otherwise fail every trajectory of the run in the
    environment's step. A bool is no number here, an int is a float. Other annotations are the
    environment's own business (its __post_init__)."""
    kinds = annotation.replace(" ", "").split("|")
    if value is None and "None" in kinds:
        return
    known = [k for k in kinds if k in _KINDS]
    if not known or len(known) != len([k for k in kinds if k != "None"]):
        return
    ok = any(isinstance(value, _KINDS[k]) and (k == "bool" or not isinstance(value, bool)) for k in known)
    if not ok:
        words = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}
        want = " or ".join(words[k] for k in known) + (" or null" if "None" in kinds else "")
        raise TypeError(f"{env}'s setting {key}={value!r}: {want}")


ENV_PLUGINS = class_slot("environment", Environment, ENVS, "megatron_rl/data/envs/base.py")
