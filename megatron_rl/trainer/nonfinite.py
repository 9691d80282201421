"""Non-finite numbers never reach the weights or a checkpoint.

    ok = agreed_finite(losses)                        # this update's loss on every rank: one all-reduce
    outcome = guarded_step(optimizer, loss_finite=ok) # skipped when the loss or the gradient norm is inf/nan
    in_a_row = count_in_a_row(in_a_row, outcome, limit, where)   # raises NonFiniteUpdates at the limit
    check_parameters(model, what)                     # after an applied update, before a save: one norm each

An update whose loss or global gradient norm is not finite is skipped: the weights and the
optimizer state stay as they were (megatron's fp16 loss scaler does the same on an overflow; this
covers fp32 and bf16, and a non-finite loss under fp16). After `train.max_nonfinite_updates` such
updates in a row the run stops. An update that writes inf/NaN from a finite loss and gradient is
the optimizer's own doing (e.g. a huge learning rate): the parameter check names it and stops the
run before the engine or a checkpoint sees the weights.

Every decision here is the same on every rank: the gradient norm is megatron's global one, and
the loss and parameter checks end in an all-reduce over the world.
Cost per optimizer update: one pass over the parameters (an inf-norm each, no temporaries of
their size) and two scalar all-reduces.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.metrics.reduce import group_device


class NonFiniteUpdates(FloatingPointError):
    """Too many updates in a row were skipped for a non-finite loss or gradient norm."""


class NonFiniteWeights(FloatingPointError):
    """Parameters hold inf or NaN: nothing may save or serve them."""


@dataclass(frozen=True)
class StepOutcome:
    """applied: the update was written into the weights. grad_norm: megatron's global norm (nan
    when the fp16 loss scaler skipped before computing it). overflow: megatron's fp16 loss scaler
    found inf/NaN gradients (it lowered the scale). nonfinite: skipped for a non-finite loss or
    gradient norm ("loss", "gradient norm", or None)."""

    applied: bool
    grad_norm: float
    overflow: bool = False
    nonfinite: str | None = None


@torch.no_grad()
def guarded_step(optimizer, loss_finite: bool = True) -> StepOutcome:
    """megatron's `optimizer.step()` (ChainedOptimizer.step: prepare the gradients, their global
    norm, clip by it, update), with the update skipped when `loss_finite` is False or the norm is
    not finite. The same calls in the same order as megatron's step, so an applied update is
    bitwise megatron's; a skipped one never runs the inner optimizer (no Adam moment or step count
    moves) and never copies main params to the model. `loss_finite` must be the same on every rank
    (`agreed_finite`); the norm is (megatron reduces it over the model- and, where gradients are
    sharded, data-parallel ranks)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # fp16: the loss scaler found inf/nan and lowered the scale
        return StepOutcome(False, math.nan, overflow=True, nonfinite=None if loss_finite else "loss")
    grad_norm = float(optimizer.get_grad_norm())
    if not loss_finite or not math.isfinite(grad_norm):
        return StepOutcome(False, grad_norm, nonfinite="loss" if not loss_finite else "gradient norm")
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return StepOutcome(bool(optimizer.step_with_ready_grads()), grad_norm)


def agreed_finite(values: Iterable[Tensor], group=None) -> bool:
    """True when every value on every rank of `group` (default: the world) is finite.

    The losses live on the last pipeline stage and differ between data-parallel ranks, so each
    rank's verdict goes into one all-reduce (MAX of a 0/1 flag): every rank then skips, or none
    does. A rank without values (an earlier pipeline stage) adds 0."""
    values = [v.detach().reshape(()) for v in values]
    bad = torch.zeros((), device=_device(group))
    if values:
        bad = (~torch.isfinite(torch.stack(values).float())).any().float().to(bad.device)
    _all_reduce(bad, dist.ReduceOp.MAX, group)
    return not bool(bad)


def count_in_a_row(in_a_row: int, outcome: StepOutcome, limit: int, where: str) -> int:
    """Non-finite updates in a row after `outcome` (an applied update resets it, an fp16 overflow
    leaves it); raises NonFiniteUpdates naming `where` (the step and update) when it reaches `limit`."""
    if outcome.applied:
        return 0
    if outcome.nonfinite is None:
        return in_a_row
    in_a_row += 1
    if in_a_row >= limit:
        raise NonFiniteUpdates(
            f"{where}: the {outcome.nonfinite} is not finite (gradient norm {outcome.grad_norm:g}); {in_a_row} "
            f"update(s) in a row skipped for that (train.max_nonfinite_updates={limit}), so the run stops here; the "
            f"weights hold the last finite update and nothing was saved from this step. Look at the rollouts "
            f"(a log μ of -inf, an advantage or reward that is not finite) or lower optim.lr, then resume from the "
            f"last checkpoint (train.resume=true)")
    return in_a_row


def nonfinite_parameters(named_parameters: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the parameters holding inf or NaN, from one inf-norm (max |x|) each: no overflow of
    a large finite weight, no temporary of the parameter's size; one host sync for all. Parameters
    on the meta device (a lazy converter model) are not read."""
    named = [(n, p) for n, p in named_parameters if p.device.type != "meta"]
    if not named:
        return []
    norms = torch.stack([torch.linalg.vector_norm(p.detach(), ord=math.inf).float() for _, p in named])
    return [named[i][0] for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist()]


def check_parameters(model, what: str, cause: str = "") -> None:
    """Raise NonFiniteWeights on every rank when a parameter of `model` holds inf or NaN on any
    rank (collective over the world). `what`: where the weights come from ("the update of step 3"),
    `cause`: what to do about it."""
    local = nonfinite_parameters(model.named_parameters())
    count = torch.tensor(float(len(local)), device=_device())
    _all_reduce(count, dist.ReduceOp.SUM)
    if count:
        shown = ", ".join(local[:3]) + (", ..." if len(local) > 3 else "") if local else "on other ranks"
        raise NonFiniteWeights(f"{what} left inf or NaN in {int(count)} parameter tensor(s) ({shown}); "
                               f"nothing was saved or sent to the rollout engine from them{'. ' + cause if cause else ''}")


def _device(group=None) -> torch.device:
    return group_device(group) if dist.is_initialized() else torch.device("cpu")


def _all_reduce(x: Tensor, op, group=None) -> None:
    """In place over `group`; nothing to reduce in a process without torch.distributed (a tool)."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op, group=group)
