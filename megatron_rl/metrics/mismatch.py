"""Training–inference mismatch diagnostics (ALGORITHMS.md, "Mismatch diagnostics"), pure functions.

With Δ_t = log π_old,t − log μ_t over tokens with m_t = 1 (w = π_old/μ, r = π_θ/π_old, ρ = π_θ/μ):

    kl_k3 = mean(exp(Δ) − Δ − 1)   kl_k1 = mean(−Δ)   abs_logprob_diff = mean|Δ|
    prob_abs_diff = mean|π_old − μ|   ratio stats (mean/min/max/p01/p99), token ESS, sequence ESS
    bucket table by μ_t (edges 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9 -> 7 buckets, lower edge inclusive):
    token count, mean |Δ|, kl_k3;  per-turn split (first assistant turn vs later turns);  entropy mean.

Two layers:
- local means (`kl_k3`, `ratio_stats`, `token_ess`, `seq_ess`, `entropy_mean`, ...), for one rank's data;
- reducible SUMS: `mismatch_sums` -> dict of float64 0-dim tensors. A key ending in `/min` reduces with
  MIN, `/max` with MAX, every other key with SUM (`reduce_op`, `all_reduce_sums`); sum over micro-batches
  the same way, then `finish_mismatch` -> flat dict `mismatch/kl_k3`, `mismatch/bucket/<lo>-<hi>/count`,
  `mismatch/w/ess`, `mismatch/turn/first/kl_k3`, ... Quantiles are not reducible: `mismatch_metrics`
  adds rank-local p01/p99 (rank 0 logs them). `routing_agreement_sums` adds MoE routing agreement.
Sequence quantities go through SeqOps (CP-safe; sequence counts on the CP owner rank only).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.losses.seqops import LOCAL, SeqOps

BUCKET_EDGES: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9)
_LOG_CLAMP = 300.0  # |log ratio| clamp before exp in float64 sums (exp(2·300) is still finite)
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


def ratio_quantiles(log_ratio: Tensor, mask: Tensor, qs: Sequence[float] = (0.01, 0.99)) -> list[Tensor]:
    """Rank-local quantiles (linear interpolation) of x = exp(log_ratio) over m = 1; float64 0-dim each.

    Boolean indexing makes this one host sync; it is a logging-time helper, not loss code.
    """
    vals = torch.exp(log_ratio.detach().double()[mask.bool()]).sort().values
    n = vals.numel()
    if n == 0:
        return [torch.zeros((), dtype=_F64, device=vals.device) for _ in qs]
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(vals[lo] + (vals[hi] - vals[lo]) * (pos - lo))
    return out


def ratio_stats(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Local {mean, min, max, p01, p99} of x = exp(log_ratio) over m = 1 (float64 0-dim)."""
    m = mask.bool()
    lr = log_ratio.detach().double()
    x = torch.exp(torch.where(m, lr, 0.0))
    p01, p99 = ratio_quantiles(log_ratio, m)
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


# ----------------------------------------------------------------------------- reducible sums


def bucket_labels(edges: Sequence[float] = BUCKET_EDGES) -> list[str]:
    """['0-0.0001', '0.0001-0.001', ..., '0.9-1'] for len(edges) + 1 buckets of μ."""
    bounds = [0.0, *edges, 1.0]
    return [f"{lo:g}-{hi:g}" for lo, hi in itertools.pairwise(bounds)]


def reduce_op(key: str) -> str:
    """'min' | 'max' | 'sum': how key of `mismatch_sums` is reduced over micro-batches and ranks."""
    return "min" if key.endswith("/min") else "max" if key.endswith("/max") else "sum"


