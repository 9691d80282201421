"""The fused log-prob kernel on a GPU: bf16/fp16 inputs, fp32 logits from the device's mixed GEMM
(chunk_math.mixed_gemm), log-probs and entropy within 2e-5 of a float64 computation from the same
low-precision values, gradients within their rounding; both the Inductor-compiled chunk math (the
default on a GPU with Triton, whose backward runs in tiles of tokens by vocab rows) and the eager
one. GPU lane: skipped without CUDA."""
import pytest
import torch

from megatron_rl.logprobs import compiled_math, reference_logprobs_and_entropy, token_logprobs_and_entropy
from megatron_rl.logprobs.chunk_math import mixed_addmm, mixed_gemm
from megatron_rl.logprobs.compiled_math import kernels_for

pytestmark = [pytest.mark.gpu]
COMPILED = ("max_stage", "sum_stage", "logit_grad")


def fresh_compiles() -> None:
    """Forget every compiled graph: Dynamo's caches and the process-wide compiled chunk math.

    Dynamo's recompile limit (8) counts per function across every torch.compile wrapper of it: the
    tests here compile `compiled_math`'s three functions for many configurations (dtype, None-ness
    of the optional inputs, entropy, a one-token last chunk or tile), so without this a later test
    passes the limit, `_eager_past_recompile_limit` switches that function to eager for the rest
    of the process, and `test_compiled_equals_eager_*` would compare eager with eager (its frame
    count, measured on the CPU with the eager backend: 5, 6, 3, 1 over its four cases without
    this; 5, 7, 5, 7 with it; tests/unit/platform/test_gpu_logprob_compiles.py)."""
    torch._dynamo.reset()
    compiled_math._compiled.cache_clear()


