"""The probes that pick the low-precision GEMM forms (`chunk_math.mixed_gemm`, `mixed_addmm`).

The CPU has neither kernel, so the probes answer no there. What a CUDA kernel must do to pass
`mixed_addmm` is checked here with stand-in addmm functions: a correct one passes; one that lets
beta=0 multiply the NaN already in `out`, one that does not write in place, and an older torch
without `out_dtype` fail."""
import pytest
import torch

from megatron_rl.logprobs import chunk_math


def test_the_cpu_has_no_mixed_kernels():
    assert chunk_math.mixed_gemm("cpu", torch.bfloat16, torch.float32) is None
    assert chunk_math.mixed_addmm("cpu", torch.bfloat16, torch.float32) is False


def _correct(c, a, b, *, out_dtype, beta, alpha, out):
    prod = alpha * (a.to(out_dtype) @ b.to(out_dtype))
    out.copy_(prod if beta == 0 else beta * c + prod)
    return out


def _nan_through_beta_zero(c, a, b, *, out_dtype, beta, alpha, out):
    out.copy_(beta * c + alpha * (a.to(out_dtype) @ b.to(out_dtype)))
    return out


def _not_in_place(c, a, b, *, out_dtype, beta, alpha, out):
    return alpha * (a.to(out_dtype) @ b.to(out_dtype))


def _no_out_dtype(c, a, b, **kwargs):
    raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")


@pytest.mark.parametrize("fake, expected", [(_correct, True), (_nan_through_beta_zero, False),
                                            (_not_in_place, False), (_no_out_dtype, False)])
def test_mixed_addmm_probe_checks_what_the_backward_relies_on(monkeypatch, fake, expected):
    monkeypatch.setattr(torch, "addmm", fake)
    assert chunk_math.mixed_addmm.__wrapped__("cpu", torch.bfloat16, torch.float32) is expected
