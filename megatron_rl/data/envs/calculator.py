"""`calculator`: a tool the policy may call before it answers; reward 1 for the right final answer.

    prompt   "123*45="                     (the task's prompt: data/tasks/multiplication.py)
    policy   "<calc>123*45</calc>" <eos>   a tool call: the whole turn is one call
    env      "<r>5535</r>"                 the result, the next observation
    policy   "5535" <eos>                  any other turn is the final answer: reward 1 if it equals
                                           the label, else 0; the trajectory ends

A call holds two non-negative integers of at most 9 digits and one of + - *; anything else between
the tags answers `?` (the policy sees its mistake; no Python is evaluated). The tags are settings:
the character tokenizer has no `<`, so a toy run spells them in its vocabulary (e.g.
call_open="c:", call_close="", result_open="r:", result_close="", examples/multiturn_cpu.yaml).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_rl.data.envs.base import Environment, Step, register_env
from megatron_rl.data.types import Example

_CALL = re.compile(r"\s*(\d{1,9})\s*([-+*])\s*(\d{1,9})\s*")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def calculate(expression: str) -> str:
    """The value of "a op b" (op in + - *) as decimal text, or "?" for anything else."""
    m = _CALL.fullmatch(expression)
    return str(_OPS[m.group(2)](int(m.group(1)), int(m.group(3)))) if m else "?"


@register_env("calculator")
@dataclass
class Calculator(Environment):
    """call_open / call_close: the tags around a tool call (a turn that starts with call_open and
    ends with call_close is a call); result_open / result_close: around the answer."""

    max_turns = 3  # a call, maybe a second one, the answer
    observation_role = "tool"

    call_open: str = "<calc>"
    call_close: str = "</calc>"
    result_open: str = "<r>"
    result_close: str = "</r>"
    label: str = field(default="", init=False)

    def __post_init__(self):
        if not self.call_open:
            raise ValueError("calculator: call_open must not be empty (it tells a call from an answer)")

    def reset(self, example: Example) -> str:
        self.label = example.label
        return example.prompt

    def step(self, generated_text: str, generated_ids: Sequence[int]) -> Step:
        text = generated_text.strip()
        if text.startswith(self.call_open) and text.endswith(self.call_close):
            inner = text[len(self.call_open):len(text) - len(self.call_close)]
            return Step(self.result_open + calculate(inner) + self.result_close, None, False)
        return Step("", 1.0 if text == self.label else 0.0, True)

    def demonstrate(self, example: Example) -> list[str]:
        """Call the tool on the prompt's expression ("123*45=" -> "123*45"), then answer its result;
        a prompt that is no expression is answered directly."""
        expression = example.prompt.removesuffix("=")
        if calculate(expression) != example.label:
            return [example.label]
        return [self.call_open + expression + self.call_close, example.label]
