"""compute_policy_loss: composition, split invariance, on-policy identities, recipes, keep_sampling_mask."""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.config.schema import LossSection
from megatron_rl.losses import (
    GlobalCounts,
    PolicyBatch,
    apply_corrections,
    compute_policy_loss,
    ess_from_stats,
    get_recipe,
    get_surrogate,
    keep_sampling_mask,
    local_counts,
    p3o_ess_stats,
)
from megatron_rl.losses.setup import resolve_loss
from megatron_rl.metrics.reduce import finish as finish_metrics

from . import reference as ref
from .batches import as_lists, assert_close, make_arrays, seeds, to_batch


def _counts(mask_chunks):
    total = local_counts(mask_chunks[0])
    for m in mask_chunks[1:]:
        total = total + local_counts(m)
    return total


def _rows(batch: PolicyBatch, lp: torch.Tensor, sl: slice) -> PolicyBatch:
    return PolicyBatch(lp[sl], batch.old_logprobs[sl], batch.rollout_logprobs[sl], batch.advantages[sl],
                       batch.loss_mask[sl])


def _loss_and_grad(arr, surrogate, sparams, corrections, aggregation, agg_params, n_micro):
    """Sum of micro-batch losses with the global normaliser (and the global ESS for P3O)."""
    full, lp = to_batch(arr)
    B = lp.shape[0]
    bounds = np.linspace(0, B, n_micro + 1).astype(int)
    slices = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    counts = _counts([full.loss_mask[s] for s in slices])
    sparams = dict(sparams)
    if surrogate == "p3o":
        stats = [p3o_ess_stats(lp[s], full.old_logprobs[s], full.loss_mask[s]) for s in slices]
        sparams["ess"] = ess_from_stats(*(sum(x[i] for x in stats) for i in range(3)))
    total = 0.0
    for s in slices:
        loss, _ = compute_policy_loss(_rows(full, lp, s), surrogate, sparams, corrections, aggregation, agg_params,
                                      normaliser=counts)
        total = total + loss
    (g,) = torch.autograd.grad(total, lp)
    return total.detach(), g


