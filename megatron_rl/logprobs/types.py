"""Result type shared by the fused and the reference computations."""
from __future__ import annotations

from typing import NamedTuple

import torch


class LogprobOutput(NamedTuple):
    """Per-token outputs, all fp32 and shaped like `labels` (`[*]`).

    logprobs: `log π(y_t)` over the full vocabulary; 0 where the label is ignored (< 0).
    entropy: full-vocabulary entropy `H_t = logZ_t − Σ_v p_{t,v} z_{t,v}`, or None when not asked.
    kept_logprobs: `log π(y_t) − logsumexp_{v ∈ K_t} z_{t,v}` (log-prob renormalised over the kept
        top-p/top-k set `K_t`), or None without `kept_ids`; 0 where the label is ignored or `K_t`
        is empty.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    kept_logprobs: torch.Tensor | None
