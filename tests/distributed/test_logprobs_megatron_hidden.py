"""`gpt_hidden_states` + the fused head equal megatron-core GPTModel's own vocab-parallel loss.

A tiny dense GPTModel (local spec, fp32) at TP=2, untied without sequence parallelism and tied
with it: log-probs equal `−model(..., labels=labels)` and the gradient of every parameter is the
same, which also shows the TP reduction of the hidden-state gradient is done exactly once.
"""
from __future__ import annotations

import pytest
import torch

from tests.spawn import run_ranks

# a forward pre-hook on GPTModel's output layer, whose output step changed in 0.19
pytestmark = pytest.mark.mcore_api

VOCAB, SEQ, BATCH = 64, 16, 2


def _build(tp: int, tied: bool, sp: bool, pgs):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        use_cpu_initialization=True, add_bias_linear=False, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, sequence_parallel=sp, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=tied, pg_collection=pgs)


def _gpt_worker(rank, world_size):
    from megatron_rl.logprobs import token_logprobs_and_entropy
    from megatron_rl.logprobs.megatron_hidden import gpt_hidden_states, output_weight
    from megatron_rl.parallel import ParallelConfig, init_parallel
    from megatron_rl.platform import apply_platform_workarounds

    apply_platform_workarounds()
    groups = init_parallel(ParallelConfig(tensor_model_parallel_size=world_size), seed=1234)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    weights = torch.randn(BATCH, SEQ, generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)

    report = {}
    for tied, sp in ((False, False), (True, True)):
        model = _build(world_size, tied, sp, groups.pgs)
        model.zero_grad()
        megatron_lp = -model(tokens, pos, mask, labels=labels)            # [B, S]
        (megatron_lp * weights).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        hidden = gpt_hidden_states(model, tokens, pos, mask)               # [S, B, H]
        out = token_logprobs_and_entropy(hidden, output_weight(model), labels.t(),
                                         tp_group=groups.tp_group, chunk_size=5)
        ours_lp = out.logprobs.t()
        (ours_lp * weights).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        report[(tied, sp)] = {
            "hidden_shape": tuple(hidden.shape),
            "value_diff": (ours_lp - megatron_lp).abs().max().item(),
            "same_params": grads.keys() == ref_grads.keys(),
            "grad_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
        }
    return report


def test_gpt_hidden_states_tp2_match_megatron_loss():
    for rank, report in enumerate(run_ranks(_gpt_worker, world_size=2, timeout=240)):
        for (tied, sp), r in report.items():
            where = f"rank {rank} tied={tied} sp={sp}: {r}"
            assert r["hidden_shape"] == (SEQ, BATCH, 32), where
            assert r["same_params"] and r["value_diff"] < 1e-5 and r["grad_diff"] < 1e-5, where