CONFIGS = [
    ("ppo_clip", {"eps_high": 0.28}, [], "token_mean", {}),
    ("ppo_clip", {"dual_clip": 3.0}, [("tis_token", {})], "seq_mean_token_mean", {}),
    ("minirl", {}, [], "token_sum_norm", {"l_norm": 6}),
    ("cispo", {}, [("mis_token", {"C": 1.5})], "token_mean", {}),
    ("reinforce", {}, [("icepop", {"alpha": 0.8, "beta": 1.3})], "seq_mean_token_sum", {"l_norm": 6}),
    ("gspo", {"eps_low": 0.05, "eps_high": 0.07}, [("tis_seq", {})], "seq_mean_token_mean", {}),
    ("gspo_token", {"eps_low": 0.05, "eps_high": 0.07}, [("opsm", {"delta": 0.05})], "seq_mean_token_mean", {}),
    ("p3o", {}, [("veto", {"tau": 0.3})], "token_mean", {}),
    ("mu_grpo", {}, [("nav", {"kappa": 1.3})], "seq_mean_token_mean", {}),
    ("ppo_clip", {}, [("kpop", {}), ("mis_geo", {"lo": 0.8, "hi": 1.2}), ("mis_seq", {"C": 3.0})], "token_mean", {}),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-{c[3]}-{'+'.join(n for n, _ in c[2]) or 'none'}")
@settings(max_examples=15, deadline=None)
@given(seed=seeds)
def test_micro_batch_split_invariance(cfg, seed):
    arr = make_arrays(seed, B=8, T=6, sigma_r=0.3, sigma_w=0.3, garbage=seed % 2 == 0)
    ref_loss, ref_grad = _loss_and_grad(arr, *cfg, n_micro=1)
    assert torch.isfinite(ref_loss) and torch.isfinite(ref_grad).all()
    for n in (2, 4):
        loss, grad = _loss_and_grad(arr, *cfg, n_micro=n)
        assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_composition_matches_manual_product():
    arr = make_arrays(3, B=4, T=5)
    batch, _lp = to_batch(arr)
    spec = [("tis_token", {"C": 1.5}), ("icepop", {"alpha": 0.9, "beta": 1.2})]
    loss, metrics = compute_policy_loss(batch, "ppo_clip", {}, spec, "token_mean", normaliser=local_counts(batch.loss_mask))
    out = get_surrogate("ppo_clip")(batch)
    c = apply_corrections(batch, spec)
    manual = (out.per_token * c.weight * c.keep * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert_close(loss, manual)
    assert {"ppo_clip/clipped/num/sum", "tis_token/truncated/num/sum", "icepop/masked/num/sum", "policy/kept_tokens/num/sum"} <= set(metrics)
    assert all(v.dtype == torch.float64 and v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_decoupled_ppo_recipe_is_ppo_clip_with_tis_on_w():
    arr = make_arrays(5, B=4, T=5, sigma_w=0.5)
    batch, _lp = to_batch(arr)
    counts = local_counts(batch.loss_mask)
    loss, _ = compute_policy_loss(batch, **resolve_loss(LossSection(recipe="decoupled_ppo"), 5).loss_kwargs(),
                                  normaliser=counts)
    m = batch.mask
    w = torch.exp(torch.where(m, batch.old_logprobs - batch.rollout_logprobs, 0.0)).clamp(max=2.0)
    manual = (get_surrogate("ppo_clip")(batch).per_token * w * m).sum() / m.sum()
    assert_close(loss, manual)
    with pytest.raises(KeyError, match="decoupled_ppo"):
        get_recipe("nope")
    minirl = get_recipe("minirl")
    assert minirl.aggregation == "token_sum_norm" and minirl.advantage == "mean_centered"
    assert resolve_loss(LossSection(recipe="minirl"), 1024).loss_kwargs()["agg_params"] == {"l_norm": 1024.0}


def test_finish_metrics():
    metrics = {"a/clipped/num/sum": torch.tensor(3.0, dtype=torch.float64), "a/clipped/den/sum": torch.tensor(12.0),
               "p3o/ess/num/sum": torch.tensor(0.5), "p3o/ess/den/sum": torch.tensor(1.0),
               "b/x/num/sum": torch.tensor(0.0), "b/x/den/sum": torch.tensor(0.0)}
    assert finish_metrics(metrics) == {"a/clipped": 0.25, "p3o/ess": 0.5, "b/x": 0.0}


# ----------------------------------------------------------------------------- on-policy identities


@settings(max_examples=25, deadline=None)
@given(seed=seeds)
def test_on_policy_gradients_identical(seed):
    """θ = θ_old and μ = π_old: minirl, ppo_clip, reinforce, cispo, p3o all give −A·m/N, and ESS = 1."""
    arr = make_arrays(seed, B=4, T=5)
    arr["lp"] = arr["old"].copy()
    arr["ro"] = arr["old"].copy()
    grads = {}
    for name in ("minirl", "ppo_clip", "reinforce", "cispo", "p3o", "mu_grpo"):
        batch, lp = to_batch(arr)
        params = {}
        if name == "p3o":
            params["ess"] = ess_from_stats(*p3o_ess_stats(lp, batch.old_logprobs, batch.loss_mask))
            assert float(params["ess"]) == 1.0
        loss, _ = compute_policy_loss(batch, name, params, [], "token_mean", normaliser=local_counts(batch.loss_mask))
        (grads[name],) = torch.autograd.grad(loss, lp)
    m = torch.tensor(arr["m"])
    expected = torch.where(m, -torch.tensor(arr["A"], dtype=torch.float32), 0.0) / max(int(m.sum()), 1)
    for name, g in grads.items():
        assert_close(g, expected, rtol=1e-6, atol=1e-7), name


# ----------------------------------------------------------------------------- edge cases


def _extreme_batch():
    # rows: r = e^80 (A>0), w = e^80 (A<0), rho = e^80 (A>0), all ratios e^-80 (A<0); padding holds inf/nan
    lp = [[-10.0, -85.0, -5.0, -85.0, math.nan]]
    old = [[-90.0, -5.0, -5.0, -85.0, -math.inf]]
    ro = [[-10.0, -85.0, -85.0, -5.0, math.inf]]
    A = [[1.0, -1.0, 1.0, -1.0, math.nan]]
    t = [torch.tensor(x) for x in (lp, old, ro, A)]
    m = torch.tensor([[True, True, True, True, False]])
    lp_t = t[0].clone().requires_grad_()
    return PolicyBatch(lp_t, t[1], t[2], t[3], m), lp_t


ALL_SURROGATES = [("ppo_clip", {}), ("ppo_clip", {"dual_clip": 3.0}), ("mu_grpo", {}), ("reinforce", {}),
                  ("cispo", {}), ("gspo", {}), ("gspo_token", {}), ("minirl", {}), ("p3o", {"ess": 0.5})]
ALL_CORRECTIONS = ["tis_token", "tis_seq", "mis_token", "mis_seq", "mis_geo", "veto", "icepop", "kpop", "opsm", "nav"]


@pytest.mark.parametrize("surrogate,params", ALL_SURROGATES, ids=[f"{n}{i}" for i, (n, _) in enumerate(ALL_SURROGATES)])
@pytest.mark.parametrize("correction", ALL_CORRECTIONS)
def test_extreme_log_prob_gaps_are_finite(surrogate, params, correction):
    batch, lp = _extreme_batch()
    loss, metrics = compute_policy_loss(batch, surrogate, params, [(correction, {})], "token_mean",
                                        normaliser=local_counts(batch.loss_mask))
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and g[0, 4] == 0
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_extreme_gaps_are_counted_in_metrics():
    batch, _ = _extreme_batch()
    n = local_counts(batch.loss_mask)
    _, met = compute_policy_loss(batch, "ppo_clip", {}, [("tis_token", {}), ("mis_token", {}), ("icepop", {}),
                                                           ("veto", {})], "token_mean", normaliser=n)
    f = finish_metrics(met)
    assert f["ppo_clip/clipped"] == 0.5          # r = e^80 with A > 0 and r = e^-80 with A < 0
    assert f["tis_token/truncated"] == 0.5       # w = e^80 twice
    assert f["mis_token/masked"] == 1.0          # every token has w outside [1/2, 2]
    assert f["icepop/masked"] == 1.0
    assert f["veto/vetoed_seqs"] == 1.0          # w = e^-80 < 1e-4
    _, met = compute_policy_loss(batch, "minirl", {}, [], "token_mean", normaliser=n)
    assert finish_metrics(met)["minirl/tis_truncated"] == 0.25  # rho = e^80


@pytest.mark.parametrize("name", ["minirl", "cispo", "ppo_clip"])
def test_bounded_weights_survive_gaps_beyond_fp32_exp(name):
    """Bounded weights compare in log space, so even |Δ| = 200 (exp overflows fp32) stays finite."""
    lp = torch.tensor([[-1.0, -201.0]], requires_grad=True)
    b = PolicyBatch(lp, torch.tensor([[-201.0, -1.0]]), torch.tensor([[-201.0, -1.0]]), torch.tensor([[1.0, -1.0]]),
                    torch.ones(1, 2, dtype=torch.bool))
    loss, _ = compute_policy_loss(b, name, {}, [("tis_token", {}), ("icepop", {}), ("mis_seq", {})], "token_mean",
                                  normaliser=local_counts(b.loss_mask))
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()


@pytest.mark.parametrize("surrogate,params", ALL_SURROGATES, ids=[f"{n}{i}" for i, (n, _) in enumerate(ALL_SURROGATES)])
def test_all_masked_rows(surrogate, params):
    arr = make_arrays(11, B=3, T=4, garbage=True)
    arr["m"][1] = False
    for k, v in (("lp", math.nan), ("old", math.inf), ("ro", -math.inf), ("A", math.nan)):
        arr[k][1] = v
    batch, lp = to_batch(arr)
    out = get_surrogate(surrogate)(batch, **params)
    assert (out.per_token[1] == 0).all() and torch.isfinite(out.per_token).all()
    for agg, ap in (("token_mean", {}), ("seq_mean_token_mean", {}), ("token_sum_norm", {"l_norm": 4})):
        loss, _ = compute_policy_loss(batch, surrogate, params, [(c, {}) for c in ALL_CORRECTIONS], agg, ap,
                                      normaliser=local_counts(batch.loss_mask))
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and (g[1] == 0).all()
    empty = PolicyBatch(lp.detach()[:0], *(torch.zeros(0, 4) for _ in range(3)), torch.zeros(0, 4, dtype=torch.bool))
    for counts in (local_counts(empty.loss_mask), local_counts(batch.loss_mask)):  # step total 0, or > 0
        loss, _ = compute_policy_loss(empty, "ppo_clip", {}, [], "token_mean", normaliser=counts)
        assert float(loss) == 0.0


def test_zero_variance_group_gives_zero_loss():
    arr = make_arrays(2, B=4, T=5)
    arr["A"][:] = 0.0
    batch, lp = to_batch(arr)
    for name in ("ppo_clip", "minirl", "reinforce", "cispo", "gspo"):
        loss, _ = compute_policy_loss(batch, name, {}, [], "token_mean", normaliser=local_counts(batch.loss_mask))
        (g,) = torch.autograd.grad(loss, lp)
        assert float(loss.detach()) == 0.0 and (g == 0).all()


# ----------------------------------------------------------------------------- keep_sampling_mask


def test_keep_sampling_mask_hand_computed():
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]], requires_grad=True)
    labels = torch.tensor([[3, 2]])
    kept = torch.tensor([[[False, True, False, True], [False, True, False, True]]])
    out = keep_sampling_mask(logits, labels, kept)
    assert_close(out[0, 0], 3 - math.log(math.exp(1) + math.exp(3)))  # -0.126928
    assert out[0, 1] == -math.inf  # sampled token outside the kept set
    ids = torch.tensor([[[3, 1, -1], [1, 3, -1]]])
    assert_close(keep_sampling_mask(logits, labels, ids)[0, 0], -0.1269280110429725)
    (g,) = torch.autograd.grad(out[0, 0], logits)
    p1 = math.exp(1) / (math.exp(1) + math.exp(3))
    assert_close(g[0, 0], [0.0, -p1, 0.0, 1 - (1 - p1)])


