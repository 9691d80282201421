"""Sampling, one decode step: pure functions on [B, V] logits (the embedded engine's; module docstring
of embedded.py for the semantics).

    logits / T -> reported log-prob = log_softmax of the sampled token in fp32 before truncation
    (or renormalised over the kept set: logprobs_mode="processed") -> top-k then top-p keep-mask ->
    inverse-CDF draw from the renormalised kept distribution with the row's uniform.
    T = 0 is greedy argmax (log-prob and kept set at T = 1).

Cost: O(B x V) per step (top-p sorts each row: O(B x V log V)).
"""
from __future__ import annotations

import torch

from megatron_rl.rollout.types import SamplingParams, stream_seed


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / T; T = 0 (greedy) leaves them at T = 1."""
    logits = logits.float()
    return logits if temperature == 0 else logits / temperature


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep-mask [B, V] of the k largest logits per row (k = -1: all). Ties with the k-th are kept."""
    if k == -1 or k >= logits.shape[-1]:
        return torch.ones_like(logits, dtype=torch.bool)
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits >= kth


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep-mask [B, V] of the nucleus: the most likely tokens whose mass first reaches p.

    A token is kept when the probability mass strictly before it (descending order, ties in
    id order) is < p, so the top token is always kept. p = 1: all.
    """
    if p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = before < p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def truncation_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """top-k, then top-p on the renormalised top-k distribution (vLLM's order)."""
    keep = top_k_mask(logits, top_k)
    if top_p < 1.0:
        keep &= top_p_mask(logits.masked_fill(~keep, float("-inf")), top_p)
    return keep


def sample_inverse_cdf(logits: torch.Tensor, keep: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [B]: draw from softmax(logits) restricted to `keep`, with uniforms u [B] in [0, 1).

    Picks the first token whose cumulative (fp64) probability exceeds u * total; never a token
    outside `keep` or of zero probability.
    """
    probs = torch.softmax(logits.double().masked_fill(~keep, float("-inf")), dim=-1)
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u.to(cdf.device, torch.float64) * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    last_positive = torch.where(probs > 0, ids, -1).amax(-1)
    return torch.minimum(idx, last_positive)


def sample_step(logits: torch.Tensor, u: torch.Tensor, sampling: SamplingParams):
    """One decoding step for rows of logits [B, V] -> (tokens [B], logprobs [B] fp32, keep [B, V])."""
    scaled = apply_temperature(logits, sampling.temperature)
    keep = truncation_mask(scaled, sampling.top_k, sampling.top_p)
    if sampling.temperature == 0:
        tokens = scaled.argmax(-1)
    else:
        tokens = sample_inverse_cdf(scaled, keep, u)
    dist = scaled.masked_fill(~keep, float("-inf")) if sampling.logprobs_mode == "processed" else scaled
    logprobs = torch.log_softmax(dist, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs, keep


def stream_uniforms(seed: int, seqs: list[tuple[int, int]], steps: int) -> torch.Tensor:
    """[N, steps] fp64 uniforms: row s is the stream of sequence seqs[s] = (i, j)."""
    out = torch.empty(len(seqs), steps, dtype=torch.float64)
    for s, (i, j) in enumerate(seqs):
        gen = torch.Generator().manual_seed(stream_seed(seed, i, j))
        out[s] = torch.rand(steps, generator=gen, dtype=torch.float64)
    return out
