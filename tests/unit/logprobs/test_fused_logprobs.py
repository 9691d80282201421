"""The fused chunked path equals the straightforward full-logits computation (fp32, atol 1e-5).

Tests marked with the `kernels` parameter run twice: the eager in-place chunk math (None, the CPU's
path) and `compiled_math`'s pure functions run uncompiled (PURE: the graphs Inductor compiles on a
GPU; test_compiled_math.py compiles them)."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.logprobs import (
    auto_chunk_size,
    auto_grad_tile,
    compiled_math,
    next_token_labels,
    reference_logprobs_and_entropy,
    token_logprobs_and_entropy,
    zigzag_shard,
    zigzag_unshard,
)

PURE = types.SimpleNamespace(max_stage=compiled_math.max_stage, sum_stage=compiled_math.sum_stage,
                             logit_grad=compiled_math.logit_grad)
KERNELS = pytest.mark.parametrize("kernels", [None, PURE], ids=["eager", "pure"])

ATOL = 1e-5
N, H, V = 29, 16, 97


def _kept_sets(labels: torch.Tensor, vocab: int, k: int, seed: int) -> torch.Tensor:
    """[N, k] unique kept ids containing the label, random sizes, padded with -1; row 1 empty."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for y in labels.tolist():
        size = int(torch.randint(1, k + 1, (1,), generator=g))
        ids = torch.randperm(vocab, generator=g)[:size]
        if y >= 0 and y not in ids.tolist():
            ids[0] = y
        rows.append(torch.cat([ids, torch.full((k - size,), -1)]))
    kept = torch.stack(rows)
    kept[1] = -1
    return kept


def _inputs(seed=0, n=N, vocab=V, hidden=H, ignore=(3,)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    y = torch.randint(0, vocab, (n,), generator=g)
    for i in ignore:
        y[i] = -100
    return h, w, y


def _run(fn, h, w, y, grads, **kw):
    """Outputs and d(Σ g·out)/d(h, W) for the outputs that have an upstream grad."""
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = fn(h, w, y, **kw)
    loss = sum((o * g).sum() for o, g in zip(out, grads) if g is not None and o is not None)
    dh, dw = torch.autograd.grad(loss, [h, w])
    return out, dh, dw


def _assert_same(a, b):
    (oa, dha, dwa), (ob, dhb, dwb) = a, b
    for x, z in zip(oa, ob):
        assert (x is None) == (z is None)
        if x is not None:
            torch.testing.assert_close(x, z, atol=ATOL, rtol=0)
    torch.testing.assert_close(dha, dhb, atol=ATOL, rtol=0)
    torch.testing.assert_close(dwa, dwb, atol=ATOL, rtol=0)


@KERNELS
@pytest.mark.parametrize("chunk_size", [1, 4, 7, N, 64])
def test_matches_reference_all_outputs(chunk_size, kernels):
    h, w, y = _inputs()
    kept = _kept_sets(y, V, 6, seed=1)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(N, generator=g) for _ in range(3)]
    ref = _run(reference_logprobs_and_entropy, h, w, y, grads, kept_ids=kept)
    ours = _run(token_logprobs_and_entropy, h, w, y, grads, kept_ids=kept, chunk_size=chunk_size,
                kernels=kernels)
    _assert_same(ours, ref)
    assert ours[0].logprobs[3] == 0 and ours[0].kept_logprobs[1] == 0   # ignored label, empty set


@KERNELS
@pytest.mark.parametrize("grad_tile", [(1, V), (4, 10), (7, 33), (N, 1), (64, 96), (5, 2 * V)])
def test_backward_tiles_match_reference(grad_tile, kernels):
    """The backward in tiles of (tokens, vocab rows), independent of the forward's chunks: blocks
    that split the vocabulary (one row, ragged last block, one block) and token tiles that split
    the sequence or exceed it, with kept sets, an ignored label and a temperature."""
    h, w, y = _inputs(seed=8)
    kept = _kept_sets(y, V, 6, seed=9)
    g = torch.Generator().manual_seed(10)
    grads = [torch.randn(N, generator=g) for _ in range(3)]
    ref = _run(reference_logprobs_and_entropy, h, w, y, grads, kept_ids=kept, temperature=0.7)
    ours = _run(token_logprobs_and_entropy, h, w, y, grads, kept_ids=kept, temperature=0.7, chunk_size=6,
                grad_tile=grad_tile, kernels=kernels)
    _assert_same(ours, ref)


@KERNELS
@pytest.mark.parametrize("which", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1)])
def test_each_output_alone_and_in_pairs(which, kernels):
    h, w, y = _inputs(seed=3)
    kept = _kept_sets(y, V, 5, seed=4)
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(N, generator=g) if on else None for on in which]
    ref = _run(reference_logprobs_and_entropy, h, w, y, grads, kept_ids=kept)
    ours = _run(token_logprobs_and_entropy, h, w, y, grads, kept_ids=kept, chunk_size=8, kernels=kernels)
    _assert_same(ours, ref)


