"""Sample.loss_mask: the response tokens a sample trains on (an agent's environment tokens masked).

An all-true mask packs exactly what no mask packs (today's single-turn batches, bit for bit); a
masked token changes nothing the losses and the diagnostics compute, whatever its values."""
import dataclasses

import pytest
import torch

from megatron_rl.config.schema import LossSection
from megatron_rl.losses import RECIPES, PolicyBatch, compute_policy_loss, local_counts
from megatron_rl.losses.setup import resolve_loss
from megatron_rl.metrics.mismatch import mismatch_sums
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.batch import build_batch
from megatron_rl.trainer.phases import group_advantages


def _samples(mask=None, garbage: float = -0.5) -> list[Sample]:
    """Two samples; the first has a 5-token response whose token 2 is masked when `mask` says so
    (its μ and kept ids then hold `garbage`)."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(5, generator=g) - 0.05
    kept = torch.tensor([[3, 4, -1], [5, -1, -1], [6, 7, 8], [9, -1, -1], [2, 3, -1]])
    if mask is not None:
        lp[2], kept[2] = garbage, torch.tensor([int(-garbage * 10) % 60, -1, -1])
    return [Sample(prompt_ids=torch.tensor([1, 2, 3]), response_ids=torch.tensor([4, 5, 11, 9, 2]), rollout_logprobs=lp,
                   finish_reason="stop", policy_version=0, kept_ids=kept, loss_mask=mask),
            Sample(prompt_ids=torch.tensor([1, 7]), response_ids=torch.tensor([8, 9, 2]),
                   rollout_logprobs=torch.tensor([-0.3, -0.2, -0.1]), finish_reason="stop", policy_version=0,
                   kept_ids=torch.tensor([[8, -1, -1], [9, 1, -1], [2, -1, -1]]))]


def _fields(batch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def test_an_all_true_mask_packs_exactly_what_no_mask_packs():
    plain = build_batch(_samples(), [1.0, 0.0], pad_id=0, seq_len=9, with_kept_ids=True)
    full = _samples()
    full[0] = dataclasses.replace(full[0], loss_mask=torch.ones(5, dtype=torch.bool))
    masked = build_batch(full, [1.0, 0.0], pad_id=0, seq_len=9, with_kept_ids=True)
    for name, value in _fields(plain).items():
        other = _fields(masked)[name]
        assert (torch.equal(value, other) and value.dtype == other.dtype) if isinstance(value, torch.Tensor) \
            else value == other, name


def test_a_masked_token_is_context_only():
    mask = torch.tensor([True, True, False, True, True])
    b = build_batch(_samples(mask, garbage=-7.0), [1.0, 0.0], pad_id=0, seq_len=9, with_kept_ids=True)
    assert b.input_ids[0, 3 + 2] == 11  # still in the row: the next tokens are conditioned on it
    assert b.loss_mask[0].tolist() == [False, False, True, True, False, True, True, False]
    assert b.rollout_logprobs[0, 4] == 0 and b.positions[0].tolist() == [0, 0, 0, 1, 0, 3, 4, 0]
    assert (b.kept_ids[0, 4] == -1).all()  # as at padding
    assert b.with_advantages(torch.tensor([2.0, -1.0])).advantages[0, 4] == 0
    assert float(local_counts(b.loss_mask).num_tokens) == 4 + 3  # the environment's token is no token count
    with pytest.raises(ValueError, match=r"loss_mask must be bool \[5\]"):
        build_batch(_samples(torch.ones(4, dtype=torch.bool)), [1.0, 0.0], pad_id=0, seq_len=9)


def _policy_batch(mask_values: float):
    """A PolicyBatch from the masked batch whose masked position holds `mask_values` in every
    tensor the losses read (π_θ, π_old, μ, A)."""
    mask = torch.tensor([True, True, False, True, True])
    b = build_batch(_samples(mask, garbage=mask_values), [1.0, 0.0], pad_id=0, seq_len=9)
    adv, _, _ = group_advantages(torch.tensor([1.0, 0.0]), 2, "grpo", False)
    b = b.with_advantages(adv)
    g = torch.Generator().manual_seed(1)
    old = b.rollout_logprobs + 0.1 * torch.randn(b.rollout_logprobs.shape, generator=g)
    lp = old + 0.2 * torch.randn(old.shape, generator=g)
    hole = (slice(0, 1), slice(4, 5))  # row 0, label index of response token 2
    for t in (old, lp):
        t[hole] = mask_values
    mu, a = b.rollout_logprobs.clone(), b.advantages.clone()
    mu[hole], a[hole] = mask_values, -mask_values
    lp = lp.clone().requires_grad_(True)
    return PolicyBatch(lp, old, mu, a, b.loss_mask, positions=b.positions), lp


@pytest.mark.parametrize("recipe", RECIPES.names())
def test_a_masked_token_changes_no_loss_gradient_or_diagnostic(recipe):
    loss = resolve_loss(LossSection(recipe=recipe), 8)
    kwargs = loss.loss_kwargs()
    kwargs["surrogate_params"].update({param: 0.9 for param in loss.step_statistics})  # P3O's ESS
    out = []
    for value in (-0.5, -30.0):
        batch, lp = _policy_batch(value)
        counts = local_counts(batch.loss_mask)
        value_loss, metrics = compute_policy_loss(batch, normaliser=counts, **kwargs)
        value_loss.backward()
        diagnostics = mismatch_sums(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                    logprobs=lp.detach())
        assert lp.grad[0, 4] == 0
        out.append((value_loss.detach(), lp.grad, metrics, diagnostics))
    (l1, g1, m1, d1), (l2, g2, m2, d2) = out
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1), recipe
    assert d1.keys() == d2.keys() and all(torch.equal(d1[k], d2[k]) for k in d1)


def test_a_batch_with_environment_tokens_numbers_the_policy_turns_of_its_trained_positions():
    mask = torch.tensor([True, True, False, True, True])
    b = build_batch(_samples(mask), [1.0, 0.0], pad_id=0, seq_len=9)
    # row 0: prompt 3, response label positions 2..6 with turn 0, 0, env, 1, 1; row 1 is one turn
    assert b.turns.tolist() == [[-1, -1, 0, 0, -1, 1, 1, -1], [-1, 0, 0, 0, -1, -1, -1, -1]]
    assert build_batch(_samples(), [1.0, 0.0], pad_id=0, seq_len=9).turns is None  # single-turn: as before
    assert b.select(torch.tensor([1])).turns.tolist() == [[-1, 0, 0, 0, -1, -1, -1, -1]]
