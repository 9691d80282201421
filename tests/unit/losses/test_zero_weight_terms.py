"""Terms of weight 0 stay finite: every surrogate × correction × aggregation, in fp32 and bf16, on
log-ratios up to ±1000 and log μ = ±inf, against the float64 reference (reference.policy_loss).

exp of a log-ratio past ~88.7 is inf in fp32; on a token whose term must be 0 (A = 0, a dropped
token, P3O's k3 at ESS = 1) that made 0 · inf = nan in the loss or its gradient, and one such token
made the whole step nan (docs/algorithms.md#zero-weight-terms). The issue's two-token examples come
first, then the property over random inputs, through `compute_policy_loss` and the token-local
terms of the log-prob kernel that forms gradients in its forward.

What is compared, per value v of the reference: nan -> nothing (the math is undefined there, e.g.
Π w over a response holding both log μ = +inf and −inf); |v| < 1e30 -> finite and equal;
|v| > fp32's max -> ±inf of v's sign; in between -> not nan (fp32 may overflow on the way).
The inputs keep every log-ratio either moderate or beyond ±600, so no exp lands near fp32's edge.
log w = log π_old − log μ reaches +600..+1000 and −inf (log μ = +inf), but no finite −600: a
correction weight w (tis_token, tis_seq, mis_seq) of e^−600 underflows to 0 in fp32 and drops a
term that float64 keeps (times a term of e^900 it is e^300): a range limit, not a nan.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from megatron_rl.losses import (
    PolicyBatch,
    compute_policy_loss,
    ess_from_stats,
    local_counts,
    p3o_ess_stats,
)
from megatron_rl.losses.token_local import TokenTerms, token_local_blocker

from . import reference as ref
from .batches import seeds

FP32_MAX = float(torch.finfo(torch.float32).max)
MODERATE = 1e30

SURROGATES = [("ppo_clip", {}), ("ppo_clip", {"dual_clip": 3.0}), ("mu_grpo", {}), ("reinforce", {}), ("cispo", {}),
              ("cispo", {"eps_high": math.inf}), ("gspo", {}), ("gspo_token", {}), ("minirl", {}),
              ("minirl", {"c_tis": math.inf}), ("p3o", {}), ("p3o", {"ess": 1.0})]
CORRECTIONS = [None, "tis_token", "tis_seq", "mis_token", "mis_seq", "mis_geo", "veto", "icepop", "kpop", "opsm", "nav"]
AGGREGATIONS = {"gspo": ["seq_mean_token_mean"], "p3o": ["token_mean"]}


def _batch(lp, old, ro, A, dtype=torch.float32, mask=None):
    leaf = torch.tensor(lp, dtype=dtype, requires_grad=True)
    t = [torch.tensor(x, dtype=dtype) for x in (old, ro, A)]
    m = torch.ones(leaf.shape, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return PolicyBatch(leaf, *t, m), leaf


def _loss_grad(batch, leaf, surrogate, params, corrections, aggregation="token_mean", agg_params=None):
    loss, _ = compute_policy_loss(batch, surrogate, params, corrections, aggregation, agg_params,
                                  normaliser=local_counts(batch.loss_mask))
    (g,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), g


# ----------------------------------------------------------------------------- the issue's examples


LP, OLD = [[-0.5, -1.0]], [[-100.5, -1.1]]  # log r = 100 on the first token: r = inf in fp32


@pytest.mark.parametrize("surrogate,params", [("ppo_clip", {}), ("ppo_clip", {"dual_clip": 3.0}),
                                              ("mu_grpo", {}), ("reinforce", {}), ("cispo", {"eps_high": math.inf}),
                                              ("minirl", {"c_tis": math.inf})])
def test_zero_advantage_with_an_overflowing_ratio_is_zero(surrogate, params):
    """(a) an all-equal group has A = 0: loss and gradient 0, not nan (ρ = π_θ/μ = e^100 too)."""
    batch, leaf = _batch(LP, OLD, [[-100.5, -1.0]], [[0.0, 0.0]])
    loss, g = _loss_grad(batch, leaf, surrogate, params, [])
    assert float(loss) == 0.0 and torch.equal(g.abs(), torch.zeros_like(g)), (loss, g)


@pytest.mark.parametrize("correction,params,mu", [("icepop", {}, [[-0.5, -1.0]]), ("mis_token", {}, [[-0.5, -1.0]]),
                                                  ("nav", {}, [[-0.5, -1.0]]), ("veto", {}, [[-0.5, -1.0]]),
                                                  ("mis_seq", {}, [[-200.5, -1.0]])])
def test_a_dropped_token_with_an_overflowing_ratio_has_zero_gradient(correction, params, mu):
    """(b) the correction drops the first token (w = e^−100 or e^100, or r = e^100 for nav; veto and
    mis_seq drop the response): the loss was right but its gradient nan; now both are the float64
    reference's."""
    A = [[-1.0, -1.0]]
    for surrogate in ("ppo_clip", "reinforce", "minirl", "cispo"):
        batch, leaf = _batch(LP, OLD, mu, A)
        loss, g = _loss_grad(batch, leaf, surrogate, {}, [(correction, params)])
        terms, want = ref.policy_loss(surrogate, {}, [(correction, params)], "token_mean", {}, LP, OLD, mu, A,
                                      [[True, True]])
        assert torch.isfinite(g).all(), (surrogate, g)
        torch.testing.assert_close(g.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-7)
        assert math.isclose(float(loss), math.fsum(x for row in terms for x in row), rel_tol=1e-5, abs_tol=1e-7)


