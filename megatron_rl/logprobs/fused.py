"""Fused, chunked, vocab-parallel log-probs and entropy from hidden states (never `[N, V]` logits).

`token_logprobs_and_entropy(hidden, weight, labels)` computes, per token t,

    z_t = h_t Wᵀ / temperature                         (this rank's `[V/TP]` slice only)
    logprob_t = z_{t,y_t} − logZ_t,    logZ_t = logsumexp_v z_{t,v}          (full vocabulary)
    entropy_t = logZ_t − Σ_v p_{t,v} z_{t,v}
    kept_t    = z_{t,y_t} − logsumexp_{v ∈ K_t} z_{t,v}                       (optional)

chunk by chunk (`chunk_size` tokens at a time). The backward recomputes the logits from the saved
`hidden`, `weight`, `labels` (and `kept_ids`) plus three fp32 numbers per token (logZ, H,
logZ_K), in tiles of `grad_tile` = (tokens, vocab rows): those three numbers are all a tile needs
of the rest of the vocabulary. So peak memory is two fp32 buffers of a chunk's or a tile's logits
plus the gradients of `hidden` and `weight`, whatever N is; under megatron DDP the weight gradient
is accumulated straight into the parameter's fp32 `main_grad` (`accumulates_into_main_grad`),
with no buffer. The price is one extra output-projection GEMM (4 instead of 3). Tiles of many
tokens by a block of the vocabulary keep the weight-gradient GEMM compute-bound at that memory
(`auto_grad_tile`). See `chunk_math` for the formulas and the TP all-reduces, `compiled_math` for
the compiled chunk math a GPU runs.

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


GRAD_TILE_TOKENS = 4096


def auto_grad_tile(vocab_local: int, buffer_bytes: int = CHUNK_BUFFER_BYTES,
                   tokens: int = GRAD_TILE_TOKENS) -> tuple[int, int]:
    """Default backward tile of the compiled path: `tokens` tokens by the most vocab rows (a
    multiple of 128, at least 128, at most V/TP) whose fp32 `[tokens, rows]` logits fit in
    `buffer_bytes` ((4096, 16384) for V/TP = 151,936: 256 MiB of logits, 128 MiB of bf16 G).

    Why tiles: the weight-gradient GEMM `G_bᵀ h` has the tile's token count as its inner
    dimension K, and reads and writes the fp32 `[rows, H]` gradient block (8 bytes an element)
    for 2·K flops an element. With a chunk of a few hundred tokens over the whole vocabulary that
    traffic, not the arithmetic, bounds it on a GPU (an H100 does ~700 bf16 TFLOP/s over
    ~3.3 TB/s: K below ~850 is memory-bound). 4096 tokens make it compute-bound; splitting the
    vocabulary into blocks keeps the tile's buffers as small as the forward's chunk."""
    rows = max(128, buffer_bytes // (4 * tokens) // 128 * 128)
    return tokens, min(rows, max(1, vocab_local))


def tp_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in the vocab-parallel group (its shard starts at `tp_rank · V/TP`)."""
    return 0 if group is None else dist.get_rank(group)


