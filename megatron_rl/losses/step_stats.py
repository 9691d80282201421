"""Per-step statistics: values of the current policy over the whole optimizer step that a
surrogate takes as a parameter (P3O's ESS of r = π_θ/π_old).

A surrogate declares them when it registers,

    @register_surrogate("p3o", step_statistics={"ess": "ratio_ess"}, aggregations=("token_mean",))

and before each optimizer step the trainer, for every declared (parameter, statistic): runs a
no-grad pass of the current weights over the mini-batch, adds up `sums(logprobs, old, mask)` over
its micro-batches, all-reduces them over the data-parallel x context-parallel ranks (metrics
convention: keys end in /sum), and passes `value(reduced)` as the parameter. θ is fixed during
that computation, so every micro-batch of the step sees the same value. Adding a surrogate with
a new per-step statistic is one `register_step_statistic` here and one registration line.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor

from megatron_rl.losses.surrogates import ess_from_stats, p3o_ess_stats
from megatron_rl.registry import Registry


@dataclass(frozen=True)
class StepStatistic:
    """sums: (logprobs [N, L] of the current weights, old_logprobs [N, L], loss_mask [N, L]) ->
    {key/sum: float64 0-dim}, local to the rank; value: the reduced sums -> the parameter."""

    sums: Callable[[Tensor, Tensor, Tensor], dict[str, Tensor]]
    value: Callable[[Mapping[str, Tensor]], Tensor | float]


STEP_STATISTICS = Registry("step statistic", StepStatistic)


def register_step_statistic(name: str, stat: StepStatistic) -> StepStatistic:
    return STEP_STATISTICS.add(name, stat)


register_step_statistic("ratio_ess", StepStatistic(
    sums=lambda lp, old, m: dict(zip(("r/sum", "n/sum", "r2/sum"), p3o_ess_stats(lp, old, m), strict=True)),
    value=lambda s: ess_from_stats(s["r/sum"], s["n/sum"], s["r2/sum"])))
