"""The verifiable-task contract and the task registry.

A task is a frozen dataclass of its settings. It generates problems from a `random.Random`, keeps a
fixed held-out split (`heldout_size` distinct problems drawn from `heldout_seed`) and never lets the
training sampler return one of them:

    task = make_task("addition", digits=3)
    task.heldout()              # the same 1,000 examples on every machine and run
    task.sample(rng)            # an Example whose prompt is not in task.heldout()

A new task subclasses `Task`, implements `generate` and `num_problems`, and registers itself with
`@register_task("name")`. Prompts must determine labels (two problems with the same prompt are the
same problem): held-out membership is checked by prompt. A config may also name a Task subclass
by import path (`data.tasks: [my_tasks:Countdown]`, megatron_rl/plugins.py): `TASK_PLUGINS`
registers it under that name. A task family makes its tasks from a name on first use
(`reasoning_gym:chain_sum`: `TASK_FAMILIES`, `add_family_task`).
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import ClassVar, TypeVar

from megatron_rl.data.types import Example, derive_seed
from megatron_rl.plugins import class_slot

T = TypeVar("T", bound=type)

TASKS: dict[str, type[Task]] = {}
TASK_FAMILIES: dict[str, Callable[[str], type[Task]]] = {}
"""prefix -> builder: the task "<prefix>:<member>" is the class builder(member), made and registered
under the whole name by `add_family_task` (configure/plugins.py calls it for data.tasks)."""

# A training draw that keeps landing in the held-out split means the split is most of the space;
# the size check in __post_init__ prevents that, this bound only turns a bug into an error.
_MAX_REJECTIONS = 10_000


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator: make the task constructible as make_task(name, ...)."""

    def deco(cls: T) -> T:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        cls.name = name
        TASKS[name] = cls
        return cls

    return deco


def family_of(name: object) -> str | None:
    """The registered family a task name belongs to ("reasoning_gym" for "reasoning_gym:chain_sum"), or None."""
    if not isinstance(name, str) or ":" not in name:
        return None
    prefix = name.partition(":")[0]
    return prefix if prefix in TASK_FAMILIES else None


def add_family_task(name: str) -> None:
    """Register the task `name` of a registered family (once); the builder's ValueError says why it
    cannot be made (its package missing, an unknown member)."""
    if name in TASKS:
        return
    prefix, _, member = name.partition(":")
    register_task(name)(TASK_FAMILIES[prefix](member))


def make_task(name: str, **settings) -> Task:
    """Build a registered task; unknown names raise KeyError listing the available ones."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}") from None
    return cls(**settings)


@dataclass(frozen=True, kw_only=True)
class Task(ABC):
    """Base class. heldout_size: number of distinct held-out problems; heldout_seed: their seed
    (keep it fixed across runs so evaluations compare)."""

    name: ClassVar[str] = ""
    reward: ClassVar[str] = "exact_match"  # the rewards registry name that scores this task

    heldout_size: int = 1000
    heldout_seed: int = 0

    def __post_init__(self):
        if self.heldout_size < 0:
            raise ValueError(f"{self.name}: heldout_size must be >= 0, got {self.heldout_size}")
        if self.heldout_size > self.num_problems // 2:
            raise ValueError(
                f"{self.name}: heldout_size={self.heldout_size} is more than half of the "
                f"{self.num_problems} possible problems; lower it or make the task larger"
            )

    @property
    @abstractmethod
    def num_problems(self) -> int:
        """How many distinct problems (prompts) the task can generate."""

    @property
    @abstractmethod
    def max_label_len(self) -> int:
        """Longest label in characters (a response budget is this + 1 for <eos>)."""

    @property
    @abstractmethod
    def max_prompt_len(self) -> int:
        """Longest prompt in characters (checked against the model's maximum length at start-up)."""

    @abstractmethod
    def generate(self, rng: random.Random) -> Example:
        """One problem drawn from rng, held-out or not. Use `sample` for training."""

    def sample(self, rng: random.Random) -> Example:
        """A training problem: drawn from rng, redrawn while it is in the held-out split."""
        for _ in range(_MAX_REJECTIONS):
            ex = self.generate(rng)
            if ex.prompt not in self._heldout_prompts:
                return ex
        raise RuntimeError(f"{self.name}: {_MAX_REJECTIONS} draws in a row were held-out problems")

    def heldout(self, n: int | None = None) -> list[Example]:
        """The first n (default all `heldout_size`) examples of the fixed held-out split."""
        examples = self._heldout
        if n is not None:
            if n > len(examples):
                raise ValueError(f"{self.name}: asked for {n} held-out examples, the split has {len(examples)}")
            examples = examples[:n]
        return list(examples)

    def is_heldout(self, example: Example) -> bool:
        return example.prompt in self._heldout_prompts

    def config(self) -> dict:
        """name + settings, e.g. for checkpoint metadata."""
        return {"name": self.name, **asdict(self)}

    @cached_property
    def _heldout(self) -> tuple[Example, ...]:
        rng = random.Random(derive_seed("heldout", self.name, self.heldout_seed))
        seen: dict[str, Example] = {}
        while len(seen) < self.heldout_size:
            ex = self.generate(rng)
            seen.setdefault(ex.prompt, ex)
        return tuple(seen.values())

    @cached_property
    def _heldout_prompts(self) -> frozenset[str]:
        return frozenset(ex.prompt for ex in self._heldout)


TASK_PLUGINS = class_slot("task", Task, TASKS, "megatron_rl/data/tasks/base.py")