class FusedVocabParallelLogprobs(torch.autograd.Function):
    """autograd Function behind `token_logprobs_and_entropy` (flattened `[N, H]` inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, kept_ids, tp_group, chunk_size, grad_tile, compute_entropy,
                temperature, reduce_grad_input, kernels):
        ctx.set_materialize_grads(False)
        n_tok, vocab_local = hidden.shape[0], weight.shape[0]
        vocab_start = tp_rank(tp_group) * vocab_local
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
        ctx.cfg = (tp_group, grad_tile, vocab_start, inv_temp, reduce_grad_input, kernels)
        return logprob, entropy, kept

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logprob, g_entropy, g_kept):
        hidden, weight, labels, kept_ids, stats = ctx.saved_tensors
        tp_group, tile, vocab_start, inv_temp, reduce_grad_input, kernels = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logprob is None and g_entropy is None and g_kept is None) or not (need_h or need_w):
            return (None,) * 11
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
        rows = min(tile[0], max(n_tok, 1))
        blocks = [(v, min(v + tile[1], vocab_local)) for v in range(0, vocab_local, tile[1])] or [(0, 0)]
        zbuf = torch.empty(rows, blocks[0][1], dtype=acc, device=hidden.device)
        ebuf = torch.empty_like(zbuf) if kernels is None else zbuf[:0]
        # G straight in bf16 (the GEMMs' input) where the device adds a bf16 product into fp32
        # (`mixed_addmm`); else fp32, with the inputs upcast for d_weight. Not for fp16: its range
        # flushes small probabilities and overflows under loss scaling.
        low_g = (kernels is not None and weight.dtype == hidden.dtype == torch.bfloat16
                 and mixed_addmm(weight.device.type, weight.dtype, acc))
        d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # several vocab blocks: each block's G W_b is a partial sum of ∂L/∂h, added up in fp32
        dh_acc = (torch.empty(rows, hidden.shape[1], dtype=acc, device=hidden.device)
                  if need_h and len(blocks) > 1 else None)
        into_main = need_w and accumulates_into_main_grad(weight, acc)
        if into_main:
            d_weight = weight.main_grad
        else:
            d_weight = torch.empty(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s in range(0, n_tok, rows):
            sl = slice(s, min(s + rows, n_tok))
            for j, (v0, v1) in enumerate(blocks):
                w_b = weight[v0:v1]
                g = chunk_logit_grad(
                    hidden[sl], w_b, labels[sl], None if kept_ids is None else kept_ids[sl], stats[sl],
                    None if g_logprob is None else g_logprob[sl],
                    None if g_entropy is None else g_entropy[sl],
                    None if g_kept is None else g_kept[sl],
                    vocab_start=vocab_start + v0, inv_temp=inv_temp, zbuf=zbuf, ebuf=ebuf, kernels=kernels,
                    out_dtype=weight.dtype if low_g else acc)
                if dh_acc is not None:   # ∂L/∂h = Σ_b G_b W_b / temperature
                    add_hidden_grad(dh_acc[:sl.stop - s], g, w_b, fresh=j == 0, alpha=inv_temp, mixed=low_g)
                elif need_h:   # one block: G W / temperature straight into ∂L/∂h
                    put_hidden_grad(d_hidden[sl], g, weight, alpha=inv_temp)
                if need_w:   # ∂L/∂W_b += G_bᵀ h / temperature  (the first chunk initialises a fresh buffer)
                    add_weight_grad(d_weight[v0:v1], g, hidden[sl], fresh=s == 0 and not into_main,
                                    alpha=inv_temp, mixed=low_g)
                del g   # the compiled path's G is a new tensor: never two alive at once
            if dh_acc is not None:
                d_hidden[sl] = dh_acc[:sl.stop - s]
        if need_w and n_tok == 0 and not into_main:
            d_weight.zero_()
        if need_h and reduce_grad_input:
            all_reduce(d_hidden, dist.ReduceOp.SUM, tp_group)
        if into_main:
            d_weight = None  # already in main_grad; other uses of a tied weight still reach .grad
        elif need_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None, None, None, None


def add_weight_grad(out: torch.Tensor, g: torch.Tensor, h: torch.Tensor, *, fresh: bool, alpha: float,
                    mixed: bool) -> None:
    """`out = alpha · Gᵀ h` (fresh) or `out += alpha · Gᵀ h`, summed in `out`'s dtype (fp32).

    `g [n, V_b]`, `h [n, H]`, `out [V_b, H]` (rows of the weight gradient or of `main_grad`).
    mixed: `g` and `h` are bf16 and the device adds their product into `out` with fp32
    accumulation (`mixed_addmm`: tensor-core rate, the sum never rounded). Otherwise `g` is already
    in `out`'s dtype and `h` (a token tile, the small operand) is upcast exactly and scaled.
    """
    if mixed:
        torch.addmm(out, g.t(), h, out_dtype=out.dtype, beta=0.0 if fresh else 1.0, alpha=alpha, out=out)
        return
    h = h.to(out.dtype)
    h = h if alpha == 1.0 else h * alpha
    if fresh:
        torch.mm(g.t(), h, out=out)
    else:
        out.addmm_(g.t(), h)


def put_hidden_grad(out: torch.Tensor, g: torch.Tensor, w: torch.Tensor, *, alpha: float) -> None:
    """`out = alpha · G W`, the whole vocabulary (shard) in one GEMM: `g [n, V_r]`, `w [V_r, H]`,
    `out [n, H]` in the hidden states' dtype. Where `g`, `w` and `out` share a dtype (fp32, or bf16
    G on the compiled path) the GEMM writes `out`; else `g` is rounded to `w`'s dtype first."""
    if g.dtype == w.dtype == out.dtype:
        torch.mm(g, w, out=out)
    else:
        out.copy_(torch.mm(g.to(w.dtype), w))
    if alpha != 1.0:
        out.mul_(alpha)


