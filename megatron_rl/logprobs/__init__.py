"""Vocab-parallel, context-parallel, chunked log-probs and entropy (never full-vocab logits).

    from megatron_rl.logprobs import token_logprobs_and_entropy
    out = token_logprobs_and_entropy(hidden, weight, labels, tp_group=tp_group)
    out.logprobs, out.entropy, out.kept_logprobs          # each shaped like labels

`fused` (the autograd Function and entry point), `chunk_math` (per-chunk formulas),
`context_parallel` (zig-zag CP layout), `megatron_hidden` (hidden states from a GPTModel),
`reference` (the straightforward computation, for tests and benchmarks).
"""
from megatron_rl.logprobs.context_parallel import (
    global_positions,
    local_cu_seqlens,
    next_token_labels,
    zigzag_all_gather,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)
from megatron_rl.logprobs.fused import (
    FusedVocabParallelLogprobs,
    auto_chunk_size,
    auto_grad_tile,
    token_logprobs_and_entropy,
)
from megatron_rl.logprobs.reference import reference_logprobs_and_entropy
from megatron_rl.logprobs.types import LogprobOutput

__all__ = [
    "FusedVocabParallelLogprobs",
    "LogprobOutput",
    "auto_chunk_size",
    "auto_grad_tile",
    "global_positions",
    "local_cu_seqlens",
    "next_token_labels",
    "reference_logprobs_and_entropy",
    "token_logprobs_and_entropy",
    "zigzag_all_gather",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]
