"""Per-chunk math of the fused vocab-parallel log-prob / entropy (forward stats and logit gradient).

One chunk is `n` tokens against this rank's vocab shard `[v0, v0 + V_r)`. Notation per token t:
`z_v = h_t·W_v / temperature` (logits, fp32), `M = max_v z_v`, `S = Σ_v e^{z_v − M}`,
`logZ = M + log S`, `p_v = e^{z_v − logZ}`, entropy `H = −Σ_v p_v log p_v = log S − T/S` with
`T = Σ_v e^{z_v − M}(z_v − M)`, kept set `K` (top-p/top-k ids), `logZ_K = logsumexp_{v∈K} z_v`.

Every vocabulary sum is a sum of per-shard partial sums, so with tensor parallelism a chunk needs
two small all-reduces over the TP group, on `[n, ≤2]` and `[n, ≤4]` tensors:
MAX of (M, max_{v∈K} z_v), then SUM of (S, T, z_y, S_K); `z_y` is picked only on the shard that
owns the label (0 elsewhere). The backward is local to the shard (no communication):

    ∂logprob/∂z_v = 1[v=y] − p_v
    ∂H/∂z_v       = −p_v (log p_v + H)
    ∂kept/∂z_v    = 1[v=y] − 1[v∈K] e^{z_v − logZ_K}

The `[n, V_r]` work happens in two caller-owned fp32 buffers (`zbuf`, `ebuf`), reused across chunks
so that no large tensor is allocated per chunk. Given `kernels` (`compiled_math.kernels_for`: where
Inductor emits GPU kernels), the same work runs as compiled pure functions instead, one or two
passes over the logits in place of about nine (`compiled_math` says why).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_rl.logprobs.compiled_math import CompiledChunkMath, max_stage


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place all-reduce over `group`; a no-op without a group or with one rank."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


VOCAB_BLOCK = 2048  # weight rows upcast at a time where no mixed-precision GEMM exists


@functools.cache
def mixed_gemm(device_type: str, dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """How this device writes an `out_dtype` GEMM result from `dtype` inputs without rounding it to
    `dtype`: "out" (torch.mm(..., out_dtype=, out=) into the caller's buffer), "new" (out_dtype
    only, into a new tensor) or None (no such kernel: CUDA has one for bf16/fp16 -> fp32, the CPU
    does not). Probed once per (device type, dtypes) on a 1x1 GEMM."""
    a = torch.zeros(1, 1, dtype=dtype, device=device_type)
    try:
        torch.mm(a, a, out_dtype=out_dtype, out=torch.empty(1, 1, dtype=out_dtype, device=device_type))
        return "out"
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    try:
        torch.mm(a, a, out_dtype=out_dtype)
        return "new"
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@functools.cache
def mixed_addmm(device_type: str, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(c, a, b, out_dtype=out_dtype, beta=, alpha=, out=c)` adds a product of
    `dtype` inputs into an `out_dtype` `c` in place, accumulating in `out_dtype` (CUDA: bf16/fp16 ->
    fp32 in recent torch; the CPU has no such kernel). Probed once per (device type, dtypes) on
    tiny GEMMs shaped as the backward uses it, values checked: `c` a row block of a larger buffer
    (as a vocab block of `main_grad`), `a` a transposed view (as `G_bᵀ`); beta=0 on NaN (it must
    be ignored), then beta=1 with alpha=0.5; the rows around `c` untouched."""
    buf = torch.full((3, 2), float("nan"), dtype=out_dtype, device=device_type)
    c = buf[1:2]
    a = torch.ones(2, 1, dtype=dtype, device=device_type).t()
    b = torch.ones(2, 2, dtype=dtype, device=device_type)
    try:
        torch.addmm(c, a, b, out_dtype=out_dtype, beta=0.0, alpha=0.5, out=c)   # 0.5 · 2 = 1
        torch.addmm(c, a, b, out_dtype=out_dtype, beta=1.0, alpha=0.5, out=c)   # 1 + 1 = 2
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool((c == 2.0).all()) and bool(buf[0::2].isnan().all())


def project(h: torch.Tensor, weight: torch.Tensor, inv_temp: float, out: torch.Tensor) -> torch.Tensor:
    """`out[n, V_r] = (h[n, H] · weight[V_r, H]ᵀ) · inv_temp`, accumulated and written in `out`'s
    dtype (fp32, or fp64 if given): the logits are never rounded to bf16/fp16.

    bf16/fp16 inputs use the device's mixed GEMM (`mixed_gemm`: low-precision inputs at the tensor
    cores' rate, fp32 accumulation and output). Without one, the inputs are upcast exactly (every
    bf16/fp16 value is an fp32 value) and the GEMM runs in `out`'s dtype, VOCAB_BLOCK weight rows
    at a time so the upcast copy stays small. The temperature scales the fp32 result, not h.
    """
    hs = h.to(weight.dtype)
    if weight.dtype == out.dtype:
        torch.mm(hs, weight.t(), out=out)
    else:
        kind = mixed_gemm(out.device.type, weight.dtype, out.dtype)
        if kind == "out":
            torch.mm(hs, weight.t(), out_dtype=out.dtype, out=out)
        elif kind == "new":
            out.copy_(torch.mm(hs, weight.t(), out_dtype=out.dtype))
        else:
            hs = hs.to(out.dtype)
            for v in range(0, weight.shape[0], VOCAB_BLOCK):
                block = weight[v:v + VOCAB_BLOCK].to(out.dtype)
                out[:, v:v + VOCAB_BLOCK] = torch.mm(hs, block.t())
    if inv_temp != 1.0:
        out.mul_(inv_temp)
    return out


