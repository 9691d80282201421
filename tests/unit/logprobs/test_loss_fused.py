"""`fused_token_loss` (gradients in the forward, three GEMMs) equals the float64 computation and the
recompute path, and its weight gradient goes into `main_grad` scaled as the backward will scale it."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.logprobs import reference_logprobs_and_entropy, token_logprobs_and_entropy
from megatron_rl.logprobs.loss_fused import auto_loss_chunk_size, fused_token_loss
from tests.unit.logprobs.cases import H, N, V, random_case

TEMP = 0.7


def _case(seed=0):
    h, w, y, kept, g = random_case(seed)
    return h, w, y, kept, torch.randn(3, N, generator=g, dtype=torch.float64)


def _per_token(coef, lp, ent, kept):
    """A nonlinear token-local loss: ℓ_t = a_t e^{logprob_t} + b_t H_t² + c_t kept_t."""
    a, b, c = (x.to(lp.dtype) for x in coef)
    terms = a * lp.exp()
    if ent is not None:
        terms = terms + b * ent.square()
    if kept is not None:
        terms = terms + c * kept
    return terms


def _fused(h, w, y, kept, coef, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, out = fused_token_loss(h, w, y, lambda rows, lp, ent, kp: _per_token(coef[:, rows], lp, ent, kp).sum(),
                                 kept_ids=kept, temperature=TEMP, **kw)
    loss.backward()
    return loss, out, h.grad, w.grad


def _autograd(fn, h, w, y, kept, coef, **kw):
    """The same loss on the outputs of `fn` (the reference or the recompute path), by autograd."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w, y, kept_ids=kept, temperature=TEMP, **kw)
    loss = _per_token(coef, *out).sum()
    loss.backward()
    return loss, out, h.grad, w.grad


def _close(ours, ref, tol):
    loss, out, dh, dw = ours
    r_loss, r_out, r_dh, r_dw = ref
    torch.testing.assert_close(loss.double(), r_loss.double(), atol=tol, rtol=tol)
    for a, b in zip(out, r_out):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)
    torch.testing.assert_close(dh.double(), r_dh.double(), atol=tol, rtol=tol)
    torch.testing.assert_close(dw.double(), r_dw.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("chunk", [8, 29])
def test_matches_float64_with_kept_sets_temperature_and_an_ignored_label(chunk):
    """fp32 against float64 autograd through full logits; chunks of 8 leave a ragged last chunk."""
    h, w, y, kept, coef = _case()
    ours = _fused(h, w, y, kept, coef, chunk_size=chunk, kernels=None)
    ref = _autograd(reference_logprobs_and_entropy, h.double(), w.double(), y, kept, coef)
    _close(ours, ref, 1e-5)
    out = ours[1]
    assert out.logprobs[3] == 0 and out.kept_logprobs[1] == 0   # ignored label, empty kept set


def test_equals_the_recompute_path_without_entropy_or_kept_sets():
    h, w, y, _, coef = _case(seed=1)
    ours = _fused(h, w, y, None, coef, chunk_size=8, compute_entropy=False, kernels=None)
    ref = _autograd(token_logprobs_and_entropy, h, w, y, None, coef, chunk_size=8, compute_entropy=False)
    _close(ours, ref, 1e-6)
    assert ours[1].entropy is None and ours[1].kept_logprobs is None


def test_main_grad_gets_the_weight_gradient_scaled_by_grad_scale():
    """As under megatron DDP: the weight gradient is added to what main_grad holds, times the
    gradient the loss receives (loss scale / micro-batches); a different one is refused."""
    h, w, y, kept, coef = _case(seed=2)
    *_, r_dh, r_dw = _autograd(reference_logprobs_and_entropy, h.double(), w.double(), y, kept, coef)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    ww.main_grad = torch.ones(V, H)

    def token_loss(rows, lp, ent, kp):
        return _per_token(coef[:, rows], lp, ent, kp)

    loss, _ = fused_token_loss(hh, ww, y, token_loss, kept_ids=kept, temperature=TEMP, chunk_size=8,
                               grad_scale=0.25, kernels=None)
    loss.backward(torch.tensor(0.25))
    assert ww.grad is None
    torch.testing.assert_close(ww.main_grad.double(), 1 + 0.25 * r_dw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hh.grad.double(), 0.25 * r_dh, atol=1e-5, rtol=1e-5)

    loss, _ = fused_token_loss(h.clone().requires_grad_(), ww, y, token_loss, kept_ids=kept, grad_scale=0.25,
                               kernels=None)
    with pytest.raises(RuntimeError, match="grad_scale=0.25.*got 1"):
        loss.backward()


def test_a_loss_of_the_log_probs_alone_and_a_constant_loss():
    """Unused outputs get no gradient; a loss that uses none of them gives zero gradients."""
    h, w, y, kept, coef = _case(seed=3)
    ours = _fused(h, w, y, kept, coef * torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64), kernels=None)
    ref = _autograd(reference_logprobs_and_entropy, h.double(), w.double(), y, kept,
                    coef * torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64))
    _close(ours, ref, 1e-5)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = fused_token_loss(hh, ww, y, lambda rows, lp, ent, kp: torch.tensor(2.0), kernels=None)
    loss.backward()
    assert float(loss.detach()) == 2.0 and not hh.grad.any() and not ww.grad.any()   # one chunk: N < chunk size


