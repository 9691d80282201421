"""Losses over multi-turn trajectories: only sampled tokens count.

A trajectory's row holds the environment's tokens as context (loss_mask False). Every recipe and
every rollout correction must give the same loss, metrics' values and gradients as on the same
samples with the environment's tokens deleted (the independent computation: a batch that never
had them), and whatever the environment positions hold (π_θ, π_old, μ) changes nothing. GSPO's
sequence ratio is also checked against its formula written out over the sampled tokens only."""
import dataclasses

import pytest
import torch

from megatron_rl.config.schema import LossSection
from megatron_rl.losses import RECIPES, PolicyBatch, compute_policy_loss, local_counts
from megatron_rl.losses.corrections import CORRECTIONS
from megatron_rl.losses.setup import resolve_loss
from megatron_rl.rollout.trajectory import Turn, assemble
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.batch import build_batch
from megatron_rl.trainer.phases import group_advantages

G = torch.Generator().manual_seed(0)


def _turn(context, ids):
    lp = -torch.rand(len(ids), generator=G) - 0.05
    return Sample(prompt_ids=torch.tensor(context), response_ids=torch.tensor(ids), rollout_logprobs=lp,
                  finish_reason="stop", policy_version=0)


def _trajectory(prompt, turns):
    """turns: [(sampled ids, observation ids)]; the last observation empty."""
    out, context = [], list(prompt)
    for ids, obs in turns:
        out.append(Turn(_turn(context, ids), obs))
        context += ids + obs
    return assemble(prompt, out)


SAMPLES = [_trajectory([2, 3, 4], [([5, 6, 7], [8, 9]), ([10, 1], [])]),
           _trajectory([2, 3], [([5, 6, 7, 1], [])]),
           _trajectory([4], [([5], [6, 7, 8]), ([9, 9, 1], [11]), ([12], [])]),
           _trajectory([4, 4], [([13, 14], [])])]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def _compact(s: Sample) -> Sample:
    """The same sample without the environment's tokens (what a single-turn batch of its sampled
    tokens would be)."""
    keep = s.trained()
    return dataclasses.replace(s, response_ids=s.response_ids[keep], rollout_logprobs=s.rollout_logprobs[keep],
                               loss_mask=None)


# per sampled token of each sample, in order: log π_old and log π_θ (moderate ratios to μ)
OLD = [s.rollout_logprobs[s.trained()] + 0.05 * torch.randn(s.num_trained(), generator=G) for s in SAMPLES]
NEW = [o + 0.05 * torch.randn(len(o), generator=G) for o in OLD]


def _policy_batch(samples, env_value: float | None = None):
    """(PolicyBatch, π_θ leaf) of `samples`; env_value: what every off-mask position of π_θ, π_old
    and μ holds (None: 0)."""
    b = build_batch(samples, REWARDS, pad_id=0, seq_len=12)
    adv, _, _ = group_advantages(torch.tensor(REWARDS), 2, "grpo", False)
    b = b.with_advantages(adv)
    fill = 0.0 if env_value is None else env_value
    old, new = torch.full_like(b.rollout_logprobs, fill), torch.full_like(b.rollout_logprobs, fill)
    mu = torch.where(b.loss_mask, b.rollout_logprobs, fill)
    for i in range(len(samples)):
        old[i][b.loss_mask[i]], new[i][b.loss_mask[i]] = OLD[i], NEW[i]
    lp = new.clone().requires_grad_(True)
    return PolicyBatch(lp, old, mu, b.advantages, b.loss_mask, positions=b.positions), lp


def _loss(samples, kwargs, env_value=None):
    batch, lp = _policy_batch(samples, env_value)
    loss, metrics = compute_policy_loss(batch, normaliser=local_counts(batch.loss_mask), **kwargs)
    loss.backward()
    sampled_grads = [lp.grad[i][batch.loss_mask[i]] for i in range(len(samples))]
    return loss.detach(), metrics, lp.grad, sampled_grads, batch.loss_mask


def _settings():
    out = [(f"recipe={r}", LossSection(recipe=r)) for r in RECIPES.names()]
    out += [(f"correction={c}", LossSection(recipe="grpo", corrections=[{"name": c}])) for c in CORRECTIONS.names()]
    return out


@pytest.mark.parametrize("name,section", _settings(), ids=[n for n, _ in _settings()])
def test_environment_tokens_change_no_loss_and_a_trajectory_counts_as_its_sampled_tokens(name, section):
    resolved = resolve_loss(section, 8)
    kwargs = resolved.loss_kwargs()
    kwargs["surrogate_params"].update({p: 0.9 for p in resolved.step_statistics})  # P3O's ESS
    loss, metrics, grad, sampled, mask = _loss(SAMPLES, kwargs)
    for garbage in (-30.0, 7.0):  # anything at the environment's positions: nothing changes
        l2, m2, g2, _, _ = _loss(SAMPLES, kwargs, garbage)
        assert torch.equal(loss, l2) and torch.equal(grad, g2), name
        assert all(torch.equal(metrics[k], m2[k]) for k in metrics), name
    assert (grad[~mask] == 0).all()
    lc, mc, _, sampled_c, _ = _loss([_compact(s) for s in SAMPLES], kwargs)
    torch.testing.assert_close(loss, lc, rtol=1e-6, atol=1e-7, msg=name)
    for a, b in zip(sampled, sampled_c):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    assert metrics.keys() == mc.keys()
    for k in metrics:
        torch.testing.assert_close(metrics[k].double(), mc[k].double(), rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")


def test_gspo_takes_its_sequence_ratio_over_the_sampled_tokens_only():
    resolved = resolve_loss(LossSection(recipe="gspo", surrogate_params={"eps_low": 0.5, "eps_high": 0.5}), 8)
    loss, _, _, sampled, _ = _loss(SAMPLES, resolved.loss_kwargs(), env_value=3.0)
    adv, _, _ = group_advantages(torch.tensor(REWARDS), 2, "grpo", False)
    expected, grads = 0.0, []
    for i, s in enumerate(SAMPLES):  # ratios within the clip band: ℓ_i = −s_i A_i
        n = s.num_trained()
        ratio = torch.exp((NEW[i].double() - OLD[i].double()).sum() / n)
        assert 0.5 < ratio < 1.5
        expected += float(-ratio * adv[i]) / len(SAMPLES)
        grads.append(torch.full((n,), float(-ratio * adv[i] / n / len(SAMPLES))))
    assert abs(float(loss) - expected) < 1e-6
    for got, want in zip(sampled, grads):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-7)
