"""Rollout corrections: hand-computed cases, naive reference on random inputs, composition."""
import math

import pytest
import torch
from hypothesis import given, settings

from megatron_rl.losses import NAV_SCOPES, PolicyBatch, apply_corrections, get_correction

from . import reference as ref
from .batches import as_lists, assert_close, make_arrays, scales, seeds, shapes, to_batch


def _batch(lp, old, ro, A, m=None, positions=None):
    t = [torch.tensor(x, dtype=torch.float32) for x in (lp, old, ro, A)]
    m = torch.ones_like(t[0], dtype=torch.bool) if m is None else torch.tensor(m)
    pos = None if positions is None else torch.tensor(positions)
    return PolicyBatch(t[0].requires_grad_(), t[1], t[2], t[3], m, positions=pos)


def _w_batch(w, m=None, A=None):
    """old = log 0.5, rollout chosen so that w = π_old / μ takes the given values."""
    old = [[math.log(0.5)] * len(row) for row in w]
    ro = [[math.log(0.5 / x) if x >= 0.5 else math.log(0.5) - math.log(x) for x in row] for row in w]
    A = A or [[1.0] * len(row) for row in w]
    return _batch(old, old, ro, A, m)


def test_tis_token_hand_computed():
    c = get_correction("tis_token")(_w_batch([[0.5, 1.5, 3.0, 7.0]], m=[[True, True, True, False]]), C=2.0)
    assert_close(c.weight, [[0.5, 1.5, 2.0, 1.0]])
    assert c.keep.all()
    assert float(c.metrics["truncated/num/sum"]) == 1 and float(c.metrics["truncated/den/sum"]) == 3


def test_tis_token_rho_option():
    b = _batch([[math.log(0.8)]], [[math.log(0.4)]], [[math.log(0.2)]], [[1.0]])  # w = 2, rho = 4
    assert_close(get_correction("tis_token")(b, C=3.0).weight, [[2.0]])
    assert_close(get_correction("tis_token")(b, C=3.0, tis_use_rho=True).weight, [[3.0]])


def test_tis_seq_hand_computed():
    b = _w_batch([[1.2, 1.5, 9.0], [0.5, 1.5, 2.0]], m=[[True, True, False], [True, True, True]])
    c = get_correction("tis_seq")(b, C=2.0)  # products 1.8, 1.5
    assert_close(c.weight, [[1.8, 1.8, 1.0], [1.5, 1.5, 1.5]])
    b = _w_batch([[1.2, 2.0]])
    assert_close(get_correction("tis_seq")(b, C=2.0).weight, [[2.0, 2.0]])


def test_mis_token_hand_computed():
    c = get_correction("mis_token")(_w_batch([[0.4, 0.5, 1.5, 2.0, 2.5]]), C=2.0)
    assert c.keep.tolist() == [[False, True, True, True, False]]
    assert_close(c.weight, [[0.0, 0.5, 1.5, 2.0, 0.0]])
    assert float(c.metrics["masked/num/sum"]) == 2


def test_mis_seq_hand_computed():
    c = get_correction("mis_seq")(_w_batch([[1.5, 1.2], [1.5, 1.5]]), C=2.0)  # products 1.8, 2.25
    assert c.keep.tolist() == [[True, True], [False, False]]
    assert_close(c.weight, [[1.8, 1.8], [0.0, 0.0]])
    assert float(c.metrics["masked_seqs/num/sum"]) == 1 and float(c.metrics["masked_seqs/den/sum"]) == 2


def test_mis_geo_hand_computed():
    # geometric means: sqrt(2 * 0.5) = 1; sqrt(1.21) = 1.1
    c = get_correction("mis_geo")(_w_batch([[2.0, 0.5], [1.1, 1.1]]), lo=0.95, hi=1.05)
    assert c.keep.tolist() == [[True, True], [False, False]]


def test_veto_hand_computed():
    b = _w_batch([[1.0, 5e-5, 1.0], [1.0, 2e-4, 1.0], [1.0, 1.0, 1e-9]], m=[[True] * 3, [True] * 3, [True, True, False]])
    c = get_correction("veto")(b, tau=1e-4)
    assert c.keep.tolist() == [[False] * 3, [True] * 3, [True] * 3]
    assert float(c.metrics["vetoed_seqs/num/sum"]) == 1 and float(c.metrics["vetoed_tokens/num/sum"]) == 3


