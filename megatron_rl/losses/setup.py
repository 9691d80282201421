"""LossSection (config) -> the concrete loss: surrogate, corrections, aggregation, advantages.

A recipe supplies defaults; explicit fields override them. Every name is checked against its
registry and incompatible choices fail here, at start-up, with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.losses.advantages import ADVANTAGES
from megatron_rl.losses.aggregation import AGGREGATIONS, required_counts
from megatron_rl.losses.corrections import CORRECTIONS
from megatron_rl.losses.policy_loss import RECIPES
from megatron_rl.losses.surrogates import SURROGATES


@dataclass(frozen=True)
class ResolvedLoss:
    surrogate: str
    surrogate_params: dict
    corrections: list[tuple[str, dict]]
    aggregation: str
    agg_params: dict
    advantages: str
    filter_zero_variance_groups: bool = False
    counts: tuple[str, ...] = field(default=())

    @property
    def needs_ess(self) -> bool:
        """P3O's ESS is a statistic of the current policy over the whole optimizer step."""
        return self.surrogate == "p3o"

    def loss_kwargs(self) -> dict[str, Any]:
        return dict(surrogate=self.surrogate, surrogate_params=dict(self.surrogate_params),
                    corrections=list(self.corrections), aggregation=self.aggregation,
                    agg_params=dict(self.agg_params))


def resolve_loss(section, max_response_len: int) -> ResolvedLoss:
    """Merge the recipe with explicit settings and validate. max_response_len: default L_norm."""
    recipe = RECIPES.get(section.recipe) if section.recipe else None
    surrogate = section.surrogate or (recipe.surrogate if recipe else None)
    if surrogate is None:
        raise ValueError("loss: set loss.recipe or loss.surrogate")
    SURROGATES.get(surrogate)  # raises with the available names
    params = dict(recipe.surrogate_params) if recipe and recipe.surrogate == surrogate else {}
    params.update(section.surrogate_params or {})
    if "ess" in params:
        raise ValueError("loss.surrogate_params.ess: P3O's ESS is computed by the trainer every step; "
                         "remove it from the config")
    if section.corrections is not None:
        corrections = []
        for i, c in enumerate(section.corrections):
            if not isinstance(c, dict) or "name" not in c:
                raise ValueError(f"loss.corrections[{i}] must be a mapping with a 'name' (e.g. "
                                 f"{{name: tis_token, C: 2}}), got {c!r}")
            CORRECTIONS.get(c["name"])
            corrections.append((c["name"], {k: v for k, v in c.items() if k != "name"}))
    else:
        corrections = [(n, dict(p)) for n, p in recipe.corrections] if recipe else []
    aggregation = section.aggregation or (recipe.aggregation if recipe else "token_mean")
    AGGREGATIONS.get(aggregation)
    agg_params = dict(recipe.agg_params) if recipe and recipe.aggregation == aggregation else {}
    agg_params.update(section.aggregation_params or {})
    if aggregation in ("token_sum_norm", "seq_mean_token_sum"):
        agg_params.setdefault("l_norm", float(max_response_len))
    advantages = section.advantages or (recipe.advantage if recipe else "grpo")
    ADVANTAGES.get(advantages)
    if surrogate in ("gspo",) and aggregation == "token_mean":
        raise ValueError("loss: gspo is a sequence-level objective (one ratio per response); "
                         "use loss.aggregation=seq_mean_token_mean")
    if surrogate == "p3o" and aggregation != "token_mean":
        raise ValueError("loss: p3o's ESS and KL term are token averages; use loss.aggregation=token_mean")
    return ResolvedLoss(surrogate, params, corrections, aggregation, agg_params, advantages,
                        section.filter_zero_variance_groups, required_counts(aggregation))
