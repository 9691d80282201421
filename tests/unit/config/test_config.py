import json
import os

import pytest

from megatron_rl.config import ConfigError, LossSection
from megatron_rl.configure import load_config
from megatron_rl.losses.setup import resolve_loss


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {steps: 7}\nloss: {recipe: dapo}\n")
    cfg = load_config(str(path), ["train.steps=3", "--tensor-model-parallel-size", "2", "--lr", "3e-4",
                                  "loss.corrections=[{name: tis_token, C: 4}]", "--use-distributed-optimizer"])
    assert cfg.train.steps == 3 and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.optim.lr == 3e-4 and cfg.optim.use_distributed_optimizer
    assert cfg.loss.recipe == "dapo" and cfg.loss.corrections == [{"name": "tis_token", "C": 4}]


@pytest.mark.parametrize("override,msg", [
    ("train.stepz=3", "did you mean train.steps"),
    ("rollout.backend=sglang", "rollout.backend"),
    ("parallel.tensor_model_parallel_size=0", "tensor_model_parallel_size"),
    ("optim.dtype=bf16", "precision is model.dtype"),
    ("nonsense", "cannot parse"),
    ("sft.eval_size=0", "sft.eval_size"),
    ("model.overrides={num_moe_experts: 8}",
     r"model.overrides.num_moe_experts: not a ModelArch field \(did you mean num_experts\?\); choose from .*num_layers"),
    ("model.overrides={arch: llama}", r"model.overrides.arch: not a ModelArch field.*model.arch"),
    # surrogate / correction parameters are checked against the function's keyword parameters
    ("loss.surrogate_params={epz: 0.2}", r"loss.surrogate_params.epz: not a parameter here; choose from .*eps_low"),
    ("loss.surrogate_params={eps_high: 1.0e9}", r"eps_high='1.0e9': must be float .*exponent with a sign"),
    ("loss.corrections=[{name: tis_token, C: two}]", r"loss.corrections\[0\].C='two': must be float"),
    ("loss.corrections=[{name: tis_token, tis_use_rho: 1}]", r"tis_use_rho=1: must be bool"),
])
def test_bad_config_names_the_key(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [override])


@pytest.mark.parametrize("section,msg", [
    (LossSection(recipe=None, surrogate="ppo_clipp"), "ppo_clipp"),
    (LossSection(recipe="grpo", surrogate="gspo", aggregation="token_mean"), "sequence-level"),
    (LossSection(recipe="p3o", aggregation="seq_mean_token_mean"), "token_mean"),
    (LossSection(recipe="p3o", surrogate_params={"ess": 0.5}), "computed by the trainer"),
    (LossSection(corrections=["tis_token"]), r"corrections\[0\]"),
])
def test_invalid_loss_combinations_fail_at_startup(section, msg):
    with pytest.raises((ValueError, KeyError), match=msg):
        resolve_loss(section, 8)


def test_loss_parameters_of_the_right_kind_pass():
    cfg = load_config(None, ["loss.recipe=minirl", "loss.surrogate_params={c_tis: null, eps_high: 1.0e+9}",
                             "loss.corrections=[{name: tis_token, C: 3}]"])
    assert cfg.loss.surrogate_params == {"c_tis": None, "eps_high": 1e9}


def test_recipe_defaults_and_overrides():
    r = resolve_loss(LossSection(recipe="minirl"), max_response_len=12)
    assert (r.surrogate, r.aggregation, r.advantages) == ("minirl", "token_sum_norm", "mean_centered")
    assert r.agg_params == {"l_norm": 12.0}
    r = resolve_loss(LossSection(recipe="dapo", surrogate_params={"eps_high": 0.3}), 8)
    assert r.surrogate_params == {"eps_low": 0.2, "eps_high": 0.3}