def combine_sums(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Merge two micro-batches' sums (same keys) with each key's reduce op."""
    ops = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}
    return {k: ops[reduce_op(k)](a[k], b[k]) for k in a}


def all_reduce_sums(sums: Mapping[str, Tensor], group=None) -> dict[str, Tensor]:
    """All-reduce every key with its op over `group` (three collectives, one per op)."""
    out = dict(sums)
    for op, red in (("sum", dist.ReduceOp.SUM), ("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        keys = [k for k in sums if reduce_op(k) == op]
        if keys:
            flat = torch.stack([sums[k].double() for k in keys])
            dist.all_reduce(flat, op=red, group=group)
            out.update(zip(keys, flat.unbind(), strict=True))
    return out


def _kl_terms(d: Tensor, m: Tensor, prefix: str) -> dict[str, Tensor]:
    z = torch.zeros((), dtype=_F64, device=d.device)
    return {f"{prefix}/tokens/sum": m.sum(dtype=_F64),
            f"{prefix}/kl_k3/sum": torch.where(m, torch.expm1(d) - d, z).sum(),
            f"{prefix}/kl_k1/sum": torch.where(m, -d, z).sum(),
            f"{prefix}/abs_logprob_diff/sum": torch.where(m, d.abs(), z).sum()}


def _ratio_terms(lr: Tensor, m: Tensor, seq: SeqOps, prefix: str) -> dict[str, Tensor]:
    """Token and sequence sums of x = exp(lr) (log-ratios clamped to ±300 before exp, float64)."""
    x = torch.where(m, torch.exp(lr.clamp(-_LOG_CLAMP, _LOG_CLAMP)), 0.0)
    sums = seq.sum(torch.stack([lr, m.double()]))  # per response: Σ_t m log x, |y_i|
    valid = (sums[1] > 0) & seq.is_owner
    w = torch.where(valid, torch.exp(sums[0].clamp(-_LOG_CLAMP, _LOG_CLAMP)), 0.0)
    return {f"{prefix}/sum": x.sum(), f"{prefix}/sq_sum": (x * x).sum(),
            f"{prefix}/log/min": torch.where(m, lr, math.inf).amin(),
            f"{prefix}/log/max": torch.where(m, lr, -math.inf).amax(),
            f"{prefix}/seq/sum": w.sum(), f"{prefix}/seq/sq_sum": (w * w).sum(),
            f"{prefix}/seqs/sum": valid.sum(dtype=_F64)}


def mismatch_sums(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *,
                  logprobs: Tensor | None = None, turn_ids: Tensor | None = None,
                  entropy: Tensor | None = None, seq: SeqOps = LOCAL,
                  edges: Sequence[float] = BUCKET_EDGES) -> dict[str, Tensor]:
    """Reducible sums of one micro-batch (float64 0-dim tensors; see `reduce_op`).

    old_logprobs, rollout_logprobs, mask: [B, T]. Optional: logprobs [B, T] (π_θ: adds r and ρ stats),
    turn_ids [B, T] int (0 = first assistant turn, > 0 later turns, < 0 ignored), entropy [B, T] (H of
    π_θ per token). Buckets by μ_t = exp(log μ_t): bucket k holds edges[k-1] ≤ μ < edges[k].
    """
    m = mask.bool()
    d = _delta(old_logprobs, rollout_logprobs, m)
    z = torch.zeros((), dtype=_F64, device=d.device)
    out = _kl_terms(d, m, "mismatch")
    p = torch.exp(torch.where(m, old_logprobs.detach().double(), 0.0))
    q = torch.exp(torch.where(m, rollout_logprobs.detach().double(), 0.0))
    out["mismatch/prob_abs_diff/sum"] = torch.where(m, (p - q).abs(), z).sum()
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
        out[f"mismatch/bucket/{label}/count/sum"] = b.sum(dtype=_F64)
        out[f"mismatch/bucket/{label}/abs_diff/sum"] = torch.where(b, d.abs(), z).sum()
        out[f"mismatch/bucket/{label}/kl_k3/sum"] = torch.where(b, k3, z).sum()
    if turn_ids is not None:
        out.update(_kl_terms(d, m & (turn_ids == 0), "mismatch/turn/first"))
        out.update(_kl_terms(d, m & (turn_ids > 0), "mismatch/turn/later"))
    if entropy is not None:
        out["mismatch/entropy/sum"] = torch.where(m, entropy.detach().double(), z).sum()
    return out


def routing_agreement_sums(topk_a: Tensor, topk_b: Tensor, mask: Tensor, name: str) -> dict[str, Tensor]:
    """MoE routing agreement: fraction of (token, layer) whose top-k expert SET is equal in a and b.

    topk_a, topk_b: int [B, T, L, k] expert indices per token and layer (order within k ignored);
    mask: [B, T]. name: e.g. 'route_agree_rollout_train' or 'route_agree_old_new'. Sums per layer and
    overall (`.../agree/sum`, `.../total/sum`), finished by `finish_mismatch` into `mismatch/<name>`
    and `mismatch/<name>/layer_<l>`.
    """
    same = (topk_a.sort(dim=-1).values == topk_b.sort(dim=-1).values).all(dim=-1)  # [B, T, L]
    m = mask.bool()[..., None].expand_as(same)
    agree = (same & m).sum(dim=(0, 1), dtype=_F64)
    total = m.sum(dim=(0, 1), dtype=_F64)
    out = {f"mismatch/{name}/agree/sum": agree.sum(), f"mismatch/{name}/total/sum": total.sum()}
    for layer in range(same.shape[-1]):
        out[f"mismatch/{name}/layer_{layer}/agree/sum"] = agree[layer]
        out[f"mismatch/{name}/layer_{layer}/total/sum"] = total[layer]
    return out


def finish_mismatch(sums: Mapping[str, Tensor]) -> dict[str, float]:
    """Reduced sums -> flat dict of logged values (`mismatch/kl_k3`, `mismatch/w/ess`, ...). Host read."""
    s = {k: float(v) for k, v in sums.items()}

    def div(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    out: dict[str, float] = {}
    for prefix in ("mismatch", "mismatch/turn/first", "mismatch/turn/later"):
        if f"{prefix}/tokens/sum" not in s:
            continue
        n = s[f"{prefix}/tokens/sum"]
        out[f"{prefix}/tokens"] = n
        for name in ("kl_k3", "kl_k1", "abs_logprob_diff"):
            out[f"{prefix}/{name}"] = div(s[f"{prefix}/{name}/sum"], n)
    n = s.get("mismatch/tokens/sum", 0.0)
    if "mismatch/prob_abs_diff/sum" in s:
        out["mismatch/prob_abs_diff"] = div(s["mismatch/prob_abs_diff/sum"], n)
    if "mismatch/entropy/sum" in s:
        out["mismatch/entropy"] = div(s["mismatch/entropy/sum"], n)
    for ratio in ("w", "r", "rho"):
        pre = f"mismatch/{ratio}"
        if f"{pre}/sum" not in s:
            continue
        out[f"{pre}/mean"] = div(s[f"{pre}/sum"], n)
        out[f"{pre}/min"] = math.exp(s[f"{pre}/log/min"]) if n > 0 else 0.0
        out[f"{pre}/max"] = math.exp(min(s[f"{pre}/log/max"], 700.0)) if n > 0 else 0.0
        out[f"{pre}/ess"] = div(s[f"{pre}/sum"] ** 2, n * s[f"{pre}/sq_sum"]) if n > 0 else 1.0
        ns = s[f"{pre}/seqs/sum"]
        out[f"{pre}/seq_ess"] = div(s[f"{pre}/seq/sum"] ** 2, ns * s[f"{pre}/seq/sq_sum"]) if ns > 0 else 1.0
    for key, v in s.items():
        if key.endswith("/agree/sum"):  # routing agreement
            base = key[: -len("/agree/sum")]
            out[base] = div(v, s[f"{base}/total/sum"])
        elif key.startswith("mismatch/bucket/") and key.endswith("/count/sum"):
            base = key[: -len("/count/sum")]
            out[f"{base}/count"] = v
            out[f"{base}/abs_diff"] = div(s[f"{base}/abs_diff/sum"], v)
            out[f"{base}/kl_k3"] = div(s[f"{base}/kl_k3/sum"], v)
    return out


def mismatch_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *,
                     logprobs: Tensor | None = None, turn_ids: Tensor | None = None,
                     entropy: Tensor | None = None, seq: SeqOps = LOCAL, group=None,
                     edges: Sequence[float] = BUCKET_EDGES) -> dict[str, float]:
    """One-call version: sums (all-reduced over `group` if torch.distributed is initialised and group is
    given), finished, plus rank-local p01/p99 of w (and r, ρ when logprobs is given)."""
    sums = mismatch_sums(old_logprobs, rollout_logprobs, mask, logprobs=logprobs, turn_ids=turn_ids,
                         entropy=entropy, seq=seq, edges=edges)
    if group is not None and dist.is_available() and dist.is_initialized():
        sums = all_reduce_sums(sums, group)
    out = finish_mismatch(sums)
    m = mask.bool()
    ratios = {"w": _delta(old_logprobs, rollout_logprobs, m)}
    if logprobs is not None:
        ratios["r"] = _delta(logprobs, old_logprobs, m)
        ratios["rho"] = _delta(logprobs, rollout_logprobs, m)
    for name, lr in ratios.items():
        p01, p99 = ratio_quantiles(lr, m)
        out[f"mismatch/{name}/p01"], out[f"mismatch/{name}/p99"] = float(p01), float(p99)
    return out
