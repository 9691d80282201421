import logging
import math

import pytest

from megatron_rl.rewards import RewardRunner


def _boom(prompt, response, label):
    raise ZeroDivisionError("reward bug")


def test_single_reward_for_all_tasks():
    runner = RewardRunner("exact_match")
    assert runner([("p", "975", "975", "addition"), ("p", "1", "2", "anything")]) == [1.0, 0.0]
    assert runner.stats() == {"rewards/count": 2, "rewards/errors": 0}


def test_mapping_selects_reward_by_task():
    runner = RewardRunner({"addition": "exact_match", "gsm": "math"})
    items = [("p", "0.5", "\\frac{1}{2}", "addition"), ("p", "0.5", "\\frac{1}{2}", "gsm")]
    assert runner(items) == [0.0, 1.0]


def test_raising_reward_gives_zero_and_is_counted(caplog):
    runner = RewardRunner({"ok": "exact_match", "bad": _boom})
    items = [("p", "1", "1", "ok"), ("p", "1", "1", "bad"), ("p", "1", "1", "bad"), ("p", "1", "1", "ok")]
    with caplog.at_level(logging.WARNING):
        assert runner(items) == [1.0, 0.0, 0.0, 1.0]
    assert runner.stats(reset=True) == {
        "rewards/count": 4, "rewards/errors": 2, "rewards/errors/ZeroDivisionError": 2}
    assert runner.stats() == {"rewards/count": 0, "rewards/errors": 0}
    assert sum("ZeroDivisionError" in r.getMessage() for r in caplog.records) == 1  # first one only
    assert "reward bug" in caplog.text  # with its traceback


def test_bad_returns_and_unknown_task():
    runner = RewardRunner({"nan": lambda *args: math.nan, "str": lambda *args: "x", "int": lambda *args: 1})
    assert runner([("", "", "", t) for t in ("nan", "str", "int", "missing")]) == [0.0, 0.0, 1.0, 0.0]
    stats = runner.stats()
    assert stats["rewards/errors"] == 3 and stats["rewards/errors/BadReturn"] == 2
    assert stats["rewards/errors/UnknownTask"] == 1
    with_default = RewardRunner({"x": "math"}, default="exact_match")
    assert with_default.score("", "a", "a", "missing") == 1.0


def test_unknown_reward_name_fails_at_construction():
    with pytest.raises(KeyError, match="unknown reward"):
        RewardRunner({"addition": "exact_matchh"})


class BatchJudge:
    """A reward with a batch path (as rollout/vllm/judge.py's): the length of the response, an
    exception for "raise", a non-number for "nan"; records its calls and whether it was closed."""

    def __init__(self):
        self.calls, self.closed = [], False

    def __call__(self, prompt, response, label):
        raise AssertionError("the runner must use score_batch")

    def score_batch(self, items):
        self.calls.append([r for _, r, _ in items])
        return [ValueError("unparsable") if r == "raise" else float("nan") if r == "nan" else float(len(r))
                for _, r, _ in items]

    def close(self):
        self.closed = True


def test_a_batch_reward_gets_its_items_in_one_call_and_its_failures_are_counted():
    judge = BatchJudge()
    runner = RewardRunner({"a": judge, "b": "exact_match"})
    items = [("p", "xyz", "l", "a"), ("p", "5", "5", "b"), ("p", "raise", "l", "a"), ("p", "nan", "l", "a"),
             ("p", "ab", "l", "a")]
    assert runner(items) == [3.0, 1.0, 0.0, 0.0, 2.0]
    assert judge.calls == [["xyz", "raise", "nan", "ab"]]
    stats = runner.stats()
    assert stats["rewards/count"] == 5 and stats["rewards/errors"] == 2
    assert stats["rewards/errors/ValueError"] == 1 and stats["rewards/errors/BadReturn"] == 1
    runner.close()
    assert judge.closed


def test_a_runner_batches_when_one_of_its_rewards_has_a_batch_path():
    assert RewardRunner({"a": BatchJudge(), "b": "exact_match"}).batches
    assert RewardRunner({"b": "exact_match"}, default=BatchJudge()).batches
    assert not RewardRunner({"b": "exact_match"}, default="exact_match").batches
    assert not RewardRunner("exact_match").batches
