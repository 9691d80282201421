"""LossSection (config) -> the concrete loss: surrogate, corrections, aggregation, advantages.

A recipe supplies defaults; explicit fields override them. Every name is checked against its
registry, and what a surrogate declared when it registered (allowed aggregations, per-step
statistics it takes as parameters) is checked the same way for every surrogate, so incompatible
choices fail here, at start-up (RunConfig validation), with the reason. Parameters are checked
against the function's own keyword parameters: an unknown name, or a value of the wrong kind
(YAML reads `1.0e9` as a string; `1.0e+9` is the number), fails here and not mid-step. Their values
are checked against the ranges the entry declared where it registered (`check_values`): a threshold
of 0 would fail mid-step in log(0), an empty keep band would silently drop every token.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rl import checks
from megatron_rl.losses.advantages import ADVANTAGES
from megatron_rl.losses.aggregation import AGGREGATIONS, required_counts
from megatron_rl.losses.corrections import CORRECTIONS
from megatron_rl.losses.policy_loss import RECIPES
from megatron_rl.losses.step_stats import STEP_STATISTICS
from megatron_rl.losses.surrogates import SURROGATES
from megatron_rl.losses.token_local import token_local_blocker
from megatron_rl.registry import ParamRules, keyword_params


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
    step_statistics: dict = field(default_factory=dict)  # surrogate parameter -> STEP_STATISTICS name
    gradients_in_forward: bool = False  # loss.head_gradients resolved: losses/token_local.py
    advantage_params: dict = field(default_factory=dict)  # the estimator's keyword parameters

    def loss_kwargs(self) -> dict[str, Any]:
        return dict(surrogate=self.surrogate, surrogate_params=dict(self.surrogate_params),
                    corrections=list(self.corrections), aggregation=self.aggregation,
                    agg_params=dict(self.agg_params))


def _kind_ok(value: Any, default: Any, annotation: str) -> bool:
    """Whether `value` fits a parameter with this default and (string) annotation."""
    if value is None:
        return default is None or "None" in annotation
    if isinstance(default, bool) or annotation.startswith("bool"):
        return isinstance(value, bool)
    if isinstance(default, (int, float)) or annotation.startswith(("float", "int")):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str) or annotation.startswith("str"):
        return isinstance(value, str)
    return True


def check_params(where: str, fn: Callable, params: Mapping[str, Any]) -> None:
    """Every key of `params` must be a keyword-only parameter of `fn` with a value of its kind;
    raises ValueError naming `where`.<key>."""
    allowed = keyword_params(fn)
    for key, value in params.items():
        if key not in allowed:
            raise ValueError(f"{where}.{key}: not a parameter here; choose from {', '.join(sorted(allowed)) or '(none)'}")
        p = allowed[key]
        if not _kind_ok(value, p.default, str(p.annotation)):
            hint = ""
            if isinstance(value, str):
                try:
                    float(value)
                    hint = f"; YAML reads {value} as text: write the exponent with a sign (e.g. 1.0e+9)"
                except ValueError:
                    pass
            raise ValueError(f"{where}.{key}={value!r}: must be {p.annotation} (default {p.default!r}){hint}")


def check_values(where: str, fn: Callable, rules: ParamRules, params: Mapping[str, Any]) -> None:
    """`params` over `fn`'s defaults must satisfy the rules the entry declared when it registered:
    `limits` (parameter -> bounds of checks.number; null passes, where check_params allowed it),
    `choices` (parameter -> allowed values), `band` ((lo, hi): lo <= hi, or nothing is kept).
    Raises ValueError naming `where`.<parameter> and the allowed range."""
    values = {n: p.default for n, p in keyword_params(fn).items()}
    values.update(params)
    for name, bounds in rules.limits.items():
        if values[name] is not None:
            checks.number(f"{where}.{name}", values[name], **bounds)
    for name, allowed in rules.choices.items():
        checks.choice(f"{where}.{name}", values[name], allowed)
    if rules.band is not None:
        lo, hi = rules.band
        if values[lo] > values[hi]:
            raise ValueError(f"{where}: {lo}={values[lo]!r} > {hi}={values[hi]!r} keeps nothing (the band "
                             f"[{lo}, {hi}] is empty); set {lo} <= {hi}")


def _check(where: str, fn: Callable, rules: ParamRules, params: Mapping[str, Any]) -> None:
    check_params(where, fn, params)
    check_values(where, fn, rules, params)


def resolve_loss(section, max_response_len: int) -> ResolvedLoss:
    """Merge the recipe with explicit settings and validate. max_response_len: default L_norm."""
    recipe = RECIPES.get(section.recipe) if section.recipe else None
    surrogate = section.surrogate or (recipe.surrogate if recipe else None)
    if surrogate is None:
        raise ValueError("loss: set loss.recipe or loss.surrogate")
    declared = SURROGATES.get(surrogate)  # raises with the available names
    params = dict(recipe.surrogate_params) if recipe and recipe.surrogate == surrogate else {}
    params.update(section.surrogate_params or {})
    step_statistics = dict(declared.step_statistics)
    for name, stat in step_statistics.items():
        STEP_STATISTICS.get(stat)
        if name in params:
            raise ValueError(f"loss.surrogate_params.{name}: {surrogate}'s {name} is computed by the trainer every "
                             f"step ({stat}); remove it from the config")
    _check("loss.surrogate_params", declared.fn, declared.rules, params)
    if section.corrections is not None:
        if not isinstance(section.corrections, list):
            raise ValueError(f"loss.corrections={section.corrections!r}: a list of mappings with a 'name', e.g. "
                             f"'loss.corrections=[{{name: tis_token, C: 2}}]'")
        corrections = []
        for i, c in enumerate(section.corrections):
            if not isinstance(c, dict) or "name" not in c:
                raise ValueError(f"loss.corrections[{i}] must be a mapping with a 'name' (e.g. "
                                 f"{{name: tis_token, C: 2}}), got {c!r}")
            corrections.append((c["name"], {k: v for k, v in c.items() if k != "name"}))
            spec = CORRECTIONS.get(c["name"])
            _check(f"loss.corrections[{i}]", spec.fn, spec.rules, corrections[-1][1])
    else:
        corrections = [(n, dict(p)) for n, p in recipe.corrections] if recipe else []
    aggregation = section.aggregation or (recipe.aggregation if recipe else "token_mean")
    agg_params = dict(recipe.agg_params) if recipe and recipe.aggregation == aggregation else {}
    agg_params.update(section.aggregation_params or {})
    if aggregation in ("token_sum_norm", "seq_mean_token_sum"):
        agg_params.setdefault("l_norm", float(max_response_len))
    agg = AGGREGATIONS.get(aggregation)
    _check("loss.aggregation_params", agg.fn, agg.rules, agg_params)
    advantages = section.advantages or (recipe.advantage if recipe else "grpo")
    estimator = ADVANTAGES.get(advantages)
    _check("loss.advantage_params", estimator.fn, estimator.rules, section.advantage_params or {})
    allowed = declared.aggregations
    if allowed is not None and aggregation not in allowed:
        raise ValueError(f"loss: {surrogate} allows loss.aggregation in {list(allowed)} ({declared.why}); "
                         f"use loss.aggregation={allowed[0]}")
    blocker = token_local_blocker(surrogate, params, corrections, aggregation, agg_params)
    if section.head_gradients == "forward" and blocker is not None:
        raise ValueError(f"loss.head_gradients=forward needs a token-local loss, but {blocker}; use "
                         f"loss.head_gradients=auto (or recompute)")
    return ResolvedLoss(surrogate, params, corrections, aggregation, agg_params, advantages,
                        section.filter_zero_variance_groups, required_counts(aggregation), step_statistics,
                        gradients_in_forward=section.head_gradients != "recompute" and blocker is None,
                        advantage_params=dict(section.advantage_params or {}))
