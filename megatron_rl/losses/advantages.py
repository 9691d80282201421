"""Group advantages from scalar rewards: `rewards [n_groups, G] -> advantages [n_groups, G]`.

Each response's advantage is later broadcast to its tokens. Computed in fp32.

    grpo           A_i = (R_i − mean(R)) / (std(R) + eps)     population std (divide by G)
    mean_centered  A_i = R_i − mean(R)                          (MiniRL, Dr.GRPO)
    rloo           A_i = R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean(R))

`zero_variance_groups` flags groups whose rewards are all equal (A = 0 for every estimator above);
DAPO dynamic sampling drops them before the update and logs how many.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.losses.registry import Registry

ADVANTAGES = Registry("advantage estimator")
register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.get


def _check(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    return rewards.float()


@register_advantage("grpo")
def grpo(rewards: Tensor, *, eps: float = 1e-6) -> Tensor:
    """A_i = (R_i − mean_j R_j) / (std_j R_j + eps), population std.  rewards [n, G] -> [n, G]."""
    r = _check(rewards)
    centered = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return centered / (std + eps)


@register_advantage("mean_centered")
def mean_centered(rewards: Tensor) -> Tensor:
    """A_i = R_i − mean_j R_j.  rewards [n, G] -> [n, G]."""
    r = _check(rewards)
    return r - r.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo(rewards: Tensor) -> Tensor:
    """A_i = R_i − (Σ_j R_j − R_i)/(G − 1).  rewards [n, G] -> [n, G]; G = 1 gives A = 0 (no baseline)."""
    r = _check(rewards)
    G = r.shape[1]
    if G < 2:
        return torch.zeros_like(r)
    return r - (r.sum(dim=1, keepdim=True) - r) / (G - 1)


def zero_variance_groups(rewards: Tensor, *, atol: float = 0.0) -> Tensor:
    """bool [n_groups]: max_j R_j − min_j R_j ≤ atol (all rewards of the group equal)."""
    r = _check(rewards)
    return (r.amax(dim=1) - r.amin(dim=1)) <= atol
