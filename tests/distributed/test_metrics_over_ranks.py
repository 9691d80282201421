"""The metrics reducers over gloo ranks against one rank: reduce_metrics (one collective per op, on
the group's device) over 2 ranks, and exact quantiles over 2 and 3 ranks against numpy's quantile of
all values at once. The single-rank rules are tested in tests/unit/metrics."""
import math

import numpy as np
import pytest
import torch

from megatron_rl.metrics.mismatch import ratio_quantiles
from megatron_rl.metrics.quantiles import global_quantiles
from megatron_rl.metrics.reduce import accumulate, ess, finish, ratio, reduce_metrics
from tests.spawn import run_ranks
from tests.unit.metrics.test_quantiles import QS
from tests.unit.metrics.test_quantiles import _values as _quantile_values
from tests.unit.metrics.test_reduce import t


def _values(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(5, generator=g, dtype=torch.float64)
    return {**ratio("m/mean", x.sum(), t(5.0)), **ess("m/ess", x.sum(), (x * x).sum(), t(5.0)),
            "m/min/min": x.min(), "m/max/max": x.max(), "m/count/sum": t(5.0)}


def _reduce_worker(rank, world):
    import torch.distributed as dist

    calls = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((tensor.device.type, tuple(tensor.shape)))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    try:
        out = finish(reduce_metrics(_values(rank)))
    finally:
        dist.all_reduce = real
    return out, calls


def test_reduce_over_two_ranks_equals_one_rank():
    results = run_ranks(_reduce_worker, world_size=2, timeout=120)
    both = accumulate(_values(0), _values(1))  # what one rank holding both halves sees
    want = finish(both)
    for out, calls in results:
        assert out.keys() == want.keys()
        for k in want:
            assert math.isclose(out[k], want[k], rel_tol=1e-12), (k, out[k], want[k])
        # one stacked collective per op present (sum, min, max), on gloo's device
        assert sorted(calls) == [("cpu", (1,)), ("cpu", (1,)), ("cpu", (6,))]


def _parts(first_sizes):
    """_quantile_values split over len(first_sizes) + 1 ranks: these sizes, the last rank the rest."""
    x = _quantile_values(2, 997)
    return [p[np.isfinite(p)] for p in np.split(x, np.cumsum(first_sizes))]


def _quantiles_worker(rank, world_size, first_sizes):
    mine = _parts(first_sizes)[rank]
    q = global_quantiles([torch.tensor(mine), torch.tensor(mine[: len(mine) // 2])], QS)
    logs = ratio_quantiles({"w": torch.tensor(mine) * 0.01, "none": torch.zeros(0, dtype=torch.float64)})
    return [[float(v) for v in s] for s in q], {k: float(v) for k, v in logs.items()}


@pytest.mark.parametrize("first_sizes", [[0], [500, 0], [3, 900]])
def test_quantiles_over_ranks_equal_numpys_over_all_values(first_sizes):
    """Values split unevenly over 2 or 3 ranks (one with none): every rank gets numpy's quantiles of
    all the values together, bit for bit the same on every rank."""
    parts = _parts(first_sizes)
    results = run_ranks(_quantiles_worker, world_size=len(parts), timeout=120, first_sizes=first_sizes)
    every = np.concatenate(parts)
    halves = np.concatenate([p[: len(p) // 2] for p in parts])
    w = np.exp(every * 0.01)
    for got, logs in results:
        assert got == results[0][0] and logs == results[0][1]
        np.testing.assert_allclose(got[0], np.quantile(every, QS), rtol=1e-15, atol=0)
        np.testing.assert_allclose(got[1], np.quantile(halves, QS), rtol=1e-15, atol=0)
        assert logs["mismatch/w/p01/min"] == pytest.approx(np.quantile(w, 0.01), rel=1e-14)
        assert logs["mismatch/w/p99/max"] == pytest.approx(np.quantile(w, 0.99), rel=1e-14)
        assert logs["mismatch/none/p01/min"] == 0.0 and logs["mismatch/none/p99/max"] == 0.0
