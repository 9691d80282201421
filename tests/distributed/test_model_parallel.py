"""megatron-core model under TP / EP / PP vs world size 1: HF parity, export round trip, fwd+bwd.

Every rank builds the same random HF model (same seed), so the single-rank reference and the
sharded run start from identical weights.
"""
import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_ranks

SIZES = {
    "tp2": dict(tensor_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def _load(arch_kw, sizes, seed=0):
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import SafetensorsReader, load_hf_weights
    from megatron_rl.model.presets import preset_arch
    from tests.mcore_setup import random_hf_dir, setup_parallel

    groups = setup_parallel(**sizes)
    arch = preset_arch(**arch_kw)
    path = random_hf_dir(arch, seed=seed)
    model = build_gpt_model(arch, groups, BuildOptions(dtype="fp32"))
    load_hf_weights(model, arch, groups, SafetensorsReader(path))
    return arch, groups, model, path


def _parity_and_export(rank, world, arch_kw, sizes):
    from transformers import AutoModelForCausalLM

    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.model.parity import compare_logits, mcore_logits
    from tests.mcore_setup import hf_tensors

    arch, groups, model, path = _load(arch_kw, sizes)
    exported = dict(export_hf_weights(model, arch, groups))
    ref = hf_tensors(path)
    export_equal = exported.keys() == ref.keys() and all(torch.equal(exported[k], ref[k]) for k in ref)
    report = None
    if groups.config.pp == 1:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            report = compare_logits(hf(tokens).logits, mcore_logits(model.eval(), tokens, groups), tokens)
        # negative control: the same comparison against a model that skipped loading fails
        from megatron_rl.model import BuildOptions, build_gpt_model

        fresh = build_gpt_model(arch, groups, BuildOptions(dtype="fp32", seed=7)).eval()
        with torch.no_grad():
            control = compare_logits(hf(tokens).logits, mcore_logits(fresh, tokens, groups), tokens)
        assert control.max_logit_diff > 1e-2
    return export_equal, report


# Llama 3 with its RoPE scaling on; rope_theta 5e5 puts half the frequencies in the scaled band
LLAMA3 = dict(arch="llama", rope_llama3_factor=8.0, rope_theta=500000.0, max_position_embeddings=16384)
# every family; the MoE ones also with a dense first layer or tied embeddings where HF allows it
FAMILY_KWS = {
    "qwen3": dict(arch="qwen3"), "qwen3_tied": dict(arch="qwen3", tie_word_embeddings=True),
    "qwen3_moe": dict(arch="qwen3_moe"), "qwen3_moe_dense0": dict(arch="qwen3_moe", mlp_only_layers=(0,)),
    "llama3": LLAMA3, "qwen2_tied": dict(arch="qwen2", tie_word_embeddings=True), "qwen2": dict(arch="qwen2"),
    "mixtral": dict(arch="mixtral"),
    # MLA, first layer dense, shared expert, random router bias; and with tied embeddings and
    # group-limited routing
    "deepseek_v3": dict(arch="deepseek_v3"),
    "deepseek_v3_grouped": dict(arch="deepseek_v3", tie_word_embeddings=True, moe_num_groups=2),
}


def _parity_many(rank, world, arch_kws, sizes):
    return [_parity_and_export(rank, world, kw, sizes) for kw in arch_kws]


def test_parity_world_size_1():
    """HF -> mcore -> HF is bit-exact and the logits agree with transformers, for every family."""
    [results] = run_ranks(_parity_many, world_size=1, timeout=300, arch_kws=list(FAMILY_KWS.values()), sizes={})
    for name, (export_equal, report) in zip(FAMILY_KWS, results):
        assert export_equal, name
        assert report.ok(1e-4), (name, report)


# per layout, the families whose sharding it exercises (qkv bias rows and MLA latents under TP,
# Mixtral's and DeepSeek-V3's experts under EP)
TWO_RANK = {"tp2": ["qwen3_moe", "llama3", "qwen2", "mixtral", "deepseek_v3", "deepseek_v3_grouped"],
            "ep2": ["qwen3_moe", "mixtral", "deepseek_v3"], "tp2ep2": ["qwen3_moe", "mixtral", "deepseek_v3"]}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.mcore_api) if k in ("tp2", "ep2") else k
                                    for k in sorted(TWO_RANK)])  # tp2/ep2: specs, MLA, GPTModel's output (0.19)
def test_parity_two_ranks(layout):
    names = TWO_RANK[layout]
    for results in run_ranks(_parity_many, world_size=2, timeout=300, arch_kws=[FAMILY_KWS[n] for n in names],
                             sizes=SIZES[layout]):
        for name, (export_equal, report) in zip(names, results):
            assert export_equal, (layout, name)
            assert report.ok(1e-4), (layout, name, report)


def _rope_control(rank, world):
    """Logits of the Llama 3 HF model against mcore built with and without the RoPE scaling."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import SafetensorsReader, load_hf_weights
    from megatron_rl.model.parity import compare_logits, mcore_logits
    from megatron_rl.model.presets import preset_arch
    from tests.mcore_setup import random_hf_dir, setup_parallel

    groups = setup_parallel()
    arch = preset_arch(**LLAMA3)
    path = random_hf_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, arch.vocab_size, (2, 96), generator=torch.Generator().manual_seed(3))
    out = []
    for factor in (arch.rope_llama3_factor, 0.0):
        variant = preset_arch(**{**LLAMA3, "rope_llama3_factor": factor})
        model = build_gpt_model(variant, groups, BuildOptions(dtype="fp32")).eval()
        load_hf_weights(model, variant, groups, SafetensorsReader(path))
        with torch.no_grad():
            out.append(compare_logits(hf(tokens).logits, mcore_logits(model, tokens, groups), tokens))
    return out


def test_llama3_rope_scaling_is_what_parity_checks():
    """Negative control: without megatron's RoPE scaling the same weights miss parity."""
    [(scaled, plain)] = run_ranks(_rope_control, world_size=1, timeout=180)
    assert scaled.ok(1e-4), scaled
    assert plain.max_logit_diff > 1e-3, plain


