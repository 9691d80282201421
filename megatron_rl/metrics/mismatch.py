"""Training–inference mismatch diagnostics as reducible sums (docs/diagnostics.md).

With Δ_t = log π_old,t − log μ_t over tokens with m_t = 1 (w = π_old/μ, r = π_θ/π_old, ρ = π_θ/μ),
`mismatch_sums` gives one micro-batch's values in the metrics convention (metrics/reduce.py);
after `accumulate` over micro-batches, `reduce_metrics` over ranks and `finish` they read:

    mismatch/kl_k3 = mean(exp(Δ) − Δ − 1)   mismatch/kl_k1 = mean(−Δ)   mismatch/abs_logprob_diff = mean|Δ|
    mismatch/prob_abs_diff = mean|π_old − μ|   mismatch/tokens   mismatch/entropy (mean H of π_old)
    mismatch/{w,r,rho}/{mean,min,max,ess,seq_ess}   mismatch/{w,r,rho}/{p01,p99} (`ratio_quantiles`)
    mismatch/bucket/<lo>-<hi>/{count,abs_diff,kl_k3}   by μ_t (edges 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9 ->
        7 buckets, lower edge inclusive)
    mismatch/turn/{first,later}/{tokens,kl_k3,kl_k1,abs_logprob_diff}   (first assistant turn vs later)
    mismatch/turn/{0,1,2,3_or_later}/{...the same}   by policy turn (multi-turn
        trajectories: later turns sit on longer contexts and on environment text)
    mismatch/staleness_<s>/{tokens,kl_k3,kl_k1,abs_logprob_diff,w/mean,r/mean,rho/mean}   (off-policy
        schedules: the tokens generated s trainer versions ago; staleness_<lo>-<hi> for the ranges
        2-3, 4-7, ... of `staleness_buckets`)

Quantiles do not reduce like sums: `ratio_quantiles` finds them over all ranks' tokens at once
(exactly, metrics/quantiles.py) and gives every rank the same value, under keys that the MIN / MAX
reduction then leaves as they are (`mismatch/{w,r,rho}/p01/min`, `.../p99/max`). Sequence
quantities go through SeqOps (CP-safe; a sequence counts once, on its CP owner rank).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from megatron_rl.losses.seqops import LOCAL, SeqOps
from megatron_rl.metrics.quantiles import global_quantiles
from megatron_rl.metrics.reduce import ess, ratio

BUCKET_EDGES: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9)
TURN_BUCKETS = 4  # turns 0, 1, 2 each, then 3 and later together
_LOG_CLAMP = 300.0  # |log ratio| clamp before exp in float64 sums (exp(2·300) is still finite)
_F64 = torch.float64


def _delta(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """float64 a − b where mask, 0 elsewhere."""
    return torch.where(mask.bool(), a.detach().double() - b.detach().double(), 0.0)


def bucket_labels(edges: Sequence[float] = BUCKET_EDGES) -> list[str]:
    """['0-0.0001', '0.0001-0.001', ..., '0.9-1'] for len(edges) + 1 buckets of μ."""
    bounds = [0.0, *edges, 1.0]
    return [f"{lo:g}-{hi:g}" for lo, hi in itertools.pairwise(bounds)]


def turn_labels() -> list[str]:
    """['0', '1', '2', '3_or_later']: the policy-turn buckets of the per-turn mismatch."""
    return [str(k) for k in range(TURN_BUCKETS - 1)] + [f"{TURN_BUCKETS - 1}_or_later"]


QUANTILES: tuple[tuple[str, float, str], ...] = (("p01", 0.01, "min"), ("p99", 0.99, "max"))


def valid_log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """float64 [n]: a − b at the tokens with m = 1 (boolean indexing: one host sync; logging code)."""
    return (a.detach().double() - b.detach().double())[mask.bool()]


def ratio_quantiles(log_ratios: Mapping[str, Tensor], group=None) -> dict[str, Tensor]:
    """{name: this rank's valid log-ratios [n]} -> {"mismatch/<name>/p01/min": Q, "mismatch/<name>/p99/max": Q}:
    the quantiles (linear interpolation) of x = exp(clamp(log ratio, ±300)) over the values of all
    ranks of `group` together, float64 0-dim, the same on every rank; 0 where no rank has a value.
    Every rank of `group` must call it with the same names."""
    names = sorted(log_ratios)
    found = global_quantiles([log_ratios[n] for n in names], [q for _, q, _ in QUANTILES], group,
                             transform=lambda x: torch.exp(x.clamp(-_LOG_CLAMP, _LOG_CLAMP)))
    return {f"mismatch/{name}/{label}/{op}": value for name, qs in zip(names, found, strict=True)
            for (label, _, op), value in zip(QUANTILES, qs, strict=True)}


def staleness_buckets(max_staleness: int) -> list[tuple[int, int]]:
    """Inclusive staleness ranges 0, 1, 2-3, 4-7, ... up to max_staleness (a long stage gets a
    handful of buckets, not one per version)."""
    out, lo = [], 0
    while lo <= max_staleness:
        hi = min(max_staleness, max(lo, 2 * lo - 1))
        out.append((lo, hi))
        lo = hi + 1
    return out


def _kl_terms(d: Tensor, m: Tensor, prefix: str) -> dict[str, Tensor]:
    z = torch.zeros((), dtype=_F64, device=d.device)
    n = m.sum(dtype=_F64)
    return {f"{prefix}/tokens/sum": n,
            **ratio(f"{prefix}/kl_k3", torch.where(m, torch.expm1(d) - d, z).sum(), n),
            **ratio(f"{prefix}/kl_k1", torch.where(m, -d, z).sum(), n),
            **ratio(f"{prefix}/abs_logprob_diff", torch.where(m, d.abs(), z).sum(), n)}


def _ratio_terms(lr: Tensor, m: Tensor, seq: SeqOps, prefix: str) -> dict[str, Tensor]:
    """Token and sequence values of x = exp(lr) (log-ratios clamped to ±300 before exp, float64)."""
    x = torch.where(m, torch.exp(lr.clamp(-_LOG_CLAMP, _LOG_CLAMP)), 0.0)
    n = m.sum(dtype=_F64)
    sums = seq.sum(torch.stack([lr, m.double()]))  # per response: Σ_t m log x, |y_i|
    valid = (sums[1] > 0) & seq.is_owner
    w = torch.where(valid, torch.exp(sums[0].clamp(-_LOG_CLAMP, _LOG_CLAMP)), 0.0)
    return {**ratio(f"{prefix}/mean", x.sum(), n),
            f"{prefix}/min/min": torch.exp(torch.where(m, lr, math.inf).amin()),
            f"{prefix}/max/max": torch.exp(torch.where(m, lr, -math.inf).amax().clamp(max=700.0)),
            **ess(f"{prefix}/ess", x.sum(), (x * x).sum(), n),
            **ess(f"{prefix}/seq_ess", w.sum(), (w * w).sum(), valid.sum(dtype=_F64))}


def mismatch_sums(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *,
                  logprobs: Tensor | None = None, turn_ids: Tensor | None = None,
                  entropy: Tensor | None = None, seq: SeqOps = LOCAL,
                  staleness: Tensor | None = None, max_staleness: int = 0,
                  edges: Sequence[float] = BUCKET_EDGES) -> dict[str, Tensor]:
    """One micro-batch's values in the metrics convention (float64 0-dim tensors).

    old_logprobs, rollout_logprobs, mask: [B, T]. Optional: logprobs [B, T] (π_θ: adds r and ρ stats),
    turn_ids [B, T] int (0 = first assistant turn, > 0 later turns, < 0 ignored), entropy [B, T] (H of
    π_θ per token), staleness [B, T] int, or [B] for whole rows (versions since each token was generated: adds the KL and the
    w (and r, ρ) means per `staleness_buckets(max_staleness)` as mismatch/staleness_<s>/... or
    mismatch/staleness_<lo>-<hi>/...; off when max_staleness is 0). Buckets by μ_t = exp(log μ_t): bucket k holds edges[k-1] ≤ μ < edges[k].
    """
    m = mask.bool()
    d = _delta(old_logprobs, rollout_logprobs, m)
    z = torch.zeros((), dtype=_F64, device=d.device)
    out = _kl_terms(d, m, "mismatch")
    n = out["mismatch/tokens/sum"]
    p = torch.exp(torch.where(m, old_logprobs.detach().double(), 0.0))
    q = torch.exp(torch.where(m, rollout_logprobs.detach().double(), 0.0))
    out.update(ratio("mismatch/prob_abs_diff", torch.where(m, (p - q).abs(), z).sum(), n))
    out.update(_ratio_terms(d, m, seq, "mismatch/w"))
    if logprobs is not None:
        out.update(_ratio_terms(_delta(logprobs, old_logprobs, m), m, seq, "mismatch/r"))
        out.update(_ratio_terms(_delta(logprobs, rollout_logprobs, m), m, seq, "mismatch/rho"))
    log_mu = rollout_logprobs.detach().double()
    idx = torch.bucketize(log_mu, torch.tensor([math.log(e) for e in edges], dtype=_F64, device=d.device),
                          right=True)
    k3 = torch.expm1(d) - d
    for k, label in enumerate(bucket_labels(edges)):
        b = m & (idx == k)
        count = b.sum(dtype=_F64)
        out[f"mismatch/bucket/{label}/count/sum"] = count
        out.update(ratio(f"mismatch/bucket/{label}/abs_diff", torch.where(b, d.abs(), z).sum(), count))
        out.update(ratio(f"mismatch/bucket/{label}/kl_k3", torch.where(b, k3, z).sum(), count))
    if turn_ids is not None:
        out.update(_kl_terms(d, m & (turn_ids == 0), "mismatch/turn/first"))
        out.update(_kl_terms(d, m & (turn_ids > 0), "mismatch/turn/later"))
        for k, label in enumerate(turn_labels()):
            sel = (turn_ids >= k) if k == TURN_BUCKETS - 1 else (turn_ids == k)
            out.update(_kl_terms(d, m & sel, f"mismatch/turn/{label}"))
    if entropy is not None:
        out.update(ratio("mismatch/entropy", torch.where(m, entropy.detach().double(), z).sum(), n))
    if staleness is not None and max_staleness > 0:
        ratios = {"w": d}
        if logprobs is not None:
            ratios["r"] = _delta(logprobs, old_logprobs, m)
            ratios["rho"] = _delta(logprobs, rollout_logprobs, m)
        stale = staleness.to(d.device)
        stale = stale[:, None] if stale.dim() == 1 else stale
        for lo, hi in staleness_buckets(max_staleness):
            ms = m & (stale >= lo) & (stale <= hi)
            prefix = f"mismatch/staleness_{lo}" if lo == hi else f"mismatch/staleness_{lo}-{hi}"
            out.update(_kl_terms(d, ms, prefix))
            for name, lr in ratios.items():
                x = torch.where(ms, torch.exp(lr.clamp(-_LOG_CLAMP, _LOG_CLAMP)), z)
                out.update(ratio(f"{prefix}/{name}/mean", x.sum(), ms.sum(dtype=_F64)))
    return out
