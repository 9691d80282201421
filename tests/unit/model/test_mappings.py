"""Pure shard math of the HF <-> mcore mappings, against independent constructions."""
import pytest
import torch

from megatron_rl.model.mappings import Kind, from_shards, mapping_for, to_local_shard
from megatron_rl.model.mappings.base import qkv_from_mcore, qkv_to_mcore
from megatron_rl.model.presets import preset_arch


def test_qkv_fuse_matches_per_group_layout():
    nh, ng, d, h = 4, 2, 3, 5
    q = torch.arange(nh * d * h, dtype=torch.float32).view(nh * d, h)
    k = 1000 + torch.arange(ng * d * h, dtype=torch.float32).view(ng * d, h)
    v = 2000 + torch.arange(ng * d * h, dtype=torch.float32).view(ng * d, h)
    fused = qkv_to_mcore(q, k, v, nh, ng, d)
    # independent construction: group g = [q heads 2g, 2g+1 ; k_g ; v_g]
    rows = []
    for g in range(ng):
        rows += [q[(2 * g) * d:(2 * g + 2) * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    assert torch.equal(fused, torch.cat(rows))
    for a, b in zip(qkv_from_mcore(fused, nh, ng, d), (q, k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_roundtrip(kind, size):
    nh, ng, d, h = 8, 4, 2, 6
    g = torch.Generator().manual_seed(0)
    if kind is Kind.QKV:
        hf = [torch.randn(nh * d, h, generator=g), torch.randn(ng * d, h, generator=g),
              torch.randn(ng * d, h, generator=g)]
    elif kind is Kind.GATED:
        hf = [torch.randn(8, h, generator=g), torch.randn(8, h, generator=g)]
    else:
        hf = [torch.randn(8, 12, generator=g)]
    kw = {"num_heads": nh, "num_groups": ng, "head_dim": d}
    shards = [to_local_shard(kind, hf, r, size, **kw) for r in range(size)]
    back = from_shards(kind, shards, **kw)
    assert len(back) == len(hf)
    for a, b in zip(back, hf):
        assert torch.equal(a, b)


@pytest.mark.parametrize("size", [1, 2])
def test_qkv_bias_fuses_like_the_weight_rows(size):
    """Qwen2's q/k/v biases: each bias element goes where its weight row goes, on every TP rank."""
    nh, ng, d, h = 4, 2, 3, 5
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, h, generator=g) for n in (nh, ng, ng))
    qb, kb, vb = (w[:, 0].clone() for w in (q, k, v))  # a bias equal to the weights' first column
    for rank in range(size):
        w = to_local_shard(Kind.QKV, [q, k, v], rank, size, num_heads=nh, num_groups=ng, head_dim=d)
        b = to_local_shard(Kind.QKV, [qb, kb, vb], rank, size, num_heads=nh, num_groups=ng, head_dim=d)
        assert torch.equal(b, w[:, 0])
    shards = [to_local_shard(Kind.QKV, [qb, kb, vb], r, size, num_heads=nh, num_groups=ng, head_dim=d)
              for r in range(size)]
    back = from_shards(Kind.QKV, shards, num_heads=nh, num_groups=ng, head_dim=d)
    assert all(torch.equal(x, y) for x, y in zip(back, (qb, kb, vb)))


def test_gated_shard_keeps_gate_and_up_halves_per_rank():
    gate = torch.arange(4.0).view(4, 1)
    up = 10 + torch.arange(4.0).view(4, 1)
    assert to_local_shard(Kind.GATED, [gate, up], 1, 2).flatten().tolist() == [2.0, 3.0, 12.0, 13.0]


def test_mapping_covers_every_hf_tensor_of_random_models():
    """Every tensor in a saved transformers checkpoint is named by the mapping exactly once."""
    from tests.mcore_setup import hf_tensors, random_hf_dir

    for arch in (preset_arch("qwen3"), preset_arch("qwen3_moe", mlp_only_layers=(0,)),
                 preset_arch("qwen3", tie_word_embeddings=True), preset_arch("llama"),
                 preset_arch("qwen2", tie_word_embeddings=True), preset_arch("mixtral")):
        names = set(hf_tensors(random_hf_dir(arch)))
        mapped = []
        for p in mapping_for(arch):
            if not p.export:
                continue
            for layer in range(arch.num_layers):
                for e in range(max(arch.num_experts, 1)):
                    mapped += [t.format(layer=layer, expert=e) for t in p.hf]
        # templates expand to names for every layer/expert; keep only the ones that exist
        assert names <= set(mapped), names - set(mapped)
