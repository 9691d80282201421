"""Policy surrogates: per-token loss terms ℓ_t (we minimise; ℓ = −J) before corrections and aggregation.

Common signature: `fn(batch: PolicyBatch, **params) -> SurrogateOut` with `per_token [B, T]` (0 where
m_t = 0). Notation (docs/algorithms.md#notation): r_t = π_θ/π_old, w_t = π_old/μ, ρ_t = π_θ/μ = r_t·w_t, sg = detach,
A = advantage broadcast to tokens. Ratios are exp of fp32 log-differences with Δ = 0 at padding.
Where a term's weight is 0 (A = 0, a clipped branch, a token the corrections drop: `batch.idle`,
P3O's k3 at ESS = 1) its ratio is frozen before the exp (`frozen_exp`), so the term and its
gradient stay finite there (0, not 0 · inf = nan) whatever the log-ratio; metrics still read the
true ratios. docs/algorithms.md#zero-weight-terms.

Registered names: ppo_clip, mu_grpo, reinforce, cispo, gspo, gspo_token, minirl, p3o.
`token_local=True` where a surrogate registers: ℓ_t and its gradient read token t's own values
only (not gspo / gspo_token, whose sequence ratio couples a response's tokens); such a loss may
have its gradients formed inside the log-prob kernel's forward (losses/token_local.py).
Metric keys are un-prefixed here (`clipped/num`); `compute_policy_loss` prefixes the surrogate name.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from megatron_rl.losses.seqops import owner_count
from megatron_rl.losses.types import (
    PolicyBatch,
    SurrogateOut,
    add_fraction,
    count,
    frozen_exp,
    masked,
    masked_log_ratio,
)
from megatron_rl.registry import ParamRules, Registry, keyword_params


@dataclass(frozen=True)
class SurrogateSpec:
    """A registered surrogate: `fn(batch, **params) -> SurrogateOut` and what it declares.

    rules: its parameters' value ranges (registry.ParamRules).
    token_local: ℓ_t and its gradient read token t's own values only (losses/token_local.py).
    aggregations: the aggregations it allows (None: any), `why` says why.
    step_statistics: parameter -> STEP_STATISTICS name the trainer computes every optimizer step
        and passes as that parameter (P3O's ESS).
    """

    fn: Callable[..., SurrogateOut]
    rules: ParamRules = field(default_factory=ParamRules)
    token_local: bool = False
    aggregations: tuple[str, ...] | None = None
    why: str = ""
    step_statistics: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        where = f"surrogate {self.fn.__name__}"
        self.rules.check_against(where, self.fn)
        unknown = sorted(set(self.step_statistics) - set(keyword_params(self.fn)))
        if unknown:
            raise TypeError(f"{where}: step_statistics for {unknown}, which are not its keyword parameters")


SURROGATES = Registry("surrogate", SurrogateSpec)


def register_surrogate(name: str, *, limits: Mapping[str, Mapping[str, Any]] | None = None, token_local: bool = False,
                       aggregations: tuple[str, ...] | None = None, why: str = "",
                       step_statistics: Mapping[str, str] | None = None):
    """Decorator: register `fn` as surrogate `name` with its declarations (see SurrogateSpec)."""
    def deco(fn):
        SURROGATES.add(name, SurrogateSpec(fn, ParamRules(limits or {}), token_local, aggregations, why,
                                           step_statistics or {}))
        return fn

    return deco


def get_surrogate(name: str) -> Callable[..., SurrogateOut]:
    return SURROGATES.get(name).fn


# Value ranges a surrogate declares where it registers (`limits`: parameter -> bounds of
# checks.number), checked by losses.setup.resolve_loss at start-up. The clip range is
# [1 − ε_low, 1 + ε_high] around a ratio ≥ 0: ε_low >= 1 is no lower bound (the "no clip" arms
# write 1e9 for both), a large ε_high (or inf) no upper one; a negative ε would make the range empty.
CLIP_LIMITS = {"eps_low": {"lo": 0, "finite": False, "hint": ">= 1 = no lower clip"},
               "eps_high": {"lo": 0, "finite": False, "hint": "a large value or inf = no upper clip"}}
DUAL_CLIP_LIMITS = {"dual_clip": {"lo": 1, "lo_open": True, "hint": "the -cA cap of A < 0 tokens; null = off"}}


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), device=x.device)


def _clip_active(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """bool: the clipped branch of min(ratio·A, clip(ratio)·A) is strictly smaller (zero gradient)."""
    return ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))


def _clipped_surrogate(log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float,
                       dual_clip: float | None = None, idle: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """ℓ = −min(x A, clip(x, 1−ε_low, 1+ε_high) A), x = exp(log_ratio); dual clip: ℓ = min(ℓ, −c A) for A < 0.

    Written as a select: where the clip (or dual clip) is active ℓ is a constant of θ, elsewhere ℓ = −x A.
    The gradient path exponentiates log_ratio only where its term counts: not on a clipped token,
    nor where A = 0 or `idle` (bool, the term's weight is 0 downstream), so an overflowing ratio
    there cannot turn a zero loss or gradient into 0·inf = nan. Returns (ℓ, clip_active, dual_active).
    """
    x = torch.exp(log_ratio.detach())
    clip_active = _clip_active(x, adv, eps_low, eps_high)
    dual_active = (adv < 0) & (x > dual_clip) if dual_clip is not None else torch.zeros_like(clip_active)
    frozen = clip_active | dual_active | (adv == 0)
    if idle is not None:
        frozen = frozen | idle
    x_grad = frozen_exp(log_ratio, frozen)
    loss = torch.where(clip_active, -x.clamp(1 - eps_low, 1 + eps_high) * adv, -x_grad * adv)
    if dual_clip is not None:
        loss = torch.where(dual_active, -dual_clip * adv, loss)
    return loss, clip_active, dual_active


@register_surrogate("ppo_clip", limits={**CLIP_LIMITS, **DUAL_CLIP_LIMITS}, token_local=True)
def ppo_clip(batch: PolicyBatch, *, eps_low: float = 0.2, eps_high: float = 0.2,
             dual_clip: float | None = None) -> SurrogateOut:
    """ℓ_t = −min(r_t A, clip(r_t, 1−ε_low, 1+ε_high) A); dual clip c > 1: ℓ_t = min(ℓ_t, −c A) where A < 0.

    DAPO clip-higher: eps_high = 0.28, eps_low = 0.2. Shapes: [B, T] -> per_token [B, T].
    Metrics: clipped (clip branch active), dual_clipped (A < 0 and the −cA cap active).
    """
    m = batch.mask
    adv = masked(batch.advantages, m)
    logr = masked_log_ratio(batch.logprobs, batch.old_logprobs, m)
    loss, clipped, dual = _clipped_surrogate(logr, adv, eps_low, eps_high, dual_clip, batch.idle)
    metrics = {}
    add_fraction(metrics, "clipped", m & clipped, m)
    if dual_clip is not None:
        add_fraction(metrics, "dual_clipped", m & dual, m)
    return SurrogateOut(torch.where(m, loss, _zero(loss)), metrics)


@register_surrogate("mu_grpo", limits={**CLIP_LIMITS, **DUAL_CLIP_LIMITS}, token_local=True)
def mu_grpo(batch: PolicyBatch, *, eps_low: float = 1.0, eps_high: float = 4.0,
            dual_clip: float | None = None) -> SurrogateOut:
    """µ-GRPO relaxed clipping: `ppo_clip` with [1−ε_low, 1+ε_high] = [0, 5].

    The negative-advantage veto half of µ-GRPO is the `nav` correction (recipe `mu_grpo` adds it).
    """
    return ppo_clip(batch, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)


@register_surrogate("reinforce", token_local=True)
def reinforce(batch: PolicyBatch) -> SurrogateOut:
    """ℓ_t = −sg[ρ_t] A log π_θ,t  (ρ_t = π_θ/μ; ∂ℓ_t/∂log π_θ,t = −ρ_t A)."""
    m = batch.mask
    adv = masked(batch.advantages, m)
    # ρ is inf for log μ = −inf or a log-ratio > 88.7: frozen where A = 0 or the term is dropped
    rho = frozen_exp(masked_log_ratio(batch.logprobs.detach(), batch.rollout_logprobs, m), batch.idle | (adv == 0))
    loss = -rho * adv * masked(batch.logprobs, m)
    return SurrogateOut(loss, {})


@register_surrogate("cispo", limits=CLIP_LIMITS, token_local=True)
def cispo(batch: PolicyBatch, *, eps_low: float = 1.0, eps_high: float = 0.28) -> SurrogateOut:
    """ℓ_t = −sg[clip(r_t, 1−ε_low, 1+ε_high)] A log π_θ,t  (MiniMax-M1; every token keeps a gradient).

    Default eps_low = 1.0 (no lower bound, as in MiniMax-M1, which tunes only the upper bound);
    eps_high = 0.28 is our default. Metrics: clipped (the weight was clipped, either side).
    """
    m = batch.mask
    logr = masked_log_ratio(batch.logprobs.detach(), batch.old_logprobs, m)
    adv = masked(batch.advantages, m)
    r = torch.exp(logr)
    # frozen where the term is 0: with ε_high = inf the weight is r itself, inf past Δ ≈ 88.7
    coef = frozen_exp(logr, batch.idle | (adv == 0)).clamp(1 - eps_low, 1 + eps_high)
    loss = -coef * adv * masked(batch.logprobs, m)
    metrics = {}
    add_fraction(metrics, "clipped", m & ((r > 1 + eps_high) | (r < 1 - eps_low)), m)
    return SurrogateOut(loss, metrics)


def _seq_stats(batch: PolicyBatch, logprobs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One (CP-reduced) pass: L_i = (1/|y_i|) Σ_t m (log π_θ − log π_old), |y_i|, A_i = mean_t A; all [B].

    An all-masked response gets L_i = 0, A_i = 0. Gradient flows into L_i iff `logprobs` has one.
    """
    m = batch.mask
    parts = torch.stack([masked_log_ratio(logprobs, batch.old_logprobs, m), m.float(),
                         masked(batch.advantages, m)])
    sums = batch.seq.sum(parts)  # [3, B]
    n = sums[1].detach()
    return sums[0] / n.clamp_min(1.0), n, sums[2].detach() / n.clamp_min(1.0)


def _gspo_metrics(batch: PolicyBatch, s: Tensor, n: Tensor, adv_seq: Tensor, eps_low: float,
                  eps_high: float) -> dict:
    m = batch.mask
    adv = masked(batch.advantages, m)
    s = s.detach()
    metrics = {}
    add_fraction(metrics, "clipped_tokens", m & _clip_active(s[:, None].expand_as(adv), adv, eps_low, eps_high), m)
    valid = n > 0
    metrics["clipped_seqs/num/sum"] = owner_count(valid & _clip_active(s, adv_seq, eps_low, eps_high), batch.seq)
    metrics["clipped_seqs/den/sum"] = owner_count(valid, batch.seq)
    metrics["seq_ratio/num/sum"] = owner_count(torch.where(valid, s.double(), 0.0), batch.seq)
    metrics["seq_ratio/den/sum"] = metrics["clipped_seqs/den/sum"]
    return metrics


@register_surrogate("gspo", limits=CLIP_LIMITS, aggregations=("seq_mean_token_mean",),
                    why="a sequence-level objective aggregated per sequence: its per_token repeats ℓ_i on "
                        "every token, so a token sum would weight each response by its length")
def gspo(batch: PolicyBatch, *, eps_low: float = 3e-4, eps_high: float = 4e-4) -> SurrogateOut:
    """GSPO (sequence level). s_i = exp((1/|y_i|) Σ_t m (log π_θ − log π_old)) (has gradient),
    ℓ_i = −min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i).

    per_seq: [B] ℓ_i (A_i = mean of A over the response's tokens; 0 for an all-masked response).
    per_token: [B, T] ℓ_i at every token of response i (A_t in place of A_i), so that
    `seq_mean_token_mean` gives exactly (1/N_seq) Σ_i ℓ_i, and token corrections compose per token.
    Under CP, s_i is finished with a differentiable CP all-reduce (SeqOps.sum).
    """
    m = batch.mask
    L, n, adv_seq = _seq_stats(batch, batch.logprobs)  # log s_i [B] (with gradient)
    adv = masked(batch.advantages, m)
    # a token whose term is dropped adds no gradient to s_i (its frozen copy of L_i is a constant)
    per_token, _, _ = _clipped_surrogate(L[:, None].expand_as(adv), adv, eps_low, eps_high, idle=batch.idle)
    per_token = torch.where(m, per_token, _zero(per_token))
    per_seq, _, _ = _clipped_surrogate(L, adv_seq, eps_low, eps_high)
    metrics = _gspo_metrics(batch, torch.exp(L.detach()), n, adv_seq, eps_low, eps_high)
    return SurrogateOut(per_token, metrics, per_seq=per_seq)


@register_surrogate("gspo_token", limits=CLIP_LIMITS)
def gspo_token(batch: PolicyBatch, *, eps_low: float = 3e-4, eps_high: float = 4e-4) -> SurrogateOut:
    """GSPO-token: s_i,t = sg[s_i] · π_θ,t / sg[π_θ,t] (value s_i, gradient s_i ∇log π_θ,t),
    ℓ_t = −min(s_i,t A_t, clip(s_i,t, 1−ε_low, 1+ε_high) A_t).  [B, T] -> [B, T].
    """
    m = batch.mask
    L, n, adv_seq = _seq_stats(batch, batch.logprobs.detach())
    lp = masked(batch.logprobs, m)
    log_s_tok = L[:, None] + (lp - lp.detach())  # value log s_i, gradient ∇log π_θ,t
    adv = masked(batch.advantages, m)
    per_token, _, _ = _clipped_surrogate(log_s_tok, adv, eps_low, eps_high, idle=batch.idle)
    per_token = torch.where(m, per_token, _zero(per_token))
    return SurrogateOut(per_token, _gspo_metrics(batch, torch.exp(L), n, adv_seq, eps_low, eps_high))


@register_surrogate("minirl", limits={**CLIP_LIMITS, "c_tis": {"lo": 0, "lo_open": True, "finite": False,
                                                                  "hint": "null = no IS weight, inf = untruncated"}},
                    token_local=True)
def minirl(batch: PolicyBatch, *, eps_low: float = 0.2, eps_high: float = 0.27,
           c_tis: float | None = 5.0) -> SurrogateOut:
    """MiniRL (Qwen, eq. 7): ℓ_t = −M_t · sg[min(ρ_t, C_tis)] · A · log π_θ,t, with the decoupled clip mask
    M_t = 0 if (A > 0 and r_t > 1+ε_high) or (A < 0 and r_t < 1−ε_low), else 1.

    IS weight against μ (rollout engine), clip mask against π_old. Paper defaults; pair with
    aggregation `token_sum_norm` and advantages `mean_centered` (recipe `minirl`).
    c_tis=None drops the training-inference IS weight (ρ_t := 1): the paper's "w/o IS correction"
    ablation; eps_low=1, eps_high=inf drops the clip mask (its "w/o clipping").
    Metrics: clip_masked (M_t = 0), tis_truncated (ρ_t > C_tis).
    """
    m = batch.mask
    lp_d = batch.logprobs.detach()
    r = torch.exp(masked_log_ratio(lp_d, batch.old_logprobs, m))
    log_rho = masked_log_ratio(lp_d, batch.rollout_logprobs, m)
    adv = masked(batch.advantages, m)
    clip_mask = _clip_active(r, adv, eps_low, eps_high)
    # frozen where the term is 0 (masked, A = 0, dropped): with c_tis = inf, ρ itself may be inf
    log_coef = torch.where(clip_mask | (adv == 0) | batch.idle, _zero(log_rho), log_rho)
    coef = torch.exp(log_coef.clamp(max=math.log(c_tis))) if c_tis is not None else torch.ones_like(log_rho)
    loss = -coef * adv * masked(batch.logprobs, m)
    loss = torch.where(m & ~clip_mask, loss, _zero(loss))
    metrics = {}
    add_fraction(metrics, "clip_masked", m & clip_mask, m)
    add_fraction(metrics, "tis_truncated", m & (log_rho > math.log(c_tis if c_tis is not None else math.inf)), m)
    return SurrogateOut(loss, metrics)


# ----------------------------------------------------------------------------- P3O


def p3o_ess_stats(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Local sums for P3O's ESS: (Σ m r, Σ m, Σ m r²), float64 0-dim, r_t = π_θ/π_old (detached).

    Sum them over the micro-batches of the optimizer step and all-reduce (SUM) over every DP×CP rank,
    then `ess_from_stats`. Log-ratios are clamped to ±300 so r² stays finite in float64 (exact below).
    """
    m = loss_mask.bool()
    logr = masked_log_ratio(logprobs.detach(), old_logprobs, m).double().clamp(-300.0, 300.0)
    r = torch.where(m, torch.exp(logr), 0.0)
    return r.sum(), m.sum(dtype=torch.float64), (r * r).sum()


def ess_from_stats(sum_r: Tensor, sum_mask: Tensor, sum_r2: Tensor) -> Tensor:
    """ESS = (Σ m r)² / ((Σ m) · Σ m r²) ∈ (0, 1] (1 when there are no tokens). float64 0-dim."""
    sum_r, sum_mask, sum_r2 = (torch.as_tensor(x, dtype=torch.float64) for x in (sum_r, sum_mask, sum_r2))
    ess = sum_r * sum_r / (sum_mask * sum_r2).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(sum_mask > 0, ess.clamp(0.0, 1.0), torch.ones_like(ess))


@register_surrogate("p3o", step_statistics={"ess": "ratio_ess"}, aggregations=("token_mean",),
                    why="its ESS and KL term are token averages", token_local=True)
def p3o(batch: PolicyBatch, *, ess: Tensor | float) -> SurrogateOut:
    """P3O (trust the batch): ℓ_t = −sg[clamp(r_t, 0, ESS)] A log π_θ,t + (1 − ESS) · k3_t,
    k3_t = exp(log π_old − log π_θ) − (log π_old − log π_θ) − 1 (has gradient).

    `ess`: the GLOBAL ESS of the optimizer step (`ess_from_stats` of all-reduced `p3o_ess_stats`), a
    0-dim tensor or float, same value on every rank and micro-batch. θ is fixed during the step, so the
    stats come from a no-grad forward of the step's micro-batches before the first backward (on the
    step right after the π_old pass with unchanged weights, r ≡ 1 and ESS = 1). Pair with `token_mean`.
    Metrics: ess (global value), capped (r_t > ESS), k3 (mean of k3 over tokens).
    """
    m = batch.mask
    ess_t = torch.as_tensor(ess, dtype=torch.float32, device=batch.logprobs.device).detach()
    r = torch.exp(masked_log_ratio(batch.logprobs.detach(), batch.old_logprobs, m))
    coef = torch.minimum(r, ess_t)
    d = masked_log_ratio(batch.old_logprobs, batch.logprobs, m)  # log π_old − log π_θ, grad via π_θ
    # k3's weight 1 − ESS is 0 at ESS = 1, and so is a dropped token's: d is frozen to 0 there (k3 = 0)
    d_term = torch.where(batch.idle | (ess_t >= 1.0), _zero(d), d)
    k3 = torch.exp(d_term) - d_term - 1.0
    loss = -coef * masked(batch.advantages, m) * masked(batch.logprobs, m) + (1.0 - ess_t) * k3
    loss = torch.where(m, loss, _zero(loss))
    metrics = {"ess/num/sum": ess_t.double(), "ess/den/sum": torch.ones_like(ess_t, dtype=torch.float64)}
    add_fraction(metrics, "capped", m & (r > ess_t), m)
    d = d.detach()
    metrics["k3/num/sum"] = count(torch.where(m, torch.exp(d) - d - 1.0, 0.0))  # the true k3, frozen or not
    metrics["k3/den/sum"] = count(m)
    return SurrogateOut(loss, metrics)