def test_icepop_hand_computed():
    b = _w_batch([[0.4, 0.5, 1.0, 5.0, 5.5]])
    c = get_correction("icepop")(b, alpha=0.5, beta=5.0)
    assert c.keep.tolist() == [[False, True, True, True, False]]
    assert_close(c.weight, [[1.0] * 5])
    c = get_correction("icepop")(b, alpha=0.5, beta=5.0, ratio_weight=True)
    assert_close(c.weight, [[1.0, 0.5, 1.0, 5.0, 1.0]])


def test_kpop_hand_computed():
    # p = 0.5: q = 0.45 -> KL_B ≈ 0.005025, 0.005017 (kept); q = 0.4 -> 0.0204, 0.0201 (dropped)
    assert abs(ref.binary_kl(0.5, 0.45) - 0.0050252) < 1e-6
    b = _batch([[0.0, 0.0]], [[math.log(0.5)] * 2], [[math.log(0.45), math.log(0.4)]], [[1.0, 1.0]])
    assert get_correction("kpop")(b, phi=0.01).keep.tolist() == [[True, False]]
    # current-policy option: π_θ = 0.4 agrees with μ = 0.4
    b = _batch([[math.log(0.4)] * 2], [[math.log(0.5)] * 2], [[math.log(0.45), math.log(0.4)]], [[1.0, 1.0]])
    assert get_correction("kpop")(b, phi=0.01, use_current_policy=True).keep.tolist() == [[True, True]]


def test_opsm_hand_computed_with_padding():
    # seq KL = mean(log μ − log π_θ): row0 (A<0) 0.01 > δ -> drop; row1 (A>0) same KL -> keep;
    # row2 (A<0) mean(0.03, -0.03) = 0 -> keep; its padded token (0.5 gap) must not count.
    lp = [[-1.0, -1.0, -1.0]] * 3
    ro = [[-0.99, -0.99, -1.0], [-0.99, -0.99, -0.99], [-0.97, -1.03, -0.5]]
    m = [[True, True, False], [True] * 3, [True, True, False]]
    A = [[-1.0] * 3, [1.0] * 3, [-1.0] * 3]
    c = get_correction("opsm")(_batch(lp, lp, ro, A, m), delta=1e-3)
    assert c.keep.tolist() == [[False, False, True], [True] * 3, [True] * 3]
    assert float(c.metrics["dropped_seqs/num/sum"]) == 1 and float(c.metrics["dropped_seqs/den/sum"]) == 3


NAV_EXPECT = {  # row0: A<0, r = [1, 3, 1, 2.5, 1, pad]; row1: A>0 (never vetoed)
    "suffix": [True, True, False, True, False, True],
    "from_trigger": [True, False, False, False, False, True],
    "trigger_only": [True, False, True, False, True, True],
    "sequence": [False, False, False, False, False, True],
}


@pytest.mark.parametrize("scope", NAV_SCOPES)
def test_nav_hand_computed(scope):
    old = [[math.log(0.1)] * 6] * 2
    r = [1.0, 3.0, 1.0, 2.5, 1.0, 9.0]
    lp = [[math.log(0.1 * x) for x in r]] * 2
    m = [[True] * 5 + [False]] * 2
    c = get_correction("nav")(_batch(lp, old, old, [[-1.0] * 6, [1.0] * 6], m), kappa=2.0, nav_scope=scope)
    assert c.keep.tolist() == [NAV_EXPECT[scope], [True] * 6]
    assert float(c.metrics["trigger_tokens/num/sum"]) == 2
    assert float(c.metrics["triggered_seqs/num/sum"]) == 1


def test_nav_uses_global_positions():
    """Columns permuted (as under zig-zag CP) with positions carried along: same decision per token."""
    old = [[math.log(0.1)] * 5]
    r = [1.0, 3.0, 1.0, 2.5, 1.0]
    perm = [3, 0, 4, 1, 2]
    lp = [[math.log(0.1 * r[p]) for p in perm]]
    c = get_correction("nav")(_batch(lp, old, old, [[-1.0] * 5], positions=[perm]), nav_scope="from_trigger")
    assert c.keep.tolist() == [[False, True, False, False, False]]  # positions ≥ 1 dropped


