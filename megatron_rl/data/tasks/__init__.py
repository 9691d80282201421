"""Verifiable toy tasks generated locally from a seed: `addition` (reversed-digit sums) and
`sorting` (sort 4-6 digits), a registry to add more, and `PromptStream` (a deterministic,
resumable mixture of tasks)."""

from megatron_rl.data.tasks.addition import Addition
from megatron_rl.data.tasks.base import TASKS, Task, make_task, register_task
from megatron_rl.data.tasks.sorting import Sorting
from megatron_rl.data.tasks.stream import PromptStream

__all__ = ["TASKS", "Addition", "PromptStream", "Sorting", "Task", "make_task", "register_task"]
