"""Local (single-rank) mismatch diagnostics computed directly from their definitions: the
independent reference the reducible values of megatron_rl.metrics.mismatch are tested against.

With Δ_t = log π_old,t − log μ_t over tokens with m_t = 1 (docs/diagnostics.md).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_rl.losses.seqops import LOCAL, SeqOps
from megatron_rl.metrics.mismatch import ratio_quantiles, valid_log_ratio

_F64 = torch.float64


def _delta(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """float64 a − b where mask, 0 elsewhere."""
    return torch.where(mask.bool(), a.detach().double() - b.detach().double(), 0.0)


def _mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.bool()
    return torch.where(m, x, 0.0).sum(dtype=_F64) / m.sum().clamp_min(1)


# ----------------------------------------------------------------------------- local means


def kl_k3(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """mean_t(exp(Δ) − Δ − 1), Δ = log π_old − log μ.  [B, T] -> 0-dim float64."""
    d = _delta(old_logprobs, rollout_logprobs, mask)
    return _mean(torch.expm1(d) - d, mask)


def kl_k1(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """mean_t(−Δ) (the k1 estimate of KL(μ‖π_old)).  [B, T] -> 0-dim float64."""
    return _mean(-_delta(old_logprobs, rollout_logprobs, mask), mask)


def abs_logprob_diff(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """mean_t |Δ|.  [B, T] -> 0-dim float64."""
    return _mean(_delta(old_logprobs, rollout_logprobs, mask).abs(), mask)


def prob_abs_diff(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """mean_t |exp(log π_old) − exp(log μ)|.  [B, T] -> 0-dim float64."""
    m = mask.bool()
    p = torch.exp(torch.where(m, old_logprobs.detach().double(), 0.0))
    q = torch.exp(torch.where(m, rollout_logprobs.detach().double(), 0.0))
    return _mean((p - q).abs(), m)


def token_ess(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """(Σ m x)² / ((Σ m) Σ m x²) with x = exp(log_ratio), computed in log space. -> 0-dim, 1 if empty."""
    m = mask.bool()
    lr = torch.where(m, log_ratio.detach().double(), -math.inf).flatten()
    n = m.sum().clamp_min(1)
    ess = torch.exp(2 * torch.logsumexp(lr, 0) - torch.logsumexp(2 * lr, 0) - torch.log(n.double()))
    return torch.where(m.any(), ess, torch.ones_like(ess))


def seq_ess(log_ratio: Tensor, mask: Tensor, seq: SeqOps = LOCAL) -> Tensor:
    """Token ESS of the sequence weights W_i = exp(Σ_t m log x_t) over responses with ≥ 1 token (local)."""
    m = mask.bool()
    sums = seq.sum(torch.stack([torch.where(m, log_ratio.detach().double(), 0.0), m.double()]))
    return token_ess(sums[0], sums[1] > 0)


def ratio_stats(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Local {mean, min, max, p01, p99} of x = exp(log_ratio) over m = 1 (float64 0-dim)."""
    m = mask.bool()
    lr = log_ratio.detach().double()
    x = torch.exp(torch.where(m, lr, 0.0))
    q = ratio_quantiles({"x": valid_log_ratio(log_ratio, torch.zeros_like(log_ratio), m)})
    p01, p99 = q["mismatch/x/p01/min"], q["mismatch/x/p99/max"]
    empty = ~m.any()
    lo = torch.exp(torch.where(m, lr, math.inf).amin())
    hi = torch.exp(torch.where(m, lr, -math.inf).amax())
    return {"mean": _mean(x, m), "min": torch.where(empty, 0.0, lo), "max": torch.where(empty, 0.0, hi),
            "p01": p01, "p99": p99}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) − Σ_v softmax(z)_v z_v over the full vocabulary.  [..., V] -> [...] fp32."""
    z = logits.float()
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


def entropy_mean(entropy: Tensor, mask: Tensor, num_tokens: Tensor | float | None = None) -> Tensor:
    """Σ m H / N (N = num_tokens if given, e.g. a global count, else the local Σ m).  [B, T] -> 0-dim."""
    m = mask.bool()
    total = torch.where(m, entropy.detach().double(), 0.0).sum()
    return total / (m.sum().clamp_min(1) if num_tokens is None else num_tokens)


def mismatch_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *,
                     logprobs: Tensor | None = None, turn_ids: Tensor | None = None,
                     entropy: Tensor | None = None, seq: SeqOps = LOCAL) -> dict[str, float]:
    """The library's values for one rank, finished, plus p01/p99 of w (and r, ρ) (one rank: no group)."""
    from megatron_rl.metrics.mismatch import mismatch_sums
    from megatron_rl.metrics.reduce import finish

    out = finish(mismatch_sums(old_logprobs, rollout_logprobs, mask, logprobs=logprobs, turn_ids=turn_ids,
                               entropy=entropy, seq=seq))
    m = mask.bool()
    ratios = {"w": _delta(old_logprobs, rollout_logprobs, m)}
    if logprobs is not None:
        ratios["r"] = _delta(logprobs, old_logprobs, m)
        ratios["rho"] = _delta(logprobs, rollout_logprobs, m)
    q = ratio_quantiles({name: lr[m] for name, lr in ratios.items()})
    for name in ratios:
        out[f"mismatch/{name}/p01"] = float(q[f"mismatch/{name}/p01/min"])
        out[f"mismatch/{name}/p99"] = float(q[f"mismatch/{name}/p99/max"])
    return out