def test_nav_rejects_unknown_scope():
    with pytest.raises(ValueError, match="nav_scope"):
        get_correction("nav")(_w_batch([[1.0]]), nav_scope="prefix")


def test_unknown_correction_lists_names():
    with pytest.raises(KeyError, match="tis_token"):
        get_correction("nope")


# ----------------------------------------------------------------------------- property tests

REFS = {  # test id: (registry name, params, reference -> (weight or None, keep or None))
    "tis_token": ("tis_token", {"C": 2.0}, lambda L, O, R, A, M: (ref.tis_token(O, R, M, 2.0), None)),
    "tis_token_rho": ("tis_token", {"C": 2.0, "tis_use_rho": True},
                      lambda L, O, R, A, M: (ref.tis_token(O, R, M, 2.0, L), None)),
    "tis_seq": ("tis_seq", {"C": 2.0}, lambda L, O, R, A, M: (ref.tis_seq(O, R, M, 2.0), None)),
    "mis_token": ("mis_token", {"C": 1.5}, lambda L, O, R, A, M: ref.mis_token(O, R, M, 1.5)),
    "mis_seq": ("mis_seq", {"C": 1.5}, lambda L, O, R, A, M: ref.mis_seq(O, R, M, 1.5)),
    "mis_geo": ("mis_geo", {"lo": 0.9, "hi": 1.1}, lambda L, O, R, A, M: (None, ref.mis_geo(O, R, M, 0.9, 1.1))),
    "veto": ("veto", {"tau": 0.3}, lambda L, O, R, A, M: (None, ref.veto(O, R, M, 0.3))),
    "icepop": ("icepop", {"alpha": 0.7, "beta": 1.5}, lambda L, O, R, A, M: (None, ref.icepop(O, R, M, 0.7, 1.5))),
    "kpop": ("kpop", {"phi": 0.01}, lambda L, O, R, A, M: (None, ref.kpop(O, R, M, 0.01))),
    "kpop_current": ("kpop", {"phi": 0.01, "use_current_policy": True},
                     lambda L, O, R, A, M: (None, ref.kpop(L, R, M, 0.01))),
    "opsm": ("opsm", {"delta": 0.05}, lambda L, O, R, A, M: (None, ref.opsm(L, R, A, M, 0.05))),
    **{f"nav_{s}": ("nav", {"kappa": 1.3, "nav_scope": s},
                    lambda L, O, R, A, M, s=s: (None, ref.nav(L, O, A, M, 1.3, s))) for s in NAV_SCOPES},
}


@pytest.mark.parametrize("name", sorted(REFS))
@settings(max_examples=25, deadline=None)
@given(seed=seeds, shape=shapes, sr=scales, sw=scales)
def test_corrections_match_reference(name, seed, shape, sr, sw):
    arr = make_arrays(seed, *shape, sigma_r=sr, sigma_w=sw, garbage=seed % 2 == 0)
    batch, _ = to_batch(arr)
    registry_name, params, fn = REFS[name]
    c = get_correction(registry_name)(batch, **params)
    want_w, want_keep = fn(*as_lists(arr))
    assert not c.weight.requires_grad and torch.isfinite(c.weight).all() and (c.weight >= 0).all()
    if want_w is not None:
        assert_close(c.weight, want_w)
    if want_keep is not None:
        assert c.keep.tolist() == want_keep


@settings(max_examples=25, deadline=None)
@given(seed=seeds, shape=shapes, sw=scales)
def test_composition_multiplies_weights_and_ands_keeps(seed, shape, sw):
    batch, _ = to_batch(make_arrays(seed, *shape, sigma_w=sw))
    spec = [("tis_token", {"C": 1.5}), ("icepop", {"alpha": 0.8, "beta": 1.3}), ("mis_seq", {"C": 3.0})]
    parts = [get_correction(n)(batch, **p) for n, p in spec]
    c = apply_corrections(batch, spec)
    assert_close(c.weight, parts[0].weight * parts[1].weight * parts[2].weight)
    assert torch.equal(c.keep, parts[0].keep & parts[1].keep & parts[2].keep)
    assert "tis_token/truncated/num/sum" in c.metrics and "icepop/masked/num/sum" in c.metrics
    twice = apply_corrections(batch, [("tis_token", {}), ("tis_token", {"C": 1.1})])
    assert "tis_token#2/truncated/num/sum" in twice.metrics
