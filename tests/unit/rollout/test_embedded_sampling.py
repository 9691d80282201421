"""The embedded engine's sampling math: temperature, top-k, top-p, inverse-CDF draw, RNG streams."""
import math

import pytest
import torch

from megatron_rl.rollout.sampling import (
    apply_temperature,
    sample_inverse_cdf,
    sample_step,
    stream_seed,
    stream_uniforms,
    top_k_mask,
    top_p_mask,
    truncation_mask,
)
from megatron_rl.rollout.types import SamplingParams

# probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled vocabulary order
PROBS = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
LOGITS = PROBS.log()


def test_temperature():
    x = torch.tensor([[1.0, 2.0, -3.0]])
    assert torch.equal(apply_temperature(x, 2.0), torch.tensor([[0.5, 1.0, -1.5]]))
    assert torch.equal(apply_temperature(x, 0.0), x)  # greedy: log-probs at T = 1
    assert apply_temperature(x.bfloat16(), 1.0).dtype == torch.float32


def test_top_k():
    assert top_k_mask(LOGITS, 2).tolist() == [[False, True, False, True]]
    assert top_k_mask(LOGITS, 1).tolist() == [[False, True, False, False]]
    assert top_k_mask(LOGITS, -1).all() and top_k_mask(LOGITS, 10).all()
    assert top_k_mask(torch.tensor([[1.0, 1.0, 0.0]]), 1).tolist() == [[True, True, False]]  # ties kept


@pytest.mark.parametrize("p, keep", [
    (0.4, [False, True, False, False]),  # the top token alone reaches 0.5 >= 0.4
    (0.7, [False, True, False, True]),  # 0.5 < 0.7 -> add 0.3
    (0.81, [True, True, False, True]),  # 0.8 < 0.81 -> add 0.15
    (0.96, [True, True, True, True]),
    (1.0, [True, True, True, True]),
])
def test_top_p(p, keep):
    assert top_p_mask(LOGITS, p).tolist() == [keep]


def test_top_k_then_top_p_renormalises():
    # top-3 renormalised: 0.526, 0.316, 0.158 -> mass before the third is 0.842 >= 0.83: dropped;
    # without top-k it would be 0.8 < 0.83: kept
    assert truncation_mask(LOGITS, 3, 0.83).tolist() == [[False, True, False, True]]
    assert truncation_mask(LOGITS, -1, 0.83).tolist() == [[True, True, False, True]]


@pytest.mark.parametrize("u, token", [(0.1, 0), (0.55, 1), (0.85, 2), (1 - 1e-12, 2)])
def test_inverse_cdf(u, token):
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    keep = torch.ones(1, 3, dtype=torch.bool)
    assert sample_inverse_cdf(logits, keep, torch.tensor([u], dtype=torch.float64)).item() == token


def test_inverse_cdf_respects_keep_mask():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    keep = torch.tensor([[True, False, True]])  # renormalised: 5/7, 0, 2/7

    def draw(u):
        return sample_inverse_cdf(logits, keep, torch.tensor([u], dtype=torch.float64)).item()

    assert [draw(0.7), draw(0.72), draw(1 - 1e-15)] == [0, 2, 2]
    # vocabulary entries after the last kept one are never picked, even when u * total rounds up
    keep = torch.tensor([[True, True, False]])
    assert draw(1.0) == 1
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = sample_inverse_cdf(logits.expand(len(u), -1), keep.expand(len(u), -1), u)
    assert set(ids.tolist()) == {0, 1}
    assert ids.float().mean().item() == pytest.approx(0.375, abs=0.01)  # 0.3 / 0.8


def test_sample_step_logprobs_before_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    u = torch.tensor([0.99], dtype=torch.float64)
    tok, lp, keep = sample_step(logits, u, SamplingParams(temperature=0.5, top_k=1))
    assert tok.item() == 0 and keep.tolist() == [[True, False, False, False]]
    assert lp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 0].item())
    assert lp.item() < -0.1  # not log(1): reported before truncation
    tok, lp, _ = sample_step(logits, u, SamplingParams(temperature=0.0))
    assert tok.item() == 0 and lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
    tok, lp, _ = sample_step(logits, u, SamplingParams(temperature=1.0))
    assert tok.item() == 3 and lp.dtype == torch.float32
    assert lp.item() == pytest.approx(-1 - math.log(sum(math.exp(x) for x in (2, 1, 0, -1))), abs=1e-6)


def test_streams_are_per_sequence():
    assert stream_seed(0, 1, 2) == stream_seed(0, 1, 2)
    assert len({stream_seed(0, 0, 1), stream_seed(0, 1, 0), stream_seed(1, 0, 0), stream_seed(0, 0, 0)}) == 4
    a = stream_uniforms(7, [(0, 0), (3, 1)], 5)
    b = stream_uniforms(7, [(3, 1)], 5)
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])
    assert ((a >= 0) & (a < 1)).all()


def test_processed_logprobs_are_renormalised_over_the_kept_set():
    import torch

    from megatron_rl.rollout.sampling import sample_step
    from megatron_rl.rollout.types import SamplingParams

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    u = torch.tensor([0.0])  # picks the first (most likely) token
    raw = sample_step(logits, u, SamplingParams(top_k=2))[1]
    processed = sample_step(logits, u, SamplingParams(top_k=2, logprobs_mode="processed"))[1]
    assert raw.item() == pytest.approx(torch.log(torch.tensor(0.5)).item(), abs=1e-6)
    assert processed.item() == pytest.approx(torch.log(torch.tensor(0.5 / 0.8)).item(), abs=1e-6)
