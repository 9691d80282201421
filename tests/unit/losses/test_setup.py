"""resolve_loss checks parameter values against the ranges each surrogate, correction and
aggregation declares where it registers: at start-up, naming the field and the range."""
import pytest
import torch

from megatron_rl.config import LossSection
from megatron_rl.losses import AGGREGATIONS, CORRECTIONS, RECIPES, SURROGATES
from megatron_rl.losses.setup import resolve_loss


@pytest.mark.parametrize("corrections,msg", [
    ([{"name": "tis_token", "C": 0}], r"loss.corrections\[0\].C=0: must be a number > 0"),
    ([{"name": "tis_seq", "C": -1.0}], r"loss.corrections\[0\].C=-1.0: must be a number > 0"),
    ([{"name": "mis_seq", "C": 0}], r"loss.corrections\[0\].C=0: must be a number > 0"),
    ([{"name": "mis_token", "C": 0.5}], r"loss.corrections\[0\].C=0.5: must be a number >= 1 \(C < 1 makes"),
    ([{"name": "tis_token"}, {"name": "icepop", "alpha": 0}], r"loss.corrections\[1\].alpha=0: must be a number > 0"),
    ([{"name": "icepop", "alpha": 6}], r"loss.corrections\[0\]: alpha=6 > beta=5.0 keeps nothing.*set alpha <= beta"),
    ([{"name": "mis_geo", "lo": 0}], r"loss.corrections\[0\].lo=0: must be a number > 0"),
    ([{"name": "mis_geo", "lo": 1.1}], r"loss.corrections\[0\]: lo=1.1 > hi=1.001"),
    ([{"name": "veto", "tau": 0}], r"loss.corrections\[0\].tau=0: must be a number > 0"),
    ([{"name": "kpop", "phi": -0.1}], r"loss.corrections\[0\].phi=-0.1: must be a number >= 0"),
    ([{"name": "nav", "kappa": 0}], r"loss.corrections\[0\].kappa=0: must be a number > 0"),
    ([{"name": "nav", "nav_scope": "bogus"}], r"loss.corrections\[0\].nav_scope='bogus': choose one of suffix"),
])
def test_correction_values_out_of_range_fail_at_startup(corrections, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_loss(LossSection(corrections=corrections), 8)


@pytest.mark.parametrize("section,msg", [
    (LossSection(recipe="minirl", surrogate_params={"c_tis": 0}), r"surrogate_params.c_tis=0: must be a number > 0"),
    (LossSection(surrogate_params={"eps_low": -0.2}), r"surrogate_params.eps_low=-0.2: must be a number >= 0 \(>= 1"),
    (LossSection(surrogate_params={"eps_high": -1}), r"surrogate_params.eps_high=-1: must be a number >= 0"),
    (LossSection(surrogate_params={"dual_clip": 1.0}), r"surrogate_params.dual_clip=1.0: must be a number > 1"),
    (LossSection(recipe="mu_grpo", surrogate_params={"dual_clip": 0.5}), r"dual_clip=0.5: must be a number > 1"),
    (LossSection(recipe="gspo", surrogate_params={"eps_high": -1e-4}), r"eps_high=-0.0001: must be a number >= 0"),
])
def test_surrogate_values_out_of_range_fail_at_startup(section, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_loss(section, 8)


def test_no_clip_written_as_huge_epsilons_passes():
    """examples/repro/p3o.py's unclipped arm: ε_low = ε_high = 1e9 (ε_low >= 1 is no lower bound)."""
    r = resolve_loss(LossSection(recipe="grpo", surrogate_params={"eps_low": 1.0e9, "eps_high": 1.0e9}), 8)
    assert r.surrogate_params == {"eps_low": 1.0e9, "eps_high": 1.0e9}


@pytest.mark.parametrize("section,msg", [
    (LossSection(recipe="grpo", aggregation_params={"l_norm": 100}),
     r"loss.aggregation_params.l_norm: not a parameter here; choose from \(none\)"),
    (LossSection(recipe="minirl", aggregation_params={"lnorm": 100}),
     r"loss.aggregation_params.lnorm: not a parameter here; choose from l_norm"),
    (LossSection(recipe="minirl", aggregation_params={"l_norm": "1e3"}), r"l_norm='1e3': must be float"),
    (LossSection(recipe="minirl", aggregation_params={"l_norm": 0}), r"aggregation_params.l_norm=0: must be a number > 0"),
    (LossSection(recipe="minirl", aggregation_params={"l_norm": -8}), r"l_norm=-8: must be a number > 0"),
])
def test_aggregation_params_are_checked_at_startup(section, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_loss(section, 8)


def test_valid_values_and_every_default_pass():
    """Every registered entry's defaults fit its own declared ranges, and boundary values pass."""
    for name in RECIPES:
        resolve_loss(LossSection(recipe=name), 8)
    for name in CORRECTIONS:
        resolve_loss(LossSection(corrections=[{"name": name}]), 8)
    r = resolve_loss(LossSection(recipe="minirl", surrogate_params={"c_tis": None, "eps_low": 1, "eps_high": float("inf")},
                                 aggregation_params={"l_norm": 100}), 8)
    assert r.agg_params == {"l_norm": 100}
    resolve_loss(LossSection(corrections=[{"name": "mis_token", "C": 1}, {"name": "icepop", "alpha": 2, "beta": 2},
                                          {"name": "kpop", "phi": 0}]), 8)
    assert SURROGATES.get("ppo_clip").rules.limits and AGGREGATIONS.get("token_sum_norm").rules.limits


def test_advantage_params_reach_the_estimator_and_are_checked():
    """loss.advantage_params sets grpo's eps (the spec leaves it open); names and ranges are checked
    as the surrogate's are, at start-up."""
    from megatron_rl.trainer.phases import group_advantages

    r = resolve_loss(LossSection(recipe="grpo", advantage_params={"eps": 0.5}), 8)
    assert r.advantage_params == {"eps": 0.5}
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])   # mean 0.5, std 0.5
    adv, _, _ = group_advantages(rewards, 4, r.advantages, False, r.advantage_params)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]   # 0.5 / (0.5 + 0.5)
    assert resolve_loss(LossSection(recipe="grpo"), 8).advantage_params == {}
    with pytest.raises(ValueError, match=r"loss.advantage_params.eps=-1: must be a number >= 0"):
        resolve_loss(LossSection(recipe="grpo", advantage_params={"eps": -1}), 8)
    with pytest.raises(ValueError, match=r"loss.advantage_params.eps: not a parameter here; choose from \(none\)"):
        resolve_loss(LossSection(recipe="minirl", advantage_params={"eps": 0.1}), 8)


@pytest.mark.parametrize("aggregation", ["token_mean", "token_sum_norm", "seq_mean_token_sum"])
def test_gspo_is_aggregated_per_sequence_only(aggregation):
    """A token aggregation of gspo's per_token (ℓ_i on each of the response's tokens) weights each
    response by its length; the spec aggregates ℓ_i per sequence."""
    with pytest.raises(ValueError, match=r"gspo allows loss.aggregation in \['seq_mean_token_mean'\].*length"):
        resolve_loss(LossSection(recipe="gspo", aggregation=aggregation), 8)