def test_issue_icepop_example():
    batch, leaf = _batch(LP, OLD, [[-0.5, -1.0]], [[-1.0, -1.0]])
    loss, g = _loss_grad(batch, leaf, "ppo_clip", {}, [("icepop", {})])
    assert math.isclose(float(loss), 0.5526, abs_tol=1e-4)
    assert g[0, 0] == 0 and math.isclose(float(g[0, 1]), 0.5526, abs_tol=1e-4)


def test_p3o_k3_at_ess_one_is_zero():
    """P3O's k3 = exp(log π_old − log π_θ) − … has weight 1 − ESS = 0 at ESS = 1: a log-ratio of
    −100 made it 0 · inf = nan."""
    batch, leaf = _batch([[-100.5, -1.0]], [[-0.5, -1.1]], [[-0.5, -1.0]], [[1.0, 1.0]])
    loss, g = _loss_grad(batch, leaf, "p3o", {"ess": 1.0}, [])
    assert torch.isfinite(loss) and torch.isfinite(g).all(), (loss, g)
    _, want = ref.policy_loss("p3o", {"ess": 1.0}, [], "token_mean", {}, [[-100.5, -1.0]], [[-0.5, -1.1]],
                                  [[-0.5, -1.0]], [[1.0, 1.0]], [[True, True]])
    torch.testing.assert_close(g.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_token_local_terms_of_a_dropped_token_have_zero_gradient():
    """The same defect in the log-prob kernel's path (TokenTerms.chunk_loss), one token per chunk."""
    batch, _ = _batch(LP, OLD, [[-0.5, -1.0]], [[-1.0, -1.0]])
    terms = TokenTerms.from_batch(batch, "ppo_clip", {}, [("icepop", {})], "token_mean",
                                  normaliser=local_counts(batch.loss_mask)).map(lambda x: x.reshape(-1))
    lp = torch.tensor(LP[0], requires_grad=True)
    loss = sum(terms.chunk_loss(slice(t, t + 1), lp[t:t + 1]) for t in range(2))
    (g,) = torch.autograd.grad(loss, lp)
    assert g[0] == 0 and math.isclose(float(g[1]), 0.5526, abs_tol=1e-4)


# ----------------------------------------------------------------------------- the property


def _arrays(seed: int, B: int = 3, T: int = 6) -> dict:
    """Right-padded rows; per token log r moderate or ±[600, 1000], log w moderate or +[600, 1000]
    (see the module docstring); log μ = −inf or +inf on some tokens; A per row, often 0."""
    rng = np.random.default_rng(seed)
    m = np.arange(T)[None, :] < rng.integers(0, T + 1, size=B)[:, None]
    s_r = rng.choice([-1, 0, 0, 0, 1], size=(B, T))
    s_w = rng.choice([0, 0, 0, 1], size=(B, T))
    d_r = np.where(s_r != 0, s_r * rng.uniform(600, 1000, (B, T)), rng.normal(0, 0.5, (B, T)))  # log π_θ − log π_old
    d_w = np.where(s_w != 0, s_w * rng.uniform(600, 1000, (B, T)), rng.normal(0, 0.5, (B, T)))  # log π_old − log μ
    lp, old = np.zeros((B, T)), -d_r
    ro = old - d_w
    top = np.maximum(np.maximum(lp, old), ro)
    shift = -rng.exponential(1.0, (B, T)) - 1e-3 - top  # every log-prob < 0
    lp, old, ro = lp + shift, old + shift, ro + shift
    u = rng.random((B, T))
    ro = np.where(u < 0.08, -math.inf, np.where(u > 0.96, math.inf, ro))
    a_row = np.where(rng.random(B) < 0.4, 0.0, np.where(rng.random(B) < 0.5, rng.choice([-1.0, -0.5, 0.7, 1.3], B),
                                                         rng.normal(size=B)))
    return {"lp": lp, "old": old, "ro": ro, "A": np.repeat(a_row[:, None], T, axis=1), "m": m}


def _check(what: str, got: torch.Tensor, want, rtol: float, atol: float) -> None:
    got = got.detach().double().reshape(-1)
    want = torch.tensor(want, dtype=torch.float64).reshape(-1)
    defined = ~want.isnan()
    assert not got[defined].isnan().any(), f"{what}: nan where the reference is {want[defined & got.isnan()]}"
    small = defined & (want.abs() < MODERATE)
    assert torch.isfinite(got[small]).all(), f"{what}: {got[small]} vs {want[small]}"
    close = (got[small] - want[small]).abs() <= atol + rtol * want[small].abs()
    assert close.all(), f"{what}: {got[small][~close]} vs {want[small][~close]}"
    huge = defined & (want.abs() > FP32_MAX)
    assert torch.equal(got[huge], want[huge].sign() * math.inf), f"{what}: {got[huge]} vs {want[huge]}"


def _check_loss(what: str, got: torch.Tensor, terms, rtol: float) -> None:
    flat = [x for row in terms for x in row]
    if any(math.isnan(x) for x in flat):
        return
    huge = [x for x in flat if abs(x) >= MODERATE]
    if huge:  # a term beyond fp32: the sum is ±inf where they all have one sign, else inf − inf
        if all(x > 0 for x in huge) or all(x < 0 for x in huge):
            assert not got.isnan(), f"{what}: nan for terms {huge}"
            if abs(math.fsum(flat)) > FP32_MAX:
                assert float(got) == math.copysign(math.inf, huge[0]), f"{what}: {got} for terms {huge}"
        return
    _check(what, got, math.fsum(flat), rtol, atol=rtol * (1.0 + math.fsum(abs(x) for x in flat)))


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("surrogate,params", SURROGATES, ids=[f"{n}{p or ''}" for n, p in SURROGATES])
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=seeds)
def test_zero_weight_terms_are_finite_and_match_float64(surrogate, params, correction, seed):
    arr = _arrays(seed)
    corrections = [(correction, {})] if correction else []
    T = arr["m"].shape[1]
    # bf16: the gradient reaches log π_θ along two paths (p3o, ppo's ratio and log-prob), each rounded
    # to bf16 before they are added: an absolute error of ~2^-9 of the parts, not of the sum
    for dtype, rtol, atol in ((torch.float32, 1e-4, 1e-6), (torch.bfloat16, 1e-2, 1e-3)):
        # the reference reads exactly the values torch holds in this dtype
        L, O, R, A = (torch.tensor(arr[k], dtype=dtype).double().tolist() for k in ("lp", "old", "ro", "A"))
        batch, leaf = _batch(L, O, R, A, dtype, arr["m"])
        p = dict(params)
        if surrogate == "p3o" and "ess" not in p:  # the step statistic as the trainer makes it, fp32 as the loss reads it
            p["ess"] = float(torch.tensor(float(ess_from_stats(*p3o_ess_stats(leaf, batch.old_logprobs, batch.mask))),
                                          dtype=torch.float32))
        for aggregation in AGGREGATIONS.get(surrogate, ["token_mean", "seq_mean_token_mean", "token_sum_norm"]):
            agg_params = {"l_norm": float(T)} if aggregation == "token_sum_norm" else {}
            what = f"{surrogate}{params} × {correction} × {aggregation} in {dtype}, seed {seed}"
            terms, want = ref.policy_loss(surrogate, p, corrections, aggregation, agg_params, L, O, R, A,
                                          arr["m"].tolist())
            loss, g = _loss_grad(batch, leaf, surrogate, p, corrections, aggregation, agg_params)
            _check_loss(what + ": loss", loss, terms, rtol)
            _check(what + ": gradient", g, want, rtol, atol)
            if token_local_blocker(surrogate, p, corrections, aggregation, agg_params) is None:
                tl = TokenTerms.from_batch(batch, surrogate, p, corrections, aggregation, agg_params,
                                           normaliser=local_counts(batch.loss_mask)).map(lambda x: x.reshape(-1))
                flat = leaf.detach().reshape(-1).clone().requires_grad_()
                half = flat.numel() // 2  # two chunks, as the kernel sees them
                loss_tl = tl.chunk_loss(slice(0, half), flat[:half]) + tl.chunk_loss(slice(half, None), flat[half:])
                (g_tl,) = torch.autograd.grad(loss_tl, flat)
                _check_loss(what + ": token-local loss", loss_tl.detach(), terms, rtol)
                _check(what + ": token-local gradient", g_tl, want, rtol, atol)
