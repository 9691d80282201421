"""Exact quantiles over ranks (metrics/quantiles.py): the order keys sort as the floats do, and the
quantiles of values split over 2 and 3 gloo ranks equal numpy's quantile of all of them at once."""
import numpy as np
import pytest
import torch

from megatron_rl.metrics.mismatch import ratio_quantiles
from megatron_rl.metrics.quantiles import from_keys, global_quantiles, order_keys, order_statistics
from tests.spawn import run_ranks

QS = [0.0, 0.01, 0.25, 0.5, 0.99, 1.0]


def _values(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(0, 1, n), rng.normal(0, 1e-300, 3), [0.0, -0.0, 5e-324, -5e-324, np.inf, -np.inf,
                                                                          1.5, 1.5, 1.5, -1e308]])
    return rng.permutation(x)


def test_order_keys_sort_as_the_floats_and_invert():
    x = torch.tensor(_values(0, 2000), dtype=torch.float64)
    k = order_keys(x)
    assert torch.equal(from_keys(k).view(torch.int64), x.view(torch.int64))   # bit for bit, -0.0 included
    by_key, by_value = x[k.argsort()], x.sort().values
    assert torch.equal(by_key, by_value)


def test_one_rank_order_statistics_and_quantiles_are_numpys():
    x = _values(1, 500)
    xs = np.sort(x)
    ranks = torch.tensor([0, 1, 7, 250, len(x) - 1])
    got = from_keys(order_statistics([order_keys(torch.tensor(x))], [ranks])[0])
    assert got.tolist() == xs[ranks.numpy()].tolist()
    finite = x[np.isfinite(x)]
    q = global_quantiles([torch.tensor(finite)], QS)[0]
    np.testing.assert_allclose([float(v) for v in q], np.quantile(finite, QS), rtol=1e-15, atol=0)
    assert [float(v) for v in global_quantiles([torch.zeros(0, dtype=torch.float64)], QS)[0]] == [0.0] * len(QS)
    nan = float("nan")   # no place in an order: left out (a NaN log-ratio shows in the means instead)
    assert [float(v) for v in global_quantiles([torch.tensor([nan, 2.0, -nan, 1.0])], [0.0, 1.0])[0]] == [1.0, 2.0]


def _parts(first_sizes):
    """_values split over len(first_sizes) + 1 ranks: these sizes, the last rank the rest."""
    x = _values(2, 997)
    return [p[np.isfinite(p)] for p in np.split(x, np.cumsum(first_sizes))]


def _worker(rank, world_size, first_sizes):
    mine = _parts(first_sizes)[rank]
    q = global_quantiles([torch.tensor(mine), torch.tensor(mine[: len(mine) // 2])], QS)
    logs = ratio_quantiles({"w": torch.tensor(mine) * 0.01, "none": torch.zeros(0, dtype=torch.float64)})
    return [[float(v) for v in s] for s in q], {k: float(v) for k, v in logs.items()}


@pytest.mark.parametrize("first_sizes", [[0], [500, 0], [3, 900]])
def test_quantiles_over_ranks_equal_numpys_over_all_values(first_sizes):
    """Values split unevenly over 2 or 3 ranks (one with none): every rank gets numpy's quantiles of
    all the values together, bit for bit the same on every rank."""
    parts = _parts(first_sizes)
    results = run_ranks(_worker, world_size=len(parts), timeout=120, first_sizes=first_sizes)
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
