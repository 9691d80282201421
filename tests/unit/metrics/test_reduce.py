"""The metrics convention: op from the key, accumulation, finishing rules, and the reducer over
2 gloo ranks against one rank (one collective per op, on the group's device)."""
import math

import pytest
import torch

from megatron_rl.metrics.reduce import accumulate, ess, finish, op_of, ratio


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_op_from_the_key_and_unknown_keys_refused():
    assert [op_of(k) for k in ("a/sum", "a/b/min", "x/max")] == ["sum", "min", "max"]
    with pytest.raises(ValueError, match="does not end in /sum, /min or /max"):
        op_of("loss/value")


def test_finish_rules_hand_computed():
    values = {**ratio("loss/clipped", t(3.0), t(12.0)), **ratio("empty", t(0.0), t(0.0)),
              **ess("w/ess", t(3.0), t(5.0), t(2.0)), **ess("none/ess", t(0.0), t(0.0), t(0.0)),
              "tokens/sum": t(7.0), "w/min/min": t(0.5), "w/max/max": t(-math.inf)}
    assert finish(values) == {"loss/clipped": 0.25, "empty": 0.0, "w/ess": 9 / 10, "none/ess": 1.0,
                              "tokens": 7.0, "w/min": 0.5, "w/max": 0.0}


def test_accumulate_uses_each_keys_op():
    a = {"n/sum": t(1.0), "lo/min": t(3.0), "hi/max": t(3.0)}
    b = {"n/sum": t(2.0), "lo/min": t(1.0), "hi/max": t(5.0), "new/sum": t(4.0)}
    assert {k: float(v) for k, v in accumulate(a, b).items()} == {"n/sum": 3.0, "lo/min": 1.0, "hi/max": 5.0,
                                                                  "new/sum": 4.0}


