"""The chunk math compiled by Inductor equals the float64 computation.

On a GPU, Inductor turns `compiled_math`'s functions into Triton kernels; here its C++ backend
compiles the same graphs (a C++ compiler process per kernel, hence this tier, not tests/unit), so
what the compiler does to them (fusing, reordering the reductions, symbolic shapes for a shorter
last chunk) is checked on every CI run. The run must really compile: a counting backend checks that
graphs were captured, so a silently eager run cannot pass.
"""
from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from megatron_rl.logprobs import reference_logprobs_and_entropy, token_logprobs_and_entropy
from megatron_rl.logprobs.compiled_math import CompiledChunkMath
from tests.unit.logprobs.test_compiled_math import _case, _run, dynamo_on  # noqa: F401 (a fixture)
from tests.unit.logprobs.test_loss_fused import _autograd as _loss_autograd
from tests.unit.logprobs.test_loss_fused import _case as _loss_case
from tests.unit.logprobs.test_loss_fused import _close as _loss_close
from tests.unit.logprobs.test_loss_fused import _fused as _loss_fused


# about 20 s of C++ compiles on 2 cores
def test_inductor_compiled_chunk_math_matches_float64(dynamo_on):  # noqa: F811 (the fixture)
    """All three outputs with kept sets, an ignored label, an empty kept set and temperature 0.7;
    forward chunks of 8 over 29 tokens, so a shorter last chunk recompiles with a symbolic token
    dim, and backward tiles of 12 tokens by 40 vocab rows (ragged in both: 12, 12, 5 by 40, 40, 17)."""
    h, w, y, kept, grads = _case()
    counter = CompileCounterWithBackend("inductor")
    ours = _run(token_logprobs_and_entropy, h, w, y, kept, grads, chunk_size=8, grad_tile=(12, 40),
                kernels=CompiledChunkMath(backend=counter))
    assert counter.frame_count >= 3, "the chunk math ran without being compiled"
    ref = _run(reference_logprobs_and_entropy, h.double(), w.double(), y, kept, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    assert ours[0][3] == 0 and ours[2][1] == 0   # ignored label, empty kept set


def test_loss_fused_inductor_compiled_chunk_math_matches_float64(monkeypatch):
    """fused_token_loss's chunk math as a GPU runs it (compiled; Inductor's C++ backend here)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    torch._dynamo.reset()
    try:
        h, w, y, kept, coef = _loss_case(seed=4)
        counter = CompileCounterWithBackend("inductor")
        ours = _loss_fused(h, w, y, kept, coef, chunk_size=8, kernels=CompiledChunkMath(backend=counter))
        assert counter.frame_count >= 3, "the chunk math ran without being compiled"
        ref = _loss_autograd(reference_logprobs_and_entropy, h.double(), w.double(), y, kept, coef)
        _loss_close(ours, ref, 1e-5)
    finally:
        torch._dynamo.reset()