def add_hidden_grad(out: torch.Tensor, g: torch.Tensor, w: torch.Tensor, *, fresh: bool, alpha: float,
                    mixed: bool) -> None:
    """`out = alpha · G W_b` (fresh) or `out += alpha · G W_b`: one vocab block's part of `∂L/∂h`,
    summed over the blocks in `out`'s dtype (fp32).

    `g [n, V_b]`, `w [V_b, H]`, `out [n, H]`. mixed: as in `add_weight_grad`. Where `g` and `w`
    share a dtype (fp32 runs), one addmm. Otherwise (fp16, or bf16 without `mixed_addmm`) `g` is
    rounded to `w`'s dtype and the product runs at its tensor-core rate, as the one-block path
    does, rather than copying the `[V_b, H]` block up to fp32; only the block sums are added in fp32.
    """
    if mixed:
        torch.addmm(out, g, w, out_dtype=out.dtype, beta=0.0 if fresh else 1.0, alpha=alpha, out=out)
    elif g.dtype == w.dtype == out.dtype:
        torch.addmm(out, g, w, beta=0.0 if fresh else 1.0, alpha=alpha, out=out)
    elif fresh:
        torch.mul(torch.mm(g.to(w.dtype), w), alpha, out=out)
    else:
        out.add_(torch.mm(g.to(w.dtype), w), alpha=alpha)


def accumulates_into_main_grad(weight: torch.Tensor, acc: torch.dtype) -> bool:
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


def flat_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, kept_ids: torch.Tensor | None,
                kernels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, CompiledChunkMath | None]:
    """Checked, flattened inputs: `(h [N, H], labels [N] int64, kept_ids [N, K] int64 or None,
    the chunk math)`, with "auto" kernels resolved for `hidden`'s device."""
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
    return h, y, k, kernels_for(hidden.device) if isinstance(kernels, str) else kernels


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    grad_tile: tuple[int, int] | None = None,
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
        chunk_size: tokens per forward chunk; peak extra memory ≈ `2 · chunk_size · V/TP · 4`
            bytes (plus the gradients of `hidden` and `weight`). None: `auto_chunk_size(V/TP)`.
        grad_tile: (tokens, vocab rows) of the backward's tiles: each recomputes the logits of
            that many tokens against that many rows of the shard. None: `(chunk_size, V/TP)` on
            the eager path, `auto_grad_tile(V/TP)` on the compiled one.
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
    h, y, k, kernels = flat_inputs(hidden, weight, labels, kept_ids, kernels)
    lead = labels.shape
    chunk = int(chunk_size or auto_chunk_size(weight.shape[0]))
    if grad_tile is None:   # the eager path: one chunk by the whole shard (on a CPU tiles changed little)
        grad_tile = (chunk, weight.shape[0]) if kernels is None else auto_grad_tile(weight.shape[0])
    elif len(grad_tile) != 2 or min(grad_tile) < 1:
        raise ValueError(f"grad_tile must be (tokens, vocab rows), both >= 1, got {grad_tile!r}")
    logprob, entropy, kept = FusedVocabParallelLogprobs.apply(
        h, weight, y, k, tp_group, chunk, (int(grad_tile[0]), int(grad_tile[1])),
        bool(compute_entropy), float(temperature), bool(reduce_grad_input), kernels)
    return LogprobOutput(
        logprob.reshape(lead),
        entropy.reshape(lead) if compute_entropy else None,
        kept.reshape(lead) if kept_ids is not None else None,
    )