def test_auto_chunk_keeps_logits_and_g_within_the_buffer():
    """832 tokens at V = 151,936 with a bf16 G: 832 · 151,936 · 6 bytes <= 768 MiB < 896 · ..."""
    assert auto_loss_chunk_size(151_936, 2) == 832
    assert auto_loss_chunk_size(151_936, 4) == 640 and auto_loss_chunk_size(10**9, 2) == 64


def test_bf16_inputs_give_fp32_accurate_outputs_at_a_large_vocabulary():
    """Logits of a trained LM's size (std ~3 / 0.7) over 32,000 ids, from bf16 inputs: log-prob,
    entropy and kept-set log-prob within 2e-5 of float64, as the recompute path's are. (A
    GEMM-based row dot product for the entropy's Σ (z − M) e^{z − M} was off by 1e-4 here.)"""
    g = torch.Generator().manual_seed(5)
    n, hidden, vocab = 256, 256, 32_000
    h = torch.randn(n, hidden, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g) * 3 * hidden**-0.5).bfloat16()
    y = torch.randint(0, vocab, (n,), generator=g)
    kept = (y[:, None] + torch.arange(4) * 3989) % vocab
    _, out = fused_token_loss(h, w, y, lambda rows, lp, ent, kp: lp.sum(), kept_ids=kept, temperature=0.7,
                              chunk_size=96, kernels=None)
    ref = reference_logprobs_and_entropy(h.double(), w.double(), y, kept_ids=kept, temperature=0.7)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0)


def test_without_main_grad_the_backward_scales_to_the_gradient_it_gets():
    """No main_grad (an accumulator of its own): any incoming gradient, with or without a
    grad_scale announced, gives that multiple of the gradients."""
    h, w, y, kept, coef = _case(seed=6)
    *_, r_dh, r_dw = _autograd(reference_logprobs_and_entropy, h.double(), w.double(), y, kept, coef)
    for grad_scale, incoming in ((1.0, 3.0), (0.25, 0.25), (0.25, 3.0)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, _ = fused_token_loss(hh, ww, y, lambda rows, lp, ent, kp: _per_token(coef[:, rows], lp, ent, kp),
                                   kept_ids=kept, temperature=TEMP, chunk_size=8, grad_scale=grad_scale, kernels=None)
        loss.backward(torch.tensor(incoming))
        torch.testing.assert_close(hh.grad.double(), incoming * r_dh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ww.grad.double(), incoming * r_dw, atol=1e-5, rtol=1e-5)


def test_no_grad_adds_nothing_to_main_grad_and_a_second_backward_raises():
    h, w, y, _, coef = _case(seed=7)
    ww = w.clone().requires_grad_()
    ww.main_grad = torch.zeros(V, H)
    hh = h.clone().requires_grad_()

    def token_loss(rows, lp, ent, kp):
        return _per_token(coef[:, rows], lp, ent, kp)

    with torch.no_grad():
        loss, out = fused_token_loss(hh, ww, y, token_loss, kernels=None)
    assert not loss.requires_grad and not ww.main_grad.any() and out.logprobs.abs().sum() > 0
    loss, _ = fused_token_loss(hh, w.clone().requires_grad_(), y, token_loss, kernels=None)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time"):
        loss.backward()


def test_fp16_gradients_carry_the_loss_scale_before_rounding():
    """fp16 with loss scaling: a loss with a tiny per-token weight (a large normaliser) times a
    large loss scale. Formed unscaled, G's entries and G W would underflow in fp16 before the
    scale; formed with it (as the recompute backward does), ∂L/∂h stays within fp16 rounding."""
    g = torch.Generator().manual_seed(8)
    n, hidden, vocab, scale = 64, 32, 1024, 65536.0
    h = torch.randn(n, hidden, generator=g).half()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).half()
    y = torch.randint(0, vocab, (n,), generator=g)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = fused_token_loss(hh, ww, y, lambda rows, lp, ent, kp: 1e-7 * lp.sum(), grad_scale=scale,
                               kernels=None)
    loss.backward(torch.tensor(scale))
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    (1e-7 * reference_logprobs_and_entropy(h64, w64, y).logprobs.sum()).backward()
    expect = scale * h64.grad
    err = (hh.grad.double() - expect).abs().max() / expect.abs().max()
    assert err < 1e-2 and (hh.grad != 0).float().mean() > 0.99, float(err)
