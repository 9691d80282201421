"""What every rollout engine (embedded, vLLM, ...) takes and returns (the protocol and the
registry of engines are in engine.py).

A sample carries everything the losses and
diagnostics need: the engine's log-prob of every sampled token (`rollout_logprobs`, i.e. log μ),
the routed experts when the engine can report them (router replay R3), the kept top-p/top-k set
when asked (keep_sampling_mask), and the policy version whose weights produced it, per token
when a weight update fell inside its generation (partial rollouts: off-policy schedules count
staleness per token).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (vLLM's names).

    temperature: logits are divided by it before sampling; the reported log-probs are of the
        temperature-scaled distribution before top-p/top-k truncation (the trainer computes
        log π with the same temperature). 0 means greedy (log-probs then at temperature 1).
    top_p, top_k: nucleus / top-k truncation (1.0 / -1 = off).
    max_tokens: response length cap. stop_token_ids: ids that end a response (included in it).
    seed: base seed; sample j of prompt i uses a stream derived from (seed, i, j), so a batch
        is reproducible regardless of batching.
    return_kept_ids: also return the token ids kept by top-p/top-k at every position.
    logprobs_mode: "raw" = log_softmax(logits / T) before truncation (vLLM raw_logprobs);
        "processed" = renormalised over the kept top-p/top-k set, i.e. the distribution actually
        sampled from (vLLM processed_logprobs; what keep_sampling_mask pairs with).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    return_kept_ids: bool = False
    logprobs_mode: str = "raw"

    def __post_init__(self):
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"sampling.logprobs_mode must be raw or processed, got {self.logprobs_mode!r}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Request:
    """One sequence to sample: the unit of work of the request-level engine API
    (`generate_requests`, rollout/requests.py), where the engine batches whatever requests it has.

    prompt_ids: the token ids so far (a prompt, or a trajectory's prompt + turns + observations).
    sampling: its own settings (requests of one call may differ, e.g. in max_tokens).
    stream: (i, j), its random stream: `stream_seed(sampling.seed, i, j)`, the stream sample j of
        prompt i of a `generate` call uses, so a request's sample does not depend on which other
        requests share its batch. The Sample it gets has prompt_index i, sample_index j.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: tuple[int, int] = (0, 0)

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))


def requests_of(prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Request]:
    """A `generate(prompts, n, sampling)` call as requests: (prompt i, sample j) at index i·n + j."""
    return [Request(tuple(p), sampling, (i, j)) for i, p in enumerate(prompts) for j in range(n)]


def grouped(samples: list[Sample], num_prompts: int, n: int) -> list[list[Sample]]:
    """requests_of's flat samples back as generate's result[i][j]."""
    return [samples[i * n:(i + 1) * n] for i in range(num_prompts)]


@dataclass
class Sample:
    """One response to one prompt.

    prompt_ids: [P] int64. response_ids: [R] int64 (includes the stop token when one ended it).
    rollout_logprobs: [R] float32, log μ(y_t | x, y_<t) as the engine sampled.
    finish_reason: "stop" (stop token) or "length" (max_tokens).
    routed_experts: [P + R - 1, num_moe_layers, top_k] int16 or None: the experts each
        processed input position was routed to, for every MoE layer (position i is the token
        at index i of prompt+response; the last sampled token is never an input).
    kept_ids: [R, K] int64 padded with -1, or None: the token ids top-p/top-k kept.
    policy_version: version of the weights that generated the sample's first token (the version
        it started with; the oldest of its tokens').
    token_versions: [R] int32, or None (= every token policy_version): the version of the weights
        that computed each response token's distribution, when they differ: a generation that a
        weight update paused and resumed (partial rollouts, train.in_flight_update=pause).
    prompt_index: index of the prompt in the generate() call; sample_index: j of n.
    loss_mask: [R] bool, or None (= all true): which response tokens the policy sampled and is
        trained on. A multi-turn rollout puts the environment's tokens (tool output, the next user
        turn) into the response as context and masks them: they are no loss term, no token count,
        no part of a sequence's log-ratio, and their rollout_logprobs / kept_ids are not read.
    cached_tokens: how many of the prompt's tokens the engine found in its prefix cache (a
        diagnostic: rollout/prefix_cache/*), or None when the engine does not say.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    finish_reason: str
    policy_version: int
    prompt_index: int = 0
    sample_index: int = 0
    routed_experts: torch.Tensor | None = None
    kept_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    cached_tokens: int | None = None

    def versions(self) -> torch.Tensor:
        """[R] int64: the policy version of each response token (`token_versions`, or policy_version)."""
        if self.token_versions is None:
            return torch.full((len(self.response_ids),), self.policy_version, dtype=torch.long,
                              device=self.response_ids.device)
        return self.token_versions.long()

    def trained(self) -> torch.Tensor:
        """[R] bool: the response tokens trained on (`loss_mask`, all true when it is None)."""
        if self.loss_mask is None:
            return torch.ones(len(self.response_ids), dtype=torch.bool, device=self.response_ids.device)
        return self.loss_mask.bool()

    def num_trained(self) -> int:
        """How many response tokens the policy sampled (the trained ones)."""
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())


def check_prompts(prompts: list[list[int]], n: int, vocab_size: int, max_len: int | None = None,
                  max_tokens: int = 0) -> None:
    """The argument checks every engine's generate() starts with (named errors, not garbage or an
    out-of-memory kill): ids in the vocabulary, and prompt + max_tokens within `max_len`."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        if max_len is not None and len(p) + max_tokens > max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_tokens={max_tokens} that exceeds the "
                             f"engine's maximum length {max_len}")


def check_requests(requests: list[Request], vocab_size: int, max_len: int | None = None) -> None:
    """check_prompts for each request (its own max_tokens); an error names the request's index."""
    for k, r in enumerate(requests):
        try:
            check_prompts([list(r.prompt_ids)], 1, vocab_size, max_len, r.sampling.max_tokens)
        except ValueError as e:
            raise ValueError(f"request {k}: {e}") from None


def stream_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 63-bit seed of sequence (prompt i, sample j)'s random stream (SamplingParams.seed): every
    engine derives its per-sample randomness from it, so a sample does not depend on batching."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
