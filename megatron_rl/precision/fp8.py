"""FP8 quantizers and the scaled GEMM they feed: pure functions, numerically those of an FP8
tensor-core GEMM, run on the CPU with torch's float8 dtypes.

    fmt = FP8_FORMATS.get("fp8_block")
    wq = fmt.quantize_weight(w)            # w [N, K] -> Quantized(values fp8 [N, K], scale)
    xq = fmt.quantize_activation(x)        # x [M, K] -> Quantized(values fp8 [M, K], scale)
    y = scaled_gemm(xq, wq, fmt)           # [M, N] fp32: y = x_dq @ w_dq.T

Element format E4M3 (`torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, no infinity, max
448, subnormals down to 2^-9). A value is scaled and cast as

    q = e4m3(clamp(v / s, -448, 448))      round to nearest, ties to even; saturating

(the clamp makes the saturation explicit rather than left to the cast's overflow rule). The dequantized
value is q * s. The formats differ in how s is shared:

    fp8_tensor  one fp32 scale per tensor: s = max(amax, 1e-10) / 448 (the weight's once per sync,
                the activation's per GEMM call over the whole input, every token together: vLLM's
                online `quantization=fp8`, dynamic per-tensor activations)
    fp8_block   weights in 128 x 128 blocks, activations per token in groups of 128 along K, each
                s = max(amax, 1e-10) / 448 over its block or group (DeepSeek-V3's block FP8 and
                vLLM's `weight_block_size=[128, 128]`, per_token_group_quant_fp8)
    mxfp8       OCP Microscaling v1.0 MXFP8: blocks of 32 along K for weights and activations
                alike, scale an E8M0 power of two s = 2^(floor(log2 amax) - 8) (8 = the exponent
                of E4M3's largest power of two, 256), clamped to 2^-127 .. 2^127; an all-zero
                block gets 2^-127. |v / s| lies in [256, 512), so values in (448, 512) saturate
                to 448, as the OCP rule does

A block or group at the edge of a tensor whose size is not a multiple of the block is the
smaller remainder (as if zero-padded: zeros never raise an amax).

The GEMM (`scaled_gemm`) is that of a block-scaled FP8 tensor core: along K in groups of the
format's scale granularity g (K for fp8_tensor, 128, 32), the products of the FP8 values are
exact in fp32 (4 x 4 significant bits) and summed in fp32, each group's sum is multiplied by
its two scales, and the groups are summed in fp32. Only the summation order differs from a
GPU's (fp32 rounding, ~1e-7 relative). Cost: M x N x ceil(K / g) fp32 of intermediate, one
batched matmul.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl.registry import Registry

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of the largest power of two E4M3 holds (256)
SCALE_EPS = 1e-10  # amax floor of the fp32 scales (vLLM's and DeepSeek-V3's eps)
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7; else scales stay fp32 (same values)
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


@dataclass(frozen=True)
class Quantized:
    """FP8 values and their scales.

    values: [..., K] float8_e4m3fn.
    scale: [R, ceil(K / group)] for the scale of rows r * rows .. (r + 1) * rows - 1 and K-group j
        (fp32, or float8_e8m0fnu for MX); a per-tensor scale is [1, 1] with rows = all rows.
    rows, group: the block shape a scale covers (rows along dim 0 of the 2-D view, group along K).
    """

    values: torch.Tensor
    scale: torch.Tensor
    rows: int
    group: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scale [..., K] in `dtype` (float64: exact)."""
        return self.values.to(dtype) * expand_scale(self.scale.to(dtype), self.values.shape, self.rows, self.group)


def cast_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Saturating cast of fp32 `v` to float8_e4m3fn (round to nearest even, clamp to +-448)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def expand_scale(scale: torch.Tensor, shape: torch.Size, rows: int, group: int) -> torch.Tensor:
    """Scales [R, G] -> one per element of a tensor of `shape` [..., K] (viewed as [N, K])."""
    k = shape[-1]
    n = math.prod(shape[:-1])
    full = scale.repeat_interleave(rows, 0)[:n] if scale.shape[0] > 1 else scale.expand(n, -1)
    full = full.repeat_interleave(group, 1)[:, :k] if full.shape[1] > 1 else full.expand(-1, k)
    return full.reshape(shape)


