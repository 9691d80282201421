"""Reward functions by name. A reward function is pure: (prompt, response, label) -> float.

    @register_reward("my_reward")
    def my_reward(prompt: str, response: str, label: str) -> float: ...
    get_reward("my_reward")           # KeyError listing the registered names if unknown

It may raise; `RewardRunner` turns an exception into reward 0.0 and counts it.
"""
from __future__ import annotations

from collections.abc import Callable

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
