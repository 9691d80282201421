"""The `[n, V_r]` elementwise and reduction work of one chunk as pure functions, compiled by Inductor
where it emits GPU kernels (CUDA with Triton).

Same notation and formulas as `chunk_math`. The eager path (`chunk_math`) spends most of its time
outside the GEMMs: each op is a separate pass over the fp32 `[n, V_r]` logits, about nine in the
forward (`sub_`, `exp`, `sum`, `mul_`, `sum`, `amax`, ...) and six in the backward. Written as
pure functions of the logits, the same math compiles to:

- forward: `max_stage` (one read: row max, label and kept-set gathers) and `sum_stage` (one read:
  `S = Σ e^{z−M}` and `T = Σ e^{z−M}(z−M)` in one reduction kernel), with the TP all-reduces
  between them, where they must be;
- backward: `logit_grad` (one read of z, one write of `G = ∂L/∂z` already in the GEMM's input
  dtype, bf16 for bf16 weights; the label's one-hot term is an index compare inside the same
  kernel). The kept-set term needs a scatter, one extra pass over a `[n, V_r]` fp32 G, only when
  kept-set log-probs carry a gradient.

Why Inductor rather than a hand-written Triton kernel:
- the math stays the readable PyTorch of the formulas, and the compiled graph can be checked
  against a float64 computation on any machine: Inductor's C++ backend compiles the same graphs on
  the CPU (`tests/unit/logprobs/test_compiled_math.py`), where a Triton kernel would need a GPU;
- the GEMMs stay cuBLAS's (`chunk_math.project`, `torch.mm(..., out_dtype=float32)`), at full
  tensor-core rate, with fp32 logits; a Triton GEMM with a fused epilogue would save the fp32
  logits' write and read but would have to match cuBLAS's rate first.

What the recompute design cannot do: the backward needs the logits again, so forward plus
backward is four `[n, H] × [H, V_r]` GEMMs (forward, recompute, d_hidden, d_weight), at least
4/3 of a three-GEMM floor. Keeping the logits instead would cost `N · V_r · 2` bytes (20 GiB at
64k tokens and V = 151,936).

`kernels_for(device)` picks: the compiled functions where Inductor emits GPU kernels, else None
(the eager in-place path, which on the CPU allocates nothing per chunk and has no compile time).
"""
from __future__ import annotations

import functools
import os

import torch


def max_stage(z: torch.Tensor, yidx: torch.Tensor, y_here: torch.Tensor, kidx: torch.Tensor | None,
              k_here: torch.Tensor | None):
    """Row maxima and gathers of one chunk's logits `z [n, V_r]` (not modified).

    Returns `(maxes [n, 1 or 2], z_y [n], z_k [n, K] or None)`: `maxes[:, 0] = max_v z_v`,
    `maxes[:, 1] = max_{v∈K} z_v` (−inf for a kept set with no id on this shard), `z_y` the label's
    logit on the shard that owns it (0 elsewhere), `z_k` the kept ids' logits (−inf where padded or
    on another shard).
    """
    z_y = torch.where(y_here, z.gather(1, yidx[:, None])[:, 0], 0.0)
    m = z.amax(dim=1)
    if kidx is None:
        return m[:, None], z_y, None
    z_k = z.gather(1, kidx).masked_fill(~k_here, float("-inf"))
    return torch.stack([m, z_k.amax(dim=1)], dim=1), z_y, z_k


def sum_stage(z: torch.Tensor, m: torch.Tensor, z_y: torch.Tensor, z_k: torch.Tensor | None,
              m_k: torch.Tensor | None, compute_entropy: bool) -> torch.Tensor:
    """This shard's partial sums `[n, 2..4]`: `S = Σ_v e^{z_v−M}`, `z_y`, then `T = Σ_v e^{z_v−M}(z_v−M)`
    (if `compute_entropy`) and `S_K = Σ_{v∈K} e^{z_v−M_K}` (if `z_k`), to be summed over TP.
    `m`, `m_k`: `[n]` global maxima (finite)."""
    zm = z - m[:, None]
    e = torch.exp(zm)
    sums = [e.sum(dim=1), z_y]
    if compute_entropy:
        sums.append((zm * e).sum(dim=1))
    if z_k is not None:
        sums.append(torch.exp(z_k - m_k[:, None]).sum(dim=1))
    return torch.stack(sums, dim=1)


