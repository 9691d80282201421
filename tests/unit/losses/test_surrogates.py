"""Surrogates: hand-computed cases, a naive reference on random inputs, analytic gradients."""
import math

import pytest
import torch
from hypothesis import given, settings

from megatron_rl.losses import PolicyBatch, ess_from_stats, get_surrogate, p3o_ess_stats

from . import reference as ref
from .batches import as_lists, assert_close, make_arrays, scales, seeds, shapes, to_batch

LN2 = 0.6931471805599453


def _batch(lp, old, ro, A, m=None):
    lp = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    old, ro, A = (torch.tensor(x, dtype=torch.float32) for x in (old, ro, A))
    m = torch.ones_like(old, dtype=torch.bool) if m is None else torch.tensor(m)
    return PolicyBatch(lp, old, ro, A, m), lp


def _grad(per_token, lp):
    (g,) = torch.autograd.grad(per_token.sum(), lp)
    return g


def _ppo_case():
    old = [[math.log(0.5)] * 4] * 2
    ratios = [[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 1.0, 0.9]]
    lp = [[o + math.log(r) for o, r in zip(orow, rrow)] for orow, rrow in zip(old, ratios)]
    A = [[1.0] * 4, [-2.0] * 4]
    m = [[True, True, True, False], [True] * 4]
    return _batch(lp, old, old, A, m)


def test_ppo_clip_hand_computed():
    batch, lp = _ppo_case()
    out = get_surrogate("ppo_clip")(batch, eps_low=0.2, eps_high=0.2)
    assert_close(out.per_token, [[-1.2, -0.5, -1.1, 0.0], [3.0, 1.6, 2.0, 1.8]])
    assert_close(_grad(out.per_token, lp), [[0.0, -0.5, -1.1, 0.0], [3.0, 0.0, 2.0, 1.8]])
    assert float(out.metrics["clipped/num/sum"]) == 2 and float(out.metrics["clipped/den/sum"]) == 7


def test_ppo_clip_dual_clip_hand_computed():
    batch, lp = _ppo_case()
    out = get_surrogate("ppo_clip")(batch, eps_low=0.2, eps_high=0.2, dual_clip=1.4)
    assert_close(out.per_token, [[-1.2, -0.5, -1.1, 0.0], [2.8, 1.6, 2.0, 1.8]])
    assert_close(_grad(out.per_token, lp), [[0.0, -0.5, -1.1, 0.0], [0.0, 0.0, 2.0, 1.8]])
    assert float(out.metrics["dual_clipped/num/sum"]) == 1


def test_mu_grpo_is_relaxed_ppo_clip():
    batch, _ = _ppo_case()
    out = get_surrogate("mu_grpo")(batch)  # [0, 5]: nothing in the case is clipped
    assert_close(out.per_token, [[-1.5, -0.5, -1.1, 0.0], [3.0, 1.0, 2.0, 1.8]])
    assert float(out.metrics["clipped/num/sum"]) == 0


def test_reinforce_hand_computed():
    batch, lp = _batch([[math.log(0.5)]], [[math.log(0.4)]], [[math.log(0.25)]], [[1.5]])
    out = get_surrogate("reinforce")(batch)  # rho = 2
    assert_close(out.per_token, [[2 * 1.5 * LN2]])
    assert_close(_grad(out.per_token, lp), [[-3.0]])


def test_cispo_hand_computed():
    old = [[math.log(0.4), math.log(0.4), math.log(0.4)]]
    lp = [[math.log(0.6), math.log(0.2), math.log(0.4)]]  # r = 1.5, 0.5, 1
    batch, g = _batch(lp, old, old, [[1.0, 1.0, -1.0]])
    out = get_surrogate("cispo")(batch, eps_low=1.0, eps_high=0.28)
    assert_close(out.per_token, [[1.28 * 0.5108256, 0.5 * 1.6094379, -0.9162907]])
    assert_close(_grad(out.per_token, g), [[-1.28, -0.5, 1.0]])
    assert float(out.metrics["clipped/num/sum"]) == 1