def _block_amax(x: torch.Tensor, rows: int, group: int) -> torch.Tensor:
    """amax of |x| [N, K] over blocks rows x group -> [ceil(N / rows), ceil(K / group)] fp32."""
    n, k = x.shape
    pad = (0, -k % group, 0, -n % rows)
    a = torch.nn.functional.pad(x.float().abs(), pad)
    return a.view(a.shape[0] // rows, rows, a.shape[1] // group, group).amax(dim=(1, 3))


def quantize_scaled(x: torch.Tensor, rows: int, group: int) -> Quantized:
    """E4M3 with fp32 scales s = max(amax, 1e-10) / 448 per block rows x group of x [N, K]
    (rows = N, group = K: one per-tensor scale)."""
    x = x.float()
    scale = _block_amax(x, rows, group).clamp(min=SCALE_EPS) / E4M3_MAX
    return Quantized(cast_e4m3(x / expand_scale(scale, x.shape, rows, group)), scale, rows, group)


def e8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX shared scale of blocks with maximum magnitude `amax` (fp32): 2^(floor(log2 amax) - 8)
    clamped to 2^-127 .. 2^127 (2^-127 for amax = 0), as float8_e8m0fnu (fp32 without it)."""
    _, exp = torch.frexp(amax.float())  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = torch.where(amax > 0, exp - 1 - E4M3_EMAX, torch.full_like(exp, E8M0_MIN_EXP))
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float32), shared.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP))
    return scale.to(E8M0) if E8M0 is not None else scale


def quantize_mx(x: torch.Tensor, group: int = 32) -> Quantized:
    """MXFP8 of x [N, K]: E4M3 elements with an E8M0 scale per block of `group` along K."""
    x = x.float()
    scale = e8m0_scale(_block_amax(x, 1, group))
    return Quantized(cast_e4m3(x / expand_scale(scale.float(), x.shape, 1, group)), scale, 1, group)


def scaled_gemm(x: Quantized, w: Quantized) -> torch.Tensor:
    """[M, N] fp32 = x_dq [M, K] @ w_dq [N, K].T, as a block-scaled FP8 tensor core computes it
    (module docstring): per K-group of g (the operands' common group size), exact FP8 products
    summed in fp32, times the group's two scales, the groups summed in fp32."""
    m, k = x.values.shape
    n = w.values.shape[0]
    if x.group != w.group or w.values.shape[1] != k:
        raise ValueError(f"scaled_gemm: x [{m}, {k}] in K-groups of {x.group} and w {tuple(w.values.shape)} in "
                         f"K-groups of {w.group} do not match")
    g = x.group
    groups = -(-k // g)
    pad = groups * g - k
    xv = torch.nn.functional.pad(x.values.float(), (0, pad)).view(m, groups, g)
    wv = torch.nn.functional.pad(w.values.float(), (0, pad)).view(n, groups, g)
    partial = torch.einsum("mgk,ngk->gmn", xv, wv)  # [G, M, N]: fp32 sums of exact products
    sx, sw = _row_scales(x, m), _row_scales(w, n)  # [M, G], [N, G]
    return (partial * sx.T[:, :, None] * sw.T[:, None, :]).sum(0)


def _row_scales(q: Quantized, rows: int) -> torch.Tensor:
    """The scale of each row and K-group of q, [rows, G] fp32."""
    s = q.scale.float()
    return s.repeat_interleave(q.rows, 0)[:rows] if s.shape[0] > 1 else s.expand(rows, -1)


@dataclass(frozen=True)
class Fp8Format:
    """A rollout FP8 format (rollout.quantization): how weights (at every sync) and activations (at
    every GEMM input) are quantized. quantize_weight: w [N, K] -> Quantized; quantize_activation:
    x [M, K] -> Quantized; doc: one line."""

    quantize_weight: Callable[[torch.Tensor], Quantized]
    quantize_activation: Callable[[torch.Tensor], Quantized]
    doc: str


def _per_tensor(x: torch.Tensor) -> Quantized:
    return quantize_scaled(x, max(x.shape[0], 1), max(x.shape[1], 1))


FP8_FORMATS = Registry("rollout FP8 format", Fp8Format)
FP8_FORMATS.add("fp8_tensor", Fp8Format(
    _per_tensor, _per_tensor, "E4M3, one scale per weight (per sync) and per activation tensor (per call)"))
FP8_FORMATS.add("fp8_block", Fp8Format(
    lambda w: quantize_scaled(w, 128, 128), lambda x: quantize_scaled(x, 1, 128),
    "E4M3, weights in 128x128 blocks, activations per token in groups of 128 (DeepSeek-V3)"))
FP8_FORMATS.add("mxfp8", Fp8Format(
    quantize_mx, quantize_mx, "OCP MXFP8: E4M3 in blocks of 32 along K with E8M0 power-of-two scales"))