@settings(max_examples=25, deadline=None)
@given(seed=seeds)
def test_keep_sampling_mask_properties(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 11, generator=g) * 3
    labels = torch.randint(0, 11, (2, 3), generator=g)
    full = keep_sampling_mask(logits, labels, torch.ones(2, 3, 11, dtype=torch.bool))
    assert_close(full, torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0])
    kept = torch.rand(2, 3, 11, generator=g) < 0.5
    kept.scatter_(-1, labels[..., None], True)
    out = keep_sampling_mask(logits, labels, kept)
    assert (out >= full - 1e-6).all()  # renormalising over a subset raises the probability
    total = sum(torch.exp(keep_sampling_mask(logits, torch.full_like(labels, v), kept)) for v in range(11))
    assert_close(total, torch.ones(2, 3))
    ids = torch.where(kept, torch.arange(11).expand(2, 3, 11), -1)
    assert_close(keep_sampling_mask(logits, labels, ids), out)


SCORE_FUNCTION_REFS = {
    "minirl": lambda L, O, R, A, M: ref.minirl(L, O, R, A, M, 0.2, 0.27, 5.0)[1],
    "cispo": lambda L, O, R, A, M: ref.cispo(L, O, A, M, 1.0, 0.28)[1],
    "reinforce": lambda L, O, R, A, M: ref.reinforce(L, R, A, M)[1],
}