def test_minirl_hand_computed():
    # (A, r, rho): (1, 1.3, .) masked; (1, 1.2, 6) -> c = 5; (-1, 0.7, .) masked; (-1, 0.9, 0.5)
    lp = [[math.log(0.13), math.log(0.12), math.log(0.07), math.log(0.09)]]
    old = [[math.log(0.1)] * 4]
    ro = [[math.log(0.1), math.log(0.02), math.log(0.1), math.log(0.18)]]
    batch, g = _batch(lp, old, ro, [[1.0, 1.0, -1.0, -1.0]])
    out = get_surrogate("minirl")(batch)
    assert_close(out.per_token, [[0.0, -5 * math.log(0.12), 0.0, 0.5 * math.log(0.09)]])
    assert_close(_grad(out.per_token, g), [[0.0, -5.0, 0.0, 0.5]])
    assert float(out.metrics["clip_masked/num/sum"]) == 2
    assert float(out.metrics["tis_truncated/num/sum"]) == 1


def test_p3o_hand_computed():
    lp = [[math.log(0.5), math.log(0.125)]]
    old = [[math.log(0.25)] * 2]  # r = 2, 0.5
    batch, g = _batch(lp, old, old, [[1.0, 1.0]])
    ess = ess_from_stats(*p3o_ess_stats(batch.logprobs, batch.old_logprobs, batch.loss_mask))
    assert_close(ess, 6.25 / 8.5)
    out = get_surrogate("p3o")(batch, ess=ess)
    e = 6.25 / 8.5
    k3_0 = 0.5 + LN2 - 1  # d = -ln2
    k3_1 = 2.0 - LN2 - 1  # d = +ln2
    assert_close(out.per_token, [[e * LN2 + (1 - e) * k3_0, 0.5 * 3 * LN2 + (1 - e) * k3_1]])
    assert_close(_grad(out.per_token, g), [[-e + (1 - e) * 0.5, -0.5 + (1 - e) * (1 - 2.0)]])
    assert float(out.metrics["capped/num/sum"]) == 1
    assert_close(out.metrics["ess/num/sum"], e, rtol=1e-6, atol=1e-7)


def test_gspo_hand_computed_with_padding():
    # row0: A=1, log ratios (0.1, 0.3) -> s = e^0.2 inside [0.8, 1.28]; row1: A=-1, mean -0.3 -> s < 0.8
    # row2: all masked
    old = [[-1.0] * 3] * 3
    d = [[0.1, 0.3, 9.0], [-0.5, -0.3, -0.1], [5.0, 5.0, 5.0]]
    lp = [[o + x for o, x in zip(orow, drow)] for orow, drow in zip(old, d)]
    m = [[True, True, False], [True, True, True], [False] * 3]
    batch, g = _batch(lp, old, old, [[1.0] * 3, [-1.0] * 3, [1.0] * 3], m)
    out = get_surrogate("gspo")(batch, eps_low=0.2, eps_high=0.28)
    s0 = math.exp(0.2)
    assert_close(out.per_seq, [-s0, 0.8, 0.0])
    assert_close(out.per_token, [[-s0, -s0, 0.0], [0.8, 0.8, 0.8], [0.0] * 3])
    (grad,) = torch.autograd.grad(out.per_seq.sum(), g)
    assert_close(grad, [[-s0 / 2, -s0 / 2, 0.0], [0.0] * 3, [0.0] * 3])
    assert float(out.metrics["clipped_seqs/num/sum"]) == 1 and float(out.metrics["clipped_seqs/den/sum"]) == 2


# ----------------------------------------------------------------------------- property tests

