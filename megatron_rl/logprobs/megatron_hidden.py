"""Hidden states in front of megatron-core `GPTModel`'s output layer, without computing logits.

How (megatron-core 0.16.1): a forward pre-hook on `model.output_layer` (a `ColumnParallelLinear`)
records its input — the decoder output after the final norm, `[S, B, H]` (`[S/TP, B, H]` under
sequence parallelism) — and hands the layer a zero-token slice instead, so `GPTModel.forward`
runs unchanged (embedding, RoPE, packed-sequence params, decoder, final norm, wrappers such as
`Float16Module`) and its output projection costs nothing. Why not the alternatives:

- `runtime_gather_output` only decides whether the TP-sharded logits are all-gathered; the
  `[S, B, V/TP]` logits are still computed (and with it, gathered to full V): the opposite of
  what we want.
- calling `model.decoder` directly means re-implementing `GPTModel._preprocess` (embedding,
  rotary tables, packed-sequence handling), which changes between megatron-core versions.
- toggling `model.post_process` changes an attribute the constructor used to build the model.
- a hook that lets the layer run on the real input would still materialise the logits.

The output layer's own TP backward is skipped with it, so the recorded states are routed
through the same TP mapping it would have applied (see `fused`): sequence parallel ->
`gather_from_sequence_parallel_region` (all-gather forward, reduce-scatter backward); TP > 1 ->
`copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward). The returned
tensor is therefore the full sequence on every TP rank and ready for
`token_logprobs_and_entropy(..., reduce_grad_input=False)`.

Use (labels shifted before any CP split; packed THD batches have B = 1):

    hidden = gpt_hidden_states(model, input_ids, position_ids, attention_mask,
                               packed_seq_params=packed_seq_params)          # [S, B, H]
    out = token_logprobs_and_entropy(hidden, output_weight(model), labels.t(),  # labels [B, S]
                                     tp_group=tp_group, temperature=rollout_temperature)
    logprobs, entropy = out.logprobs.t(), out.entropy.t()                     # [B, S]

Not supported: multi-token prediction (`mtp_num_layers`; the MTP head needs labels and calls the
output layer again) and pipeline stages without the output layer.
"""
from __future__ import annotations

import torch

from megatron_rl.model.builder import unwrap_model


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This TP rank's output-layer weight `[V/TP, H]` (the embedding weight when tied)."""
    gpt = unwrap_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def gpt_hidden_states(model: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
    """Run `model(*args, **kwargs)` (a `GPTModel`, possibly wrapped) up to its output layer.

    Takes `GPTModel.forward`'s arguments (`input_ids, position_ids, attention_mask,
    packed_seq_params=...`); `labels` must not be given.

    Returns:
        `[S, B, H]` final hidden states (after the final norm), full sequence, replicated over TP,
        whose backward performs the TP reduction megatron's output layer would have done.
        Pair with `labels.t()` (`[S, B]`) and `output_weight(model)`.
    """
    gpt = unwrap_model(model)
    layer = getattr(gpt, "output_layer", None)
    if layer is None or not getattr(gpt, "post_process", True):
        raise ValueError("model has no output layer on this pipeline stage")
    if getattr(gpt.config, "mtp_num_layers", None):
        raise ValueError("multi-token prediction (mtp_num_layers) is not supported by gpt_hidden_states")
    if kwargs.get("labels") is not None:
        raise ValueError("do not pass labels: the log-probs are computed from the hidden states")

    captured: list[torch.Tensor] = []

    def take_input(module, args, kw):
        hidden = args[0] if args else kw.pop("input_")
        captured.append(hidden)
        return (hidden[:0],) + tuple(args[1:]), kw

    handle = layer.register_forward_pre_hook(take_input, with_kwargs=True)
    try:
        model(*args, **kwargs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"output layer was called {len(captured)} times, expected once")
    hidden = captured[0]

    tp_group = layer.tp_group
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=tp_group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    return hidden
