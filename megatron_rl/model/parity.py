"""Numerical parity between a `transformers` model and the megatron-core model built from it.

Used by tools/check_parity.py and the tests: same tokens through both, compare logits and
per-token log-probs. Full-vocabulary logits are fine here (small models only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.model.arch import ModelArch
from megatron_rl.model.builder import causal_mask
from megatron_rl.parallel import ParallelGroups


def random_hf_model(arch: ModelArch, seed: int = 0, std: float = 0.1, dtype: torch.dtype = torch.float32):
    """A random-initialised `transformers` model of `arch`.

    std: weights ~ N(0, std) (larger than the usual 0.02 so logits are far from uniform);
    norm weights ~ 1 + N(0, 0.1) so a norm mapped to the wrong place cannot pass parity;
    checkpointed buffers (DeepSeek-V3's router score-correction bias) ~ N(0, 0.1), so that they
    change routing and a dropped one fails parity.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch.to_hf_config(), attn_implementation="eager", dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        saved = model.state_dict().keys()
        for name, b in model.named_buffers():
            if name in saved and b.is_floating_point():
                b.normal_(0.0, 0.1)
    return model.eval()


@torch.no_grad()
def mcore_logits(model, tokens: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Full-vocabulary logits [B, S, V] of a megatron GPTModel (gathered over TP). PP must be 1."""
    if groups.config.pp != 1:
        raise ValueError("mcore_logits runs a plain forward; use PP=1")
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, -1)
    logits = model(tokens, pos, causal_mask(s, device=tokens.device))  # [B, S, V/TP]
    tp = dist.get_world_size(groups.tp_group)
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits.float()


@dataclass(frozen=True)
class ParityReport:
    max_logit_diff: float
    max_logprob_diff: float

    def ok(self, tol: float) -> bool:
        return self.max_logit_diff <= tol and self.max_logprob_diff <= tol


def compare_logits(ref: torch.Tensor, got: torch.Tensor, tokens: torch.Tensor) -> ParityReport:
    """Max |logit diff| and max |log-prob diff| of the next tokens (tokens[:, 1:])."""
    lp_ref = torch.log_softmax(ref.float()[:, :-1], -1).gather(-1, tokens[:, 1:, None])
    lp_got = torch.log_softmax(got.float()[:, :-1], -1).gather(-1, tokens[:, 1:, None])
    return ParityReport(max_logit_diff=(ref.float() - got.float()).abs().max().item(),
                        max_logprob_diff=(lp_ref - lp_got).abs().max().item())