@KERNELS
def test_temperature_no_entropy_no_kept_and_leading_dims(kernels):
    h, w, y = _inputs(seed=6, n=24)
    h3, y3 = h.view(4, 6, H), y.view(4, 6)
    grads = [torch.ones(4, 6), None, None]
    ref = _run(reference_logprobs_and_entropy, h3, w, y3, grads, temperature=0.7)
    ours = _run(token_logprobs_and_entropy, h3, w, y3, grads, temperature=0.7, chunk_size=5,
                compute_entropy=False, kernels=kernels)
    assert ours[0].entropy is None and ours[0].kept_logprobs is None and ours[0].logprobs.shape == (4, 6)
    _assert_same((ours[0][:1], ours[1], ours[2]), (ref[0][:1], ref[1], ref[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_logits_are_stable(dtype):
    """Logits far beyond exp's range (|z| ~ 1e3) stay finite and agree with float64 to the
    precision of the dtype (fp64 inputs are computed in fp64)."""
    h, w, y = _inputs(seed=7)
    w = w * 300.0
    kept = _kept_sets(y, V, 4, seed=15)
    kept[3, 0] = (h[3] @ w.t()).argmax()           # ignored label, kept set with a huge logit
    grads = [torch.ones(N), torch.ones(N) * 0.1, torch.ones(N) * 0.5]
    ref = _run(reference_logprobs_and_entropy, h.double(), w.double(), y, grads, kept_ids=kept)
    ours = _run(token_logprobs_and_entropy, h.to(dtype), w.to(dtype), y, grads, chunk_size=6, kept_ids=kept)
    for x in (*ours[0], ours[1], ours[2]):
        assert torch.isfinite(x).all() and x.dtype == dtype
    if dtype == torch.float64:
        _assert_same(ours, ref)
    else:   # fp32 logits of size 1e3 carry ~1e-4 absolute rounding, amplified in the grads
        for a, b in zip(ours[0], ref[0]):
            torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=1e-4)
        for a, b in zip(ours[1:], ref[1:]):
            torch.testing.assert_close(a.double(), b, atol=1e-2, rtol=2e-3)


@KERNELS
@pytest.mark.parametrize("grad_tile", [None, (24, 300)], ids=["chunks", "tiles"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_low_precision_inputs_give_fp32_accurate_logprobs(dtype, temperature, grad_tile, kernels):
    """bf16/fp16 hidden and weight: the logits are accumulated and kept in fp32 (never rounded to
    the inputs' precision), so log-probs and entropy match a float64 computation from the same
    low-precision values to 2e-5; gradients come back in the inputs' dtype within its rounding.
    Rounding the logits to bf16, as a bf16 GEMM output does, is off by ~1e-2 here."""
    h, w, y = _inputs(seed=14, n=64, vocab=1000, hidden=64)
    h, w = (h * 2).to(dtype), w.to(dtype)
    grads = [torch.ones(64), torch.full((64,), 0.5), None]
    f64 = _run(reference_logprobs_and_entropy, h.double(), w.double(), y, grads, temperature=temperature)
    ours = _run(token_logprobs_and_entropy, h, w, y, grads, chunk_size=16, temperature=temperature,
                grad_tile=grad_tile, kernels=kernels)
    assert ours[0].logprobs.dtype == torch.float32 and ours[1].dtype == ours[2].dtype == dtype
    for a, b in zip(ours[0][:2], f64[0][:2]):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0)
    for a, b in zip(ours[1:], f64[1:]):
        torch.testing.assert_close(a.double(), b, atol=1e-2, rtol=1e-2)
    rounded = _run(reference_logprobs_and_entropy, h, w, y, grads, temperature=temperature)  # bf16 logits
    assert (rounded[0].logprobs.double() - f64[0].logprobs).abs().max() > 1e-3  # the test can tell


@KERNELS
@pytest.mark.parametrize("grad_tile", [None, (8, 40)], ids=["chunks", "tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_accumulates_into_main_grad(dtype, grad_tile, kernels):
    """A weight with megatron DDP's fp32 `main_grad` gets Gᵀh added to it in the backward (what was
    there stays) and no `.grad`; the sum equals the float64 weight gradient (bf16 weights too:
    the gradient is never rounded to bf16)."""
    h, w, y = _inputs(seed=21)
    h, w = h.to(dtype), w.to(dtype)
    grads = [torch.ones(N), torch.full((N,), 0.5), None]
    f64 = _run(reference_logprobs_and_entropy, h.double(), w.double(), y, grads)
    weight = w.clone().requires_grad_()
    before = torch.randn(w.shape, generator=torch.Generator().manual_seed(3))
    weight.main_grad = before.clone()
    hh = h.clone().requires_grad_()
    out = token_logprobs_and_entropy(hh, weight, y, chunk_size=8, grad_tile=grad_tile, kernels=kernels)
    (out.logprobs.sum() + 0.5 * out.entropy.sum()).backward()
    assert weight.grad is None and weight.main_grad.dtype == torch.float32
    atol = 1e-5 if dtype == torch.float32 else 2e-5
    torch.testing.assert_close((weight.main_grad - before).double(), f64[2], atol=atol, rtol=1e-5)
    torch.testing.assert_close(hh.grad.double(), f64[1], atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


def test_tied_weight_with_main_grad_keeps_both_contributions():
    """Tied head under megatron DDP's contract: the head's part goes to main_grad, the embedding
    lookup's part to .grad (DDP's hook then adds it): together the full gradient."""
    model = _TiedLM(V, H, seed=5)
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(6))
    y = torch.roll(tokens, -1)
    full = torch.autograd.grad(reference_logprobs_and_entropy(model.hidden(tokens), model.emb, y).logprobs.sum(),
                               model.emb)[0]
    model.emb.main_grad = torch.zeros_like(model.emb)
    token_logprobs_and_entropy(model.hidden(tokens), model.emb, y, chunk_size=8).logprobs.sum().backward()
    assert model.emb.grad is not None
    torch.testing.assert_close(model.emb.main_grad + model.emb.grad, full, atol=ATOL, rtol=0)


class _TiedLM(torch.nn.Module):
    """Embedding -> tiny mixer -> tied output layer (the embedding weight passed as W)."""

    def __init__(self, vocab, hidden, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
        self.mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)

    def hidden(self, tokens):
        return torch.tanh(self.emb[tokens] @ self.mix)


@pytest.mark.parametrize("use_fused", [True, False])
def test_tied_head_gradient_reaches_embedding_through_both_paths(use_fused):
    def grads_of(fused: bool):
        model = _TiedLM(V, H, seed=8)
        tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(9))
        labels = next_token_labels(tokens)
        fn = token_logprobs_and_entropy if fused else reference_logprobs_and_entropy
        kw = {"chunk_size": 5} if fused else {}
        out = fn(model.hidden(tokens), model.emb, labels, **kw)
        (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
        return out.logprobs.detach(), model.emb.grad, model.mix.grad

    ref = grads_of(False)
    ours = grads_of(use_fused)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_packed_unequal_sequences_and_single_process_cp_split():
    """Packed THD batch of unequal lengths; computing each zig-zag CP shard separately and
    reassembling gives the full-sequence result, and the shard gradients sum to the full one."""
    lengths = [8, 4, 12, 20]                      # multiples of 2*CP=4
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = int(cu[-1])
    g = torch.Generator().manual_seed(10)
    tokens = torch.randint(0, V, (t,), generator=g)
    labels = next_token_labels(tokens, cu)         # shift before the split
    assert (labels[cu[1:] - 1] == -100).all()
    h = torch.randn(t, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    kept = _kept_sets(labels, V, 4, seed=11)
    grads = [torch.randn(t, generator=g) for _ in range(3)]
    ref = _run(reference_logprobs_and_entropy, h, w, labels, grads, kept_ids=kept)

    cp = 2
    h_leaf = h.clone().requires_grad_()
    w_leaf = w.clone().requires_grad_()
    shards = []
    for r in range(cp):
        out = token_logprobs_and_entropy(
            zigzag_shard(h_leaf, r, cp, cu), w_leaf, zigzag_shard(labels, r, cp, cu),
            kept_ids=zigzag_shard(kept, r, cp, cu), chunk_size=5)
        loss = sum((o * zigzag_shard(gr, r, cp, cu)).sum() for o, gr in zip(out, grads))
        loss.backward()                            # W.grad accumulates = the CP all-reduce
        shards.append(out)
    full = [zigzag_unshard([s[i].detach() for s in shards], cu) for i in range(3)]
    _assert_same((full, h_leaf.grad, w_leaf.grad), ref)


def test_saved_state_is_small():
    """Only h, W, labels, kept ids and [N, 3] stats are kept for backward: no [N, V] tensor."""
    h, w, y = _inputs(seed=12, n=64, vocab=512)
    h.requires_grad_()
    kept = _kept_sets(y, 512, 3, seed=13)
    out = token_logprobs_and_entropy(h, w, y, kept_ids=kept, chunk_size=16)
    saved = out.logprobs.grad_fn.next_functions[0][0].saved_tensors   # under the reshape
    sizes = sorted(t.numel() for t in saved if t is not None)
    assert sum(sizes) == h.numel() + w.numel() + y.numel() + kept.numel() + 64 * 3
    assert max(sizes) == w.numel() and 64 * 512 not in sizes


def test_no_tokens():
    h, w, _ = _inputs()
    w = w.clone().requires_grad_()
    out = token_logprobs_and_entropy(h[:0], w, torch.zeros(0, dtype=torch.long))
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert out.logprobs.shape == (0,) and torch.equal(w.grad, torch.zeros_like(w))


def test_rejects_bad_shapes():
    h, w, y = _inputs()
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(h, w, y[:-1])
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(h, w[:, :-1], y)
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(h, w, y, kept_ids=torch.zeros(N - 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="kernels"):
        token_logprobs_and_entropy(h, w, y, kernels="eager")
    for tile in ((0, 8), (8,), (8, -1)):
        with pytest.raises(ValueError, match="grad_tile"):
            token_logprobs_and_entropy(h, w, y, grad_tile=tile)


def test_auto_tiles():
    """Forward chunks and backward tiles keep their fp32 logits within 256 MiB: 384 tokens of the
    whole Qwen vocabulary forward, 4096 tokens by 16,384 rows backward, never wider than the shard."""
    assert auto_chunk_size(151_936) == 384
    assert auto_grad_tile(151_936) == (4096, 16_384)
    assert auto_grad_tile(151_936 // 8) == (4096, 16_384)
    assert auto_grad_tile(97) == (4096, 97)
    assert auto_grad_tile(151_936, tokens=2**20) == (2**20, 128)   # at least 128 rows


def _cuda_like_addmm(real, calls: list):
    """torch.addmm plus the form a GPU has and the CPU lacks: bf16 operands, an fp32 `out_dtype`,
    in place, the bf16 products summed in fp32 (what `mixed_addmm` probes for). Every other call
    goes to torch; `calls` counts the mixed ones."""
    def addmm(c, a, b, *, out_dtype=None, beta=1.0, alpha=1.0, out=None):
        if out_dtype is None:
            return real(c, a, b, beta=beta, alpha=alpha, out=out)
        assert a.dtype == b.dtype == torch.bfloat16 and out_dtype == out.dtype == torch.float32 and out is c
        assert beta in (0.0, 1.0)
        prod = (a.float() @ b.float()).mul_(alpha)
        out.copy_(prod) if beta == 0.0 else out.add_(prod)
        calls.append(tuple(out.shape))
        return out
    return addmm


@pytest.mark.parametrize("grad_tile", [None, (8, 40), (5, 211)], ids=["auto", "tiles", "ragged-tiles"])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_the_gpu_weight_gradient_path_with_a_cuda_like_addmm(monkeypatch, grad_tile, main_grad):
    """The compiled path's bf16 branch (G in bf16, both gradient GEMMs as fp32-accumulating addmm
    into `main_grad` or a fresh buffer, ∂L/∂h summed over vocab blocks in fp32), which only a GPU
    takes, run here on the CPU through a stand-in for the GPU's mixed addmm: equal to float64
    within bf16 rounding of G, with kept sets, temperature 0.7 and one or several vocab blocks."""
    from megatron_rl.logprobs import fused

    calls: list = []
    monkeypatch.setattr(fused, "mixed_addmm", lambda *args: True)
    monkeypatch.setattr(torch, "addmm", _cuda_like_addmm(torch.addmm, calls))
    h, w, y = _inputs(seed=31, n=40, vocab=500, hidden=32)
    h, w = h.bfloat16(), (w * 0.5).bfloat16()
    kept = _kept_sets(y, 500, 5, seed=32)
    grads = [torch.ones(40), torch.full((40,), 0.1), torch.full((40,), 0.3)]
    f64 = _run(reference_logprobs_and_entropy, h.double(), w.double(), y, grads, kept_ids=kept, temperature=0.7)
    weight, hh = w.clone().requires_grad_(), h.clone().requires_grad_()
    if main_grad:
        weight.main_grad = torch.ones(w.shape)
    out = token_logprobs_and_entropy(hh, weight, y, kept_ids=kept, temperature=0.7, chunk_size=16,
                                     grad_tile=grad_tile, kernels=PURE)
    sum(((o * g).sum() for o, g in zip(out, grads)), torch.zeros(())).backward()
    assert calls, "the mixed addmm branch did not run"
    for a, b in zip(out, f64[0]):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0)
    dw = weight.main_grad - 1.0 if main_grad else weight.grad
    assert (weight.grad is None) == main_grad
    scale = f64[2].abs().max()
    assert (dw.double() - f64[2]).abs().max() <= 1e-2 * scale
    assert (hh.grad.double() - f64[1]).abs().max() <= 1e-2 * f64[1].abs().max()
