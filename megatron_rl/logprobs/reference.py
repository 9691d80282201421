"""The straightforward computation: full logits, log-softmax, gather, entropy.

This is what the fused path must reproduce (fp32, 1e-5). It holds `[N, V]` logits plus several
same-sized temporaries, so it is for tests and the benchmark only, never for training.

    z = h Wᵀ / temperature                                  [N, V]
    logprob_t   = z_{t,y_t} − logsumexp_v z_{t,v}           (0 where y_t < 0: ignored)
    entropy_t   = −Σ_v p_{t,v} log p_{t,v}                  (= logZ − Σ_v p z)
    kept_t      = z_{t,y_t} − logsumexp_{v ∈ K_t} z_{t,v}   (0 where y_t < 0 or K_t is empty)
"""
from __future__ import annotations

import torch

from megatron_rl.logprobs.types import LogprobOutput


def reference_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    kept_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> LogprobOutput:
    """Full-vocabulary reference.

    Args:
        hidden: `[*, H]` final hidden states.
        weight: `[V, H]` the whole (unsharded) output-layer weight.
        labels: `[*]` target ids; negative = ignored.
        kept_ids: `[*, K]` kept token ids per position, padded with -1, or None.
        temperature: logits are divided by it.

    Returns:
        `LogprobOutput(logprobs [*], entropy [*], kept_logprobs [*] or None)`, fp32 (fp64 for
        fp64 inputs).
    """
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    z = (h @ weight.t()).to(torch.promote_types(weight.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = y >= 0
    safe_y = torch.where(valid, y, torch.zeros_like(y))
    logprobs = torch.where(valid, logp.gather(1, safe_y[:, None])[:, 0], torch.zeros_like(logp[:, 0]))
    entropy = -(logp.exp() * logp).sum(-1)
    kept = None
    if kept_ids is not None:
        k = kept_ids.reshape(y.shape[0], -1)
        present = k >= 0
        zk = z.gather(1, torch.where(present, k, torch.zeros_like(k)))
        zk = zk.masked_fill(~present, float("-inf"))
        nonempty = present.any(-1)
        lse = torch.logsumexp(zk, dim=-1)
        zy = z.gather(1, safe_y[:, None])[:, 0]
        ok = valid & nonempty
        kept = torch.where(ok, zy - torch.where(ok, lse, torch.zeros_like(lse)), torch.zeros_like(zy))
        kept = kept.reshape(lead)
    return LogprobOutput(logprobs.reshape(lead), entropy.reshape(lead), kept)
