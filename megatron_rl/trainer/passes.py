"""Forward passes of the RL step through megatron's schedules (PP-aware, micro-batched).

- `logprob_pass`: forward only; per-token log π (and entropy) of every row -> old_logprobs.
- `train_pass`: forward + backward of the policy loss over one mini-batch (one optimizer step).

Log-probs come from the final hidden states and the vocab-parallel output weight through the
chunked fused kernel (megatron_rl.logprobs): full-vocabulary logits are never materialised.
A token-local loss (`TokenLocalLoss`, losses/token_local.py) instead goes through
`fused_token_loss`, which forms the output layer's gradients inside its forward (three GEMMs, not
four); the schedule's backward then only hands them on.
Values that the losses need per row live on the last pipeline stage (where the loss is).
Under context parallelism every per-token tensor, in and out, is in the rank's CP-local layout
(`batch.cp_shard`); losses finish per-sequence values with CPSeqOps.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.logprobs import token_logprobs_and_entropy
from megatron_rl.logprobs.loss_fused import fused_token_loss
from megatron_rl.logprobs.megatron_hidden import gpt_hidden_states, output_weight
from megatron_rl.losses import LOCAL, GlobalCounts, SeqOps, local_counts
from megatron_rl.losses.token_local import NllTerms, TokenTerms
from megatron_rl.metrics.reduce import reduce_metrics
from megatron_rl.model.builder import causal_mask
from megatron_rl.parallel import ParallelGroups
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.stack import forward_backward


@dataclass(frozen=True)
class PassSettings:
    """temperature: the rollout's sampling temperature (log π of the same distribution).
    chunk_size: tokens per chunk of the fused log-prob kernel (None = auto).

    No precision setting: the kernel computes the logits, softmax and entropy in fp32 from the
    model's hidden states and head weight whatever their dtype (exact products, fp32 sums), which
    is what precision.fp32_lm_head asks of an LM head; that setting changes the engine only."""

    micro_batch_size: int
    temperature: float = 1.0
    chunk_size: int | None = None


LossFn = Callable[[dict, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class TokenLocalLoss:
    """A loss whose gradient `fused_token_loss` may form in the forward (losses/token_local.py).

    terms(micro_batch) -> the micro-batch's TokenTerms (or SFT's NllTerms), `[b, L]` like its tensors.
    values: the same loss as a LossFn, called on the detached log-probs for the metrics (its loss
        value is replaced by the kernel's, the one trained on).
    """

    terms: Callable[[dict], TokenTerms | NllTerms]
    values: LossFn


def megatron_loss_scale(model) -> float:
    """The gradient megatron's schedule gives a loss in its backward: `grad_scale_func(1)` (fp16:
    the dynamic loss scale; 1 otherwise), as the schedule's backward_step applies it."""
    func = getattr(model.config, "grad_scale_func", None)
    return 1.0 if func is None else float(func(torch.ones(1, device=next(model.parameters()).device)))


def make_forward_step(groups: ParallelGroups, settings: PassSettings, loss_fn: LossFn | TokenLocalLoss,
                      need_entropy: bool, hidden_states: Callable = gpt_hidden_states,
                      head_weight: Callable = output_weight, grad_scale: float = 1.0):
    """A Megatron-LM style forward_step(data_iterator, model) -> (output, loss_func).

    loss_fn(micro_batch, logprobs [b, L], entropy [b, L] | None) -> (loss, metrics), all in the
    micro-batch's (CP-local) token layout; or a TokenLocalLoss, whose gradients the log-prob kernel
    forms in the forward: grad_scale is then the gradient the loss will get in its backward
    (`megatron_loss_scale`), checked there.

    Under context parallelism the micro-batch already holds this rank's zig-zag shard of inputs,
    labels and positions (`batch.cp_shard`); the model gets no attention mask, because megatron's
    CP attention (Transformer Engine) applies the causal mask itself, across the shards.
    hidden_states(model, input_ids, position_ids, attention_mask) -> [L, b, H] and
    head_weight(model) -> [V/TP, H] are where the log-probs read the model; the defaults take
    megatron's GPTModel (tests feed hidden states sharded as megatron shards them).
    """
    cp = groups.config.cp

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        inp, pos = mb["input_ids"], mb["position_ids"]
        mask = causal_mask(inp.shape[1], device=inp.device) if cp == 1 else None
        if not groups.is_last_stage:
            return model(inp, pos, mask), None
        hidden = hidden_states(model, inp, pos, mask)  # [L, b, H]
        labels, kept = mb["labels"], mb.get("kept_ids")

        def loss_func(h):
            weight = head_weight(model)
            kw = {"tp_group": groups.tp_group, "chunk_size": settings.chunk_size, "compute_entropy": need_entropy,
                  "temperature": settings.temperature, "kept_ids": kept.transpose(0, 1) if kept is not None else None}
            if isinstance(loss_fn, TokenLocalLoss):
                # the kernel's tokens are [L, b] flattened: lay the constants out the same way
                terms = loss_fn.terms(mb).map(lambda x: x.t().reshape(-1))
                loss, out = fused_token_loss(h, weight, labels.t(), lambda rows, lp, _ent, lp_kept: terms.chunk_loss(
                    rows, lp_kept if lp_kept is not None else lp), grad_scale=grad_scale, **kw)
                _, metrics = loss_fn.values(mb, *_outputs(out))   # the metrics; the loss is the kernel's
                metrics["loss/value/sum"] = loss.detach().double()
            else:
                loss, metrics = loss_fn(mb, *_outputs(token_logprobs_and_entropy(h, weight, labels.t(), **kw)))
            # megatron's schedule adds this "token count" up across micro-batches on the loss's device;
            # our losses are already globally normalised, so it is a placeholder 1
            return loss, torch.ones((), dtype=torch.long, device=loss.device), metrics

        def _outputs(out):
            """(log-probs [b, L], entropy [b, L] | None) of the kernel's [L, b] outputs; with
            keep_sampling_mask, π renormalised over the rollout's kept set (one action space)."""
            logprobs = out.kept_logprobs if kept is not None else out.logprobs
            return logprobs.t(), out.entropy.t() if need_entropy else None

        return hidden, loss_func

    return forward_step


