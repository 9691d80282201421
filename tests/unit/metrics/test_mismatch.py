"""Mismatch diagnostics: hand-computed values, a numpy reference, reducibility, edge cases."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.metrics import mismatch as lib
from megatron_rl.metrics.reduce import accumulate, finish, op_of
from tests.unit.metrics import reference as mm

LN2 = 0.6931471805599453


def _close(a, b, tol=1e-6):
    assert math.isclose(float(a), float(b), rel_tol=tol, abs_tol=tol), (float(a), float(b))


def _hand():
    old = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    ro = torch.tensor([[math.log(0.25), math.log(0.5), -5.0]])
    m = torch.tensor([[True, True, False]])
    return old, ro, m


def test_token_metrics_hand_computed():
    old, ro, m = _hand()  # Δ = ln2, −ln2; w = 2, 0.5
    _close(mm.kl_k3(old, ro, m), ((2 - LN2 - 1) + (0.5 + LN2 - 1)) / 2)  # 0.25
    _close(mm.kl_k1(old, ro, m), 0.0)
    _close(mm.abs_logprob_diff(old, ro, m), LN2)
    _close(mm.prob_abs_diff(old, ro, m), 0.25)
    _close(mm.token_ess(old - ro, m), 6.25 / 8.5)
    stats = mm.ratio_stats(old - ro, m)
    _close(stats["mean"], 1.25), _close(stats["min"], 0.5), _close(stats["max"], 2.0)
    _close(stats["p01"], 0.5 + 0.01 * 1.5), _close(stats["p99"], 0.5 + 0.99 * 1.5)


def test_finished_sums_hand_computed():
    old, ro, m = _hand()
    out = finish(lib.mismatch_sums(old, ro, m))
    _close(out["mismatch/kl_k3"], 0.25)
    _close(out["mismatch/w/ess"], 6.25 / 8.5)
    _close(out["mismatch/w/seq_ess"], 1.0)  # one response
    assert out["mismatch/tokens"] == 2


def test_buckets_hand_computed():
    mu = torch.tensor([[5e-5, 5e-4, 5e-3, 0.05, 0.3, 0.7, 0.95, 0.3]])
    d = torch.tensor([[0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.01, 0.2]])  # Δ = log π_old − log μ
    old, ro = torch.log(mu) + d, torch.log(mu)
    out = finish(lib.mismatch_sums(old, ro, torch.ones(1, 8, dtype=torch.bool)))
    counts = [out[f"mismatch/bucket/{b}/count"] for b in lib.bucket_labels()]
    assert counts == [1, 1, 1, 1, 2, 1, 1]
    _close(out["mismatch/bucket/0.1-0.5/abs_diff"], 0.35, tol=1e-5)
    _close(out["mismatch/bucket/0.1-0.5/kl_k3"], ((math.exp(0.5) - 1.5) + (math.exp(0.2) - 1.2)) / 2, tol=1e-5)
    _close(out["mismatch/bucket/0-0.0001/kl_k3"], math.exp(0.1) - 1.1, tol=1e-5)
    assert lib.bucket_labels() == ["0-0.0001", "0.0001-0.001", "0.001-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9",
                                  "0.9-1"]


def test_seq_ess_hand_computed():
    lr = torch.tensor([[LN2, 0.0], [-LN2, 9.0]])
    m = torch.tensor([[True, True], [True, False]])
    _close(mm.seq_ess(lr, m), 6.25 / 8.5)  # W = 2, 0.5


def test_turn_split_and_entropy():
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.5]]))
    ro = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.1]]))
    m = torch.ones(1, 4, dtype=torch.bool)
    turns = torch.tensor([[0, 0, 1, -1]])  # the last token is not an assistant turn
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = finish(lib.mismatch_sums(old, ro, m, turn_ids=turns, entropy=ent))
    _close(out["mismatch/turn/first/kl_k3"], 0.25)
    _close(out["mismatch/turn/later/kl_k3"], 0.0)
    assert out["mismatch/turn/first/tokens"] == 2 and out["mismatch/turn/later/tokens"] == 1
    _close(out["mismatch/entropy"], 2.5)
    _close(mm.entropy_mean(ent, m), 2.5)
    _close(mm.entropy_mean(ent, m, num_tokens=10), 1.0)
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = (1/4, 3/4)
    _close(mm.entropy_from_logits(logits)[0], -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def _np_reference(old, ro, lp, m, turns):
    d = (old - ro)[m]
    out = {"mismatch/kl_k3": np.mean(np.exp(d) - d - 1), "mismatch/kl_k1": np.mean(-d),
           "mismatch/abs_logprob_diff": np.mean(np.abs(d)),
           "mismatch/prob_abs_diff": np.mean(np.abs(np.exp(old[m]) - np.exp(ro[m])))}
    for name, lr in (("w", old - ro), ("r", lp - old), ("rho", lp - ro)):
        x = np.exp(lr[m])
        out[f"mismatch/{name}/mean"] = x.mean()
        out[f"mismatch/{name}/min"], out[f"mismatch/{name}/max"] = x.min(), x.max()
        out[f"mismatch/{name}/p01"], out[f"mismatch/{name}/p99"] = np.quantile(x, [0.01, 0.99])
        out[f"mismatch/{name}/ess"] = x.sum() ** 2 / (len(x) * (x * x).sum())
        W = np.array([np.exp(lr[i][m[i]].sum()) for i in range(len(m)) if m[i].any()])
        out[f"mismatch/{name}/seq_ess"] = W.sum() ** 2 / (len(W) * (W * W).sum())
    mu = np.exp(ro)
    bounds = [0.0, *lib.BUCKET_EDGES, 1.0 + 1e-9]
    for label, lo, hi in zip(lib.bucket_labels(), bounds[:-1], bounds[1:]):
        sel = m & (mu >= lo) & (mu < hi)
        dd = (old - ro)[sel]
        out[f"mismatch/bucket/{label}/count"] = sel.sum()
        out[f"mismatch/bucket/{label}/abs_diff"] = np.abs(dd).mean() if len(dd) else 0.0
        out[f"mismatch/bucket/{label}/kl_k3"] = (np.exp(dd) - dd - 1).mean() if len(dd) else 0.0
    for part, sel in (("first", m & (turns == 0)), ("later", m & (turns > 0)), ("0", m & (turns == 0)),
                      ("1", m & (turns == 1)), ("2", m & (turns == 2)), ("3_or_later", m & (turns >= 3))):
        dd = (old - ro)[sel]
        out[f"mismatch/turn/{part}/kl_k3"] = (np.exp(dd) - dd - 1).mean() if len(dd) else 0.0
        out[f"mismatch/turn/{part}/abs_logprob_diff"] = np.abs(dd).mean() if len(dd) else 0.0
        out[f"mismatch/turn/{part}/tokens"] = sel.sum()
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 8),
       sw=st.sampled_from([0.01, 0.5, 3.0]))
def test_mismatch_metrics_match_numpy_reference(seed, B, T, sw):
    rng = np.random.default_rng(seed)
    m = rng.random((B, T)) < 0.7
    m[0, 0] = True
    old = -rng.exponential(3.0, (B, T)).astype(np.float32)
    ro = np.minimum(old + rng.normal(0, sw, (B, T)), -1e-6).astype(np.float32)
    lp = (old + rng.normal(0, 0.2, (B, T))).astype(np.float32)
    turns = rng.integers(-1, 6, (B, T))
    got = mm.mismatch_metrics(torch.tensor(old), torch.tensor(ro), torch.tensor(m), logprobs=torch.tensor(lp),
                              turn_ids=torch.tensor(turns))
    want = _np_reference(old.astype(np.float64), ro.astype(np.float64), lp.astype(np.float64), m, turns)
    for k, v in want.items():
        assert math.isclose(got[k], float(v), rel_tol=1e-5, abs_tol=1e-7), (k, got[k], float(v))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cut=st.integers(1, 4))
def test_sums_are_reducible_over_micro_batches(seed, cut):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 6, generator=g) * 6
    ro = old + torch.randn(5, 6, generator=g)
    lp = old + 0.1 * torch.randn(5, 6, generator=g)
    m = torch.rand(5, 6, generator=g) < 0.7
    full = lib.mismatch_sums(old, ro, m, logprobs=lp)
    parts = [lib.mismatch_sums(old[s], ro[s], m[s], logprobs=lp[s]) for s in (slice(0, cut), slice(cut, 5))]
    combined = accumulate(parts[0], parts[1])
    a, b = finish(full), finish(combined)
    assert a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12), k
    assert op_of("mismatch/w/min/min") == "min" and op_of("mismatch/w/max/max") == "max"
    assert op_of("mismatch/kl_k3/num/sum") == "sum"


def test_on_policy_ess_is_one_and_kl_zero():
    old = -torch.rand(3, 4) * 3
    m = torch.ones(3, 4, dtype=torch.bool)
    out = mm.mismatch_metrics(old, old.clone(), m, logprobs=old.clone())
    for name in ("w", "r", "rho"):
        assert out[f"mismatch/{name}/ess"] == 1.0 and out[f"mismatch/{name}/seq_ess"] == 1.0
        assert out[f"mismatch/{name}/mean"] == 1.0
    assert out["mismatch/kl_k3"] == 0.0 and out["mismatch/kl_k1"] == 0.0


@pytest.mark.parametrize("gap", [80.0, -80.0, 200.0])
def test_extreme_gaps_finite(gap):
    old = torch.tensor([[-1.0, -1.0, 0.0]])
    ro = old - torch.tensor([[gap, 0.0, 0.0]])
    m = torch.tensor([[True, True, False]])
    out = mm.mismatch_metrics(old, ro, m, logprobs=old + 0.5)
    assert all(math.isfinite(v) for v in out.values()), {k: v for k, v in out.items() if not math.isfinite(v)}
    assert 0 < out["mismatch/w/ess"] <= 1 and out["mismatch/tokens"] == 2
    assert math.isfinite(float(mm.token_ess(old - ro, m))) and math.isfinite(float(mm.kl_k3(old, ro, m)))


def test_empty_mask():
    z = torch.zeros(2, 3)
    out = mm.mismatch_metrics(z, z, torch.zeros(2, 3, dtype=torch.bool))
    assert out["mismatch/tokens"] == 0 and out["mismatch/w/ess"] == 1.0
    assert all(math.isfinite(v) for v in out.values())


def test_split_by_staleness_hand_computed():
    """Rows generated 0 and 1 versions ago: each staleness gets its own KL and ratio means."""
    old = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]]))
    ro = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.5]]))  # row 0: w = 2, 0.5; row 1: w = 1
    lp = old + torch.tensor([[LN2, 0.0], [0.0, -LN2]])       # r = 2, 1; 1, 0.5
    m = torch.ones(2, 2, dtype=torch.bool)
    out = finish(lib.mismatch_sums(old, ro, m, logprobs=lp, staleness=torch.tensor([1, 0]), max_staleness=2))
    _close(out["mismatch/staleness_1/kl_k3"], 0.25)
    _close(out["mismatch/staleness_0/kl_k3"], 0.0)
    _close(out["mismatch/staleness_1/w/mean"], 1.25)
    _close(out["mismatch/staleness_0/r/mean"], 0.75)
    _close(out["mismatch/staleness_1/rho/mean"], (4 + 0.5) / 2)
    assert out["mismatch/staleness_2/tokens"] == 0 and out["mismatch/staleness_2/kl_k3"] == 0.0
    assert not any("staleness" in k for k in finish(lib.mismatch_sums(old, ro, m, staleness=torch.tensor([1, 0]))))


def test_staleness_buckets_grow_geometrically():
    assert lib.staleness_buckets(0) == [(0, 0)]
    assert lib.staleness_buckets(3) == [(0, 0), (1, 1), (2, 3)]
    assert lib.staleness_buckets(74)[-2:] == [(32, 63), (64, 74)]
    old = torch.zeros(3, 1)
    out = finish(lib.mismatch_sums(old, old - 0.1, torch.ones(3, 1, dtype=torch.bool),
                                   staleness=torch.tensor([0, 2, 3]), max_staleness=3))
    assert out["mismatch/staleness_2-3/tokens"] == 2 and out["mismatch/staleness_1/tokens"] == 0