TOKEN_SURROGATES = {
    "ppo_clip": ({"eps_low": 0.2, "eps_high": 0.28}, lambda L, O, R, A, M: ref.ppo_clip(L, O, A, M, 0.2, 0.28)),
    "ppo_clip_dual": ({"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0},
                      lambda L, O, R, A, M: ref.ppo_clip(L, O, A, M, 0.2, 0.28, 3.0)),
    "reinforce": ({}, lambda L, O, R, A, M: ref.reinforce(L, R, A, M)),
    "cispo": ({"eps_low": 0.5, "eps_high": 0.3}, lambda L, O, R, A, M: ref.cispo(L, O, A, M, 0.5, 0.3)),
    "minirl": ({}, lambda L, O, R, A, M: ref.minirl(L, O, R, A, M, 0.2, 0.27, 5.0)),
    "minirl_no_is": ({"c_tis": None}, lambda L, O, R, A, M: ref.minirl(L, O, R, A, M, 0.2, 0.27, None)),
    "minirl_no_clip": ({"eps_low": 1.0, "eps_high": math.inf},
                       lambda L, O, R, A, M: ref.minirl(L, O, R, A, M, 1.0, math.inf, 5.0)),
}


@pytest.mark.parametrize("name", sorted(TOKEN_SURROGATES))
@settings(max_examples=30, deadline=None)
@given(seed=seeds, shape=shapes, sr=scales, sw=scales)
def test_token_surrogates_match_reference(name, seed, shape, sr, sw):
    arr = make_arrays(seed, *shape, sigma_r=sr, sigma_w=sw, garbage=seed % 2 == 0)
    batch, lp = to_batch(arr)
    params, fn = TOKEN_SURROGATES[name]
    registered = name.removesuffix("_dual").removesuffix("_no_is").removesuffix("_no_clip")
    out = get_surrogate(registered)(batch, **params)
    want_loss, want_grad = fn(*as_lists(arr))
    assert_close(out.per_token, want_loss)
    assert_close(_grad(out.per_token, lp), want_grad)


@settings(max_examples=30, deadline=None)
@given(seed=seeds, shape=shapes, sr=scales)
def test_p3o_matches_reference(seed, shape, sr):
    arr = make_arrays(seed, *shape, sigma_r=sr, garbage=seed % 2 == 0)
    batch, lp = to_batch(arr)
    L, O, _R, A, M = as_lists(arr)
    e = ref.ess(L, O, M)
    ess = ess_from_stats(*p3o_ess_stats(batch.logprobs, batch.old_logprobs, batch.loss_mask))
    assert_close(ess, e, rtol=1e-5, atol=1e-6)
    assert 0 < float(ess) <= 1
    out = get_surrogate("p3o")(batch, ess=ess)
    want_loss, want_grad = ref.p3o(L, O, A, M, float(ess))
    assert_close(out.per_token, want_loss)
    assert_close(_grad(out.per_token, lp), want_grad)


@settings(max_examples=30, deadline=None)
@given(seed=seeds, shape=shapes, sr=scales)
def test_gspo_matches_reference(seed, shape, sr):
    arr = make_arrays(seed, *shape, sigma_r=sr * 0.3, garbage=seed % 2 == 0)
    batch, lp = to_batch(arr)
    L, O, _R, A, M = as_lists(arr)
    want = ref.gspo(L, O, A, M, 0.05, 0.07)
    out = get_surrogate("gspo")(batch, eps_low=0.05, eps_high=0.07)
    assert_close(out.per_seq, [w[0] for w in want])
    (grad,) = torch.autograd.grad(out.per_seq.sum(), lp)
    assert_close(grad, [w[1] for w in want])
    # per_token: the sequence value on valid tokens
    assert_close(out.per_token, [[w[0] if M[i][t] else 0.0 for t in range(len(M[i]))] for i, w in enumerate(want)])


@settings(max_examples=30, deadline=None)
@given(seed=seeds, shape=shapes, sr=scales)
def test_gspo_token_equals_gspo_value_and_gradient(seed, shape, sr):
    """With A constant per response, GSPO-token has GSPO's per-token values and (after the per-sequence
    token mean) GSPO's gradient."""
    arr = make_arrays(seed, *shape, sigma_r=sr * 0.3)
    grads, values = [], []
    for name in ("gspo", "gspo_token"):
        batch, lp = to_batch(arr)
        out = get_surrogate(name)(batch, eps_low=0.05, eps_high=0.07)
        n = batch.mask.float().sum(-1, keepdim=True).clamp_min(1)
        (g,) = torch.autograd.grad((out.per_token / n).sum(), lp)
        grads.append(g), values.append(out.per_token.detach())
    assert_close(values[1], values[0])
    assert_close(grads[1], grads[0])
