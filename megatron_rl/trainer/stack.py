"""megatron-core's own training stack, assembled the way Megatron-LM does it.

    settings = OptimSettings(cfg.optim, dtype=cfg.model.dtype)
    model = wrap_model(gpt_model, settings)                  # Float16Module (bf16/fp16) -> DDP
    optimizer = build_optimizer(model, settings)             # get_megatron_optimizer
    forward_backward(model, optimizer, forward_step, num_microbatches, ...)  # schedules + finalize
    outcome = guarded_step(optimizer, loss_finite)           # optimizer.step(), skipped on inf/NaN (trainer/nonfinite.py)

Losses passed through `forward_step` arrive divided by their global normaliser (see
model.builder: calculate_per_token_loss), so DDP sums gradients over data-parallel ranks and
we call `finalize_model_grads` ourselves without a token count.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_rl.config.schema import OptimSection


@dataclass(frozen=True)
class OptimSettings:
    """What the stack needs: the optimizer section of the config and the training precision
    (model.dtype: "fp32" | "bf16" | "fp16"; bf16/fp16 keep fp32 master weights)."""

    optim: OptimSection = field(default_factory=OptimSection)
    dtype: str = "fp32"


def wrap_model(model, settings: OptimSettings):
    """Float16Module for bf16/fp16 (as Megatron-LM's get_model), then megatron DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if settings.dtype in ("bf16", "fp16"):
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # Megatron-LM --accumulate-allreduce-grads-in-fp32
        overlap_grad_reduce=False,
        use_distributed_optimizer=settings.optim.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(model, settings: OptimSettings):
    """megatron's optimizer (torch AdamW fallback on CPU), hooked into the model config."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[settings.dtype]
    o = settings.optim
    config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=settings.dtype == "bf16", fp16=settings.dtype == "fp16",
        params_dtype=dtype, loss_scale=o.loss_scale, initial_loss_scale=o.initial_loss_scale,
        min_loss_scale=o.min_loss_scale, loss_scale_window=o.loss_scale_window,
        hysteresis=o.hysteresis, use_distributed_optimizer=o.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, [model])
    mcfg = model.config
    mcfg.grad_scale_func = optimizer.scale_loss
    mcfg.no_sync_func = model.no_sync
    mcfg.finalize_model_grads_func = None  # called explicitly in forward_backward (no token count)
    _ = finalize_model_grads  # imported to fail early if the API moved
    return optimizer


def forward_backward(model, forward_step: Callable, data_iterator, num_microbatches: int, seq_length: int,
                     micro_batch_size: int, forward_only: bool = False, optimizer=None) -> list[dict]:
    """One pass of megatron's schedule (PP-aware) over `num_microbatches`; grads finalised.

    optimizer: the optimizer that will step on these gradients (its grads are reset first).
    forward_step(data_iterator, model) -> (output, loss_func) as in Megatron-LM; loss_func must
    return (loss, num_tokens, metrics) with `loss` already globally normalised.
    Returns the per-micro-batch metrics dicts (last pipeline stage only; [] elsewhere).
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        model.zero_grad_buffer()
        if optimizer is not None:
            # after a step, param.grad aliases the grad buffer: without this, autograd would
            # accumulate into it in place and megatron's hook would then add it a second time
            optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=[model],
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only)
    if not forward_only:
        finalize_model_grads([model], num_tokens=None)
    return out


def release_model(model) -> None:
    """Let a megatron DDP model (and the process groups, buffers and threads it holds) be freed.

    megatron's DDP registers a closure on every parameter's gradient-accumulator node that refers
    back to the DDP. Those nodes live in autograd's C++ graph, which Python's garbage collector
    cannot traverse, so the cycle node -> hook -> DDP -> parameters is never collected: every
    model a process builds and drops would keep its gloo groups (two threads and a socket pair
    per peer each) for the life of the process. This empties the closures' references to the
    DDP and its list of nodes; the hooks are dead afterwards, so call it only when the model is
    done with. A model that is not a megatron DDP is left alone.

    Cost: one pass over the DDP's referrers (`gc.get_referrers`, linear in the number of live
    Python objects), once per model at the end of its life.
    """
    import gc
    import types

    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    for ref in gc.get_referrers(model):
        if isinstance(ref, types.CellType):
            ref.cell_contents = None
    model.grad_accs.clear()
