"""FP8 quantizers (megatron_rl/precision/fp8.py) against an independent numpy reference: E4M3
decoded from its bit patterns, round-to-nearest-even by search over that table, scales from
float64 block maxima by explicit loops, MX exponents from math.frexp."""
import math

import numpy as np
import pytest
import torch

from megatron_rl.precision.fp8 import FP8_FORMATS, cast_e4m3, quantize_mx, quantize_scaled, scaled_gemm


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Every finite E4M3 (fn) value from its bits, ascending, with its code's mantissa LSB."""
    vals, lsb = [], []
    for code in range(256):
        sign, exp, mant = code >> 7, (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and mant == 0x7:
            continue  # NaN
        v = (mant / 8) * 2.0 ** -6 if exp == 0 else (1 + mant / 8) * 2.0 ** (exp - 7)
        vals.append(-v if sign else v)
        lsb.append(mant & 1)
    order = np.argsort(vals, kind="stable")
    return np.asarray(vals)[order], np.asarray(lsb)[order]


TABLE, LSB = _e4m3_table()


def ref_e4m3(v: np.ndarray) -> np.ndarray:
    """Round float64 v to the nearest E4M3 value, ties to the even code, saturating at +-448."""
    v = np.clip(v, -448.0, 448.0)
    out = np.empty_like(v)
    for i, x in enumerate(v.ravel()):
        d = np.abs(TABLE - x)
        best = np.flatnonzero(d == d.min())
        best = [b for b in best if not (TABLE[b] == 0 and len(best) > 1 and math.copysign(1, x) < 0)] or best
        pick = best[0] if len(best) == 1 else next(b for b in best if LSB[b] == 0)
        out.flat[i] = TABLE[pick]
    return out


def test_table_is_e4m3fn():
    assert TABLE.max() == 448 and TABLE.min() == -448
    assert TABLE[TABLE > 0].min() == 2.0 ** -9  # smallest subnormal
    assert len(np.unique(TABLE)) == 253  # 254 finite codes, +0 and -0 equal


def test_cast_rounds_to_nearest_even_and_saturates():
    ties = np.array([17.0, 19.0, 9.5 / 8 * 1, 2.0 ** -10, 3 * 2.0 ** -10, 464.0, 500.0, 1e9, -1e9, -17.0])
    got = cast_e4m3(torch.tensor(ties, dtype=torch.float32)).double().numpy()
    np.testing.assert_array_equal(got, ref_e4m3(ties))
    assert got[0] == 16 and got[1] == 20 and got[5] == 448 and got[8] == -448


def test_cast_matches_reference_over_the_range():
    gen = np.random.default_rng(0)
    v = (gen.standard_normal(3000) * np.exp2(gen.uniform(-14, 10, 3000))).astype(np.float32)
    got = cast_e4m3(torch.from_numpy(v)).double().numpy()
    np.testing.assert_array_equal(got, ref_e4m3(v.astype(np.float64)))


def ref_scaled(x: np.ndarray, rows: int, group: int):
    """(dequantized [N, K], scales [R, G]) with s = fp32(max(amax, 1e-10) / 448) per block."""
    n, k = x.shape
    r, g = -(-n // rows), -(-k // group)
    scale = np.zeros((r, g), dtype=np.float32)
    deq = np.zeros_like(x, dtype=np.float64)
    for i in range(r):
        for j in range(g):
            blk = x[i * rows:(i + 1) * rows, j * group:(j + 1) * group].astype(np.float64)
            s = np.float32(max(np.abs(blk).max(), 1e-10) / 448.0)
            scale[i, j] = s
            q = ref_e4m3((blk / np.float64(s)).astype(np.float32).astype(np.float64))
            deq[i * rows:(i + 1) * rows, j * group:(j + 1) * group] = q * np.float64(s)
    return deq, scale


@pytest.mark.parametrize("shape,rows,group", [((130, 200), 128, 128), ((3, 257), 1, 128), ((40, 50), 40, 50)])
def test_scaled_blocks_match_reference_at_ragged_edges(shape, rows, group):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 2, shape[1])  # columns of different scale
    x[:rows, :group] = 0  # an all-zero block: scale 1e-10 / 448, values 0
    q = quantize_scaled(x, rows, group)
    deq, scale = ref_scaled(x.numpy(), rows, group)
    np.testing.assert_array_equal(q.scale.numpy(), scale)
    np.testing.assert_array_equal(q.dequantize(torch.float64).numpy(), deq)
    assert q.values.dtype == torch.float8_e4m3fn and q.values.shape == x.shape


def test_block_format_shapes():
    fmt = FP8_FORMATS.get("fp8_block")
    assert fmt.quantize_weight(torch.randn(300, 129)).scale.shape == (3, 2)
    assert fmt.quantize_activation(torch.randn(7, 129)).scale.shape == (7, 2)
    t = FP8_FORMATS.get("fp8_tensor")
    assert t.quantize_weight(torch.randn(300, 129)).scale.shape == (1, 1)


def test_mx_scales_are_ocp_powers_of_two():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 70, generator=gen) * torch.tensor([1e-30, 1e-3, 1.0, 300.0, 1e6, 1.0])[:, None]
    x[5, 32:64] = 0  # an all-zero block
    x[2, 0] = 511.0  # amax 511 -> scale 2^(8 - 8) = 1: 511 saturates to 448
    q = quantize_mx(x, 32)
    assert q.scale.dtype == getattr(torch, "float8_e8m0fnu", torch.float32)
    assert q.scale.shape == (6, 3)  # K = 70: blocks of 32, 32, 6
    xs = x.double().numpy()
    for r in range(6):
        for j in range(3):
            blk = xs[r, 32 * j:32 * (j + 1)]
            amax = np.abs(blk).max()
            e = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
            s = 2.0 ** e
            assert q.scale[r, j].double().item() == s
            np.testing.assert_array_equal(q.dequantize(torch.float64)[r, 32 * j:32 * (j + 1)].double().numpy(),
                                          ref_e4m3(blk / s) * s)
    assert q.dequantize(torch.float64)[2, 0].item() == 448.0


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_block", "mxfp8"])
@pytest.mark.parametrize("k", [64, 200, 384])
def test_scaled_gemm_is_the_fp64_matmul_of_the_fp8_inputs(name, k):
    fmt = FP8_FORMATS.get(name)
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(9, k, generator=gen) * 3, torch.randn(150, k, generator=gen) * 0.05
    xq, wq = fmt.quantize_activation(x), fmt.quantize_weight(w)
    xd, wd = xq.dequantize(torch.float64), wq.dequantize(torch.float64)
    ref = xd @ wd.T
    bound = k * 2.0 ** -23 * (xd.abs() @ wd.abs().T)  # fp32 accumulation over K terms
    err = (scaled_gemm(xq, wq).double() - ref).abs()
    assert (err <= bound + 1e-30).all(), float((err / bound).max())
    assert (xd - x.double()).abs().max() > 0  # the inputs were rounded
