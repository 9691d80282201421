"""Precision recipes: each expands to its documented settings, layer by layer overridable; GPU-only
ones are accepted by megatron-core's TransformerConfig and refused here with the capability named."""
import pytest

from megatron_rl.config import ConfigError
from megatron_rl.configure import load_config
from megatron_rl.precision import PRECISION_RECIPES


def _value(cfg, path):
    node = cfg
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


@pytest.mark.parametrize("name", list(PRECISION_RECIPES))
def test_each_recipe_expands_to_its_settings(name):
    cfg = load_config(None, [f"precision.recipe={name}", "model.dtype=bf16"] if name == "te_fp8" else
                      [f"precision.recipe={name}"])
    for path, value in PRECISION_RECIPES[name].settings.items():
        assert _value(cfg, path) == value, path


def test_fields_override_the_recipe_of_their_layer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {dtype: fp32}\nrollout: {dtype: bf16}\n")
    cfg = load_config(str(path), ["precision.recipe=fp16_fp32head"])  # a command-line recipe beats the file
    assert (cfg.model.dtype, cfg.rollout.dtype, cfg.precision.fp32_lm_head) == ("fp16", "fp16", True)
    cfg = load_config(str(path), ["precision.recipe=fp16", "rollout.dtype=fp32"])  # a command-line field beats it
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("fp16", "fp32")
    path.write_text("precision: {recipe: bf16}\nrollout: {dtype: fp32}\n")  # in the file, the file's field wins
    cfg = load_config(str(path))
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("bf16", "fp32")
    path.write_text("precision: {recipe: bf16_fp32head}\n")  # a command-line recipe replaces the file's:
    cfg = load_config(str(path), ["precision.recipe=fp16"])   # none of its settings survive
    assert (cfg.model.dtype, cfg.precision.fp32_lm_head) == ("fp16", False)


@pytest.mark.parametrize("overrides,msg", [
    (["precision.recipe=fp64"], "precision.recipe='fp64': choose one of fp32"),
    (["precision.recipe=bf16_fp32head", "rollout.backend=vllm"], "vLLM has no option to run only the LM head"),
    (["precision.fp8=hybrid"], "set model.dtype=bf16"),
    (["precision.fp8=e5m2"], "precision.fp8='e5m2'"),
    (["rollout.quantization=fp4"], "rollout.quantization='fp4': choose one of fp8_block, fp8_tensor, mxfp8"),
    (["precision.recipe=fp8_block", "rollout.backend=vllm"],
     ("rollout.quantization=fp8_block: rollout.backend=vllm does not run it; use rollout.backend=embedded, or "
      r"rollout.quantization=null \(a vLLM server on a GPU quantizes with rollout.vllm.quantization=fp8\)")),
])
def test_bad_precision_settings_fail_at_start_up(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8"])
def test_megatron_accepts_the_fp8_fields(recipe):
    """te_fp8 can only run on a GPU with TE; its TransformerConfig fields are checked here."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.model.builder import BuildOptions, fp8_fields

    fields = fp8_fields(BuildOptions(dtype="bf16", fp8="hybrid", fp8_recipe=recipe))
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True,
                               use_cpu_initialization=True, **fields)
    assert (config.fp8, config.fp8_recipe) == ("hybrid", recipe)
    assert fp8_fields(BuildOptions()) == {}
