"""Aggregations (global normaliser) and group advantages."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.losses import (
    GlobalCounts,
    aggregate,
    get_advantage,
    local_counts,
    required_counts,
    seq_mean_token_mean,
    token_mean,
    token_sum_norm,
    zero_variance_groups,
)

from . import reference as ref
from .batches import assert_close, seeds

X = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


def test_token_mean_hand_computed():
    assert_close(token_mean(X, M, 4), 10 / 4)
    assert_close(token_mean(X, M, 8), 10 / 8)  # the normaliser is the caller's (global) count


def test_seq_mean_token_mean_hand_computed():
    assert_close(seq_mean_token_mean(X, M, 2), (6 / 3 + 4 / 1) / 2)


def test_token_sum_norm_hand_computed():
    assert_close(token_sum_norm(X, M, 2, l_norm=4), 10 / (2 * 4))


def test_local_counts_and_required():
    c = local_counts(M)
    assert float(c.num_tokens) == 4 and float(c.num_seqs) == 2
    assert float(local_counts(M, count_empty_seqs=True).num_seqs) == 3
    assert required_counts("token_mean") == ("num_tokens",)
    assert required_counts("seq_mean_token_mean") == ("num_seqs",)
    assert required_counts("seq_mean_token_sum") == ("num_seqs",)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate("token_mean", X, M, GlobalCounts(num_seqs=2))
    with pytest.raises(KeyError, match="token_mean"):
        aggregate("nope", X, M, c)
    assert (c + c).num_tokens == 8


def test_float64_counts_do_not_promote_loss():
    loss = aggregate("token_mean", X, M, local_counts(M))
    assert loss.dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(seed=seeds, B=st.integers(1, 5), T=st.integers(1, 6))
def test_aggregations_match_reference(seed, B, T):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T)).astype(np.float32)
    m = rng.random((B, T)) < 0.6
    xl, ml = x.astype(np.float64).tolist(), m.tolist()
    xt, mt = torch.tensor(x), torch.tensor(m)
    n_tok, n_seq = 7.0, 3.0
    assert_close(aggregate("token_mean", xt, mt, GlobalCounts(num_tokens=n_tok)), ref.token_mean(xl, ml, n_tok))
    assert_close(aggregate("seq_mean_token_mean", xt, mt, GlobalCounts(num_seqs=n_seq)),
                 ref.seq_mean_token_mean(xl, ml, n_seq))
    for name in ("token_sum_norm", "seq_mean_token_sum"):
        assert_close(aggregate(name, xt, mt, GlobalCounts(num_seqs=n_seq), l_norm=5.0),
                     ref.token_sum_norm(xl, ml, n_seq, 5.0))


# ----------------------------------------------------------------------------- advantages


def test_advantages_hand_computed():
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    # group 0: mean .5, population std .5; group 2: mean .75, std sqrt(27/16) = 1.299038
    assert_close(get_advantage("grpo")(R, eps=0.0)[0], [1.0, -1.0, -1.0, 1.0])
    assert_close(get_advantage("grpo")(R)[1], [0.0] * 4)
    assert_close(get_advantage("grpo")(R, eps=0.0)[2], [2.25 / 1.2990381, -0.75 / 1.2990381, -0.75 / 1.2990381,
                                                      -0.75 / 1.2990381])
    assert_close(get_advantage("mean_centered")(R)[2], [2.25, -0.75, -0.75, -0.75])
    assert_close(get_advantage("rloo")(R)[2], [3.0, -1.0, -1.0, -1.0])
    assert_close(get_advantage("rloo")(R)[1], [0.0] * 4)
    assert zero_variance_groups(R).tolist() == [False, True, False]
    assert_close(get_advantage("rloo")(torch.tensor([[5.0]])), [[0.0]])
    with pytest.raises(ValueError):
        get_advantage("grpo")(torch.ones(4))
    with pytest.raises(KeyError, match="rloo"):
        get_advantage("nope")


@pytest.mark.parametrize("name", ["grpo", "mean_centered", "rloo"])
@pytest.mark.parametrize("reward", [0.7, 0.3, 0.1, 1 / 3, 5.3, -2.6])
@pytest.mark.parametrize("G", [7, 8, 16, 64])
def test_a_group_of_equal_rewards_gets_exactly_zero(name, reward, G):
    """The spec's "all rewards equal give A = 0", bit for bit: computed in fp32, eight rewards of 0.7
    have a mean one ulp off and a std of 0, and grpo gave A = ulp/eps = 0.056 to all eight."""
    R = torch.tensor([[reward] * G, [reward] * (G - 1) + [reward + 1.0]], dtype=torch.float32)
    A = get_advantage(name)(R)
    assert A.dtype == torch.float32 and A[0].eq(0).all(), A[0]
    assert A[1].ne(0).all()  # a group with a spread is untouched


@settings(max_examples=40, deadline=None)
@given(seed=seeds, n=st.integers(1, 4), G=st.integers(2, 8), binary=st.booleans())
def test_advantages_match_reference(seed, n, G, binary):
    rng = np.random.default_rng(seed)
    R = (rng.random((n, G)) < 0.5).astype(np.float64) if binary else rng.normal(size=(n, G))
    R = R.astype(np.float32)
    Rl, Rt = R.astype(np.float64).tolist(), torch.tensor(R)
    assert_close(get_advantage("grpo")(Rt, eps=1e-6), ref.grpo_adv(Rl, 1e-6), rtol=1e-4, atol=1e-4)
    assert_close(get_advantage("mean_centered")(Rt), [[r - sum(g) / G for r in g] for g in Rl])
    assert_close(get_advantage("rloo")(Rt), ref.rloo_adv(Rl))
    zv = zero_variance_groups(Rt).tolist()
    assert zv == [max(g) == min(g) for g in Rl]
    for name in ("grpo", "mean_centered", "rloo"):
        A = get_advantage(name)(Rt)
        assert all(math.isclose(float(a), 0.0, abs_tol=1e-6) for i, g in enumerate(zv) if g for a in A[i])
        assert_close(A.sum(dim=1), torch.zeros(n), atol=1e-4, rtol=0)  # all three are centred
