"""losses/token_local.py: the marks each loss part declared, and TokenTerms against compute_policy_loss.

The log-prob kernel that forms gradients in its forward sees one chunk of tokens at a time. These
tests check what it relies on: a `token_local` surrogate evaluated one token at a time gives the
same terms and gradients as on the whole batch (and gspo's does not), a correction that declares it
does not read π_θ gives the same weights whatever π_θ is (and one that reads it does not), every
`linear` aggregation is linear, and the sum of `chunk_loss` over any partition of the tokens, in any
order, is `compute_policy_loss`'s loss with its gradient.
"""
import math

import numpy as np
import pytest
import torch

from megatron_rl.config.schema import LossSection
from megatron_rl.losses import (
    AGGREGATIONS,
    CORRECTIONS,
    RECIPES,
    SURROGATES,
    PolicyBatch,
    aggregate,
    compute_policy_loss,
    get_correction,
    get_surrogate,
    local_counts,
)
from megatron_rl.losses.setup import resolve_loss
from megatron_rl.losses.token_local import TokenTerms, token_local_blocker

from .batches import make_arrays, to_batch

PARAMS = {"p3o": {"ess": 0.7}}   # per-step statistics the trainer would supply


def _batch(seed: int, B: int = 4, T: int = 7, empty_row: bool = True, **kw) -> tuple[PolicyBatch, torch.Tensor]:
    arr = make_arrays(seed, B=B, T=T, sigma_r=0.6, sigma_w=0.6, garbage=True, empty_row=empty_row)
    batch, lp = to_batch(arr, **kw)
    return batch, lp


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)


def _with_logprobs(batch: PolicyBatch, lp: torch.Tensor) -> PolicyBatch:
    return PolicyBatch(lp, batch.old_logprobs, batch.rollout_logprobs, batch.advantages, batch.loss_mask,
                       positions=batch.positions)


def _one_token_at_a_time(name: str, batch: PolicyBatch, lp: torch.Tensor):
    """(ℓ, ∂Σℓ/∂lp) with the surrogate called on each token alone, as the fused kernel's chunks do."""
    leaf = lp.detach().clone().requires_grad_()
    pos = batch.token_positions()
    terms = []
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            def one(x, b=b, t=t):
                return x[b, t].reshape(1, 1)
            sub = PolicyBatch(one(leaf), one(batch.old_logprobs), one(batch.rollout_logprobs), one(batch.advantages),
                              one(batch.loss_mask), positions=one(pos))
            terms.append(get_surrogate(name)(sub, **PARAMS.get(name, {})).per_token.reshape(()))
    per_token = torch.stack(terms).reshape(lp.shape)
    (g,) = torch.autograd.grad(torch.where(batch.mask, per_token, 0.0).sum(), leaf)
    return per_token.detach(), g


def _whole(name: str, batch: PolicyBatch, lp: torch.Tensor):
    leaf = lp.detach().clone().requires_grad_()
    per_token = get_surrogate(name)(_with_logprobs(batch, leaf), **PARAMS.get(name, {})).per_token
    (g,) = torch.autograd.grad(torch.where(batch.mask, per_token, 0.0).sum(), leaf)
    return per_token.detach(), g


@pytest.mark.parametrize("name", SURROGATES.names())
def test_surrogate_mark_matches_its_math(name):
    batch, lp = _batch(3)
    m = batch.mask
    whole, g_whole = _whole(name, batch, lp)
    alone, g_alone = _one_token_at_a_time(name, batch, lp)
    same = torch.allclose(whole[m], alone[m], rtol=1e-6, atol=1e-7) and torch.allclose(g_whole, g_alone, rtol=1e-6,
                                                                                          atol=1e-7)
    assert same == SURROGATES.get(name).token_local, name


CORRECTION_CASES = [(name, {}) for name in CORRECTIONS.names()] + [
    ("tis_token", {"tis_use_rho": True}), ("kpop", {"use_current_policy": True}), ("icepop", {"ratio_weight": True}),
    ("nav", {"nav_scope": "sequence"}), ("opsm", {"delta": 0.1})]


@pytest.mark.parametrize("name,params", CORRECTION_CASES, ids=[f"{n}-{p}" for n, p in CORRECTION_CASES])
def test_correction_mark_matches_its_math(name, params):
    batch, _ = _batch(5, empty_row=False)
    m = batch.mask
    adv = torch.tensor([-1.0, 0.7, -0.5, 1.3])[:, None].expand_as(m)   # both signs: nav and opsm act on A < 0
    batch = PolicyBatch(batch.logprobs, batch.old_logprobs, batch.rollout_logprobs, torch.where(m, adv, math.nan), m)
    assert m.sum(1).min() > 0
    # π_θ well above and well below π_old: every π_θ-reading correction changes its verdict
    outs = []
    for lp in (batch.old_logprobs + 1.0, batch.old_logprobs - 1.0, torch.full_like(batch.old_logprobs, math.nan)):
        c = get_correction(name)(_with_logprobs(batch, lp), **params)
        outs.append((torch.where(m, c.weight, 0.0), c.keep | ~m))
    reads = token_local_blocker("ppo_clip", corrections=[(name, params)]) is not None
    independent = all(torch.equal(outs[0][i], o[i]) for o in outs[1:] for i in range(2))
    assert independent == (not reads), (name, params)


