"""Checkpoint-format (per-expert) tensors into the engine's fused in-memory layout, and back to logits."""
import pytest
import torch

from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.hf_state import Target, checkpoint_layout
from tests.unit.rollout.conftest import make_checkpoint

E, I, H = 4, 8, 16
FUSED = {"model.layers.1.mlp.experts.gate_up_proj": (E, 2 * I, H),
         "model.layers.1.mlp.experts.down_proj": (E, H, I), "model.norm.weight": (H,)}


def test_layout_fused_experts():
    layout = checkpoint_layout(FUSED)
    assert len(layout) == 3 * E + 1
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert layout["model.layers.1.mlp.experts.2.gate_proj.weight"] == Target(fused, 2, (0, I))  # gate first
    assert layout["model.layers.1.mlp.experts.2.up_proj.weight"] == Target(fused, 2, (I, 2 * I))
    assert layout["model.layers.1.mlp.experts.3.down_proj.weight"] == Target(
        "model.layers.1.mlp.experts.down_proj", 3, (0, H))
    assert layout["model.norm.weight"] == Target("model.norm.weight")


def test_layout_mixtral_renames_the_block():
    from megatron_rl.rollout.hf_state import rules_for

    shapes = {**FUSED, "model.layers.1.mlp.gate.weight": (E, H)}
    layout = checkpoint_layout(shapes, rules_for("mixtral"))
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert layout["model.layers.1.block_sparse_moe.experts.2.w1.weight"] == Target(fused, 2, (0, I))  # gate
    assert layout["model.layers.1.block_sparse_moe.experts.2.w3.weight"] == Target(fused, 2, (I, 2 * I))  # up
    assert layout["model.layers.1.block_sparse_moe.experts.0.w2.weight"] == Target(
        "model.layers.1.mlp.experts.down_proj", 0, (0, H))
    assert layout["model.layers.1.block_sparse_moe.gate.weight"] == Target("model.layers.1.mlp.gate.weight")
    assert len(layout) == 3 * E + 2


def test_layout_per_expert_modules_is_identity():
    shapes = {f"model.layers.0.mlp.experts.{e}.{p}.weight": (I, H) for e in range(E) for p in ("gate_proj", "up_proj")}
    assert checkpoint_layout(shapes) == {n: Target(n) for n in shapes}


@pytest.mark.parametrize("arch_kw", [
    {"arch": "qwen3_moe"}, {"arch": "qwen3_moe", "mlp_only_layers": (0,)},
    {"arch": "qwen3"}, {"arch": "qwen3", "tie_word_embeddings": True},
    {"arch": "llama", "rope_llama3_factor": 8.0, "max_position_embeddings": 16384},
    {"arch": "qwen2", "tie_word_embeddings": True}, {"arch": "mixtral"}],
                         ids=["moe", "moe_dense0", "dense", "dense_tied", "llama3", "qwen2_tied", "mixtral"])
def test_checkpoint_roundtrip_logits_equal(tmp_path_factory, arch_kw):
    arch, ref, ckpt = make_checkpoint(tmp_path_factory, seed=3, **arch_kw)
    if arch.arch == "qwen3_moe":
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" in ckpt  # checkpoints are per expert
    if arch.arch == "mixtral":  # and Mixtral's name the block differently from its in-memory `mlp`
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in ckpt
    engine = EmbeddedEngine(arch, dtype="fp32")
    engine.update_weights(ckpt.items(), version=7)
    assert engine.policy_version == 7
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        assert torch.equal(engine.model(tokens).logits, want)
        bf16 = EmbeddedEngine(arch, dtype="bf16")
        bf16.update_weights(ckpt.items(), version=7)
        diff = (bf16.model(tokens).logits.float() - want).abs().max().item()
    assert 0 < diff < 0.5


def test_gate_up_swapped_changes_logits(moe_checkpoint):
    arch, ref, ckpt = moe_checkpoint
    swap = {"gate_proj": "up_proj", "up_proj": "gate_proj"}

    def renamed(name):
        parts = name.split(".")
        return ".".join(swap.get(p, p) for p in parts) if ".experts." in name else name

    engine = EmbeddedEngine(arch)
    engine.update_weights(((renamed(k), v) for k, v in ckpt.items()), version=0)
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        assert (engine.model(tokens).logits - ref(tokens).logits).abs().max() > 1e-2


def test_tied_alias_accepted(dense_checkpoint):
    arch, ref, ckpt = dense_checkpoint
    assert "lm_head.weight" not in ckpt
    engine = EmbeddedEngine(arch)
    engine.update_weights([*ckpt.items(), ("lm_head.weight", ckpt["model.embed_tokens.weight"])], version=1)
    with torch.no_grad():
        assert torch.equal(engine.model(torch.arange(5)[None]).logits, ref(torch.arange(5)[None]).logits)


def test_errors(moe_checkpoint):
    arch, _, ckpt = moe_checkpoint
    engine = EmbeddedEngine(arch)
    gone = "model.layers.0.mlp.experts.1.up_proj.weight"
    with pytest.raises(KeyError, match=r"1 missing \['model.layers.0.mlp.experts.1.up_proj.weight'\]"):
        engine.update_weights([(k, v) for k, v in ckpt.items() if k != gone], version=1)
    with pytest.raises(KeyError, match=r"1 unexpected \['model.layers.0.mlp.experts.9.up_proj.weight'\]"):
        engine.update_weights([*ckpt.items(), ("model.layers.0.mlp.experts.9.up_proj.weight", ckpt[gone])], 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.update_weights([(gone, ckpt[gone][:-1])], version=1)
    with pytest.raises(KeyError, match="given twice"):
        engine.update_weights([(gone, ckpt[gone]), (gone, ckpt[gone])], version=1)
    assert engine.policy_version == -1
