"""Settings that were accepted and then ignored, or failed only mid-run, are refused by load_config."""
import os

import pytest

from megatron_rl.config import ConfigError, load_config


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.group_size=1"], r"rollout.group_size=1: must be an integer >= 2 \(every advantage estimator"),
    (["data.heldout_size=600000"], r"data.heldout_size=600000: addition: heldout_size=600000 is more than half"),
    (["data.tasks=[sorting]", "data.heldout_size=600000"], r"data.heldout_size=600000: sorting:"),
    (["sft.steps=5", "train.eval_size=0"],
     r"sft.target_accuracy=0.35 can never stop SFT: .* empty because train.eval_size=0; set sft.target_accuracy=null"),
    (["sft.steps=5", "data.heldout_size=0"], r"empty because data.heldout_size=0"),
    (["sft.steps=5", "data.jsonl=prompts.jsonl"], r"empty because data.jsonl is set"),
    (["optim.min_lr=1e-5"], r"optim.min_lr=1e-05: there is no learning-rate schedule"),
    (["rollout.backend=vllm", "rollout.vllm={request_timeout_s: 0}"],
     r"rollout.vllm.request_timeout_s=0: must be a number > 0 \(seconds; 0 is not 'no timeout'"),
    (["rollout.backend=vllm", "rollout.vllm={health_timeout_s: 0}"], r"rollout.vllm.health_timeout_s=0: must be"),
    (["rollout.backend=vllm", "rollout.vllm={gpu_memory_utilization: 90}"],
     r"rollout.vllm.gpu_memory_utilization=90: must be a number > 0 and <= 1"),
    (["rollout.backend=vllm", "rollout.vllm={max_num_seqs: 0}"], r"rollout.vllm.max_num_seqs=0: must be an integer >= 1"),
])
def test_refused_at_startup(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides", [
    ["rollout.group_size=2"],
    ["sft.steps=5", "train.eval_size=0", "sft.target_accuracy=null"],
    ["sft.steps=0", "train.eval_size=0"],          # SFT off: its settings do not matter
    ["sft.steps=5", "sft.eval_size=600"],   # cut to train.eval_size (documented: SFTSection.eval_size)
    ["optim.min_lr=0"],
    ["rollout.backend=vllm", "rollout.vllm={gpu_memory_utilization: 0.5, max_num_seqs: 8, max_logprobs: null}"],
])
def test_neighbouring_settings_pass(overrides):
    load_config(None, overrides)


def test_heldout_size_default_is_the_tasks_former_size():
    """Tasks held out 1000 problems while data.heldout_size was not passed to them; the default
    and the demo keep that, so their runs draw the same training prompts as before."""
    from megatron_rl.data.tasks import Task

    assert load_config(None).data.heldout_size == Task.heldout_size == 1000
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert load_config(os.path.join(root, "examples", "demo_cpu.yaml")).data.heldout_size == 1000


@pytest.mark.parametrize("override,msg", [
    ("{num_kv_heads: 0}", r"model.overrides.num_kv_heads=0: must be an integer >= 1"),
    ("{num_layers: 0}", r"model.overrides.num_layers=0: must be an integer >= 1"),
    ("{num_layers: 2.5}", r"model.overrides.num_layers=2.5: must be an integer"),
    ("{num_experts: -1}", r"model.overrides.num_experts=-1: must be an integer >= 0"),
    ("{rms_norm_eps: 0}", r"model.overrides.rms_norm_eps=0: must be a number > 0"),
    ("{rope_theta: big}", r"model.overrides.rope_theta='big': must be a number > 0"),
    ("{tie_word_embeddings: 1}", r"model.overrides.tie_word_embeddings=1: must be true or false"),
    ("{mlp_only_layers: [0, -1]}", r"model.overrides.mlp_only_layers\[1\]=-1: must be an integer >= 0"),
])
def test_model_overrides_are_checked_by_field_type(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [f"model.overrides={override}"])


def test_model_overrides_written_as_yaml_text_become_numbers():
    """YAML reads 1e6 (no dot, no exponent sign) as a string; the float fields take it as the number."""
    overrides = "{rope_theta: 1e6, rms_norm_eps: 1e-5, num_experts: 0, rope_llama3_factor: 0, mlp_only_layers: [0]}"
    cfg = load_config(None, [f"model.overrides={overrides}"])
    assert cfg.model.overrides == {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_experts": 0,
                                   "rope_llama3_factor": 0, "mlp_only_layers": [0]}
