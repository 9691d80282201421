"""`sorting`: sort a list of digits ascending.

    prompt "s:5,3,1,4="   label "1345"
    prompt "s:9,0,9,2,7=" label "02799"

The list length is uniform in [min_len, max_len], each digit uniform in 0..9 (repeats allowed).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_rl.data.tasks.base import Task, register_task
from megatron_rl.data.types import Example


@register_task("sorting")
@dataclass(frozen=True, kw_only=True)
class Sorting(Task):
    """min_len, max_len: inclusive range of the list length (1..20)."""

    min_len: int = 4
    max_len: int = 6

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len <= 20:
            raise ValueError(
                f"sorting: need 1 <= min_len <= max_len <= 20, got min_len={self.min_len}, max_len={self.max_len}"
            )
        super().__post_init__()

    @property
    def num_problems(self) -> int:
        return sum(10**n for n in range(self.min_len, self.max_len + 1))

    @property
    def max_label_len(self) -> int:
        return self.max_len

    @property
    def max_prompt_len(self) -> int:
        return 2 * self.max_len + 2  # "s:" + comma-separated digits + "="

    def generate(self, rng: random.Random) -> Example:
        n = rng.randint(self.min_len, self.max_len)
        digits = [rng.randrange(10) for _ in range(n)]
        prompt = "s:" + ",".join(map(str, digits)) + "="
        return Example(prompt=prompt, label="".join(map(str, sorted(digits))), task=self.name)
