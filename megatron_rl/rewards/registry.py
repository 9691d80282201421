"""Reward functions by name. A reward function is pure: (prompt, response, label) -> float.

    @register_reward("my_reward")
    def my_reward(prompt: str, response: str, label: str) -> float: ...
    get_reward("my_reward")           # KeyError listing the registered names if unknown

It may raise; `RewardRunner` turns an exception into reward 0.0 and counts it. A config may also
name a function by import path (`data.reward: my_rewards:strict_match`, megatron_rl/plugins.py):
`REWARD_PLUGINS` registers it under that name.
"""
from __future__ import annotations

from collections.abc import Callable

from megatron_rl.plugins import PluginSlot, call_refusal

RewardFn = Callable[[str, str, str], float]

REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; available: {', '.join(sorted(REWARDS))}") from None


def reward_names() -> list[str]:
    return sorted(REWARDS)


REWARD_PLUGINS = PluginSlot(
    kind="reward", expects="a function (prompt, response, label) -> float", entries=REWARDS,
    refuse=lambda obj: call_refusal(obj, ("prompt", "response", "label")),
    add=lambda name, fn: register_reward(name)(fn))
