"""Reward functions: pure (prompt, response, label) -> float, registered by name —
`exact_match` (toy tasks) and `math` (math-verify) — and `RewardRunner`, which applies them per
task, never raises, and counts failures for the trainer's metrics."""

from megatron_rl.rewards.exact_match import exact_match
from megatron_rl.rewards.math_verify_reward import math_verify_reward
from megatron_rl.rewards.registry import REWARDS, RewardFn, get_reward, register_reward, reward_names
from megatron_rl.rewards.runner import RewardRunner

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardRunner",
    "exact_match",
    "get_reward",
    "math_verify_reward",
    "register_reward",
    "reward_names",
]
