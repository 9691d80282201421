"""Sequence-level rollout corrections (registered in `corrections.CORRECTIONS`).

Per-sequence quantities go through `batch.seq` (LocalSeqOps, or CPSeqOps under context parallelism:
local partial reduction + CP all-reduce of `[B]` values; never an all-gather of tokens). The result is
broadcast back to the sequence's tokens. Sequence counts in metrics are taken on the CP owner rank only.

    tis_seq   c_i = min(Π_t w_t, C)                     (log space)
    mis_seq   keep_i = 1(Π_t w_t ≤ C), c_i = Π_t w_t     (for kept sequences)
    mis_geo   g_i = exp(mean_t log w_t), keep_i = 1(lo ≤ g_i ≤ hi)
    veto      keep_i = 0 if any token has w_t < τ
    opsm      keep_i = 0 if A_i < 0 and (1/|y_i|) Σ_t m (log μ_t − log π_θ,t) > δ
    nav       A_i < 0: triggers T_i = {t : r_t > κ}, first trigger t* by GLOBAL position; drop by scope
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_rl.losses.corrections import POSITIVE, keep_only, log_w, register_correction
from megatron_rl.losses.seqops import owner_count
from megatron_rl.losses.types import Correction, Metrics, PolicyBatch, add_fraction, masked, masked_log_ratio

NAV_SCOPES = ("suffix", "from_trigger", "trigger_only", "sequence")


def _seq_sums(batch: PolicyBatch, x: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ_t m x [B], |y_i| [B]) with one CP reduction; x is already 0 at padding."""
    sums = batch.seq.sum(torch.stack([x, batch.mask.float()]).detach())
    return sums[0], sums[1]


def _seq_fraction(metrics: Metrics, batch: PolicyBatch, name: str, hit: Tensor, valid: Tensor) -> None:
    """metrics[name/num|den] over responses with ≥ 1 valid token (`valid` [B]), owner-counted."""
    metrics[f"{name}/num/sum"] = owner_count(valid & hit, batch.seq)
    metrics[f"{name}/den/sum"] = owner_count(valid, batch.seq)


def _drop_seqs(batch: PolicyBatch, drop: Tensor, valid: Tensor, metrics: Metrics, name: str) -> Correction:
    """keep_t = ~drop_i broadcast; logs dropped sequences and dropped tokens."""
    _seq_fraction(metrics, batch, f"{name}_seqs", drop, valid)
    return keep_only(batch, ~drop[:, None].expand_as(batch.mask), metrics, f"{name}_tokens")


@register_correction("tis_seq", limits={"C": POSITIVE}, reads_policy=False)
def tis_seq(batch: PolicyBatch, *, C: float = 2.0) -> Correction:
    """c_i = min(Π_t w_t, C) = exp(min(Σ_t m log w_t, log C)), broadcast to tokens; keep = 1."""
    m = batch.mask
    s, n = _seq_sums(batch, log_w(batch))
    c = torch.exp(s.clamp(max=math.log(C)))
    metrics: Metrics = {}
    _seq_fraction(metrics, batch, "truncated_seqs", s > math.log(C), n > 0)
    weight = torch.where(m, c[:, None], 1.0)
    add_fraction(metrics, "weight", torch.where(m, weight, 0.0), m)
    return Correction(weight, torch.ones_like(m), metrics)


@register_correction("mis_seq", limits={"C": POSITIVE}, reads_policy=False)
def mis_seq(batch: PolicyBatch, *, C: float = 2.0) -> Correction:
    """keep_i = 1(Π_t w_t ≤ C), c_i = Π_t w_t for kept responses (0 for dropped ones)."""
    m = batch.mask
    s, n = _seq_sums(batch, log_w(batch))
    keep = s <= math.log(C)
    c = torch.where(keep, torch.exp(s.clamp(max=math.log(C))), 0.0)
    out = _drop_seqs(batch, ~keep, n > 0, {}, "masked")
    return Correction(torch.where(m, c[:, None], 1.0), out.keep, out.metrics)


@register_correction("mis_geo", limits={"lo": POSITIVE, "hi": POSITIVE}, band=("lo", "hi"),
                     reads_policy=False)
def mis_geo(batch: PolicyBatch, *, lo: float = 0.999, hi: float = 1.001) -> Correction:
    """g_i = exp((1/|y_i|) Σ_t m log w_t); keep_i = 1(lo ≤ g_i ≤ hi); c = 1.

    The method gives no band (docs/algorithms.md#mis_geo); default [0.999, 1.001] (per-token geometric mismatch within ±0.1%) is our
    choice — the geometric mean of a long response is close to 1, so the band must be tight.
    """
    s, n = _seq_sums(batch, log_w(batch))
    g_log = s / n.clamp_min(1.0)
    keep = (g_log >= math.log(lo)) & (g_log <= math.log(hi))
    return _drop_seqs(batch, ~keep, n > 0, {}, "masked")


