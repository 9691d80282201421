"""`multiplication`: a 3-digit by 2-digit product, the calculator environment's task.

    prompt "123*45="   label "5535"

Operands are uniform in [100, 999] and [10, 99] (81,000 problems); the label is the product in
plain decimal. A tiny model cannot multiply in its head; with the `calculator` environment
(data/envs/calculator.py) it can ask for the product and copy it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_rl.data.tasks.base import Task, register_task
from megatron_rl.data.types import Example


@register_task("multiplication")
@dataclass(frozen=True, kw_only=True)
class Multiplication(Task):
    @property
    def num_problems(self) -> int:
        return 900 * 90

    @property
    def max_label_len(self) -> int:
        return 5  # 999 * 99 = 98901

    @property
    def max_prompt_len(self) -> int:
        return 7  # "abc*de="

    def generate(self, rng: random.Random) -> Example:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        return Example(prompt=f"{a}*{b}=", label=str(a * b), task=self.name)