def logit_grad(z: torch.Tensor, stats: torch.Tensor, g_logprob: torch.Tensor | None,
               g_entropy: torch.Tensor | None, g_kept: torch.Tensor | None, yidx: torch.Tensor,
               y_here: torch.Tensor, kidx: torch.Tensor | None, k_here: torch.Tensor | None,
               out_dtype: torch.dtype) -> torch.Tensor:
    """`G = ∂L/∂z [n, V_r]` in `out_dtype` from the logits `z` (not modified), with `logp = z − logZ`:

        G = −p ⊙ (g_logprob + g_entropy (logp + H)) + (g_logprob + g_kept) 1[v=y]
            − g_kept 1[v∈K] e^{z − logZ_K}

    `stats [n, 3]`: (logZ, H, logZ_K) saved by the forward; `g_*`: `[n]` or None (as in
    `chunk_math.chunk_logit_grad`).
    """
    log_z, ent, log_zk = stats[:, 0], stats[:, 1], stats[:, 2]
    logp = z - log_z[:, None]
    p = torch.exp(logp)
    if g_entropy is not None:
        a = g_entropy * ent if g_logprob is None else g_logprob + g_entropy * ent
        g = -p * (a[:, None] + g_entropy[:, None] * logp)
    elif g_logprob is not None:
        g = -p * g_logprob[:, None]
    else:
        g = torch.zeros_like(p)
    g_y = [x for x in (g_logprob, g_kept) if x is not None]
    if g_y:
        coef = g_y[0] if len(g_y) == 1 else g_y[0] + g_y[1]
        cols = torch.arange(z.shape[1], device=z.device)
        g = g + torch.where((cols[None, :] == yidx[:, None]) & y_here[:, None], coef[:, None], 0.0)
    if kidx is not None and g_kept is not None:
        q = torch.exp(logp.gather(1, kidx) + (log_z - log_zk)[:, None]).masked_fill(~k_here, 0.0)
        g = g.scatter_add(1, kidx, -(g_kept[:, None] * q))
    return g.to(out_dtype)


class CompiledChunkMath:
    """`max_stage`, `sum_stage` and `logit_grad`, each through `torch.compile` (Inductor).

    `dynamic=True`: sizes are symbolic from the first compile, so a shorter last chunk, another
    batch size or a new chunk size reuses the graph; what does recompile is which optional inputs
    are None, `compute_entropy` and `out_dtype`, a handful of graphs per run. `fullgraph=True`
    guarantees one graph per function (no silent graph breaks); it also makes passing Dynamo's
    recompile limit an error rather than a fallback, so that case runs the same function eagerly.
    """

    def __init__(self, backend="inductor"):
        for fn in (max_stage, sum_stage, logit_grad):
            setattr(self, fn.__name__, _eager_past_recompile_limit(
                torch.compile(fn, backend=backend, fullgraph=True, dynamic=True), fn))


def _eager_past_recompile_limit(compiled, eager):
    """`compiled`, or `eager` once Dynamo refuses another recompile (a process mixing many
    configurations): slower, never wrong. `call.compiled` says which it is now."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    @functools.wraps(eager)
    def call(*args):
        if call.compiled:
            try:
                return compiled(*args)
            except FailOnRecompileLimitHit:
                call.compiled = False
        return eager(*args)

    call.compiled = True
    return call


def inductor_emits_gpu_kernels(device: torch.device) -> bool:
    """Whether torch.compile can turn the chunk math into GPU kernels on `device`: a CUDA device,
    Triton importable (Inductor's GPU code generator), and torch.compile not switched off
    (`TORCHDYNAMO_DISABLE=1`, which the CPU lane sets because megatron's fusions would compile)."""
    if device.type != "cuda" or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return False
    from torch.utils._triton import has_triton

    return has_triton()


@functools.cache
def _compiled() -> CompiledChunkMath:
    return CompiledChunkMath()


def kernels_for(device: torch.device) -> CompiledChunkMath | None:
    """The compiled chunk math where Inductor emits GPU kernels for `device`, else None (eager)."""
    return _compiled() if inductor_emits_gpu_kernels(device) else None
