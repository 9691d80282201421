"""`RewardRunner`: score a batch of responses without ever raising.

    runner = RewardRunner({"addition": "exact_match", "gsm8k": "math"}, default="exact_match")
    rewards = runner([(prompt, response, label, task), ...])    # list[float], same order
    metrics = runner.stats(reset=True)

Each item uses the reward named for its task (or the single reward when built from a name). A
reward function that raises, returns something that is not a finite number, or a task with no
reward gives 0.0 for that sample; the failure is counted by type and the first of each type is
logged with its traceback. `stats()` returns

    rewards/count                 samples scored
    rewards/errors                samples that got 0.0 because of a failure
    rewards/errors/<TypeName>     per exception type; BadReturn (non-number or non-finite return)
                                  and UnknownTask (no reward for the task) are the runner's own

Names are checked when the runner is built (an unknown reward name is a config error and raises
KeyError there). KeyboardInterrupt and SystemExit still propagate. The runner calls the functions
in the caller's thread; see math_verify_reward.py for what that means for the `math` reward.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from megatron_rl.rewards.registry import RewardFn, get_reward

logger = logging.getLogger(__name__)


class RewardRunner:
    """rewards: a reward name (all tasks), a reward function, or a mapping task -> name/function.
    default: reward for tasks missing from the mapping (None: such samples count as UnknownTask)."""

    def __init__(
        self,
        rewards: str | RewardFn | Mapping[str, str | RewardFn],
        default: str | RewardFn | None = None,
    ):
        if isinstance(rewards, Mapping):
            self._by_task = {task: _resolve(r) for task, r in rewards.items()}
            self._default = _resolve(default) if default is not None else None
        else:
            self._by_task = {}
            self._default = _resolve(rewards)
        self._counts: Counter[str] = Counter()

    def reward_fn(self, task: str) -> RewardFn | None:
        return self._by_task.get(task, self._default)

    @property
    def batches(self) -> bool:
        """Whether one of its reward functions scores many items per call (`score_batch`: the judge,
        whose requests then run concurrently): a rollout gives such a runner all of a call's items
        at once, not a group at a time (rollout/single_turn.py)."""
        return any(hasattr(f, "score_batch") for f in [*self._by_task.values(), self._default] if f is not None)

    def __call__(self, items: Iterable[tuple[str, str, str, str]]) -> list[float]:
        """items: (prompt, response, label, task) tuples. Returns one reward per item. A reward
        function with a `score_batch(items) -> [value or exception]` (the judge,
        rollout/vllm/judge.py) gets all of its items in one call."""
        items = list(items)
        out: list[float | None] = [None] * len(items)
        batched: dict[int, list[int]] = {}
        for k, (_, _, _, task) in enumerate(items):
            fn = self.reward_fn(task)
            if fn is not None and hasattr(fn, "score_batch"):
                batched.setdefault(id(fn), []).append(k)
            else:
                out[k] = self.score(*items[k])
        for ks in batched.values():
            fn = self.reward_fn(items[ks[0]][3])
            try:
                values = fn.score_batch([items[k][:3] for k in ks])
            except Exception as e:  # noqa: BLE001 - a reward must never stop training
                values = [e] * len(ks)
            for k, value in zip(ks, values, strict=True):
                self._counts["rewards/count"] += 1
                out[k] = self._checked(value, items[k][3])
        return out

    def score(self, prompt: str, response: str, label: str, task: str) -> float:
        """One sample's reward; 0.0 (counted) on any failure."""
        self._counts["rewards/count"] += 1
        fn = self.reward_fn(task)
        if fn is None:
            return self._failed("UnknownTask", f"no reward for task {task!r} and no default")
        try:
            value = fn(prompt, response, label)
        except Exception as e:  # noqa: BLE001 - a reward must never stop training
            value = e
        return self._checked(value, task)

    def close(self) -> None:
        """Release what the reward functions hold (a judge's server)."""
        for fn in {id(f): f for f in [*self._by_task.values(), self._default] if f is not None}.values():
            if hasattr(fn, "close"):
                fn.close()

    def _checked(self, value, task: str) -> float:
        """A reward function's return value (or the exception it raised) as the sample's reward."""
        if isinstance(value, Exception):
            return self._failed(type(value).__name__, f"reward for task {task!r} raised", exc=value)
        try:
            value = float(value)
        except (TypeError, ValueError):
            return self._failed("BadReturn", f"reward for task {task!r} returned {type(value).__name__}")
        if not math.isfinite(value):
            return self._failed("BadReturn", f"reward for task {task!r} returned {value}")
        return value

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Counts since construction or the last reset (see the module docstring for the keys)."""
        out = {"rewards/count": 0, "rewards/errors": 0, **self._counts}
        if reset:
            self._counts.clear()
        return out

    def load_stats(self, stats: dict) -> None:
        """Continue the counts of an earlier `stats()` (a resumed run's; other names are ignored)."""
        self._counts = Counter({k: v for k, v in stats.items() if k == "rewards/count" or k.startswith("rewards/errors")})

    def _failed(self, kind: str, what: str, exc: BaseException | None = None) -> float:
        key = f"rewards/errors/{kind}"
        if not self._counts[key]:
            logger.warning("%s (%s); scoring 0.0 and counting %s", what, kind, key, exc_info=exc)
        self._counts["rewards/errors"] += 1
        self._counts[key] += 1
        return 0.0


def _resolve(reward: str | Callable) -> RewardFn:
    if callable(reward):
        return reward
    return get_reward(reward)
