"""A policy loss as a sum of per-token terms with constant weights, for a log-prob kernel that forms
the gradients in its forward (logprobs/loss_fused.py).

That kernel needs `∂L/∂logprob_t` for a chunk of tokens while the chunk's logits are in its buffer,
before any other chunk exists. `compute_policy_loss` (surrogate × corrections × aggregation) has
that form,

    L = Σ_t a_t · ℓ_t(lp_t)        a_t = w_t · c_t · 1(m_t ∧ keep_t)

exactly when each of its three parts allows it, as each declared where it registered:

- the surrogate is `token_local`: ℓ_t, and its gradient, read token t's own log-prob and constants
  (π_old, μ, A, m of t, or a per-step statistic such as P3O's ESS);
- no correction `reads_policy` (π_θ): c_t and keep_t are then constants of the update pass, computed
  here once per micro-batch from π_old and μ, as `compute_policy_loss` computes them;
- the aggregation is `linear`: aggregate(x) = Σ_t w_t x_t with w_t fixed by the mask and the
  global counts. w is read off as the gradient of the aggregation at x = 0 (exact for a linear
  function; one small backward per micro-batch), so no aggregation states its weights twice.

`token_local_blocker(...)` says why a loss does not have that form (None when it does);
`TokenTerms.from_batch` makes the constants of a micro-batch and `TokenTerms.chunk_loss(rows, lp)`
evaluates Σ_{t ∈ rows} a_t ℓ_t on any subset of the (flattened) tokens: the sum over a partition of
the tokens is `compute_policy_loss`'s loss, and so are the gradients.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from megatron_rl.losses.aggregation import AGGREGATIONS, GlobalCounts, aggregate
from megatron_rl.losses.corrections import CORRECTIONS, apply_corrections
from megatron_rl.losses.surrogates import SURROGATES, get_surrogate
from megatron_rl.losses.types import PolicyBatch


def token_local_blocker(surrogate: str, surrogate_params: Mapping[str, Any] | None = None,
                        corrections: Sequence[tuple[str, Mapping[str, Any] | None]] = (),
                        aggregation: str = "token_mean", agg_params: Mapping[str, Any] | None = None) -> str | None:
    """Why this loss is not Σ_t a_t ℓ_t(lp_t) with constant a_t (a sentence naming the part), or
    None when it is. Arguments as for `compute_policy_loss`."""
    del surrogate_params, agg_params  # no parameter changes whether a surrogate or aggregation qualifies
    if not SURROGATES.get(surrogate).token_local:
        return f"the surrogate {surrogate} couples the tokens of a response (a sequence-level ratio)"
    for name, params in corrections:
        if CORRECTIONS.get(name).reads_policy_with(params or {}):
            return f"the correction {name} reads π_θ, so its weights are not known before the pass"
    if not AGGREGATIONS.get(aggregation).linear:
        return f"the aggregation {aggregation} is not a fixed weighted sum of the per-token terms"
    return None


@dataclass(frozen=True, eq=False)
class TokenTerms:
    """The constants of one micro-batch's token-local policy loss, any common shape (`[B, T]` as
    made; `map` re-lays them out, e.g. flat in a kernel's token order).

    old_logprobs, rollout_logprobs, advantages, loss_mask, positions: the PolicyBatch fields the
        surrogate reads at each token; coef: fp32 a_t = w_t · c_t; active: bool m_t ∧ keep_t ∧ c_t ≠ 0
        (a_t counts only there; the surrogate freezes the ratios elsewhere, so an inf term at a
        dropped token reaches neither the loss nor, as 0 · inf, the gradient).
    surrogate, params: the surrogate and its keyword parameters.
    """

    old_logprobs: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    positions: Tensor
    coef: Tensor
    active: Tensor
    surrogate: str
    params: Mapping[str, Any]

    @classmethod
    def from_batch(cls, batch: PolicyBatch, surrogate: str, surrogate_params: Mapping[str, Any] | None = None,
                   corrections: Sequence[tuple[str, Mapping[str, Any] | None]] = (),
                   aggregation: str = "token_mean", agg_params: Mapping[str, Any] | None = None, *,
                   normaliser: GlobalCounts) -> TokenTerms:
        """The constants of `compute_policy_loss(batch, ...)` for a loss `token_local_blocker` passes.

        batch.logprobs is not read (its shape is): π_θ is what the kernel supplies, per chunk.
        Under context parallelism the corrections and the aggregation reduce over the CP group
        (batch.seq), as in `compute_policy_loss`: every CP rank calls this for the same micro-batch.
        """
        reason = token_local_blocker(surrogate, surrogate_params, corrections, aggregation, agg_params)
        if reason is not None:
            raise ValueError(f"not a token-local loss: {reason}")
        m = batch.mask
        corr = apply_corrections(batch, [(n, dict(p or {})) for n, p in corrections])
        with torch.enable_grad():
            x = torch.zeros(m.shape, dtype=torch.float32, device=m.device, requires_grad=True)
            value = aggregate(aggregation, x, batch.loss_mask, normaliser, batch.seq, **dict(agg_params or {}))
            (w,) = torch.autograd.grad(value, x, allow_unused=True) if value.requires_grad else (None,)
        w = torch.zeros_like(x) if w is None else w
        active = m & corr.keep & (corr.weight != 0)  # as compute_policy_loss's
        return cls(batch.old_logprobs, batch.rollout_logprobs, batch.advantages, m, batch.token_positions(),
                   torch.where(active, w * corr.weight, 0.0), active, surrogate, dict(surrogate_params or {}))

    def map(self, fn: Callable[[Tensor], Tensor]) -> TokenTerms:
        """The same terms with `fn` applied to every tensor (one layout change for all)."""
        tensors = {f.name: fn(getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        return replace(self, **tensors)

    def chunk_loss(self, rows, logprobs: Tensor) -> Tensor:
        """Σ_{t ∈ rows} a_t ℓ_t: fp32 0-dim, differentiable w.r.t. `logprobs` ([n], the log π_θ of
        the tokens `rows` (an index of the terms' last dimension) of 1-D terms)."""
        def take(x: Tensor) -> Tensor:
            return x[rows][None]

        sub = PolicyBatch(logprobs=logprobs[None], old_logprobs=take(self.old_logprobs),
                          rollout_logprobs=take(self.rollout_logprobs), advantages=take(self.advantages),
                          loss_mask=take(self.loss_mask), positions=take(self.positions), active=take(self.active))
        per_token = get_surrogate(self.surrogate)(sub, **self.params).per_token
        return torch.where(take(self.active), take(self.coef) * per_token, 0.0).sum()


@dataclass(frozen=True, eq=False)
class NllTerms:
    """The supervised warm start's loss in the same form (trainer/sft.py):
    `token_mean(−lp, m, N) = Σ_t coef_t · (−lp_t)` with fp32 `coef_t = m_t / N`, N the global
    count of label tokens; any shape, `map` and `chunk_loss` as `TokenTerms`'."""

    coef: Tensor

    def map(self, fn: Callable[[Tensor], Tensor]) -> NllTerms:
        return NllTerms(fn(self.coef))

    def chunk_loss(self, rows, logprobs: Tensor) -> Tensor:
        """Σ_{t ∈ rows} coef_t · (−lp_t), fp32 0-dim (a masked token's log-prob is never read)."""
        coef = self.coef[rows]
        return torch.where(coef != 0, -coef * logprobs, 0.0).sum()
