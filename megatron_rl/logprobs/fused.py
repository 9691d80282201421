"""Fused, chunked, vocab-parallel log-probs and entropy from hidden states (never `[N, V]` logits).

`token_logprobs_and_entropy(hidden, weight, labels)` computes, per token t,

    z_t = h_t Wᵀ / temperature                         (this rank's `[V/TP]` slice only)
    logprob_t = z_{t,y_t} − logZ_t,    logZ_t = logsumexp_v z_{t,v}          (full vocabulary)
    entropy_t = logZ_t − Σ_v p_{t,v} z_{t,v}
    kept_t    = z_{t,y_t} − logsumexp_{v ∈ K_t} z_{t,v}                       (optional)

chunk by chunk (`chunk_size` tokens at a time). The backward recomputes each chunk's logits from
the saved `hidden`, `weight`, `labels` (and `kept_ids`) plus three fp32 numbers per token
(logZ, H, logZ_K), so peak memory is two fp32 `[chunk_size, V/TP]` buffers plus the gradients of
`hidden` and `weight`, whatever N is; under megatron DDP the weight gradient is accumulated
straight into the parameter's fp32 `main_grad` (`_accumulates_into_main_grad`), with no buffer.
The price is one extra output-projection GEMM (4 instead of 3). See `chunk_math` for the formulas
and the TP all-reduces, `compiled_math` for the compiled chunk math a GPU runs.

Tensor parallelism (megatron `ColumnParallelLinear` layout: TP rank r holds vocabulary rows
`[r·V/TP, (r+1)·V/TP)` of the output weight; `hidden` is the full sequence, replicated on the TP
ranks). The gradient of `hidden` computed on one rank is a partial sum over its vocab shard and
has to be all-reduced over TP. Megatron-core 0.16.1's `ColumnParallelLinear` does this in its own
backward: without sequence parallelism it sets `allreduce_dgrad` and
`LinearWithGradAccumulationAndAsyncCommunication.backward` all-reduces `grad_input`; with
sequence parallelism the input is all-gathered along the sequence in the forward and the input
gradient reduce-scattered in the backward. (Older megatron wrapped the input in
`copy_to_tensor_model_parallel_region`, identity forward / all-reduce backward; 0.16.1 reaches
that branch only at TP=1, where it is a no-op.) Replacing the output layer by this function
skips that layer, so the caller must supply the reduction:

- route `hidden` through `copy_to_tensor_model_parallel_region(h, group=tp_group)` (or, with
  sequence parallelism, `gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
  group=tp_group)`) and keep `reduce_grad_input=False` — `megatron_hidden.gpt_hidden_states` does
  exactly this; or
- pass `reduce_grad_input=True` to all-reduce the gradient of `hidden` over `tp_group` here.

Context parallelism needs nothing here: each CP rank passes its local (zig-zag) tokens with labels
shifted before the split (`context_parallel`); the weight gradient is a partial sum over CP
ranks, all-reduced with the data-parallel gradients by megatron's DDP (group DP×CP).

Tied embeddings: pass the embedding weight (`model.shared_embedding_or_output_weight()`) as
`weight`; its gradient accumulates into the same parameter as the embedding's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_rl.logprobs.chunk_math import all_reduce, chunk_forward, chunk_logit_grad, mixed_addmm
from megatron_rl.logprobs.compiled_math import CompiledChunkMath, kernels_for
from megatron_rl.logprobs.types import LogprobOutput

CHUNK_BUFFER_BYTES = 256 * 2**20


def auto_chunk_size(vocab_local: int, buffer_bytes: int = CHUNK_BUFFER_BYTES) -> int:
    """Default tokens per chunk: the largest multiple of 64 (at least 64) whose fp32
    `[chunk, V/TP]` buffer fits in `buffer_bytes` (384 tokens for V/TP = 151,936). Two such
    buffers are live at a time."""
    return max(64, buffer_bytes // (4 * max(1, vocab_local)) // 64 * 64)


def _tp_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class FusedVocabParallelLogprobs(torch.autograd.Function):
    """autograd Function behind `token_logprobs_and_entropy` (flattened `[N, H]` inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, kept_ids, tp_group, chunk_size, compute_entropy,
                temperature, reduce_grad_input, kernels):
        ctx.set_materialize_grads(False)
        n_tok, vocab_local = hidden.shape[0], weight.shape[0]
        vocab_start = _tp_rank(tp_group) * vocab_local
        inv_temp = 1.0 / temperature
        chunk = max(1, min(chunk_size, n_tok))
        acc = torch.promote_types(weight.dtype, torch.float32)   # logits/stats: fp32 (fp64 if given)
        zbuf = torch.empty(chunk, vocab_local, dtype=acc, device=hidden.device)
        ebuf = torch.empty_like(zbuf) if kernels is None else zbuf[:0]
        like = {"dtype": acc, "device": hidden.device}
        logprob = torch.empty(n_tok, **like)
        entropy = torch.empty(n_tok if compute_entropy else 0, **like)
        kept = torch.empty(n_tok if kept_ids is not None else 0, **like)
        stats = torch.zeros(n_tok, 3, **like)    # logZ, H, logZ_K: all the backward needs
        for s in range(0, n_tok, chunk):
            sl = slice(s, min(s + chunk, n_tok))
            out = chunk_forward(
                hidden[sl], weight, labels[sl], None if kept_ids is None else kept_ids[sl],
                vocab_start=vocab_start, inv_temp=inv_temp, compute_entropy=compute_entropy,
                tp_group=tp_group, zbuf=zbuf, ebuf=ebuf, kernels=kernels)
            logprob[sl] = out["logprob"]
            stats[sl, 0] = out["logZ"]
            if compute_entropy:
                entropy[sl] = out["entropy"]
                stats[sl, 1] = out["entropy"]
            if kept_ids is not None:
                kept[sl] = out["kept_logprob"]
                stats[sl, 2] = out["logZ_K"]
        ctx.save_for_backward(hidden, weight, labels, kept_ids, stats)
        ctx.cfg = (tp_group, chunk, vocab_start, inv_temp, reduce_grad_input, kernels)
        return logprob, entropy, kept

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logprob, g_entropy, g_kept):
        hidden, weight, labels, kept_ids, stats = ctx.saved_tensors
        tp_group, chunk, vocab_start, inv_temp, reduce_grad_input, kernels = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logprob is None and g_entropy is None and g_kept is None) or not (need_h or need_w):
            return (None,) * 10
        # Outputs defined as 0 (ignored label, empty kept set) carry no gradient.
        valid = labels >= 0
        acc = stats.dtype
        zero = torch.zeros((), dtype=acc, device=valid.device)
        if g_logprob is not None:
            g_logprob = torch.where(valid, g_logprob.to(acc), zero)
        if g_kept is not None:
            g_kept = torch.where(valid & (kept_ids >= 0).any(dim=1), g_kept.to(acc), zero)
        if g_entropy is not None:
            g_entropy = g_entropy.to(acc)

        n_tok, vocab_local = hidden.shape[0], weight.shape[0]
        zbuf = torch.empty(chunk, vocab_local, dtype=acc, device=hidden.device)
        ebuf = torch.empty_like(zbuf) if kernels is None else zbuf[:0]
        # G straight in bf16 (the GEMMs' input) where the device adds a bf16 product into fp32
        # (`mixed_addmm`); else fp32, with the inputs upcast for d_weight. Not for fp16: its range
        # flushes small probabilities and overflows under loss scaling.
        low_g = (kernels is not None and weight.dtype == hidden.dtype == torch.bfloat16
                 and mixed_addmm(weight.device.type, weight.dtype, acc))
        d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        into_main = need_w and _accumulates_into_main_grad(weight, acc)
        if into_main:
            d_weight = weight.main_grad
        else:
            d_weight = torch.empty(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s in range(0, n_tok, chunk):
            sl = slice(s, min(s + chunk, n_tok))
            g = chunk_logit_grad(
                hidden[sl], weight, labels[sl], None if kept_ids is None else kept_ids[sl], stats[sl],
                None if g_logprob is None else g_logprob[sl],
                None if g_entropy is None else g_entropy[sl],
                None if g_kept is None else g_kept[sl],
                vocab_start=vocab_start, inv_temp=inv_temp, zbuf=zbuf, ebuf=ebuf, kernels=kernels,
                out_dtype=weight.dtype if low_g else acc)
            if need_h:   # ∂L/∂h = G W / temperature  (partial sum over this vocab shard)
                if g.dtype == weight.dtype == hidden.dtype:   # fp32, or bf16 G on the compiled path
                    torch.mm(g, weight, out=d_hidden[sl])
                else:
                    d_hidden[sl] = torch.mm(g.to(weight.dtype), weight)
                if inv_temp != 1.0:
                    d_hidden[sl].mul_(inv_temp)
            fresh = s == 0 and not into_main
            if need_w and low_g:   # fp32 accumulation of the bf16 product, scaled by alpha
                torch.addmm(d_weight, g.t(), hidden[sl], out_dtype=acc,
                            beta=0.0 if fresh else 1.0, alpha=inv_temp, out=d_weight)
            elif need_w:   # ∂L/∂W += Gᵀ h / temperature  (the first chunk initialises a fresh buffer)
                h = hidden[sl].to(acc)
                h = h if inv_temp == 1.0 else h * inv_temp
                if fresh:
                    torch.mm(g.t(), h, out=d_weight)
                else:
                    d_weight.addmm_(g.t(), h)
        if need_w and n_tok == 0 and not into_main:
            d_weight.zero_()
        if need_h and reduce_grad_input:
            all_reduce(d_hidden, dist.ReduceOp.SUM, tp_group)
        if into_main:
            d_weight = None  # already in main_grad; other uses of a tied weight still reach .grad
        elif need_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None, None, None


def _accumulates_into_main_grad(weight: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether the weight gradient goes straight into megatron DDP's `main_grad` buffer.

    megatron-core's DistributedDataParallel gives every parameter a `main_grad` (fp32 with
    grad_reduce_in_fp32) and, in a hook after autograd accumulates `.grad`, adds `.grad` to it.
    Accumulating `Gᵀh` into `main_grad` here, chunk by chunk, skips the separate fp32 `[V/TP, H]`
    buffer and the `.grad` round trip (as megatron's gradient-accumulation fusion does) and keeps
    the weight gradient in fp32 for bf16 weights. The backward then returns no weight gradient, so
    the hook sees only what other uses of a tied weight (the embedding lookup) put in `.grad`. That
    hook has nothing to wait for only with overlap_grad_reduce=False, which trainer/stack.py sets.
    """
    main_grad = getattr(weight, "main_grad", None)
    return (isinstance(main_grad, torch.Tensor) and main_grad.dtype == acc and main_grad.shape == weight.shape
            and main_grad.device == weight.device)


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    kept_ids: torch.Tensor | None = None,
    compute_entropy: bool = True,
    temperature: float = 1.0,
    reduce_grad_input: bool = False,
    kernels: CompiledChunkMath | None | str = "auto",
) -> LogprobOutput:
    """Per-token log-probs of `labels`, entropy and kept-set log-probs, without full logits.

    Args:
        hidden: `[*, H]` final hidden states (after the final norm), full sequence on every TP rank
            (`[S, B, H]` from megatron works: pass `labels` as `[S, B]`).
        weight: `[V/TP, H]` this TP rank's rows of the output-layer (or tied embedding) weight.
        labels: `[*]` next-token ids in the global vocabulary; negative = ignored (output 0).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        chunk_size: tokens per chunk; peak extra memory ≈ `2 · chunk_size · V/TP · 4` bytes
            (plus the gradients of `hidden` and `weight`). None: `auto_chunk_size(V/TP)`.
        kept_ids: `[*, K]` global ids of the kept top-p/top-k set per position, padded with -1,
            unique per position; the label is expected to be in its set.
        compute_entropy: also return the full-vocabulary entropy.
        temperature: logits are divided by it (use the rollout's sampling temperature).
        reduce_grad_input: all-reduce the gradient of `hidden` over `tp_group` in the backward
            (only when `hidden` did not go through megatron's TP mapping; see the module doc).
        kernels: "auto" (`compiled_math.kernels_for(hidden.device)`: Inductor-compiled chunk math
            where it emits GPU kernels, else the eager path), None (eager), or a
            `CompiledChunkMath` (tests compile it on the CPU).

    Returns:
        `LogprobOutput(logprobs, entropy, kept_logprobs)`, fp32, each shaped like `labels` (or
        None when not asked). Identical on all TP ranks. Differentiable w.r.t. `hidden` and
        `weight`; any combination of the three outputs may enter the loss.
    """
    lead = labels.shape
    if hidden.shape[:-1] != lead:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(lead)} disagree")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V/TP, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if isinstance(kernels, str) and kernels != "auto":
        raise ValueError(f"kernels must be 'auto', None or a CompiledChunkMath, got {kernels!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).long()
    k = None
    if kept_ids is not None:
        if kept_ids.shape[:-1] != lead:
            raise ValueError(f"kept_ids {tuple(kept_ids.shape)} must be labels' shape + [K]")
        k = kept_ids.reshape(y.shape[0], -1).long()
    logprob, entropy, kept = FusedVocabParallelLogprobs.apply(
        h, weight, y, k, tp_group, int(chunk_size or auto_chunk_size(weight.shape[0])),
        bool(compute_entropy), float(temperature),
        bool(reduce_grad_input), kernels_for(hidden.device) if isinstance(kernels, str) else kernels)
    return LogprobOutput(
        logprob.reshape(lead),
        entropy.reshape(lead) if compute_entropy else None,
        kept.reshape(lead) if kept_ids is not None else None,
    )
