"""A token-local loss of log-probs and entropy, with its gradients, in one pass: three GEMMs, not four.

    loss, out = fused_token_loss(hidden, weight, labels, token_loss, grad_scale=scale)
    loss.backward(scale)            # megatron: grad_scale_func(1), its loss scale (trainer/passes.py)

`fused.token_logprobs_and_entropy` returns log-probs and lets any loss use them; its backward has
to recompute the logits (it cannot keep `[N, V/TP]` of them), so a forward and backward costs four
`[n, H] × [H, V_r]` GEMMs: forward, recompute, `∂L/∂h`, `∂L/∂W`. When the loss is token-local,

    L = Σ_t ℓ_t(logprob_t, H_t, kept_t)       (each term a function of its own token's outputs;
                                              advantages, masks and normalisers are constants)

the upstream gradients `g_t = ∂L/∂logprob_t` (and those of `H_t`, `kept_t`) are known as soon as
the token's statistics are: inside the forward's chunk loop, while the chunk's fp32 logits are
still in the buffer. Per chunk:

    GEMM 1   z = h Wᵀ / τ                       (fp32, `chunk_math.project`)
             statistics (the TP all-reduces), ℓ and g by autograd on the chunk's `[n]` outputs,
             G = ∂L/∂z  (the formula of `chunk_math.chunk_logit_grad`)
    GEMM 2   ∂L/∂h = G W / τ                    (kept until the backward)
    GEMM 3   ∂L/∂W += Gᵀ h / τ                  (into megatron's `main_grad` when the weight has one)

and the backward only scales `∂L/∂h` by the incoming gradient. This is the design of Liger's fused
linear cross entropy, generalised to any token-local function of log-prob, entropy and kept-set
log-prob. A loss that couples tokens (a sequence-level ratio, GSPO's mean log-ratio) is not
token-local: it must use `token_logprobs_and_entropy`. Nothing here can check that; the loss
registry says which losses qualify (losses/token_local.py).

The weight gradient is added in the forward, so it must be scaled by the gradient the loss will
get in its backward before that is known: `grad_scale` (megatron's schedule multiplies the loss
by its loss scale, and with `calculate_per_token_loss`, as the trainer runs it, divides by nothing
else: `trainer/passes.megatron_loss_scale`). Every gradient is formed with that
scale in it from G on, as the recompute backward's are (fp16 needs the scale before rounding). The
backward checks that the loss got that gradient (to a relative 1e-6) and raises otherwise. A weight
without `main_grad` gets an fp32 `[V/TP, H]` accumulator instead, rescaled in the backward to
whatever gradient arrives. Nothing is added under `torch.no_grad()`; otherwise call this only where
the loss will be backpropagated, once (a training pass): `main_grad` holds the gradient from the
forward on, and a second backward raises.

Memory beyond the inputs: one chunk's fp32 logits and G (`auto_loss_chunk_size`; a kept-set
gradient's scatter needs an fp32 G on the compiled path), `∂L/∂h [N, H]` (the returned gradient,
held from the forward on instead of the `hidden` the recompute design saves), and without
`main_grad` the accumulator. Tensor and context parallelism as in `fused`: `∂L/∂h` is this
shard's partial sum, reduced by megatron's TP mapping on `hidden`'s way in (or
`reduce_grad_input=True`, here in the forward).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_rl.logprobs.chunk_math import (
    all_reduce,
    finish_statistics,
    global_maxima,
    local_index,
    logit_grad_in_place,
    logit_statistics,
    mixed_addmm,
    project,
)
from megatron_rl.logprobs.compiled_math import CompiledChunkMath
from megatron_rl.logprobs.fused import (
    accumulates_into_main_grad,
    add_weight_grad,
    auto_chunk_size,
    flat_inputs,
    put_hidden_grad,
    tp_rank,
)
from megatron_rl.logprobs.types import LogprobOutput

TokenLoss = Callable[[slice, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
LOSS_CHUNK_BYTES = 768 * 2**20


def auto_loss_chunk_size(vocab_local: int, g_bytes: int, buffer_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk where the chunk math is compiled: the largest multiple of 64 (at least 64)
    whose fp32 logits and `g_bytes`-wide G fit in `buffer_bytes` together (832 tokens for
    V/TP = 151,936 and a bf16 G). The chunk is also the inner dimension of the weight-gradient
    GEMM, which needs several hundred tokens to be compute-bound on a GPU (`fused.auto_grad_tile`)."""
    return max(64, buffer_bytes // ((4 + g_bytes) * max(1, vocab_local)) // 64 * 64)


class FusedTokenLoss(torch.autograd.Function):
    """autograd Function behind `fused_token_loss` (flattened `[N, H]` inputs). Outputs: the loss
    (differentiable) and the detached log-probs, entropy and kept-set log-probs."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, kept_ids, token_loss, tp_group, chunk_size, compute_entropy,
                temperature, reduce_grad_input, grad_scale, kernels, grad_enabled):
        n_tok, vocab_local = hidden.shape[0], weight.shape[0]
        # needs_input_grad ignores grad mode: under no_grad no backward follows, so nothing may
        # be added to main_grad (`grad_enabled` is the caller's mode; the forward runs without grad)
        need_h, need_w = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        vocab_start = tp_rank(tp_group) * vocab_local
        inv_temp = 1.0 / temperature
        acc = torch.promote_types(weight.dtype, torch.float32)
        like = {"dtype": acc, "device": hidden.device}
        chunk = max(1, min(chunk_size, n_tok))
        zbuf = torch.empty(chunk, vocab_local, **like)
        ebuf = torch.empty_like(zbuf) if kernels is None else None
        logprob = torch.zeros(n_tok, **like)
        entropy = torch.zeros(n_tok if compute_entropy else 0, **like)
        kept = torch.zeros(n_tok if kept_ids is not None else 0, **like)
        total = torch.zeros((), **like)
        # G in bf16 where the device adds a bf16 product into fp32 (as in `fused`'s backward)
        low_g = (kernels is not None and weight.dtype == hidden.dtype == torch.bfloat16
                 and mixed_addmm(weight.device.type, weight.dtype, acc))
        d_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        into_main = need_w and accumulates_into_main_grad(weight, acc)
        d_weight = None
        if need_w:
            d_weight = weight.main_grad if into_main else torch.zeros(weight.shape, **like)
        for s in range(0, n_tok, chunk):
            sl = slice(s, min(s + chunk, n_tok))
            y, k = labels[sl], None if kept_ids is None else kept_ids[sl]
            z = project(hidden[sl], weight, inv_temp, out=zbuf[:sl.stop - s])                  # GEMM 1
            if kernels is None:
                out, m = _eager_statistics(z, ebuf[:sl.stop - s], y, k, vocab_start, compute_entropy, tp_group)
            else:
                out = logit_statistics(z, y, k, vocab_start=vocab_start, compute_entropy=compute_entropy,
                                       tp_group=tp_group, ebuf=None, kernels=kernels)
            logprob[sl] = out["logprob"]
            if compute_entropy:
                entropy[sl] = out["entropy"]
            if k is not None:
                kept[sl] = out["kept_logprob"]
            value, grads = _loss_and_output_grads(token_loss, sl, out, y, k)
            total += value
            if all(g is None for g in grads) or not (need_h or need_w):
                continue
            # G carries the loss scale from the start, as the recompute backward's does: fp16's
            # small entries would underflow if G, G W and the hidden gradient were formed unscaled
            grads = [None if g is None else g * grad_scale for g in grads]
            # (logZ, H, logZ_K) as the recompute backward saves them; an absent one is never read
            stats = torch.stack([out["logZ"], out.get("entropy", out["logZ"]), out.get("logZ_K", out["logZ"])], 1)
            yidx, y_here = local_index(y, vocab_start, vocab_local)
            kidx, k_here = (None, None) if k is None else local_index(k, vocab_start, vocab_local)
            if kernels is None:   # z holds z − M: log p = (z − M) − (logZ − M)
                z.sub_((out["logZ"] - m)[:, None])
                g = logit_grad_in_place(z, torch.exp(z, out=ebuf[:sl.stop - s]), stats, *grads, yidx, y_here,
                                        kidx, k_here)
            else:
                g = kernels.logit_grad(z, stats, *grads, yidx, y_here, kidx, k_here, weight.dtype if low_g else acc)
            if need_h:
                put_hidden_grad(d_hidden[sl], g, weight, alpha=inv_temp)                        # GEMM 2
            if need_w:
                add_weight_grad(d_weight, g, hidden[sl], fresh=False, alpha=inv_temp, mixed=low_g)  # GEMM 3
            del g   # the compiled path's G is a new tensor: never two alive at once
        if need_h and reduce_grad_input:
            all_reduce(d_hidden, dist.ReduceOp.SUM, tp_group)
        ctx.mark_non_differentiable(logprob, entropy, kept)
        ctx.grads = (d_hidden, None if into_main else d_weight)
        ctx.into_main, ctx.grad_scale, ctx.weight_dtype = into_main, grad_scale, weight.dtype
        return total, logprob, entropy, kept

    @staticmethod
    @once_differentiable
    def backward(ctx, g_loss, *_):
        """The gradients formed in the forward (already times grad_scale), times
        g_loss / grad_scale: 1 under megatron, where it is checked (main_grad already holds them)."""
        if ctx.grads is None:
            raise RuntimeError("backward through fused_token_loss a second time: its gradients were formed once, in "
                               "the forward, and have been handed out")
        d_hidden, d_weight = ctx.grads
        ctx.grads = None
        if g_loss is None:
            return (None,) * 13
        factor = float(g_loss) / ctx.grad_scale   # a Python float: multiplied in fp32 even into bf16
        if ctx.into_main and not math.isclose(factor, 1.0, rel_tol=1e-6):
            raise RuntimeError(f"fused_token_loss added the weight gradient into main_grad in the forward, scaled by "
                               f"grad_scale={ctx.grad_scale:g}, but the loss got {float(g_loss):g} in the backward; "
                               f"pass the gradient the loss will receive as grad_scale")
        if factor != 1.0 and not ctx.into_main:
            d_hidden = None if d_hidden is None else d_hidden.mul_(factor)
            d_weight = None if d_weight is None else d_weight.mul_(factor)
        if d_weight is not None:
            d_weight = d_weight.to(ctx.weight_dtype)
        return d_hidden, d_weight, *(None,) * 11


def _eager_statistics(z, e, labels, kept_ids, vocab_start, compute_entropy, tp_group):
    """`chunk_math.logit_statistics` in place, leaving `z − M` in `z` for the gradient (the
    recompute path's in-place forward spends `z` on T): `e` (scratch) gets `e^{z − M}`, and
    `T = Σ_v (z − M) e^{z − M}` is summed a few rows at a time (`_row_dot`). Returns
    (statistics, M)."""
    m, m_k, z_y, z_k = global_maxima(z, labels, kept_ids, vocab_start, tp_group)
    z.sub_(m[:, None])
    torch.exp(z, out=e)
    sums = [e.sum(dim=1), z_y]
    if compute_entropy:
        sums.append(_row_dot(z, e))
    if kept_ids is not None:
        sums.append(torch.exp(z_k - m_k[:, None]).sum(dim=1))
    sums = all_reduce(torch.stack(sums, dim=1), dist.ReduceOp.SUM, tp_group)
    return finish_statistics(sums, m, m_k, labels, kept_ids, compute_entropy), m


def _row_dot(a: torch.Tensor, b: torch.Tensor, rows: int = 32) -> torch.Tensor:
    """`Σ_v a ⊙ b` per row of `[n, V]` tensors, `rows` rows at a time in one small reused buffer:
    no third `[n, V]` buffer, and the sum is torch's reduction (a GEMM-based dot product, as einsum
    makes it, was 30x less accurate on the CPU: 1.5e-4 in entropy at V = 32,000)."""
    out = a.new_empty(a.shape[0])
    tmp = a.new_empty(min(rows, a.shape[0]), a.shape[1])
    for i in range(0, a.shape[0], rows):
        n = min(rows, a.shape[0] - i)
        torch.sum(torch.mul(a[i:i + n], b[i:i + n], out=tmp[:n]), dim=1, out=out[i:i + n])
    return out


def _loss_and_output_grads(token_loss: TokenLoss, rows: slice, out: dict, labels, kept_ids):
    """The chunk's loss value and its gradients w.r.t. its log-probs, entropy and kept-set
    log-probs (None where the loss does not use one), zero where that output is defined as 0
    (an ignored label, an empty kept set), as the recompute design's backward has them."""
    names = ("logprob", "entropy", "kept_logprob")
    leaves = [out[n].detach().requires_grad_() if n in out else None for n in names]
    with torch.enable_grad():
        value = token_loss(rows, *leaves)
        value = value.sum() if value.dim() else value
        inputs = [t for t in leaves if t is not None]
        found = iter(torch.autograd.grad(value, inputs, allow_unused=True) if value.requires_grad
                     else [None] * len(inputs))
    grads = [next(found) if t is not None else None for t in leaves]
    valid = labels >= 0
    if grads[0] is not None:
        grads[0] = torch.where(valid, grads[0], torch.zeros_like(grads[0]))
    if grads[2] is not None:
        grads[2] = torch.where(valid & (kept_ids >= 0).any(dim=1), grads[2], torch.zeros_like(grads[2]))
    return value.detach(), grads


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss: TokenLoss,
    *,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    kept_ids: torch.Tensor | None = None,
    compute_entropy: bool = True,
    temperature: float = 1.0,
    reduce_grad_input: bool = False,
    grad_scale: float = 1.0,
    kernels: CompiledChunkMath | None | str = "auto",
) -> tuple[torch.Tensor, LogprobOutput]:
    """A token-local loss of the per-token log-probs, entropy and kept-set log-probs, with its
    gradients computed in the same pass (see the module docstring for when that is allowed).

    Args:
        hidden, weight, labels, tp_group, kept_ids, compute_entropy, temperature,
            reduce_grad_input: as for `fused.token_logprobs_and_entropy`.
        token_loss: `(rows, logprob [n], entropy [n] | None, kept [n] | None) -> loss` of the `n`
            tokens `rows` of the flattened `labels` (a slice; a tensor of any shape, summed).
            It must depend on those tokens' outputs only; it is called once per chunk.
        chunk_size: tokens per chunk (None: `auto_loss_chunk_size` with compiled chunk math,
            `fused.auto_chunk_size` without).
        grad_scale: the gradient the returned loss will receive in its backward (see the module
            docstring); only checked, and only needed, when the weight has a `main_grad`.
        kernels: as for `token_logprobs_and_entropy` (None: eager, in place in two `[chunk, V/TP]`
            fp32 buffers).

    Returns:
        `(loss, LogprobOutput)`: the fp32 scalar `Σ_chunks token_loss(...)`, differentiable w.r.t.
        `hidden` and `weight`, and the outputs (detached, shaped like `labels`) for metrics.
    """
    if not grad_scale > 0:
        raise ValueError(f"grad_scale must be > 0, got {grad_scale!r}")
    h, y, k, kernels = flat_inputs(hidden, weight, labels, kept_ids, kernels)
    lead = labels.shape
    if chunk_size is None and kernels is None:
        chunk_size = auto_chunk_size(weight.shape[0])
    elif chunk_size is None:   # G's bytes: bf16 as in the forward's `low_g`; a kept-set gradient's scatter adds fp32
        g_bytes = 2 if weight.dtype == hidden.dtype == torch.bfloat16 else 4
        chunk_size = auto_loss_chunk_size(weight.shape[0], g_bytes + (4 if kept_ids is not None else 0))
    loss, logprob, entropy, kept = FusedTokenLoss.apply(
        h, weight, y, k, token_loss, tp_group, int(chunk_size), bool(compute_entropy), float(temperature),
        bool(reduce_grad_input), float(grad_scale), kernels, torch.is_grad_enabled())
    return loss, LogprobOutput(logprob.reshape(lead), entropy.reshape(lead) if compute_entropy else None,
                               kept.reshape(lead) if kept_ids is not None else None)
