"""`guessing`: find a secret number in [0, 99] by guesses; the `guess` environment's task.

    prompt "guess 0-99 n0042:"   label "57"     (the secret: a hash of the game number)

The prompt names a game (0..9999) and its game number alone determines the secret, so prompts
determine labels as every task's must; the policy cannot read the secret off the prompt. Played
with the `guess` environment (data/envs/guess.py), which answers each guess with higher/lower.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_rl.data.tasks.base import Task, register_task
from megatron_rl.data.types import Example, derive_seed

GAMES = 10_000


def secret_of(game: int) -> int:
    """The secret number of game `game`."""
    return derive_seed("guessing", game) % 100


@register_task("guessing")
@dataclass(frozen=True, kw_only=True)
class Guessing(Task):
    @property
    def num_problems(self) -> int:
        return GAMES

    @property
    def max_label_len(self) -> int:
        return 2

    @property
    def max_prompt_len(self) -> int:
        return len("guess 0-99 n0000:")

    def generate(self, rng: random.Random) -> Example:
        game = rng.randrange(GAMES)
        return Example(prompt=f"guess 0-99 n{game:04d}:", label=str(secret_of(game)), task=self.name)
