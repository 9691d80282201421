"""`exact_match`: 1.0 when the response, stripped of surrounding whitespace, equals the label
(also stripped), else 0.0. The reward of the toy tasks: the detokenizer has already cut the
response at <eos> and marked stray special tokens, so "975" scores and "975 " scores, "9750" does not.
"""
from __future__ import annotations

from megatron_rl.rewards.registry import register_reward


@register_reward("exact_match")
def exact_match(prompt: str, response: str, label: str) -> float:
    return 1.0 if response.strip() == label.strip() else 0.0
