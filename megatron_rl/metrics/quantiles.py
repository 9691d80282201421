"""Exact quantiles of values spread over the ranks of a process group, without gathering them.

The ratio quantiles (p01/p99 of w, r, ρ) are taken over every valid token of the step on all
DP × CP ranks. Quantiles do not reduce like sums, and gathering every token's value costs memory
that grows with the DP size (64 ranks × 1M tokens × 8 bytes = 512 MiB on each rank). Instead each
order statistic is found by bisection on the values' order-preserving int64 keys: every round
counts, on each rank, the values at or below each candidate and sums the counts over the group in
one all-reduce. The key is 64 bits wide, so 64 rounds find every requested order statistic of
every set exactly; the memory is the local values and a `[targets, n]` comparison per round.

    q-quantile (linear interpolation, as numpy.quantile and torch.quantile):
        pos = q (N − 1),   Q = x_(⌊pos⌋) + (x_(⌈pos⌉) − x_(⌊pos⌋)) (pos − ⌊pos⌋)
    x_(k): the k-th smallest (0-based) of the N values of all ranks together.

The rounds are queued without host syncs (the bisection bounds stay on the device); one sync reads
the global counts first. Logging-time code, not loss code.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.metrics.reduce import group_device

_MAGNITUDE = 0x7FFF_FFFF_FFFF_FFFF
_KEY_BITS = 64


def order_keys(x: Tensor) -> Tensor:
    """float64 [n] -> int64 [n] with the same order: the IEEE bits, with a negative number's
    magnitude bits flipped (so a larger magnitude is a smaller key). NaN is not allowed."""
    b = x.contiguous().view(torch.int64)
    return torch.where(b < 0, b ^ _MAGNITUDE, b)


def from_keys(k: Tensor) -> Tensor:
    """The inverse of `order_keys` (the flip is its own inverse)."""
    return torch.where(k < 0, k ^ _MAGNITUDE, k).view(torch.float64)


def _all_reduce(t: Tensor, group) -> Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def order_statistics(keys: Sequence[Tensor], ranks: Sequence[Tensor], group=None) -> list[Tensor]:
    """For each set `i`, the keys of rank `ranks[i]` (int64 [t_i], 0-based, each < the set's global
    count) among the set's keys on all ranks of `group`: int64 [t_i] per set.

    Bisection per target for the smallest v with #{keys ≤ v} ≥ rank + 1, invariant
    #{≤ lo} < rank + 1 ≤ #{≤ hi}, from lo = int64 min (no key: it would be a NaN) and hi = int64 max.
    """
    device = keys[0].device if keys else torch.device("cpu")
    sizes = [int(r.numel()) for r in ranks]
    want = torch.cat([r.to(device=device, dtype=torch.int64) for r in ranks]) + 1
    lo = torch.full_like(want, -2 ** 63)
    hi = torch.full_like(want, 2 ** 63 - 1)
    for _ in range(_KEY_BITS):
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)   # ⌊(lo + hi) / 2⌋ without overflow
        counts = torch.cat([(k[None, :] <= m[:, None]).sum(dim=1) for k, m in zip(keys, mid.split(sizes), strict=True)])
        counts = _all_reduce(counts, group)
        enough = counts >= want
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, mid)
    return list(hi.split(sizes))


def global_quantiles(sets: Sequence[Tensor], qs: Sequence[float], group=None,
                     transform: Callable[[Tensor], Tensor] = lambda x: x) -> list[list[Tensor]]:
    """The `qs` quantiles of `transform(x)` over each set's values on all ranks of `group`.

    sets: float64 [n_i] per set, this rank's values (any device; every rank passes the same number
    of sets; NaN values are left out: they have no place in an order). transform: monotone non-decreasing, applied to the two order statistics before the
    interpolation (e.g. exp: quantiles of a ratio from its log). Returns float64 0-dim tensors on
    the group's device, the same on every rank; 0 for a set with no value on any rank.
    """
    device = group_device(group) if dist.is_initialized() else (sets[0].device if sets else torch.device("cpu"))
    values = [s.detach().to(device=device, dtype=torch.float64).reshape(-1) for s in sets]
    keys = [order_keys(v[~v.isnan()]) for v in values]
    totals = _all_reduce(torch.tensor([k.numel() for k in keys], dtype=torch.int64, device=device), group).tolist()
    zero = torch.zeros((), dtype=torch.float64, device=device)
    plans = []   # per set: [(⌊pos⌋, ⌈pos⌉, pos − ⌊pos⌋)] per q
    for n in totals:
        plans.append([(math.floor(q * (n - 1)), math.ceil(q * (n - 1)), q * (n - 1) - math.floor(q * (n - 1)))
                      for q in qs] if n > 0 else [])
    ranks = [torch.tensor([i for a, b, _ in plan for i in (a, b)], dtype=torch.int64, device=device) for plan in plans]
    stats = order_statistics(keys, ranks, group)
    out = []
    for plan, st in zip(plans, stats, strict=True):
        if not plan:
            out.append([zero.clone() for _ in qs])
            continue
        x = transform(from_keys(st)).view(-1, 2)
        # torch.lerp interpolates from the nearer end, as numpy's and torch.quantile's do (they can
        # differ in the last bit only between subnormals)
        out.append([torch.lerp(x[j, 0], x[j, 1], frac) for j, (_, _, frac) in enumerate(plan)])
    return out
