"""Verifiable toy tasks generated locally from a seed: `addition` (reversed-digit sums),
`sorting` (sort 4-6 digits), and for multi-turn environments `multiplication` (3 by 2 digits, the
calculator's task) and `guessing` (a secret number, the guess game's), reasoning-gym's generators as
`reasoning_gym:<dataset>` (the optional extra; reasoning_gym_tasks.py), a registry to add more, and
`PromptStream` (a deterministic, resumable mixture of tasks)."""

from megatron_rl.data.tasks.addition import Addition
from megatron_rl.data.tasks.base import TASKS, Task, make_task, register_task
from megatron_rl.data.tasks.guessing import Guessing
from megatron_rl.data.tasks.multiplication import Multiplication
from megatron_rl.data.tasks.reasoning_gym_tasks import ReasoningGymTask
from megatron_rl.data.tasks.sorting import Sorting
from megatron_rl.data.tasks.stream import PromptStream

__all__ = ["TASKS", "Addition", "Guessing", "Multiplication", "PromptStream", "ReasoningGymTask", "Sorting", "Task", "make_task", "register_task"]
