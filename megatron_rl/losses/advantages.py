"""Group advantages from scalar rewards: `rewards [n_groups, G] -> advantages [n_groups, G]`.

Each response's advantage is later broadcast to its tokens. Computed in float64 and returned in
fp32. A group whose rewards are all equal gets exactly A = 0 from every estimator (written, not
left to rounding: in fp32, eight rewards of 0.7 have a mean 1 ulp off and a std of 0, which made
grpo's A = ulp/eps = 0.06 for every response, a gradient from a group that carries no signal).

    grpo           A_i = (R_i − mean(R)) / (std(R) + eps)     population std (divide by G)
    mean_centered  A_i = R_i − mean(R)                          (MiniRL, Dr.GRPO)
    rloo           A_i = R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean(R))

`zero_variance_groups` flags groups whose rewards are all equal (A = 0 for every estimator above);
DAPO dynamic sampling drops them before the update and logs how many.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from megatron_rl.registry import ParamRules, Registry


@dataclass(frozen=True)
class AdvantageSpec:
    """A registered estimator: `fn(rewards [n, G], **params) -> advantages [n, G]` and its
    parameters' value ranges (loss.advantage_params)."""

    fn: Callable[..., Tensor]
    rules: ParamRules = field(default_factory=ParamRules)

    def __post_init__(self):
        self.rules.check_against(f"advantage estimator {self.fn.__name__}", self.fn)


ADVANTAGES = Registry("advantage estimator", AdvantageSpec)


def register_advantage(name: str, *, limits: Mapping[str, Mapping[str, Any]] | None = None):
    """Decorator: register `fn` as advantage estimator `name`."""
    def deco(fn):
        ADVANTAGES.add(name, AdvantageSpec(fn, ParamRules(limits or {})))
        return fn

    return deco


def get_advantage(name: str) -> Callable[..., Tensor]:
    return ADVANTAGES.get(name).fn


def _check(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    return rewards.double()


def _finish(r: Tensor, adv: Tensor) -> Tensor:
    """`adv` with the rows of all-equal groups set to exactly 0, in fp32."""
    equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(equal, 0.0, adv).float()


@register_advantage("grpo", limits={"eps": {"lo": 0}})
def grpo(rewards: Tensor, *, eps: float = 1e-6) -> Tensor:
    """A_i = (R_i − mean_j R_j) / (std_j R_j + eps), population std.  rewards [n, G] -> [n, G].
    eps (loss.advantage_params.eps) keeps a group with a tiny spread from being blown up."""
    r = _check(rewards)
    centered = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return _finish(r, centered / (std + eps))


@register_advantage("mean_centered")
def mean_centered(rewards: Tensor) -> Tensor:
    """A_i = R_i − mean_j R_j.  rewards [n, G] -> [n, G]."""
    r = _check(rewards)
    return _finish(r, r - r.mean(dim=1, keepdim=True))


@register_advantage("rloo")
def rloo(rewards: Tensor) -> Tensor:
    """A_i = R_i − (Σ_j R_j − R_i)/(G − 1).  rewards [n, G] -> [n, G]; G = 1 gives A = 0 (no baseline)."""
    r = _check(rewards)
    G = r.shape[1]
    if G < 2:
        return torch.zeros_like(r).float()
    return _finish(r, r - (r.sum(dim=1, keepdim=True) - r) / (G - 1))


def zero_variance_groups(rewards: Tensor, *, atol: float = 0.0) -> Tensor:
    """bool [n_groups]: max_j R_j − min_j R_j ≤ atol (all rewards of the group equal)."""
    r = _check(rewards)
    return (r.amax(dim=1) - r.amin(dim=1)) <= atol
