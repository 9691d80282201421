"""Data carriers of the loss library and the small helpers every part shares.

`PolicyBatch`  one micro-batch as the loss sees it (all `[B, T]`, right-padded or packed per row).
`SurrogateOut` per-token loss terms `ℓ_t` of a surrogate (+ per-sequence terms for sequence surrogates).
`Correction`   a rollout correction: detached per-token weight `c_t ≥ 0` and keep mask.

Metrics (all detached 0-dim float64 tensors, no host sync) follow the project's one convention
(megatron_rl/metrics/reduce.py): a fraction is the pair `<name>/num/sum`, `<name>/den/sum` of SUMS,
which the trainer accumulates over micro-batches and all-reduces over ranks before finishing it
into `<name>` = num / den. A global value (the same on every rank, e.g. P3O's ESS) is logged as
its mean: `<name>/num/sum` = value, `<name>/den/sum` = 1.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_rl.losses.seqops import LOCAL, SeqOps

Metrics = dict[str, Tensor]


@dataclass(frozen=True, eq=False)
class PolicyBatch:
    """Inputs of a policy loss for one micro-batch.

    logprobs:         [B, T] log π_θ(y_t), has gradient (any float dtype; math runs in fp32)
    old_logprobs:     [B, T] log π_old(y_t), training engine with the rollout weights (no grad)
    rollout_logprobs: [B, T] log μ(y_t), rollout engine (no grad)
    advantages:       [B, T] A of the response broadcast to its tokens
    loss_mask:        [B, T] m_t (bool or 0/1 float); positions with m_t = 0 may hold any value (inf/nan)
    seq:              per-sequence reductions (LocalSeqOps, or CPSeqOps under context parallelism)
    positions:        [B, T] int, global index of each token inside its response (needed under CP,
                      where a rank's tokens are not contiguous); None = arange(T)
    active:           [B, T] bool, the tokens whose term keeps a non-zero weight after the rollout
                      corrections (m ∧ keep ∧ c ≠ 0; `compute_policy_loss` sets it); None = every
                      valid token. See `idle`.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    seq: SeqOps = LOCAL
    positions: Tensor | None = None
    active: Tensor | None = None

    def __post_init__(self):
        shape = self.logprobs.shape
        for name in ("old_logprobs", "rollout_logprobs", "advantages", "loss_mask"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"PolicyBatch.{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected {tuple(shape)} like logprobs")
        for name in ("positions", "active"):
            if getattr(self, name) is not None and getattr(self, name).shape != shape:
                raise ValueError(f"PolicyBatch.{name} must have the shape of logprobs")

    @property
    def mask(self) -> Tensor:
        """bool [B, T]: m_t = 1."""
        return self.loss_mask.bool() if self.loss_mask.dtype != torch.bool else self.loss_mask

    @property
    def idle(self) -> Tensor:
        """bool [B, T]: tokens whose term is multiplied by 0 downstream (padding, and with `active` the
        tokens a correction drops or weights 0). A surrogate freezes its ratios there (`frozen_exp`),
        so the term is finite and its gradient exactly 0, and still counts them in its metrics."""
        return ~self.mask if self.active is None else ~(self.mask & self.active)

    def token_positions(self) -> Tensor:
        """int64 [B, T]: global position of each token within its response."""
        if self.positions is not None:
            return self.positions.long()
        B, T = self.logprobs.shape
        return torch.arange(T, device=self.logprobs.device).expand(B, T)


@dataclass(frozen=True, eq=False)
class SurrogateOut:
    """per_token: [B, T] ℓ_t (0 where m_t = 0); per_seq: [B] ℓ_i for sequence-level surrogates."""

    per_token: Tensor
    metrics: Metrics = field(default_factory=dict)
    per_seq: Tensor | None = None


@dataclass(frozen=True, eq=False)
class Correction:
    """weight: [B, T] detached c_t ≥ 0 (1 at padding); keep: [B, T] bool (True at padding)."""

    weight: Tensor
    keep: Tensor
    metrics: Metrics = field(default_factory=dict)


# ----------------------------------------------------------------------------- shared helpers


def masked_log_ratio(num: Tensor, den: Tensor, mask: Tensor) -> Tensor:
    """fp32 [B, T]: Δ = log num − log den where mask, 0 elsewhere (so exp(Δ) never meets padding).

    Keeps the gradient of `num`/`den`; torch.where gives padding a zero gradient even if it holds inf.
    """
    return torch.where(mask, num.float() - den.float(), torch.zeros((), device=num.device))


def frozen_exp(log_x: Tensor, frozen: Tensor) -> Tensor:
    """fp32 [B, T]: exp(log_x), and exactly 1 where `frozen` (the exponent is replaced by 0 first).

    For a ratio whose term has weight 0 there (A = 0, a dropped token, a clipped branch, P3O's k3 at
    ESS = 1): exp of a log-ratio above ~88.7 is inf in fp32, and 0 · inf = nan, in the forward and
    in the backward, even when a torch.where drops the term afterwards (its backward still forms
    0 · ∂term, with ∂term = inf). Freezing before the exp keeps both finite; the term's weight 0
    makes its value irrelevant.
    """
    return torch.exp(torch.where(frozen, torch.zeros((), device=log_x.device), log_x))


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """fp32 [B, T]: x where mask, 0 elsewhere (gradient flows only through kept positions)."""
    return torch.where(mask, x.float(), torch.zeros((), device=x.device))


def count(x: Tensor) -> Tensor:
    """Detached float64 sum (counts of bool tensors, sums of values) for the metrics dict."""
    return x.detach().sum(dtype=torch.float64)


def add_fraction(metrics: Metrics, name: str, num: Tensor, den: Tensor) -> None:
    """metrics[name/num] = Σ num, metrics[name/den] = Σ den (bool or float tensors, or 0-dim sums)."""
    metrics[f"{name}/num/sum"] = count(num)
    metrics[f"{name}/den/sum"] = count(den)


def prefix_metrics(prefix: str, metrics: Mapping[str, Tensor]) -> Metrics:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}
