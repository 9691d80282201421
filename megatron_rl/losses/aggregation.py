"""Loss aggregation: per-token terms ℓ_t [B, T] -> one scalar, with a GLOBAL normaliser argument.

The normaliser (token or sequence count) is summed over all DP and CP ranks and all micro-batches of one
optimizer step by the trainer and passed in; these functions never take a local mean. Each returns this
micro-batch's share: summing the returned values over micro-batches and ranks gives the step's loss, so
the loss and its gradient do not depend on how the data is split.

    token_mean            Σ_i Σ_t m ℓ / N_tok                           (DAPO)
    seq_mean_token_mean   (1/N_seq) Σ_i (Σ_t m ℓ / Σ_t m)               (GRPO; |y_i| via seq.sum, CP-safe)
    token_sum_norm        Σ_i Σ_t m ℓ / (N_seq · L_norm), constant L_norm (MiniRL, Dr.GRPO)
                          alias: seq_mean_token_sum

Trainer protocol: `required_counts(name)` says which counts are needed; sum `local_counts(mask, seq)`
over the step's micro-batches, all-reduce (SUM) over the DP×CP group once, pass the result as `counts`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from megatron_rl.losses.seqops import LOCAL, SeqOps
from megatron_rl.registry import ParamRules, Registry

Count = Tensor | float | int


def _masked_sum(per_token: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), per_token * mask.float(), 0.0).sum()


def _norm(x: Count, ref: Tensor) -> Tensor | float:
    """A count as a divisor in the loss dtype (a float64 count must not promote the loss). A zero count
    (a step without valid tokens, whose numerator is 0 too) divides by 1, so the loss is 0, not nan."""
    if isinstance(x, Tensor):
        x = x.detach().to(ref.dtype)
        return torch.where(x > 0, x, torch.ones_like(x))
    return float(x) if x > 0 else 1.0


def token_mean(per_token: Tensor, mask: Tensor, global_num_tokens: Count) -> Tensor:
    """Σ_{b,t} m ℓ / global_num_tokens.  per_token, mask: [B, T] -> scalar."""
    return _masked_sum(per_token, mask) / _norm(global_num_tokens, per_token)


def seq_mean_token_mean(per_token: Tensor, mask: Tensor, global_num_seqs: Count, seq: SeqOps = LOCAL) -> Tensor:
    """(1/global_num_seqs) Σ_i (Σ_t m ℓ)_local / |y_i|, |y_i| = seq.sum(m) (global length of response i).

    per_token, mask: [B, T] -> scalar. Responses with no valid token contribute 0. Under CP each rank adds
    its tokens' share of Σ_t m ℓ / |y_i|, so the CP sum is the single-rank value.
    """
    m = mask.bool()
    lengths = seq.sum(m.float()).detach()  # [B]
    per_seq = torch.where(m, per_token * mask.float(), 0.0).sum(dim=-1)  # local partial sums [B]
    return (per_seq / lengths.clamp_min(1.0)).sum() / _norm(global_num_seqs, per_token)


def token_sum_norm(per_token: Tensor, mask: Tensor, global_num_seqs: Count, l_norm: float) -> Tensor:
    """Σ_{b,t} m ℓ / (global_num_seqs · l_norm); l_norm is a constant (default: max response length)."""
    return _masked_sum(per_token, mask) / (_norm(global_num_seqs, per_token) * l_norm)


@dataclass(frozen=True)
class GlobalCounts:
    """Normalisers of one optimizer step, summed over micro-batches and DP×CP ranks."""

    num_tokens: Count | None = None
    num_seqs: Count | None = None

    def __add__(self, other: GlobalCounts) -> GlobalCounts:
        def add(a, b):
            return b if a is None else a if b is None else a + b

        return GlobalCounts(add(self.num_tokens, other.num_tokens), add(self.num_seqs, other.num_seqs))


def local_counts(mask: Tensor, seq: SeqOps = LOCAL, *, count_empty_seqs: bool = False) -> GlobalCounts:
    """This micro-batch's contribution (float64 0-dim tensors) to the step's GlobalCounts.

    num_tokens = Σ m (each token lives on one rank). num_seqs = responses with ≥ 1 valid token (or all
    rows if count_empty_seqs), counted on the CP owner rank only, so a plain SUM over DP×CP is exact.
    """
    m = mask.bool()
    num_tokens = m.sum(dtype=torch.float64)
    rows = torch.ones(m.shape[:-1], dtype=torch.bool, device=m.device) if count_empty_seqs \
        else seq.sum(m.float()) > 0
    num_seqs = rows.sum(dtype=torch.float64) if seq.is_owner else \
        torch.zeros((), dtype=torch.float64, device=rows.device)
    return GlobalCounts(num_tokens, num_seqs)


@dataclass(frozen=True)
class AggregationSpec:
    """A registered aggregation: `fn(per_token, mask, counts, seq, **params) -> scalar` and what it declares.

    needs: the GlobalCounts fields it divides by. rules: its parameters' value ranges.
    linear: the loss is a fixed weighted sum Σ_t a_t ℓ_t of the per-token terms (the weights depend
        on the mask and counts only; losses/token_local.py reads them off).
    """

    fn: Callable[..., Tensor]
    needs: tuple[str, ...]
    rules: ParamRules = field(default_factory=ParamRules)
    linear: bool = False

    def __post_init__(self):
        known = {f.name for f in fields(GlobalCounts)}
        if not set(self.needs) <= known:
            raise TypeError(f"aggregation {self.fn.__name__}: needs {sorted(set(self.needs) - known)}, not "
                            f"GlobalCounts fields ({sorted(known)})")
        self.rules.check_against(f"aggregation {self.fn.__name__}", self.fn)


AGGREGATIONS = Registry("aggregation", AggregationSpec)


def register_aggregation(name: str, needs: tuple[str, ...], *, limits: Mapping[str, Mapping[str, Any]] | None = None,
                         linear: bool = False):
    """Register `fn(per_token, mask, counts: GlobalCounts, seq, *, **params) -> scalar` needing `needs`.

    Its parameters (loss.aggregation_params) are keyword-only, so resolve_loss checks their names and
    kinds against `fn`; `limits` declares their value ranges as a surrogate's do, and `linear=True`
    where the loss is a fixed weighted sum Σ_t a_t ℓ_t of the per-token terms (see AggregationSpec)."""
    def deco(fn):
        AGGREGATIONS.add(name, AggregationSpec(fn, needs, ParamRules(limits or {}), linear))
        return fn

    return deco


@register_aggregation("token_mean", ("num_tokens",), linear=True)
def _token_mean(per_token: Tensor, mask: Tensor, counts: GlobalCounts, seq: SeqOps) -> Tensor:
    return token_mean(per_token, mask, counts.num_tokens)


@register_aggregation("seq_mean_token_mean", ("num_seqs",), linear=True)
def _seq_mean_token_mean(per_token: Tensor, mask: Tensor, counts: GlobalCounts, seq: SeqOps) -> Tensor:
    return seq_mean_token_mean(per_token, mask, counts.num_seqs, seq)


def _token_sum_norm(per_token: Tensor, mask: Tensor, counts: GlobalCounts, seq: SeqOps, *, l_norm: float) -> Tensor:
    return token_sum_norm(per_token, mask, counts.num_seqs, l_norm)


# l_norm divides the loss: 0 gives inf / nan gradients, a negative value flips the loss's sign
for _name in ("token_sum_norm", "seq_mean_token_sum"):
    register_aggregation(_name, ("num_seqs",), limits={"l_norm": {"lo": 0, "lo_open": True}},
                         linear=True)(_token_sum_norm)


def get_aggregation(name: str) -> Callable[..., Tensor]:
    return AGGREGATIONS.get(name).fn


def required_counts(name: str) -> tuple[str, ...]:
    """Which GlobalCounts fields aggregation `name` needs, e.g. ('num_tokens',)."""
    return AGGREGATIONS.get(name).needs


def aggregate(name: str, per_token: Tensor, mask: Tensor, counts: GlobalCounts, seq: SeqOps = LOCAL,
              **params) -> Tensor:
    """Dispatch to aggregation `name`; raises if a needed global count is missing."""
    for field_name in required_counts(name):
        if getattr(counts, field_name) is None:
            raise ValueError(f"aggregation {name!r} needs GlobalCounts.{field_name}")
    return get_aggregation(name)(per_token, mask, counts, seq, **params)
