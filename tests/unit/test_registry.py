"""Registry entries are typed specs, checked when they register: a misspelt declaration or a rule
for a parameter the function does not take fails at import, not as a silently ignored flag."""
import pytest
import torch

from megatron_rl.losses import CORRECTIONS, SURROGATES, register_correction, register_surrogate
from megatron_rl.registry import ParamRules, Registry


def _surrogate(batch, *, eps: float = 0.1, flag: bool = False):
    return torch.zeros(())


def test_a_misspelt_declaration_fails_at_registration():
    with pytest.raises(TypeError, match="token_lcoal"):
        register_surrogate("toy_typo", token_lcoal=True)(_surrogate)
    assert "toy_typo" not in SURROGATES


def test_rules_must_name_keyword_parameters_of_the_function():
    with pytest.raises(TypeError, match=r"declares rules for \['epsilon'\]"):
        register_surrogate("toy_rules", limits={"epsilon": {"lo": 0}})(_surrogate)
    with pytest.raises(TypeError, match=r"limits\['eps'\] has \['low'\]"):
        register_surrogate("toy_bounds", limits={"eps": {"low": 0}})(_surrogate)
    with pytest.raises(TypeError, match="reads_policy='eps' must name one of its bool keyword parameters"):
        register_correction("toy_reads", reads_policy="eps")(_surrogate)
    assert not {"toy_rules", "toy_bounds"} & set(SURROGATES.names()) and "toy_reads" not in CORRECTIONS


def test_a_registry_takes_its_own_spec_type_once():
    reg = Registry("toy", ParamRules)
    reg.add("a", ParamRules())
    with pytest.raises(ValueError, match="toy 'a' is already registered"):
        reg.add("a", ParamRules())
    with pytest.raises(TypeError, match="must be a ParamRules"):
        reg.add("b", {"limits": {}})
    with pytest.raises(KeyError, match="unknown toy 'c'; available: a"):
        reg.get("c")
    assert [1] not in reg  # an unhashable config value is simply not a name
    reg.remove("a")
    assert reg.names() == []


def test_declarations_are_read_as_attributes():
    assert SURROGATES.get("ppo_clip").token_local and not SURROGATES.get("gspo").token_local
    assert CORRECTIONS.get("tis_token").reads_policy_with({}) is False
    assert CORRECTIONS.get("tis_token").reads_policy_with({"tis_use_rho": True}) is True