@pytest.fixture(autouse=True)
def dynamo_on(monkeypatch):
    """torch.compile on, as in a GPU run (the test session switches it off for the CPU lane), and
    every test compiles from scratch (`fresh_compiles`)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    fresh_compiles()
    yield
    fresh_compiles()


def test_the_gpu_takes_the_compiled_path_and_mixed_gemms():
    """torch.compile is on and Triton importable on a GPU machine: the compiled chunk math and the
    bf16 -> fp32 GEMM (into the chunk buffer, or a new tensor), and the in-place fp32 addmm of bf16
    products (recent torch on CUDA): without it the weight gradient would silently take an fp32 G
    and an fp32 GEMM, about 15x slower on an H100, so its absence fails here, not in a benchmark."""
    assert kernels_for(torch.device("cuda")) is not None
    assert mixed_gemm("cuda", torch.bfloat16, torch.float32) in ("out", "new")   # never the fp32 upcast
    assert mixed_addmm("cuda", torch.bfloat16, torch.float32)


@pytest.mark.parametrize("kernels", ["auto", None], ids=["compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_accurate_logprobs_on_the_gpu(dtype, kernels):
    """Against float64 from the same low-precision values: log-probs, entropy and kept-set
    log-probs within 2e-5, with an ignored label, an empty kept set and temperature 0.8."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab, k = 512, 256, 32_000, 6
    # logits of a trained LM's size (std ~3 at temperature 1): the 2e-5 bound is absolute, and fp32
    # rounding of a sum of 256 products grows with the logits' magnitude
    h = torch.randn(n, hidden, device="cuda", generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 3 * hidden**-0.5).to(dtype)
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    y[3] = -100
    kept = (y.clamp(min=0)[:, None] + torch.arange(k, device="cuda") * 5003) % vocab   # the label first
    kept[:, 4:] = -1
    kept[7] = -1
    print("mixed GEMM:", mixed_gemm("cuda", dtype, torch.float32))

    def run(fn, hh, ww, **kw):
        hh, ww = hh.clone().requires_grad_(), ww.clone().requires_grad_()
        out = fn(hh, ww, y, kept_ids=kept, temperature=0.8, **kw)
        (out.logprobs.sum() + 0.1 * out.entropy.sum() + 0.3 * out.kept_logprobs.sum()).backward()
        return out, hh.grad, ww.grad

    ours, dh, dw = run(token_logprobs_and_entropy, h, w, chunk_size=96, kernels=kernels)  # 512 = 5x96 + 32
    ref, dh64, dw64 = run(reference_logprobs_and_entropy, h.double(), w.double())
    assert ours.logprobs.device.type == "cuda" and dh.dtype == dtype and dw.dtype == dtype
    assert ours.logprobs[3] == 0 and ours.kept_logprobs[7] == 0   # ignored label, empty kept set
    torch.testing.assert_close(ours.logprobs.double(), ref.logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.entropy.double(), ref.entropy, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.kept_logprobs.double(), ref.kept_logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(dh.double(), dh64, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dw.double(), dw64, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("grad_tile", [None, (256, 5000)], ids=["auto-tiles", "small-tiles"])
@pytest.mark.parametrize("kernels", ["auto", None], ids=["compiled", "eager"])
def test_bf16_weight_gradient_accumulates_in_fp32_into_main_grad(kernels, grad_tile):
    """Under megatron DDP (fp32 main_grad): the bf16 Gᵀh products are added in fp32 into main_grad
    (mixed_addmm on the compiled path), matching the float64 weight gradient to fp32-level error
    plus G's bf16 rounding, never bf16-rounded as a whole. Small tiles: four token tiles add into
    the same rows of main_grad, in vocab blocks with a narrower last one."""
    g = torch.Generator(device="cuda").manual_seed(1)
    n, hidden, vocab = 1024, 256, 32_000
    h = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.5).bfloat16()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    weight = w.clone().requires_grad_()
    weight.main_grad = torch.zeros(vocab, hidden, device="cuda")
    out = token_logprobs_and_entropy(h, weight, y, chunk_size=256, temperature=0.8, grad_tile=grad_tile,
                                     kernels=kernels)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    assert weight.grad is None
    w64 = w.double().requires_grad_()
    ref = reference_logprobs_and_entropy(h.double(), w64, y, temperature=0.8)
    (ref.logprobs.sum() + 0.1 * ref.entropy.sum()).backward()
    err = (weight.main_grad.double() - w64.grad).abs().max().item()
    scale = w64.grad.abs().max().item()
    print(f"main_grad max error {err:.2e} (max |grad| {scale:.2e})")
    assert err <= 1e-2 * scale


@pytest.mark.parametrize("grad_tile", [None, (256, 5000)], ids=["auto-tiles", "small-tiles"])
@pytest.mark.parametrize("entropy", [True, False])
def test_compiled_equals_eager_with_kept_sets_temperature_and_a_one_token_last_chunk(entropy, grad_tile):
    """The Inductor/Triton kernels against the eager chunk math on the same bf16 inputs: kept sets
    (their scatter), temperature 0.7 (alpha in the fp32 addmm), no main_grad (beta=0 into a fresh
    buffer), 1025 tokens in chunks of 128 (a last chunk of one token); compiled for real (counted).
    The compiled backward runs in tiles: by default one of 1025 tokens by 16,384 + 15,616 vocab
    rows; small tiles are 256 tokens (a last tile of one) by 5,000 rows (a last block of 2,000)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_rl.logprobs.compiled_math import CompiledChunkMath

    g = torch.Generator(device="cuda").manual_seed(2)
    n, hidden, vocab, k = 1025, 256, 32_000, 8
    h = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.5).bfloat16()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    y[5] = -100
    offsets = torch.arange(k, device="cuda") * 3989          # distinct ids per row, the label first
    kept = (y.clamp(min=0)[:, None] + offsets) % vocab
    kept[:, k // 2:] = -1                                      # padding
    counter = CompileCounterWithBackend("inductor")

    def run(kernels, tile=None):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = token_logprobs_and_entropy(hh, ww, y, kept_ids=kept, temperature=0.7, chunk_size=128,
                                         grad_tile=tile, compute_entropy=entropy, kernels=kernels)
        loss = out.logprobs.sum() + 0.3 * out.kept_logprobs.sum()
        if entropy:
            loss = loss + 0.1 * out.entropy.sum()
        loss.backward()
        return out, hh.grad, ww.grad

    compiled = CompiledChunkMath(backend=counter)
    ours, dh, dw = run(compiled, grad_tile)
    eager, dh_e, dw_e = run(None)
    assert counter.frame_count >= 3
    assert all(getattr(compiled, name).compiled for name in COMPILED), "fell back to eager (recompile limit)"
    for a, b in zip(ours, eager):
        if b is not None:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    torch.testing.assert_close(dh.float(), dh_e.float(), atol=1e-2, rtol=1e-2)
    # On a GPU the compiled path feeds G to the weight GEMM in bf16 (`mixed_addmm`), the eager one
    # in fp32: a vocab row whose terms cancel differs by a few bf16 steps of its largest term, so
    # the bound scales with the gradient's size, as in the main_grad test above (on one H200 an
    # elementwise atol=rtol=1e-2 failed on 12 of 8.2M entries, by at most 0.027).
    scale = dw_e.float().abs().max().item()
    err = (dw.float() - dw_e.float()).abs().max().item()
    assert err <= 1e-2 * scale, (err, scale)


@pytest.mark.parametrize("kernels", ["auto", None], ids=["compiled", "eager"])
def test_loss_fused_matches_float64_with_main_grad(kernels):
    """`fused_token_loss` (gradients in the forward, three GEMMs) on bf16 inputs: the outputs
    within 2e-5 of float64, the bf16 G's products added in fp32 into main_grad scaled by
    grad_scale (1/3: not a power of two, so a scale rounded to bf16 would show), ∂L/∂h within
    bf16 rounding; a one-token last chunk, an ignored label, kept sets, temperature 0.7."""
    from megatron_rl.logprobs.loss_fused import fused_token_loss

    g = torch.Generator(device="cuda").manual_seed(3)
    n, hidden, vocab, k = 1025, 256, 32_000, 8
    h = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 3 * hidden**-0.5).bfloat16()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    y[5] = -100
    kept = (y.clamp(min=0)[:, None] + torch.arange(k, device="cuda") * 3989) % vocab
    kept[:, k // 2:] = -1
    adv = torch.randn(n, device="cuda", generator=g, dtype=torch.float64)

    def per_token(lp, ent, kp, a):   # nonlinear in the log-prob, as a PPO ratio is
        return a.to(lp.dtype) * lp.exp() + 0.1 * ent + 0.3 * kp

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    ww.main_grad = torch.zeros(vocab, hidden, device="cuda")
    loss, out = fused_token_loss(hh, ww, y, lambda rows, lp, ent, kp: per_token(lp, ent, kp, adv[rows]).sum(),
                                 kept_ids=kept, temperature=0.7, chunk_size=128, grad_scale=1 / 3, kernels=kernels)
    loss.backward(torch.tensor(1 / 3, device="cuda"))
    assert ww.grad is None and hh.grad.dtype == torch.bfloat16
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_logprobs_and_entropy(h64, w64, y, kept_ids=kept, temperature=0.7)
    ref_loss = per_token(ref.logprobs, ref.entropy, ref.kept_logprobs, adv).sum()
    ref_loss.backward()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), atol=1e-3, rtol=1e-5)
    err = (ww.main_grad.double() - w64.grad / 3).abs().max().item()
    assert err <= 1e-2 * w64.grad.abs().max().item() / 3, err
    torch.testing.assert_close(hh.grad.double(), h64.grad / 3, atol=1e-2, rtol=1e-2)
    ratio = (hh.grad.double() * 3 / h64.grad).flatten()[h64.grad.abs().flatten() > 1e-3].median().item()
    assert abs(ratio - 1) < 1e-3, ratio   # no bias from a rounded scale (1/3 in bf16 is 0.3340)
