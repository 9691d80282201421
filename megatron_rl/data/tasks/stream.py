"""`PromptStream`: the training prompts of one task or a mixture, as a function of (seed, step).

    stream = PromptStream([make_task("addition"), make_task("sorting")], seed=1, weights=[3, 1])
    stream.batch(step=120, size=32)     # the same 32 examples in every run with seed=1
    stream.heldout()                    # every task's held-out split, concatenated

Batch `step` is drawn from its own `random.Random(derive_seed(seed, "prompts", step))`: example i
picks a task with probability weight / sum(weights), then the task samples a non-held-out problem.
Nothing is carried between calls, so resuming at step k needs only k (the "data position"), and
batches can be requested in any order. Over-sampling's extra prompts of step k come from
`reserve(k, start, count)`, a second generator of the same kind (seeded by (seed, "reserve", k)),
so they change neither step k's batch nor any other step's. `state_dict()` records the seed and task settings so a
resume can check that it is replaying the same stream.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from megatron_rl.data.tasks.base import Task
from megatron_rl.data.types import Example, derive_seed


class PromptStream:
    """tasks: one task or several (distinct names); weights: mixture weights (default uniform)."""

    def __init__(self, tasks: Task | Sequence[Task], seed: int, weights: Sequence[float] | None = None):
        self.tasks: tuple[Task, ...] = (tasks,) if isinstance(tasks, Task) else tuple(tasks)
        if not self.tasks:
            raise ValueError("PromptStream needs at least one task")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"PromptStream: task names must be distinct (they select rewards), got {names}")
        if weights is None:
            weights = [1.0] * len(self.tasks)
        weights = [float(w) for w in weights]
        if len(weights) != len(self.tasks) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"PromptStream: weights must be {len(self.tasks)} non-negative numbers with a positive sum, "
                f"got {weights}"
            )
        self.weights = tuple(weights)
        self.seed = int(seed)

    def batch(self, step: int, size: int) -> list[Example]:
        """`size` training examples for optimizer step `step`; a pure function of (seed, step, size)."""
        if step < 0 or size < 0:
            raise ValueError(f"PromptStream.batch: step and size must be >= 0, got step={step}, size={size}")
        return self._draw(random.Random(derive_seed(self.seed, "prompts", step)), size)

    def reserve(self, step: int, start: int, count: int) -> list[Example]:
        """Examples start .. start + count - 1 of step `step`'s reserve (over-sampling's extra
        prompts); a pure function of (seed, step, start, count). Cost: start + count draws."""
        if step < 0 or start < 0 or count < 0:
            raise ValueError(f"PromptStream.reserve: step, start and count must be >= 0, got step={step}, "
                             f"start={start}, count={count}")
        return self._draw(random.Random(derive_seed(self.seed, "reserve", step)), start + count)[start:]

    def _draw(self, rng: random.Random, size: int) -> list[Example]:
        out = []
        for _ in range(size):
            task = self.tasks[0] if len(self.tasks) == 1 else rng.choices(self.tasks, self.weights)[0]
            out.append(task.sample(rng))
        return out

    def heldout(self, n_per_task: int | None = None) -> list[Example]:
        """The held-out split of every task (first n_per_task of each, default all), task by task."""
        return [ex for t in self.tasks for ex in t.heldout(n_per_task)]

    def rewards(self) -> dict[str, str]:
        """task name -> reward name, ready for RewardRunner."""
        return {t.name: t.reward for t in self.tasks}

    def max_label_len(self) -> int:
        return max(t.max_label_len for t in self.tasks)

    def max_prompt_len(self) -> int:
        return max(t.max_prompt_len for t in self.tasks)

    def state_dict(self) -> dict:
        return {"kind": "PromptStream", "seed": self.seed, "weights": list(self.weights),
                "tasks": [t.config() for t in self.tasks]}

    def load_state_dict(self, state: dict) -> None:
        """Check a checkpoint's stream against this one; raises ValueError naming what differs.
        (There is nothing to restore: the position is the trainer's step.)"""
        mine = self.state_dict()
        diffs = [k for k in mine if state.get(k) != mine[k]]
        if diffs:
            raise ValueError(
                "the checkpoint was trained on a different prompt stream ("
                + "; ".join(f"{k}: checkpoint {state.get(k)!r} vs now {mine[k]!r}" for k in diffs)
                + "); resume with the same data settings or start a new run"
            )
