"""Every config number must be finite unless the field says what infinity means.

`optim.lr=inf` was accepted (the checks refused nan only): the first update wrote NaN into the
weights, the engine failed on them, and the run saved them. Each float field of every section,
of the vLLM settings and of the loss parts' declared parameters is set to ±inf here and must be
refused at load time, naming the field.
"""
import math
import re
import typing
from dataclasses import fields

import pytest

from megatron_rl.config import ConfigError, schema
from megatron_rl.configure import load_config
from megatron_rl.losses import ADVANTAGES, AGGREGATIONS, CORRECTIONS, SURROGATES
from megatron_rl.rollout.vllm.config import VllmConfig

# fields where infinity has a meaning, said in their hints: no clip bound, no IS truncation
INFINITY_MEANS_SOMETHING = {"loss.surrogate_params.eps_low", "loss.surrogate_params.eps_high",
                            "loss.surrogate_params.c_tis"}


def _float_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls, localns={"VllmConfig": VllmConfig})  # schema names it for type checkers only
    return [f.name for f in fields(cls) if hints[f.name] in (float, float | None)]


SECTION_FIELDS = [f"{section.name}.{name}" for section in fields(schema.RunConfig)
                  if hasattr(getattr(schema, section.type, None), "__dataclass_fields__")
                  for name in _float_fields(getattr(schema, section.type))]


def test_the_sections_have_float_fields_to_check():
    assert {"optim.lr", "model.init_std", "sft.lr", "rollout.temperature", "optim.clip_grad"} <= set(SECTION_FIELDS)


@pytest.mark.parametrize("field", SECTION_FIELDS)
@pytest.mark.parametrize("value", [".inf", "-.inf"])
def test_an_infinite_section_number_is_refused(field, value):
    with pytest.raises(ConfigError, match=rf"{field}=-?inf: must be a"):
        load_config(None, [f"{field}={value}"])


@pytest.mark.parametrize("field", _float_fields(VllmConfig))
def test_an_infinite_vllm_number_is_refused(field):
    with pytest.raises(ConfigError, match=rf"rollout.vllm.{field}=inf: must be a"):
        load_config(None, ["rollout.backend=vllm", f"rollout.vllm={{{field}: .inf}}"])


def _declared(registry) -> list[tuple[str, str]]:
    return [(name, param) for name in registry.names() for param in registry.get(name).rules.limits]


def _loss_override(kind: str, name: str, param: str, value: str) -> list[str]:
    if kind == "surrogate":
        return [f"loss.surrogate={name}", "loss.aggregation=token_mean", f"loss.surrogate_params={{{param}: {value}}}"]
    if kind == "correction":
        return [f"loss.corrections=[{{name: {name}, {param}: {value}}}]"]
    if kind == "aggregation":
        return [f"loss.aggregation={name}", f"loss.aggregation_params={{{param}: {value}}}"]
    return [f"loss.advantages={name}", f"loss.advantage_params={{{param}: {value}}}"]


LOSS_PARAMS = [(kind, name, param) for kind, registry in (("surrogate", SURROGATES), ("correction", CORRECTIONS),
                                                           ("aggregation", AGGREGATIONS), ("advantage", ADVANTAGES))
               for name, param in _declared(registry)]


@pytest.mark.parametrize("kind,name,param", LOSS_PARAMS, ids=[f"{n}.{p}" for _, n, p in LOSS_PARAMS])
def test_an_infinite_loss_parameter_is_refused_unless_it_means_something(kind, name, param):
    if name == "gspo":  # its aggregation is fixed
        overrides = [f"loss.surrogate={name}", "loss.aggregation=seq_mean_token_mean",
                     f"loss.surrogate_params={{{param}: .inf}}"]
    else:
        overrides = _loss_override(kind, name, param, ".inf")
    where = {"surrogate": "loss.surrogate_params", "aggregation": "loss.aggregation_params",
             "advantage": "loss.advantage_params"}.get(kind, "loss.corrections[0]")
    if f"{where}.{param}" in INFINITY_MEANS_SOMETHING:
        cfg = load_config(None, overrides)
        assert math.isinf(cfg.loss.surrogate_params[param])
    else:
        with pytest.raises(ConfigError, match=re.escape(f"{where}.{param}=inf: must be a")):
            load_config(None, overrides)
