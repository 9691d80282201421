"""`guess`: a number-guessing game over several turns, with higher/lower feedback.

    prompt  "guess 0-99 n0042:"        (data/tasks/guessing.py; the secret is the label, 57)
    policy  "50" <eos>     env "higher"
    policy  "75" <eos>     env "lower"
    policy  "57" <eos>     reward 1, done

A turn that is not a number in [0, 99] is answered "?". The game ends with reward 1 at the right
guess; after max_turns guesses it ends with reward 0 (seven suffice by bisection). The answers'
spellings are settings (the default ones are in the character tokenizer's vocabulary).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_rl.data.envs.base import Environment, Step, register_env
from megatron_rl.data.types import Example


@register_env("guess")
@dataclass
class Guess(Environment):
    """higher / lower / invalid: the observation after a guess below, above, or not a number."""

    max_turns = 7

    higher: str = "higher"
    lower: str = "lower"
    invalid: str = "?"
    secret: int = field(default=-1, init=False)

    def reset(self, example: Example) -> str:
        self.secret = int(example.label)
        return example.prompt

    def step(self, generated_text: str, generated_ids: Sequence[int]) -> Step:
        text = generated_text.strip()
        if not (text.isdigit() and len(text) <= 2):
            return Step(self.invalid, None, False)
        guess = int(text)
        if guess == self.secret:
            return Step("", 1.0, True)
        return Step(self.higher if guess < self.secret else self.lower, None, False)

    def demonstrate(self, example: Example) -> list[str]:
        """Bisection over [0, 99] to the secret (at most 7 guesses)."""
        lo, hi, guesses = 0, 99, []
        while True:
            mid = (lo + hi) // 2
            guesses.append(str(mid))
            if mid == self.secret:
                return guesses
            lo, hi = (mid + 1, hi) if mid < self.secret else (lo, mid - 1)