def scratch(buf: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """A contiguous `[n, width]` view of the front of scratch buffer `buf` (`[0, width]` for an
    empty `buf`), so a narrower last vocab block still gets a contiguous GEMM output."""
    return buf.view(-1)[:n * width].view(n, width) if buf.numel() else buf.new_empty(0, width)


def local_index(ids: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global token ids `[...]` -> (index into this shard clamped to 0, mask of ids this shard owns)."""
    loc = ids - vocab_start
    here = (ids >= 0) & (loc >= 0) & (loc < vocab_local)
    return torch.where(here, loc, torch.zeros_like(loc)), here


def chunk_forward(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    kept_ids: torch.Tensor | None,
    *,
    vocab_start: int,
    inv_temp: float,
    compute_entropy: bool,
    tp_group: dist.ProcessGroup | None,
    zbuf: torch.Tensor,
    ebuf: torch.Tensor,
    kernels: CompiledChunkMath | None = None,
) -> dict[str, torch.Tensor]:
    """Forward statistics of one chunk: its logits projected into `zbuf`, then `logit_statistics`.

    Args:
        h: `[n, H]` hidden states; weight: `[V_r, H]` this rank's vocab shard.
        labels: `[n]` global ids (negative = ignored); kept_ids: `[n, K]` global ids padded with -1.
        zbuf, ebuf: fp32 scratch of at least `[n, V_r]` (overwritten; `ebuf` unused with `kernels`).
        kernels: compiled chunk math, or None for the eager in-place ops.

    Returns:
        dict of `[n]` fp32 tensors: `logprob`, `logZ`, and `entropy` (if asked), `kept_logprob` and
        `logZ_K` (if `kept_ids`). Values are identical on every TP rank.
    """
    n = h.shape[0]
    z = zbuf[:n]
    project(h, weight, inv_temp, out=z)
    return logit_statistics(z, labels, kept_ids, vocab_start=vocab_start, compute_entropy=compute_entropy,
                            tp_group=tp_group, ebuf=ebuf[:n], kernels=kernels)


def logit_statistics(
    z: torch.Tensor,
    labels: torch.Tensor,
    kept_ids: torch.Tensor | None,
    *,
    vocab_start: int,
    compute_entropy: bool,
    tp_group: dist.ProcessGroup | None,
    ebuf: torch.Tensor | None,
    kernels: CompiledChunkMath | None,
) -> dict[str, torch.Tensor]:
    """`chunk_forward`'s statistics of one chunk's fp32 logits `z [n, V_r]` (this rank's shard),
    with the TP all-reduces: by the compiled `kernels`, which leave `z` as it is, or (None) by the
    eager in-place ops in `z` and the scratch `ebuf [n, V_r]`, which overwrite `z`."""
    m, m_k, z_y, z_k = global_maxima(z, labels, kept_ids, vocab_start, tp_group,
                                     max_stage if kernels is None else kernels.max_stage)
    if kernels is not None:
        sums = kernels.sum_stage(z, m, z_y, z_k, m_k, compute_entropy)
    else:
        e = ebuf
        z.sub_(m[:, None])                      # z − M
        torch.exp(z, out=e)                     # e^{z − M}
        sums = [e.sum(dim=1), z_y]
        if compute_entropy:
            sums.append(z.mul_(e).sum(dim=1))   # T; destroys z
        if kept_ids is not None:
            sums.append(torch.exp(z_k - m_k[:, None]).sum(dim=1))
        sums = torch.stack(sums, dim=1)
    return finish_statistics(all_reduce(sums, dist.ReduceOp.SUM, tp_group), m, m_k, labels, kept_ids,
                             compute_entropy)


def global_maxima(z: torch.Tensor, labels: torch.Tensor, kept_ids: torch.Tensor | None, vocab_start: int,
                  tp_group: dist.ProcessGroup | None, max_stage_fn=max_stage):
    """`(M [n], M_K [n] or None, z_y [n], z_k [n, K] or None)`: the full vocabulary's and the kept
    set's row maxima (TP MAX all-reduce; M_K is 0 for an empty kept set, to stay finite) and this
    shard's label and kept-id logits (`compiled_math.max_stage`, or `max_stage_fn`)."""
    yidx, y_here = local_index(labels, vocab_start, z.shape[1])
    kidx, k_here = (None, None) if kept_ids is None else local_index(kept_ids, vocab_start, z.shape[1])
    maxes, z_y, z_k = max_stage_fn(z, yidx, y_here, kidx, k_here)
    maxes = all_reduce(maxes, dist.ReduceOp.MAX, tp_group)
    m = maxes[:, 0]
    m_k = None
    if kept_ids is not None:
        m_k = maxes[:, 1]
        m_k = torch.where(torch.isfinite(m_k), m_k, torch.zeros_like(m_k))
    return m, m_k, z_y, z_k


def finish_statistics(sums: torch.Tensor, m: torch.Tensor, m_k: torch.Tensor | None, labels: torch.Tensor,
                      kept_ids: torch.Tensor | None, compute_entropy: bool) -> dict[str, torch.Tensor]:
    """`logit_statistics`' outputs from the TP-summed `sums [n, 2..4]` = (S, z_y, [T], [S_K])."""
    s, z_y = sums[:, 0], sums[:, 1]
    log_s = torch.log(s)
    valid = labels >= 0
    out = {"logZ": m + log_s}
    out["logprob"] = torch.where(valid, z_y - out["logZ"], torch.zeros_like(z_y))
    if compute_entropy:
        out["entropy"] = log_s - sums[:, 2] / s
    if kept_ids is not None:
        nonempty = (kept_ids >= 0).any(dim=1)
        log_zk = torch.where(nonempty, m_k + torch.log(sums[:, -1]), torch.zeros_like(m_k))
        out["logZ_K"] = log_zk
        out["kept_logprob"] = torch.where(valid & nonempty, z_y - log_zk, torch.zeros_like(z_y))
    return out


def chunk_logit_grad(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    kept_ids: torch.Tensor | None,
    stats: torch.Tensor,
    g_logprob: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    g_kept: torch.Tensor | None,
    *,
    vocab_start: int,
    inv_temp: float,
    zbuf: torch.Tensor,
    ebuf: torch.Tensor,
    kernels: CompiledChunkMath | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Recompute the chunk's logits and return `G = ∂L/∂z` `[n, V_r]` (a view of `ebuf`; with
    `kernels`, a new tensor in `out_dtype`, default `zbuf`'s dtype).

    `L = Σ_t g_logprob_t·logprob_t + g_entropy_t·H_t + g_kept_t·kept_t`. With `logp = z − logZ`:

        G = −p ⊙ (g_logprob + g_entropy (logp + H)) + (g_logprob + g_kept) 1[v=y]
            − g_kept 1[v∈K] e^{z − logZ_K}

    Args:
        stats: `[n, 3]` saved (logZ, H, logZ_K) from the forward.
        g_*: `[n]` upstream gradients or None (output unused), already zeroed where the output
            was defined as 0 (ignored label / empty kept set).
    """
    n, vocab_local = h.shape[0], weight.shape[0]
    z, p = scratch(zbuf, n, vocab_local), scratch(ebuf, n, vocab_local)
    project(h, weight, inv_temp, out=z)
    yidx, y_here = local_index(labels, vocab_start, vocab_local)
    kidx, k_here = (None, None) if kept_ids is None else local_index(kept_ids, vocab_start, vocab_local)
    if kernels is not None:
        return kernels.logit_grad(z, stats, g_logprob, g_entropy, g_kept, yidx, y_here, kidx, k_here,
                                  out_dtype or z.dtype)
    z.sub_(stats[:, 0, None])               # log p = z − logZ
    torch.exp(z, out=p)                     # p
    return logit_grad_in_place(z, p, stats, g_logprob, g_entropy, g_kept, yidx, y_here, kidx, k_here)


def logit_grad_in_place(logp: torch.Tensor, p: torch.Tensor, stats: torch.Tensor, g_logprob, g_entropy, g_kept,
                        yidx: torch.Tensor, y_here: torch.Tensor, kidx: torch.Tensor | None,
                        k_here: torch.Tensor | None) -> torch.Tensor:
    """`chunk_logit_grad`'s G from one chunk's `logp = z − logZ` and `p = e^{logp}` (`[n, V_r]`
    fp32 buffers, both overwritten): returned in `p`'s buffer. `stats`, `g_*` as there."""
    log_z, ent, log_zk = stats[:, 0], stats[:, 1], stats[:, 2]
    if kidx is not None and g_kept is not None:
        q = torch.exp(logp.gather(1, kidx) + (log_z - log_zk)[:, None]).masked_fill_(~k_here, 0.0)
        kept_term = -(g_kept[:, None] * q)
    if g_entropy is not None:
        a = g_entropy * ent if g_logprob is None else g_logprob + g_entropy * ent
        torch.addcmul(-a[:, None], logp, -g_entropy[:, None], out=logp)   # −(g_lp + g_ent (logp + H))
        p.mul_(logp)
    elif g_logprob is not None:
        p.mul_(-g_logprob[:, None])
    else:
        p.zero_()
    g_y = [g for g in (g_logprob, g_kept) if g is not None]
    if g_y:
        coef = g_y[0] if len(g_y) == 1 else g_y[0] + g_y[1]
        p.scatter_add_(1, yidx[:, None], torch.where(y_here, coef, torch.zeros_like(coef))[:, None])
    if kidx is not None and g_kept is not None:
        p.scatter_add_(1, kidx, kept_term)
    return p
