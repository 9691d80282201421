"""Compose surrogate × rollout corrections × aggregation into the scalar policy loss of a micro-batch.

    loss, metrics = compute_policy_loss(
        batch, surrogate="ppo_clip", surrogate_params={"eps_high": 0.28},
        corrections=[("tis_token", {"C": 2.0})], aggregation="token_mean",
        normaliser=counts)            # GlobalCounts summed over the step's micro-batches and DP×CP ranks

    ℓ'_t = Π_k c_k,t · 1(∧_k keep_k,t) · ℓ_t,  loss = aggregation(ℓ', m, normaliser)

A term with weight 0 is exactly 0, with gradient 0, whatever its ratio (the surrogate sees the
weighted tokens as `PolicyBatch.active`; docs/algorithms.md#zero-weight-terms).

Named combinations (`RECIPES`, e.g. `decoupled_ppo` = ppo_clip + tis_token on w) bundle the three parts.
`keep_sampling_mask` renormalises π_θ over the rollout's top-p/top-k kept set (DeepSeek-V3.2).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from megatron_rl.losses.aggregation import GlobalCounts, aggregate
from megatron_rl.losses.corrections import apply_corrections
from megatron_rl.losses.surrogates import get_surrogate
from megatron_rl.losses.types import Metrics, PolicyBatch, add_fraction, prefix_metrics
from megatron_rl.registry import Registry


def compute_policy_loss(
    batch: PolicyBatch,
    surrogate: str = "ppo_clip",
    surrogate_params: Mapping[str, Any] | None = None,
    corrections: Sequence[tuple[str, Mapping[str, Any] | None]] = (),
    aggregation: str = "token_mean",
    agg_params: Mapping[str, Any] | None = None,
    *,
    normaliser: GlobalCounts,
) -> tuple[Tensor, Metrics]:
    """Policy loss of one micro-batch (its share of the optimizer step's loss) and its metrics.

    batch: PolicyBatch ([B, T] tensors). surrogate / corrections / aggregation: registry names with
    their keyword params. normaliser: the step's GLOBAL counts (see `aggregation.required_counts`).
    Returns (0-dim fp32 loss with gradient, metrics of detached float64 sums `<part>/<key>/num|den`).
    """
    corr = apply_corrections(batch, [(n, dict(p or {})) for n, p in corrections])
    m = batch.mask
    # the surrogate learns which terms are weighted 0 so that it freezes their ratios: a where()
    # after the fact would leave 0 · inf = nan in the backward of a dropped token with ratio inf
    active = m & corr.keep & (corr.weight != 0)
    out = get_surrogate(surrogate)(replace(batch, active=active), **dict(surrogate_params or {}))
    per_token = torch.where(active, corr.weight * out.per_token, 0.0)
    loss = aggregate(aggregation, per_token, batch.loss_mask, normaliser, batch.seq, **dict(agg_params or {}))
    metrics = prefix_metrics(surrogate, out.metrics)
    metrics.update(corr.metrics)
    add_fraction(metrics, "policy/kept_tokens", m & corr.keep, m)
    return loss, metrics


# ----------------------------------------------------------------------------- named combinations


@dataclass(frozen=True)
class LossRecipe:
    """A named surrogate × corrections × aggregation (+ the advantage estimator it was published with).

    implies: other config settings the recipe stands for, as {"section.field": value} (e.g.
    MiniRL-R3's {"moe.router_replay": "r3"}); the config loader fills them in before validation
    and refuses a config that sets them to something else.
    """

    surrogate: str
    surrogate_params: Mapping[str, Any] = field(default_factory=dict)
    corrections: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    aggregation: str = "token_mean"
    agg_params: Mapping[str, Any] = field(default_factory=dict)
    advantage: str = "grpo"
    implies: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for path in self.implies:
            if not isinstance(path, str) or path.count(".") != 1:
                raise TypeError(f"LossRecipe.implies: {path!r} is not a config field's 'section.field' name")


RECIPES = Registry("loss recipe", LossRecipe)
get_recipe = RECIPES.get


def register_recipe(name: str, recipe: LossRecipe) -> LossRecipe:
    return RECIPES.add(name, recipe)


def recipe_variant(name: str, implies: Mapping[str, Any]) -> str | None:
    """The registered recipe with the same loss as recipe `name` that implies exactly `implies`
    (e.g. minirl_r3 with {} -> minirl, with {"moe.router_replay": "r2"} -> minirl_r2), or None."""
    if name not in RECIPES:
        return None
    same = replace(RECIPES.get(name), implies=dict(implies))
    return next((n for n in RECIPES.names() if RECIPES.get(n) == same), None)


register_recipe("grpo", LossRecipe("ppo_clip", aggregation="seq_mean_token_mean"))
register_recipe("dapo", LossRecipe("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28}))
register_recipe("decoupled_ppo", LossRecipe("ppo_clip", corrections=(("tis_token", {}),)))
register_recipe("cispo", LossRecipe("cispo"))
register_recipe("gspo", LossRecipe("gspo", aggregation="seq_mean_token_mean"))
register_recipe("minirl", LossRecipe("minirl", aggregation="token_sum_norm", advantage="mean_centered"))
register_recipe("mu_grpo", LossRecipe("mu_grpo", corrections=(("nav", {}),), aggregation="seq_mean_token_mean"))
register_recipe("p3o", LossRecipe("p3o"))
# MiniRL with MoE router replay (R2: the trainer's π_old routing; R3: the rollout engine's)
register_recipe("minirl_r2", LossRecipe("minirl", aggregation="token_sum_norm", advantage="mean_centered",
                                        implies={"moe.router_replay": "r2"}))
register_recipe("minirl_r3", LossRecipe("minirl", aggregation="token_sum_norm", advantage="mean_centered",
                                        implies={"moe.router_replay": "r3"}))
# GRPO with one training-inference mismatch correction each (TIM blog; IcePop: Ring; KPop)
register_recipe("tis", LossRecipe("ppo_clip", corrections=(("tis_token", {"C": 2.0}),), aggregation="seq_mean_token_mean"))
register_recipe("mis", LossRecipe("ppo_clip", corrections=(("mis_token", {"C": 2.0}),), aggregation="seq_mean_token_mean"))
register_recipe("icepop", LossRecipe("ppo_clip", corrections=(("icepop", {"alpha": 0.5, "beta": 5.0}),),
                                     aggregation="seq_mean_token_mean"))
register_recipe("kpop", LossRecipe("ppo_clip", corrections=(("kpop", {}),), aggregation="seq_mean_token_mean"))


# ----------------------------------------------------------------------------- top-p / top-k action space


def keep_sampling_mask(logits: Tensor, labels: Tensor, kept: Tensor) -> Tensor:
    """log π_θ(y_t) renormalised over the rollout's kept token set (top-p / top-k), fp32.

    logits: [..., V] (full vocabulary, or one sequence chunk of it; call per chunk to bound memory)
    labels: [...] sampled token ids
    kept:   bool [..., V] kept-set mask, or int [..., K] kept token ids padded with -1
    returns [...]: logits[y] − logsumexp_{v ∈ kept} logits[v]; −inf where y is not in the kept set.
    """
    z = logits.float()
    y = labels.long().clamp_min(0).unsqueeze(-1)
    target = z.gather(-1, y).squeeze(-1)
    if kept.dtype == torch.bool:
        lse = torch.logsumexp(z.masked_fill(~kept, -torch.inf), dim=-1)
        in_set = kept.gather(-1, y).squeeze(-1)
    else:
        valid = kept >= 0
        sel = z.gather(-1, kept.long().clamp_min(0)).masked_fill(~valid, -torch.inf)
        lse = torch.logsumexp(sel, dim=-1)
        in_set = (valid & (kept == labels.unsqueeze(-1))).any(dim=-1)
    return torch.where(in_set, target - lse, -torch.inf)