@pytest.mark.parametrize("name", AGGREGATIONS.names())
def test_linear_aggregations_are_linear(name):
    assert AGGREGATIONS.get(name).linear, f"{name}: declare linear=True or test that it is not"
    batch, _ = _batch(7)
    counts = local_counts(batch.loss_mask)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch.mask.shape, generator=g), torch.randn(batch.mask.shape, generator=g)
    params = {"l_norm": 9.0} if "sum" in name else {}

    def agg(v):
        return aggregate(name, v, batch.loss_mask, counts, **params)

    torch.testing.assert_close(agg(2.5 * x - 0.75 * y), 2.5 * agg(x) - 0.75 * agg(y), rtol=1e-6, atol=1e-7)


def _recipe_loss(recipe) -> dict:
    agg_params = dict(recipe.agg_params) or ({"l_norm": 9.0} if recipe.aggregation == "token_sum_norm" else {})
    return {"surrogate": recipe.surrogate, "corrections": list(recipe.corrections), "aggregation": recipe.aggregation,
            "surrogate_params": {**recipe.surrogate_params, **PARAMS.get(recipe.surrogate, {})},
            "agg_params": agg_params}


LOSSES = [_recipe_loss(RECIPES.get(n)) for n in RECIPES.names()] + [
    {"surrogate": "ppo_clip", "aggregation": "seq_mean_token_mean",
     "corrections": [("tis_seq", {}), ("veto", {"tau": 0.5}), ("icepop", {"ratio_weight": True})]},
    {"surrogate": "cispo", "aggregation": "token_mean",
     "corrections": [("mis_seq", {"C": 1.5}), ("mis_geo", {"lo": 0.8, "hi": 1.2}), ("kpop", {"phi": 0.05})]},
    {"surrogate": "reinforce", "aggregation": "token_sum_norm", "agg_params": {"l_norm": 5.0},
     "corrections": [("mis_token", {"C": 1.5}), ("tis_token", {"C": 1.2})]},
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kw", LOSSES, ids=lambda kw: f"{kw['surrogate']}-{len(kw.get('corrections', []))}")
def test_chunks_sum_to_the_policy_loss(kw, seed):
    """Σ over a random partition (random order, uneven chunks) of chunk_loss == compute_policy_loss."""
    batch, lp = _batch(seed, positions=None)
    counts = local_counts(batch.loss_mask)
    reason = token_local_blocker(**kw)
    if reason is not None:
        with pytest.raises(ValueError, match="not a token-local loss"):
            TokenTerms.from_batch(batch, normaliser=counts, **kw)
        return
    loss, _ = compute_policy_loss(_with_logprobs(batch, lp), normaliser=counts, **kw)
    (g_want,) = torch.autograd.grad(loss, lp)
    nan_pi = _with_logprobs(batch, torch.full_like(lp, math.nan))   # the terms never read π_θ
    terms = TokenTerms.from_batch(nan_pi, normaliser=counts, **kw).map(_flat)
    rng = np.random.default_rng(seed)
    order = torch.as_tensor(rng.permutation(lp.numel()))
    cuts = sorted(rng.choice(np.arange(1, lp.numel()), size=4, replace=False).tolist())
    leaf = lp.detach().reshape(-1).clone().requires_grad_()
    total = sum(terms.chunk_loss(rows, leaf[rows]) for rows in torch.tensor_split(order, cuts))
    (g_got,) = torch.autograd.grad(total, leaf)
    torch.testing.assert_close(total, loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got.reshape(lp.shape), g_want, rtol=1e-5, atol=1e-7)
    assert g_want.abs().max() > 0   # not vacuous


def test_blocker_names_the_part():
    assert "gspo" in token_local_blocker("gspo")
    assert "nav" in token_local_blocker("mu_grpo", corrections=[("nav", {})])
    assert "tis_token" in token_local_blocker("ppo_clip", corrections=[("tis_token", {"tis_use_rho": True})])
    assert token_local_blocker("ppo_clip", corrections=[("tis_token", {"tis_use_rho": False})]) is None


def test_head_gradients_resolves_per_loss():
    def resolved(recipe, mode):
        return resolve_loss(LossSection(recipe=recipe, head_gradients=mode), 16).gradients_in_forward

    assert resolved("grpo", "auto") and resolved("grpo", "forward") and not resolved("grpo", "recompute")
    assert not resolved("gspo", "auto") and not resolved("mu_grpo", "auto")
    with pytest.raises(ValueError, match=r"loss.head_gradients=forward .*gspo.*loss.head_gradients=auto"):
        resolved("gspo", "forward")
    with pytest.raises(ValueError, match="loss.head_gradients"):
        LossSection(head_gradients="fused")
