"""The fused log-prob kernel on a GPU: bf16/fp16 inputs, fp32 logits from the device's mixed GEMM
(chunk_math.mixed_gemm), log-probs and entropy within 2e-5 of a float64 computation from the same
low-precision values, gradients within their rounding. GPU lane: skipped without CUDA."""
import pytest
import torch

from megatron_rl.logprobs import reference_logprobs_and_entropy, token_logprobs_and_entropy
from megatron_rl.logprobs.chunk_math import mixed_gemm

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_accurate_logprobs_on_the_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 512, 256, 32_000
    h = (torch.randn(n, hidden, device="cuda", generator=g) * 2).to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.5).to(dtype)
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    y[3] = -100
    print("mixed GEMM:", mixed_gemm("cuda", dtype, torch.float32))

    def run(fn, hh, ww, **kw):
        hh, ww = hh.clone().requires_grad_(), ww.clone().requires_grad_()
        out = fn(hh, ww, y, temperature=0.8, **kw)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        return out, hh.grad, ww.grad

    ours, dh, dw = run(token_logprobs_and_entropy, h, w, chunk_size=128)
    ref, dh64, dw64 = run(reference_logprobs_and_entropy, h.double(), w.double())
    assert ours.logprobs.device.type == "cuda" and dh.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(ours.logprobs.double(), ref.logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.entropy.double(), ref.entropy, atol=2e-5, rtol=0)
    torch.testing.assert_close(dh.double(), dh64, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dw.double(), dw64, atol=1e-2, rtol=1e-2)
