"""Rollout corrections: per-token weight c_t ≥ 0 (detached) and keep mask, composable with any surrogate.

Common signature: `fn(batch: PolicyBatch, **params) -> Correction(weight [B, T], keep [B, T], metrics)`.
The corrected term is c_t · keep_t · ℓ_t; a list of corrections multiplies weights and ANDs keep masks
(`apply_corrections`). Padding gets weight 1, keep True. w_t = π_old/μ, r_t = π_θ/π_old, ρ_t = π_θ/μ;
all comparisons are made in log space (no overflow for |Δ| up to fp32's range).

Token-level (this file): tis_token, mis_token, icepop, kpop.
Sequence-level (`corrections_seq.py`, same registry): tis_seq, mis_seq, mis_geo, veto, opsm, nav; the
package (`megatron_rl/losses/__init__.py`) imports both modules, so every entry is registered before
any module of the package is used (importing one imports the package first).
Every correction logs the fraction of tokens (and sequences) it changed as `/num`, `/den` sums.

A correction declares its parameters' valid values where it registers, checked by
`losses.setup.resolve_loss` at start-up (a threshold of 0 would fail mid-step in log(0), an empty
band would silently drop every token): `limits` (parameter -> bounds of checks.number),
`choices` (parameter -> allowed values), `band` (lo, hi): parameters that must satisfy lo <= hi.
It also declares `reads_policy`: whether c_t and keep_t read π_θ (batch.logprobs, detached):
True, False, or the name of the bool parameter that switches it on (tis_token's tis_use_rho). A
correction that does not read π_θ is a constant of the update pass, known before its forward
(losses/token_local.py); one that does not declare it is taken to read π_θ.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from megatron_rl.losses.types import (
    Correction,
    Metrics,
    PolicyBatch,
    add_fraction,
    masked_log_ratio,
    prefix_metrics,
)
from megatron_rl.registry import ParamRules, Registry, keyword_params


@dataclass(frozen=True)
class CorrectionSpec:
    """A registered correction: `fn(batch, **params) -> Correction` and what it declares.

    rules: its parameters' value ranges (registry.ParamRules).
    reads_policy: whether c_t and keep_t read π_θ: True, False, or the name of the bool keyword
        parameter that switches it on (tis_token's tis_use_rho). True unless declared otherwise.
    """

    fn: Callable[..., Correction]
    rules: ParamRules = field(default_factory=ParamRules)
    reads_policy: bool | str = True

    def __post_init__(self):
        where = f"correction {self.fn.__name__}"
        self.rules.check_against(where, self.fn)
        if isinstance(self.reads_policy, str):
            param = keyword_params(self.fn).get(self.reads_policy)
            if param is None or not isinstance(param.default, bool):
                raise TypeError(f"{where}: reads_policy={self.reads_policy!r} must name one of its bool keyword "
                                f"parameters")
        elif not isinstance(self.reads_policy, bool):
            raise TypeError(f"{where}: reads_policy must be a bool or a parameter name, got {self.reads_policy!r}")

    def reads_policy_with(self, params: Mapping[str, Any]) -> bool:
        """Whether c_t / keep_t read π_θ under `params` (the switch parameter's value, else its default)."""
        if isinstance(self.reads_policy, bool):
            return self.reads_policy
        return bool(params.get(self.reads_policy, keyword_params(self.fn)[self.reads_policy].default))


CORRECTIONS = Registry("rollout correction", CorrectionSpec)


def register_correction(name: str, *, limits: Mapping[str, Mapping[str, Any]] | None = None,
                        choices: Mapping[str, tuple] | None = None, band: tuple[str, str] | None = None,
                        reads_policy: bool | str = True):
    """Decorator: register `fn` as correction `name` with its declarations (see CorrectionSpec)."""
    def deco(fn):
        CORRECTIONS.add(name, CorrectionSpec(fn, ParamRules(limits or {}, choices or {}, band), reads_policy))
        return fn

    return deco


def get_correction(name: str) -> Callable[..., Correction]:
    return CORRECTIONS.get(name).fn
POSITIVE = {"lo": 0, "lo_open": True}  # a threshold compared in log space: log(0) is undefined


def log_w(batch: PolicyBatch) -> Tensor:
    """fp32 [B, T]: log w_t = log π_old − log μ (0 at padding), detached."""
    return masked_log_ratio(batch.old_logprobs, batch.rollout_logprobs, batch.mask).detach()


def keep_only(batch: PolicyBatch, keep: Tensor, metrics: Metrics, name: str = "masked") -> Correction:
    """Correction with c_t = 1 and the given keep mask (padding forced to keep); logs dropped tokens."""
    m = batch.mask
    add_fraction(metrics, name, m & ~keep, m)
    return Correction(torch.ones_like(keep, dtype=torch.float32), keep | ~m, metrics)


@register_correction("tis_token", limits={"C": POSITIVE}, reads_policy="tis_use_rho")
def tis_token(batch: PolicyBatch, *, C: float = 2.0, tis_use_rho: bool = False) -> Correction:
    """Truncated IS (Yao et al.): c_t = min(w_t, C); with tis_use_rho, c_t = min(ρ_t, C).  keep = 1.

    Metrics: truncated (ratio > C), weight (mean c_t).
    """
    m = batch.mask
    logx = (masked_log_ratio(batch.logprobs.detach(), batch.rollout_logprobs, m) if tis_use_rho
            else log_w(batch))
    weight = torch.where(m, torch.exp(logx.clamp(max=math.log(C))), 1.0)
    metrics: Metrics = {}
    add_fraction(metrics, "truncated", m & (logx > math.log(C)), m)
    add_fraction(metrics, "weight", torch.where(m, weight, 0.0), m)
    return Correction(weight, torch.ones_like(m), metrics)


@register_correction("mis_token", limits={"C": {"lo": 1, "hint": "C < 1 makes [1/C, C] empty: every token dropped"}},
                     reads_policy=False)
def mis_token(batch: PolicyBatch, *, C: float = 2.0) -> Correction:
    """Masked IS (Liu et al.): c_t = w_t, keep_t = 1(1/C ≤ w_t ≤ C).  Dropped tokens get c_t = 0.

    Metrics: masked (dropped tokens), weight (mean c_t over kept tokens).
    """
    m = batch.mask
    lw = log_w(batch)
    keep = (lw >= -math.log(C)) & (lw <= math.log(C))
    weight = torch.where(m, torch.where(keep, torch.exp(lw), 0.0), 1.0)
    metrics: Metrics = {}
    add_fraction(metrics, "masked", m & ~keep, m)
    add_fraction(metrics, "weight", torch.where(m & keep, weight, 0.0), m & keep)
    return Correction(weight, keep | ~m, metrics)


@register_correction("icepop", limits={"alpha": POSITIVE, "beta": POSITIVE}, band=("alpha", "beta"),
                     reads_policy=False)
def icepop(batch: PolicyBatch, *, alpha: float = 0.5, beta: float = 5.0,
           ratio_weight: bool = False) -> Correction:
    """IcePop (Ring): keep_t = 1(α ≤ w_t ≤ β), c_t = 1.

    ratio_weight=True uses c_t = w_t on kept tokens (the IcePop paper's M(k) = k inside [α, β]);
    the default is c_t = 1 (docs/algorithms.md#icepop). Metrics: masked.
    """
    m = batch.mask
    lw = log_w(batch)
    keep = (lw >= math.log(alpha)) & (lw <= math.log(beta))
    out = keep_only(batch, keep, {})
    if ratio_weight:
        return Correction(torch.where(m & keep, torch.exp(lw), out.weight), out.keep, out.metrics)
    return out


def binary_kl(p: Tensor, q: Tensor) -> Tensor:
    """KL_B(p‖q) = p log(p/q) + (1−p) log((1−p)/(1−q)), elementwise (float64 inputs recommended)."""
    return p * (torch.log(p) - torch.log(q)) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


@register_correction("kpop", limits={"phi": {"lo": 0, "hint": "KL_B >= 0: phi < 0 drops every token"}},
                     reads_policy="use_current_policy")
def kpop(batch: PolicyBatch, *, phi: float = 0.01, use_current_policy: bool = False) -> Correction:
    """KPop (adaptive region): with p = π_old,t (or π_θ,t if use_current_policy) and q = μ_t, both clamped
    to [1e-12, 1 − 1e-7]: keep_t = 1(KL_B(p‖q) ≤ φ and KL_B(q‖p) ≤ φ), c_t = 1.

    φ is not pinned by the source; default 0.01 is our choice (e.g. p = 0.5 vs q = 0.45 is kept,
    q = 0.4 is not). Computed in float64. Metrics: masked.
    """
    m = batch.mask
    lp = batch.logprobs.detach() if use_current_policy else batch.old_logprobs
    zero = torch.zeros((), dtype=torch.float64, device=lp.device)
    p = torch.exp(torch.where(m, lp.double(), zero)).clamp(1e-12, 1 - 1e-7)
    q = torch.exp(torch.where(m, batch.rollout_logprobs.double(), zero)).clamp(1e-12, 1 - 1e-7)
    keep = (binary_kl(p, q) <= phi) & (binary_kl(q, p) <= phi)
    return keep_only(batch, keep, {})


# ----------------------------------------------------------------------------- composition


def apply_corrections(batch: PolicyBatch, corrections: Sequence[tuple[str, dict]] = ()) -> Correction:
    """Compose corrections in order: weight = Π_k c_k, keep = AND_k keep_k.  -> Correction [B, T].

    Metrics of correction `name` are prefixed `name/` (a correction listed twice gets `name#2/`).
    """
    m = batch.mask
    weight = torch.ones(m.shape, dtype=torch.float32, device=m.device)
    keep = torch.ones_like(m)
    metrics: Metrics = {}
    for name, params in corrections:
        c = get_correction(name)(batch, **(params or {}))
        weight = weight * c.weight
        keep = keep & c.keep
        key = name
        i = 2
        while any(k.startswith(f"{key}/") for k in metrics):
            key, i = f"{name}#{i}", i + 1
        metrics.update(prefix_metrics(key, c.metrics))
    return Correction(weight, keep, metrics)

