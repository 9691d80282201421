"""The compiled chunk math's dispatch: the compiled path is chosen only where Inductor emits GPU
kernels, and past Dynamo's recompile limit the same math runs eagerly. The Inductor-compiled math
against float64 is tests/distributed/test_compiled_math_inductor.py (it runs a C++ compiler)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.logprobs import reference_logprobs_and_entropy, token_logprobs_and_entropy
from megatron_rl.logprobs.compiled_math import CompiledChunkMath, inductor_emits_gpu_kernels, kernels_for
from tests.unit.logprobs.cases import N, random_case


def _case(seed=0):
    h, w, y, kept, g = random_case(seed)
    grads = [torch.randn(N, generator=g) for _ in range(3)]
    return h, w, y, kept, grads


def _run(fn, h, w, y, kept, grads, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w, y, kept_ids=kept, temperature=0.7, **kw)
    loss = sum((o * g).sum() for o, g in zip(out, grads))
    return (*out, *torch.autograd.grad(loss, [h, w]))


@pytest.fixture
def dynamo_on(monkeypatch):
    """The CPU lane switches torch.compile off (TORCHDYNAMO_DISABLE=1, for megatron's fusions)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_path_is_chosen_only_where_inductor_emits_gpu_kernels(monkeypatch):
    """CPU tensors take the eager in-place path; a CUDA device with torch.compile switched off
    does too (checked without a GPU: the switch is read before anything touches CUDA)."""
    assert kernels_for(torch.device("cpu")) is None
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert not inductor_emits_gpu_kernels(torch.device("cuda"))


def test_past_the_recompile_limit_the_same_math_runs_eagerly(dynamo_on):
    """With fullgraph=True, Dynamo raises once a function passes its recompile limit; the chunk math
    then runs the same functions eagerly and the results stay right. Limit 1 here, and a second
    configuration (no entropy, no kept sets) forces the recompile."""
    h, w, y, kept, grads = _case(seed=1)
    kernels = CompiledChunkMath(backend="eager")   # Dynamo capture without Inductor: fast
    with torch._dynamo.config.patch(recompile_limit=1):
        first = _run(token_logprobs_and_entropy, h, w, y, kept, grads, chunk_size=8, kernels=kernels)
        h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
        second = token_logprobs_and_entropy(h2, w2, y, temperature=0.7, compute_entropy=False, chunk_size=8,
                                            kernels=kernels)
        second.logprobs.sum().backward()
    assert not kernels.sum_stage.compiled and not kernels.logit_grad.compiled   # the limit was hit
    ref = _run(reference_logprobs_and_entropy, h.double(), w.double(), y, kept, grads)
    for a, b in zip(first, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second.logprobs.double(), ref[0], atol=1e-5, rtol=1e-5)
    assert second.entropy is None and torch.isfinite(h2.grad).all() and torch.isfinite(w2.grad).all()