@pytest.mark.parametrize("name", sorted(SCORE_FUNCTION_REFS))
@settings(max_examples=25, deadline=None)
@given(seed=seeds, n_tok=st.floats(1.0, 100.0), n_seq=st.floats(1.0, 10.0))
def test_score_function_gradient_is_coef_times_advantage_over_normaliser(name, seed, n_tok, n_seq):
    """∂loss/∂log π_θ,t = −coef_t · A · m_t / normaliser for token_mean and token_sum_norm."""
    arr = make_arrays(seed, B=3, T=5, sigma_r=0.3, sigma_w=0.5, garbage=seed % 2 == 0)
    coef_times_adv = torch.tensor(SCORE_FUNCTION_REFS[name](*as_lists(arr)), dtype=torch.float64)
    for agg, counts, params, norm in (("token_mean", GlobalCounts(num_tokens=n_tok), {}, n_tok),
                                      ("token_sum_norm", GlobalCounts(num_seqs=n_seq), {"l_norm": 7.0}, n_seq * 7)):
        batch, lp = to_batch(arr)
        loss, _ = compute_policy_loss(batch, name, {}, [], agg, params, normaliser=counts)
        (g,) = torch.autograd.grad(loss, lp)
        assert_close(g, coef_times_adv / norm, rtol=1e-4, atol=1e-7)
