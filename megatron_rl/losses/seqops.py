"""Per-sequence reductions that also work under context parallelism (CP).

Under CP a sequence's tokens are split over the ranks of the CP group (zig-zag: each rank holds two
non-contiguous chunks). A per-sequence quantity (GSPO's mean log-ratio, sequence IS weights, OPSM's
sequence KL, NAV's first trigger, per-sequence token counts) is finished by reducing the local partial
result over the CP group. Token tensors are never all-gathered: only `[..., B]` partials travel.

Contract (`x: [..., B, T]`, the last dim is the rank's local tokens of each sequence):
- `sum(x) -> [..., B]`: differentiable (the backward of a CP all-reduce-sum is an all-reduce-sum of the
  gradients, so a loss that every CP rank computes from the reduced value and counts with weight
  `local_tokens / total_tokens` gets exactly the single-rank gradient once CP gradients are summed).
- `min(x)`, `max(x) -> [..., B]`: no gradient (used for masks and triggers only).
- `is_owner`: True on exactly one rank of the CP group; per-sequence *metric counts* are multiplied by
  it so that summing metrics over all ranks counts each sequence once.

Masked tokens must be neutralised by the caller (0 for sum, +inf / dtype max for min, -inf for max).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class SeqOps:
    """Interface; see the module docstring."""

    is_owner: bool = True

    def sum(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def min(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def max(self, x: Tensor) -> Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class LocalSeqOps(SeqOps):
    """Every sequence is whole on this rank (no CP)."""

    is_owner: bool = True

    def sum(self, x: Tensor) -> Tensor:
        return x.sum(dim=-1)

    def min(self, x: Tensor) -> Tensor:
        return x.detach().amin(dim=-1)

    def max(self, x: Tensor) -> Tensor:
        return x.detach().amax(dim=-1)


@dataclass(frozen=True)
class CPSeqOps(SeqOps):
    """Local reduction over this rank's tokens, then an all-reduce over the CP process group.

    `group` is the CP group (None = the default group). `is_owner` is True on the group's rank 0.
    """

    group: Any = None

    @property
    def is_owner(self) -> bool:  # type: ignore[override]
        return dist.get_rank(self.group) == 0

    def sum(self, x: Tensor) -> Tensor:
        local = x.sum(dim=-1)
        if local.requires_grad:
            return _AllReduceSum.apply(local, self.group)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.group)
        return local

    def _reduce(self, local: Tensor, op) -> Tensor:
        local = local.contiguous()
        dist.all_reduce(local, op=op, group=self.group)
        return local

    def min(self, x: Tensor) -> Tensor:
        return self._reduce(x.detach().amin(dim=-1), dist.ReduceOp.MIN)

    def max(self, x: Tensor) -> Tensor:
        return self._reduce(x.detach().amax(dim=-1), dist.ReduceOp.MAX)


class _AllReduceSum(torch.autograd.Function):
    """y = Σ_ranks x in forward; dL/dx = Σ_ranks dL/dy in backward (every rank's loss uses y)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


LOCAL = LocalSeqOps()


def owner_count(flags: Tensor, seq: SeqOps) -> Tensor:
    """Number of True entries of a per-sequence bool `[B]`, counted on the CP owner rank only (float64)."""
    n = flags.sum(dtype=torch.float64)
    return n if seq.is_owner else torch.zeros_like(n)
