"""`addition`: a + b with the answer's digits reversed.

    prompt "123+456="   label "975"      (579 reversed; the model emits the ones digit first,
    prompt "500+500="   label "0001"      which is the order carries are computed in)

Operands are uniform in [0, 10**digits). With zero_pad (default) they are written with exactly
`digits` digits ("007+045=" -> "25"), so every digit sits at a fixed position. The label is
str(a + b) reversed: no padding, at most digits + 1 characters.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_rl.data.tasks.base import Task, register_task
from megatron_rl.data.types import Example


@register_task("addition")
@dataclass(frozen=True, kw_only=True)
class Addition(Task):
    """digits: operand width (1..9); zero_pad: write operands with leading zeros."""

    digits: int = 3
    zero_pad: bool = True

    def __post_init__(self):
        if not 1 <= self.digits <= 9:
            raise ValueError(f"addition: digits must be in [1, 9], got {self.digits}")
        super().__post_init__()

    @property
    def num_problems(self) -> int:
        return 10 ** (2 * self.digits)

    @property
    def max_label_len(self) -> int:
        return self.digits + 1

    @property
    def max_prompt_len(self) -> int:
        return 2 * self.digits + 2  # "a+b="

    def generate(self, rng: random.Random) -> Example:
        a = rng.randrange(10**self.digits)
        b = rng.randrange(10**self.digits)
        fmt = f"0{self.digits}d" if self.zero_pad else "d"
        return Example(prompt=f"{a:{fmt}}+{b:{fmt}}=", label=str(a + b)[::-1], task=self.name)
