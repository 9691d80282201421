"""tests/gpu/test_logprobs_gpu.py compiles for real in every test, checked on the CPU.

Dynamo's recompile limit (8) counts per function over the whole process, and that GPU module
compiles `compiled_math`'s three functions in many configurations; past the limit the chunk math
silently runs eagerly (`_eager_past_recompile_limit`), so its last `test_compiled_equals_eager_*`
case would compare eager with eager and fail on its frame count. Its autouse fixture starts every
test from fresh Dynamo caches. Here the same sequence of configurations runs on the CPU at small
sizes with Dynamo's eager backend (graphs captured, nothing code-generated: seconds), under that
same fixture, imported from the GPU module: the first test shows the failure within one test
(no fixture between the cases), the others that each case then compiles every function.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from megatron_rl.logprobs import token_logprobs_and_entropy
from megatron_rl.logprobs.compiled_math import CompiledChunkMath
from tests.gpu.test_logprobs_gpu import COMPILED, dynamo_on  # noqa: F401  (the GPU module's autouse fixture)

V, H, CHUNK = 500, 16, 8
TILES = [None, (8, 150)]   # the GPU module's auto and small tiles: a last tile of one token, a narrower block


def _earlier_tests(kernels) -> None:
    """The configurations the GPU module's tests before test_compiled_equals_eager compile (bf16 and
    fp16 with kept sets, temperature 0.8; bf16 into main_grad in both tiles), at small sizes."""
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(5 * CHUNK + 1, H, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(V, H, generator=g) * 3 * H**-0.5).to(dtype).requires_grad_()
        y = torch.randint(0, V, (h.shape[0],), generator=g)
        y[3] = -100
        kept = (y.clamp(min=0)[:, None] + torch.arange(6) * 53) % V
        kept[:, 4:] = -1
        kept[7] = -1
        out = token_logprobs_and_entropy(h, w, y, kept_ids=kept, temperature=0.8, chunk_size=CHUNK, kernels=kernels)
        (out.logprobs.sum() + 0.1 * out.entropy.sum() + 0.3 * out.kept_logprobs.sum()).backward()
    for tile in TILES:
        g = torch.Generator().manual_seed(1)
        h = torch.randn(4 * CHUNK, H, generator=g).bfloat16()
        w = (torch.randn(V, H, generator=g) * 0.5).bfloat16().requires_grad_()
        w.main_grad = torch.zeros(V, H)
        y = torch.randint(0, V, (h.shape[0],), generator=g)
        out = token_logprobs_and_entropy(h, w, y, chunk_size=CHUNK, temperature=0.8, grad_tile=tile, kernels=kernels)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()


def _compiled_equals_eager_case(entropy: bool, tile) -> tuple[int, CompiledChunkMath]:
    """One case of test_compiled_equals_eager_*: kept sets, temperature 0.7, a one-token last chunk;
    (frames the counting backend compiled, the chunk math)."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4 * CHUNK + 1, H, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).bfloat16().requires_grad_()
    y = torch.randint(0, V, (h.shape[0],), generator=g)
    y[5] = -100
    kept = (y.clamp(min=0)[:, None] + torch.arange(8) * 61) % V
    kept[:, 4:] = -1
    counter = CompileCounterWithBackend("eager")
    kernels = CompiledChunkMath(backend=counter)
    out = token_logprobs_and_entropy(h, w, y, kept_ids=kept, temperature=0.7, chunk_size=CHUNK, grad_tile=tile,
                                     compute_entropy=entropy, kernels=kernels)
    loss = out.logprobs.sum() + 0.3 * out.kept_logprobs.sum()
    (loss + 0.1 * out.entropy.sum() if entropy else loss).backward()
    return counter.frame_count, kernels


CASES = [(entropy, tile) for entropy in (True, False) for tile in TILES]   # the GPU module's order


def test_without_fresh_caches_the_last_case_runs_eagerly():
    """The negative control: the GPU module's sequence in one test, no reset between its tests."""
    _earlier_tests(CompiledChunkMath(backend="eager"))
    counts = []
    for entropy, tile in CASES:
        frames, kernels = _compiled_equals_eager_case(entropy, tile)
        counts.append(frames)
    assert counts[-1] < 3 and not all(getattr(kernels, n).compiled for n in COMPILED), counts


def test_the_earlier_tests_configurations():
    """Fills the recompile budget as the GPU module's earlier tests do (the fixture runs after it)."""
    kernels = CompiledChunkMath(backend="eager")
    _earlier_tests(kernels)
    assert all(getattr(kernels, n).compiled for n in COMPILED)


@pytest.mark.parametrize("entropy, tile", CASES, ids=[f"entropy={e}-tile={t}" for e, t in CASES])
def test_each_compiled_equals_eager_case_compiles_every_function(entropy, tile):
    frames, kernels = _compiled_equals_eager_case(entropy, tile)
    assert frames >= 3 and all(getattr(kernels, n).compiled for n in COMPILED), frames