@pytest.mark.parametrize("arch_kw", [
    dict(arch="qwen3_moe"), dict(arch="qwen3", tie_word_embeddings=True),
    dict(arch="qwen2", tie_word_embeddings=True),
    dict(arch="mixtral"),
    dict(arch="deepseek_v3"),
], ids=["moe", "dense_tied", "qwen2_tied", "mixtral", "deepseek_v3"])
def test_export_roundtrip_pp2(arch_kw):
    for export_equal, _ in run_ranks(_parity_and_export, world_size=2, arch_kw=arch_kw, sizes=SIZES["pp2"]):
        assert export_equal


# ---- forward + backward through megatron DDP / schedules ----------------------------------
BATCH, SEQ = 4, 16


def _fwd_bwd(rank, world, sizes, arch="qwen3_moe"):
    """Loss = sum of token CE / (BATCH*SEQ) over the global batch; returns (loss, HF-named grads)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.model import causal_mask
    from megatron_rl.model.hf_io import export_hf_weights

    arch, groups, model, _ = _load(dict(arch=arch), sizes)
    model = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False), module=model)
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    dp, dp_rank = groups.dp_size, dist.get_rank(groups.dp_group)
    local = tokens.chunk(dp)[dp_rank]
    micro = 2 if groups.config.pp > 1 else 1
    batches = iter(local.chunk(micro))
    norm = float(BATCH * SEQ)

    def forward_step(_, m):
        b = next(batches)
        inp, labels = b[:, :-1], b[:, 1:]
        out = m(inp, torch.arange(SEQ).expand(inp.shape[0], -1), causal_mask(SEQ), labels=labels)

        def loss_func(per_token):
            loss = per_token.float().sum() / norm
            return loss, torch.tensor(1), {"loss": loss.detach()}

        return out, loss_func

    model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=[model], num_microbatches=micro,
        seq_length=SEQ, micro_batch_size=local.shape[0] // micro, forward_only=False)
    finalize_model_grads([model], num_tokens=None)
    loss = torch.tensor(sum(float(x["loss"]) for x in losses)) if losses else torch.tensor(0.0)
    # total loss: sum over DP ranks (each holds its share / global norm), from the last stage
    if groups.is_last_stage:
        dist.all_reduce(loss, group=groups.dp_group)
    src = dist.get_global_rank(groups.pp_group, groups.config.pp - 1)
    dist.broadcast(loss, src=src, group=groups.pp_group)
    grads = dict(export_hf_weights(model, arch, groups, grads=True))
    return loss.item(), grads


@pytest.fixture(scope="module")
def reference():
    [(loss, grads)] = run_ranks(_fwd_bwd, world_size=1, sizes={})
    return loss, grads


@pytest.mark.mcore_api  # layer specs, the alltoall dispatcher, DDP, finalize_model_grads, the PP schedule (0.19)
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_fwd_bwd_matches_single_rank(reference, layout):
    ref_loss, ref_grads = reference
    assert any(g.abs().sum() > 0 for k, g in ref_grads.items() if "experts" in k)
    for loss, grads in run_ranks(_fwd_bwd, world_size=2, sizes=SIZES[layout]):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.mcore_api  # MLA's spec and its TE globals (workaround #17), 0.19
def test_mla_fwd_bwd_matches_single_rank():
    """DeepSeek-V3 under TP=2 (sequence parallel, MLA latents gathered): loss and every gradient,
    the router's bias and the shared expert's included, equal the single-rank ones."""
    [(ref_loss, ref_grads)] = run_ranks(_fwd_bwd, world_size=1, sizes={}, arch="deepseek_v3")
    assert any(g.abs().sum() > 0 for k, g in ref_grads.items() if "kv_a_proj_with_mqa" in k)
    for loss, grads in run_ranks(_fwd_bwd, world_size=2, sizes=SIZES["tp2"], arch="deepseek_v3"):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


def _router_bias_control(rank, world):
    """DeepSeek-V3 logits against transformers as loaded, then with the router's bias zeroed."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.model.parity import compare_logits, mcore_logits

    arch, groups, model, path = _load(dict(arch="deepseek_v3"), {})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    out = []
    with torch.no_grad():
        for zero in (False, True):
            if zero:
                for name, buf in model.named_buffers():
                    if name.endswith("router.expert_bias"):
                        buf.zero_()
            out.append(compare_logits(hf(tokens).logits, mcore_logits(model.eval(), tokens, groups), tokens))
    return out


def test_router_bias_is_what_parity_checks():
    """Negative control: the sigmoid router's score-correction bias (a buffer, not a parameter) is
    loaded, and without it the same weights miss parity."""
    [(loaded, zeroed)] = run_ranks(_router_bias_control, world_size=1, timeout=180)
    assert loaded.ok(1e-4), loaded
    assert zeroed.max_logit_diff > 1e-2, zeroed