def test_recipe_implications_conflict_even_with_the_default_value():
    with pytest.raises(ConfigError, match="loss.recipe=minirl_r3 implies moe.router_replay=r3"):
        load_config(None, ["loss.recipe=minirl_r3", "moe.router_replay=none"])
    assert load_config(None, ["loss.recipe=minirl_r3"]).moe.router_replay == "r3"


def test_printed_and_saved_configs_carry_no_secrets():
    """config_to_dict feeds --print-config and every checkpoint's copy: the server key and the
    server's environment values are redacted there, not in the config the run uses."""
    from megatron_rl.config.loader import config_to_dict

    cfg = load_config(None, ["rollout.backend=vllm",
                             "rollout.vllm={url: 'http://127.0.0.1:8000', api_key: SECRET-KEY, env: {HF_TOKEN: hf_SECRET}}"])
    text = json.dumps(config_to_dict(cfg))
    assert "SECRET" not in text and '"HF_TOKEN": "<redacted>"' in text and '"api_key": "<redacted>"' in text
    assert cfg.rollout.vllm.api_key == "SECRET-KEY" and cfg.rollout.vllm.env == {"HF_TOKEN": "hf_SECRET"}
    assert config_to_dict(load_config(None, []))["rollout"]["vllm"]["api_key"] is None  # nothing to redact


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.oversample=true"], r"rollout.oversample=true .* set loss.filter_zero_variance_groups=true"),
    (["rollout.max_oversample=2"], r"rollout.max_oversample=2 bounds over-sampling, which is off"),
    (["rollout.oversample=true", "loss.filter_zero_variance_groups=true", "rollout.prompts_per_step=4",
      "rollout.max_oversample=1.2"], r"rollout.max_oversample=1.2 leaves no extra prompt"),
    (["rollout.max_oversample=0.5"], r"rollout.max_oversample=0.5: must be a number >= 1"),
    (["rollout.oversample=1"], r"rollout.oversample=1: expected true or false"),
    (["rollout.oversample=true", "loss.filter_zero_variance_groups=true", "rollout.max_oversample=1e6"],
     r"rollout.max_oversample=1000000.0: must be a number >= 1 and <= 16 \(at most"),
])
def test_oversampling_settings_are_consistent(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)
    ok = load_config(None, ["rollout.oversample=true", "loss.filter_zero_variance_groups=true",
                            "rollout.max_oversample=1.5", "rollout.prompts_per_step=2"])
    assert ok.rollout.max_oversample == 1.5  # floor(1.5 x 2) = 3: one extra prompt


def test_an_empty_mapping_on_the_command_line_replaces_the_files_mapping(tmp_path):
    """A mapping override merges key by key into the file's; `{}` empties it (the only way to drop
    the file's keys: examples/multiturn_cpu.yaml's calculator settings under env.name=guess)."""
    cfg = load_config("examples/multiturn_cpu.yaml", ["env.settings={}", "env.name=guess", "data.tasks=[guessing]"])
    assert cfg.env.name == "guess" and cfg.env.settings == {}
    merged = load_config("examples/multiturn_cpu.yaml", ["env.settings={call_open: 'x:'}"])
    assert merged.env.settings == {"call_open": "x:", "call_close": "", "result_open": "r:", "result_close": ""}
    with pytest.raises(ConfigError, match="env.settings: .*guess"):
        load_config("examples/multiturn_cpu.yaml", ["env.name=guess", "data.tasks=[guessing]"])
    path = tmp_path / "c.yaml"
    path.write_text("model: {overrides: {num_layers: 2}}\n")
    assert load_config(str(path), ["model.overrides={}"]).model.overrides == {}


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                        "examples")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".yaml")))
def test_every_example_config_loads(name):
    """Each examples/*.yaml is a valid config as shipped (what `--config` gets before any override);
    one that trains on reasoning-gym tasks where that optional extra is installed (lane 1)."""
    if name.startswith("reasoning_gym"):
        pytest.importorskip("reasoning_gym")
    cfg = load_config(os.path.join(EXAMPLES, name))
    cfg.check_layout(1)