def collect_logprobs(_mb, logprobs, entropy):
    """The forward-only pass's "loss": no loss, the log-probs and entropy as its outputs."""
    return torch.zeros((), device=logprobs.device), {"logprobs": logprobs, "entropy": entropy}


def micro_batches(batch: TrainBatch, slices: list[slice]) -> list[dict[str, Any]]:
    """Micro-batch dicts; "rows" lets a loss index per-row tensors it holds (e.g. old_logprobs)."""
    return [{"rows": sl, "input_ids": batch.input_ids[sl], "labels": batch.labels[sl],
             "position_ids": batch.position_ids[sl], "loss_mask": batch.loss_mask[sl],
             "rollout_logprobs": batch.rollout_logprobs[sl], "advantages": batch.advantages[sl],
             "positions": batch.positions[sl],
             "kept_ids": batch.kept_ids[sl] if batch.kept_ids is not None else None} for sl in slices]


@torch.no_grad()
def logprob_pass(model, groups: ParallelGroups, batch: TrainBatch, settings: PassSettings,
                 need_entropy: bool = True, wrap_step: Callable | None = None,
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """log π(y_t) [N, S-1] (and entropy) of every row on this rank; (None, None) off the last stage.

    wrap_step: wraps the forward step (router replay hooks in per micro-batch there).
    """
    mbs = settings.micro_batch_size
    slices = [slice(i, i + mbs) for i in range(0, batch.size, mbs)]
    step = make_forward_step(groups, settings, collect_logprobs, need_entropy)
    step = wrap_step(step) if wrap_step is not None else step
    was_training = model.training
    model.eval()
    outs = forward_backward(model, step, iter(micro_batches(batch, slices)), len(slices),
                            seq_length=batch.input_len, micro_batch_size=mbs, forward_only=True)
    model.train(was_training)
    if not groups.is_last_stage:
        return None, None
    logprobs = torch.cat([o["logprobs"] for o in outs]).float()
    entropy = torch.cat([o["entropy"] for o in outs]).float() if need_entropy else None
    return logprobs, entropy


def train_pass(model, optimizer, groups: ParallelGroups, batch: TrainBatch, slices: list[slice],
               settings: PassSettings, loss_fn: LossFn | TokenLocalLoss, need_entropy: bool = False,
               wrap_step: Callable | None = None) -> list[dict]:
    """Forward + backward of `loss_fn` over the micro-batches `slices` of one mini-batch.

    Returns the per-micro-batch metrics dicts (last stage; [] elsewhere). Gradients are
    finalised (DP/TP reductions); the caller steps the optimizer.
    """
    step = make_forward_step(groups, settings, loss_fn, need_entropy, grad_scale=megatron_loss_scale(model))
    step = wrap_step(step) if wrap_step is not None else step
    return forward_backward(model, step, iter(micro_batches(batch, slices)), len(slices),
                            seq_length=batch.input_len, micro_batch_size=settings.micro_batch_size,
                            optimizer=optimizer)


def reduce_dp(values: dict[str, torch.Tensor], groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Reduce metrics-convention values (keys ending in /sum, /min, /max) over the DP x CP ranks
    of this pipeline stage, then hand the last stage's result to every stage. Keys must be the
    same on all ranks of a stage."""
    pp = groups.config.pp
    src = dist.get_global_rank(groups.pp_group, pp - 1) if pp > 1 else None
    return reduce_metrics(values, groups.dp_cp_group, groups.pp_group if pp > 1 else None, src)


def global_counts(batch: TrainBatch, slices, groups, seq: SeqOps = LOCAL) -> GlobalCounts:
    """The mini-batch's token and sequence counts summed over its micro-batches and DP x CP ranks
    (sequences counted once: on their CP owner rank)."""
    total = GlobalCounts()
    for sl in slices:
        total = total + local_counts(batch.loss_mask[sl], seq)
    vals = reduce_dp({"num_tokens/sum": total.num_tokens, "num_seqs/sum": total.num_seqs}, groups)
    return GlobalCounts(vals["num_tokens/sum"], vals["num_seqs/sum"])