@register_correction("veto", limits={"tau": POSITIVE}, reads_policy=False)
def veto(batch: PolicyBatch, *, tau: float = 1e-4) -> Correction:
    """Drop response i entirely if any valid token has w_t < τ (checked as log w_t < log τ)."""
    m = batch.mask
    lw = log_w(batch)
    low = m & (lw < math.log(tau))
    mins = batch.seq.min(torch.stack([torch.where(m, lw, math.inf), torch.where(m, 0.0, math.inf)]))
    metrics: Metrics = {}
    add_fraction(metrics, "trigger_tokens", low, m)
    return _drop_seqs(batch, mins[0] < math.log(tau), mins[1] == 0, metrics, "vetoed")


@register_correction("opsm", limits={"delta": {"hint": "a KL threshold; any finite value"}}, reads_policy=True)
def opsm(batch: PolicyBatch, *, delta: float = 1e-3) -> Correction:
    """DeepSeek-V3.2 off-policy sequence masking: drop response i when A_i < 0 and
    (1/|y_i|) Σ_t m (log μ_t − log π_θ,t) > δ.  c = 1.

    δ is not given by the source; default 1e-3 (about the per-token KL of a bf16 train/rollout pair)
    is our choice. A_i < 0 is read from the response's tokens (A is constant per response).
    """
    m = batch.mask
    k = masked_log_ratio(batch.rollout_logprobs, batch.logprobs.detach(), m)
    neg = (m & (masked(batch.advantages, m) < 0)).float()
    sums = batch.seq.sum(torch.stack([k, m.float(), neg]).detach())
    kl, n, n_neg = sums[0] / sums[1].clamp_min(1.0), sums[1], sums[2]
    metrics: Metrics = {"seq_kl/num/sum": owner_count(torch.where(n > 0, kl.double(), 0.0), batch.seq)}
    metrics["seq_kl/den/sum"] = owner_count(n > 0, batch.seq)
    return _drop_seqs(batch, (n_neg > 0) & (kl > delta), n > 0, metrics, "dropped")


@register_correction("nav", limits={"kappa": POSITIVE}, choices={"nav_scope": NAV_SCOPES}, reads_policy=True)
def nav(batch: PolicyBatch, *, kappa: float = 2.0, nav_scope: str = "from_trigger") -> Correction:
    """µ-GRPO negative-advantage veto. For responses with A_i < 0, triggers T_i = {t : r_t > κ}
    (r_t = π_θ/π_old), t* = first trigger by GLOBAL position (`batch.positions`, CP-safe via seq.min).
    nav_scope: 'suffix' drops non-trigger tokens after t*; 'from_trigger' (default) drops all t ≥ t*;
    'trigger_only' drops T_i; 'sequence' drops the whole response.  c = 1.

    κ = 2.0 is a config default (the source does not pin it). Metrics: vetoed_tokens, trigger_tokens,
    triggered_seqs (responses with at least one trigger).
    """
    if nav_scope not in NAV_SCOPES:
        raise ValueError(f"nav_scope must be one of {NAV_SCOPES}, got {nav_scope!r}")
    m = batch.mask
    neg = m & (masked(batch.advantages, m) < 0)
    trig = neg & (masked_log_ratio(batch.logprobs.detach(), batch.old_logprobs, m) > math.log(kappa))
    pos = batch.token_positions()
    never = torch.iinfo(torch.int64).max
    mins = batch.seq.min(torch.stack([torch.where(trig, pos, never), torch.where(m, 0, never)]))
    first, valid = mins[0], mins[1] == 0  # first: [B], `never` if no trigger
    has = first < never
    if nav_scope == "suffix":
        drop = neg & ~trig & (pos > first[:, None])
    elif nav_scope == "from_trigger":
        drop = neg & (pos >= first[:, None])
    elif nav_scope == "trigger_only":
        drop = trig
    else:
        drop = neg & has[:, None]
    metrics: Metrics = {}
    add_fraction(metrics, "trigger_tokens", trig, m)
    metrics["triggered_seqs/num/sum"] = owner_count(has, batch.seq)
    metrics["triggered_seqs/den/sum"] = owner_count(valid, batch.seq)
    return keep_only(batch, ~drop, metrics, "vetoed_tokens")
