"""Exact quantiles over ranks (metrics/quantiles.py): the order keys sort as the floats do, and the
quantiles of values split over 2 and 3 gloo ranks equal numpy's quantile of all of them at once."""
import numpy as np
import torch

from megatron_rl.metrics.quantiles import from_keys, global_quantiles, order_keys, order_statistics

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


