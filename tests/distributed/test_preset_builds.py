"""A shrunk real preset of every family builds in megatron-core and runs (one spawned rank each).

The presets' shapes and parameter counts are checked without a model in tests/unit/model/test_presets.py;
here megatron builds each at its real widths (one or two layers) and its parameter count must equal
`num_parameters()`.
"""
import pytest

from tests.spawn import run_ranks
from tests.unit.model.test_presets import _arch


def _build(rank, world, name, overrides):
    import torch

    from megatron_rl.model import BuildOptions, build_gpt_model, causal_mask
    from tests.mcore_setup import setup_parallel

    arch = _arch(name, **overrides)
    model = build_gpt_model(arch, setup_parallel(), BuildOptions())
    dev = next(model.parameters()).device  # the CPU here; the current GPU on a GPU machine
    tokens = torch.randint(0, arch.vocab_size, (1, 8), device=dev)
    with torch.no_grad():
        loss = model(tokens, torch.arange(8, device=dev)[None], causal_mask(8, device=dev), labels=tokens)
    return sum(p.numel() for p in model.parameters()), arch.num_parameters(), bool(torch.isfinite(loss).all())


@pytest.mark.parametrize("name,overrides", [
    ("qwen3-0.6b", {"num_layers": 1, "vocab_size": 512}),
    ("qwen3-moe-30b-a3b", {"num_layers": 1, "vocab_size": 512, "num_experts": 8}),
    ("llama-3.2-1b", {"num_layers": 1, "vocab_size": 512}),
    ("qwen2.5-0.5b", {"num_layers": 1, "vocab_size": 512}),
    ("mixtral-8x7b", {"num_layers": 1, "vocab_size": 512, "hidden_size": 1024, "num_attention_heads": 8,
                      "num_kv_heads": 2, "moe_ffn_hidden_size": 1024}),
    # DeepSeek-V3's real MLA widths (q/kv latents 1536/512, head dims 128+64, v 128) at a small hidden size
    ("deepseek-v3", {"num_layers": 2, "mlp_only_layers": (0,), "vocab_size": 512, "hidden_size": 1024,
                     "num_attention_heads": 8, "ffn_hidden_size": 1024, "moe_ffn_hidden_size": 512,
                     "moe_shared_expert_ffn_hidden_size": 512, "num_experts": 8, "moe_topk": 4,
                     "moe_num_groups": 4, "moe_group_topk": 2}),
], ids=["dense", "moe", "llama", "qwen2", "mixtral", "deepseek_v3"])
@pytest.mark.mcore_api  # the layer-spec builders and MLA's resolver at real widths (0.19)
def test_shrunk_real_shape_builds(name, overrides):
    """Real hidden size, heads, head_dim and FFN widths, one layer: megatron builds it (on the CPU
    here), runs it, and has exactly the parameters num_parameters() counts."""
    [(built, counted, finite)] = run_ranks(_build, world_size=1, timeout=240, name=name, overrides=overrides)
    assert built == counted
    assert finite
