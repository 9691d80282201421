"""The embedded rollout engine: in-process generation with a `transformers` model.

    engine = EmbeddedEngine(arch, dtype="bf16")
    engine.update_weights(export_hf_weights(model, arch, groups), version=step)
    samples = engine.generate(prompts, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=8))

The model runs in its own dtype through transformers' modelling code (eager attention by
default), a genuinely different numeric path from the fp32 megatron trainer, which is what
makes the training-inference mismatch real on CPU.

Decoding: one sequence per request (rollout/types.py `Request`; a generate() call's sequence
(prompt i, sample j) is request (i, j) of `requests_of`); the requests of a call with equal sampling
settings are decoded in chunks of `max_batch_size`, in their order. A chunk prefills each distinct
prompt once (left padding, attention mask, explicit position ids), the
KV cache is then expanded to one row per sequence, and every step feeds one token per running
row; a row that hits a stop token or max_tokens is dropped from the batch and its cache.

Sampling (one step, pure functions below): logits / T -> reported log-prob = log_softmax of the
sampled token in fp32 before truncation -> top-k then top-p keep-mask -> inverse-CDF draw
from the renormalised kept distribution. T = 0 is greedy argmax (log-prob and kept set at T = 1).

Randomness: sequence (i, j) owns a torch.Generator seeded with a hash of (seed, i, j) and draws
one uniform per generated position, so a sample depends only on (weights, prompt, seed, i, j),
never on batching, chunking or which rows finished first. In fp32 the logits are batch-invariant
to ~1e-6; in bf16/fp16 the kernels' batch-shape dependence can move log-probs by ~1e-2 (and, at
a near-tie, a token) between max_batch_size settings, as in any batched inference server.

Partial rollouts (train.in_flight_update=pause; rollout/pausing.py): `pause()` parks the decode
loop after its current step (between sampling token t and the forward that gives token t + 1's
logits), `update_weights` loads the new version, `resume()` goes on. When the weights changed while
parked, the running rows' prompt + tokens 0..t are prefilled again with the new weights (a fresh
KV cache: no position keeps old-weight keys and values), so tokens t + 1, ... are exactly what the
new policy samples after that prefix, and each token records the version that computed its
logits (Sample.token_versions). Cost of a resume: one prefill of the running rows. `abort()`
makes the generation raise GenerationAborted at the boundary instead.

Routing (Qwen3-MoE): forward hooks on every MoE layer's router record the top-k experts of
each processed position in the engine's own dtype; a Sample gets them as
`routed_experts [P + R - 1, num_moe_layers, top_k]` int16, sorted ascending per position. A
position's routing is the one of the first forward that processed it (after a partial-rollout
resume, the re-prefill's routing of the earlier positions is not kept: router replay r3 refuses
partial rollouts, configure/rules.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.engine import EngineRequest, EngineSpec
from megatron_rl.rollout.fp8_modules import quantize_model
from megatron_rl.rollout.hf_state import load_checkpoint_tensors, rules_for
from megatron_rl.rollout.pausing import DecodeGate
from megatron_rl.rollout.types import (
    Request,
    Sample,
    SamplingParams,
    check_prompts,
    check_requests,
    grouped,
    requests_of,
    stream_seed,
)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- sampling: pure functions on [B, V] logits ----------------------------------------------
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


# ---- the engine -------------------------------------------------------------------------------
class EmbeddedEngine:
    """`RolloutEngine` backed by an in-process `transformers` model of `arch`.

    dtype: "fp32" | "bf16" | "fp16" for the model's weights and compute.
    max_batch_size: sequences decoded together (a chunk); samples do not depend on it (up to
        low-precision kernel effects, see the module docstring).
    attn_implementation: transformers attention backend ("eager", "sdpa").
    device: where the model runs and decodes ("cpu", "cuda", "cuda:1"); update_weights copies
        the trainer's tensors there directly (on-device when they already live on it). Samples
        come back on the CPU (they are broadcast to every rank).
    fp32_lm_head: compute the output projection and the softmax in fp32: the last hidden state and
        the (dtype-rounded) head weight are upcast, as the trainer's fp32-head log-prob kernel does
        (precision.fp32_lm_head).
    quantization: None, or an FP8 format of precision/fp8.py ("fp8_tensor", "fp8_block", "mxfp8"):
        the decoder's linear layers and experts compute in FP8 (rollout/fp8_modules.py), their
        weights quantized again at every update_weights (rollout.quantization).
    The model starts with random weights and policy_version -1 until update_weights.
    """

    def __init__(self, arch: ModelArch, dtype: str = "fp32", max_batch_size: int = 256,
                 attn_implementation: str = "eager", device: str | torch.device = "cpu", fp32_lm_head: bool = False,
                 quantization: str | None = None):
        from transformers import AutoModelForCausalLM

        if dtype not in _DTYPES:
            raise ValueError(f"rollout.dtype={dtype!r}; choose one of {sorted(_DTYPES)}")
        if max_batch_size < 1:
            raise ValueError(f"rollout.max_batch_size must be >= 1, got {max_batch_size}")
        self.arch = arch
        self.dtype = _DTYPES[dtype]
        self.max_batch_size = max_batch_size
        self.policy_version = -1
        self.device = torch.device(device)
        self.fp32_lm_head = fp32_lm_head
        self.model = AutoModelForCausalLM.from_config(
            arch.to_hf_config(), attn_implementation=attn_implementation, dtype=self.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self._check_expert_layout()
        self.quantization = quantization
        self.fp8_layers = quantize_model(self.model, quantization) if quantization else []
        self.gate = DecodeGate()
        self._routes: dict[int, torch.Tensor] = {}
        self._hooks = [self._router(i).register_forward_hook(self._record_route(k))
                       for k, i in enumerate(self.moe_layers)]

    @property
    def max_len(self) -> int:
        return self.arch.max_position_embeddings

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.arch.num_layers) if self.arch.is_moe_layer(i)]

    def _router(self, layer: int) -> torch.nn.Module:
        return self.model.model.layers[layer].mlp.gate

    def _check_expert_layout(self) -> None:
        for i in self.moe_layers:
            experts = self.model.model.layers[i].mlp.experts
            if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
                raise ValueError(f"layer {i}: transformers stores experts transposed or gate/up "
                                          f"interleaved; megatron_rl.rollout.hf_state expects [E, 2I, H] "
                                          f"with gate then up")

    def _record_route(self, k: int):
        top_k = self.arch.moe_topk

        def hook(_module, _inputs, output):
            if isinstance(output, tuple) and len(output) == 3:  # (logits, scores, top-k indices)
                idx = output[2]
            else:  # a router returning logits only
                logits = output[0] if isinstance(output, tuple) else output
                idx = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1).indices
            self._routes[k] = idx.sort(dim=-1).values.to(torch.int16)

        return hook

    def _take_routes(self, rows: int) -> torch.Tensor | None:
        """Routes of the last forward as [rows, S, num_moe_layers, top_k], or None (dense)."""
        if not self._hooks:
            return None
        routes = torch.stack([self._routes[k] for k in range(len(self._hooks))], dim=1)  # [rows*S, L, k]
        self._routes.clear()
        return routes.view(rows, -1, *routes.shape[1:])

    # ---- RolloutEngine ------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF checkpoint-format (name, tensor) pairs (see hf_state); set policy_version."""
        load_checkpoint_tensors(self.model, named_tensors, rules_for(self.arch.arch))
        for layer in self.fp8_layers:  # FP8 weights are made from every sync's
            layer.requantize()
        self.policy_version = version

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Sample]]:
        """n samples per prompt; result[i][j] is sample j of prompt i (see the module docstring):
        the requests of `requests_of(prompts, n, sampling)`."""
        check_prompts(prompts, n, self.arch.vocab_size, self.arch.max_position_embeddings, sampling.max_tokens)
        return grouped(self.generate_requests(requests_of(prompts, n, sampling)), len(prompts), n)

    def generate_requests(self, requests: Sequence[Request]) -> list[Sample]:
        """One sample per request, in order. Requests with equal SamplingParams are decoded
        together, in chunks of max_batch_size in their order (a chunk prefills each distinct
        (stream prompt index, prompt) once); each draws from its own stream. Parks between decode
        steps and between chunks while `pause()` holds it."""
        check_requests(list(requests), self.arch.vocab_size, self.arch.max_position_embeddings)
        by_params: dict[SamplingParams, list[int]] = {}
        for k, r in enumerate(requests):
            by_params.setdefault(r.sampling, []).append(k)
        out: list[Sample | None] = [None] * len(requests)
        with self.gate.generating():
            for sampling, ks in by_params.items():
                for start in range(0, len(ks), self.max_batch_size):
                    self.gate.boundary(-1)  # a chunk's prefill never runs while the weights change
                    chunk = ks[start:start + self.max_batch_size]
                    for k, sample in zip(chunk, self._generate_chunk([requests[k] for k in chunk], sampling)):
                        out[k] = sample
        return out

    # ---- Pausable (partial rollouts: rollout/pausing.py) ---------------------------------------
    def pause(self) -> None:
        """Park the generation in flight at its next decode-step boundary; returns once it is parked
        (or at once when none runs). update_weights may then run; resume() lets it go on."""
        self.gate.pause()

    def abort(self) -> None:
        """Make the generation in flight raise GenerationAborted at its next step boundary; returns
        once it has ended. Generations wait for resume() before starting."""
        self.gate.abort()

    def resume(self) -> None:
        self.gate.resume()

    def stats(self) -> dict[str, float]:
        """Nothing to count: generation runs in this process and cannot fail over."""
        return {}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.model = None

    # ---- decoding -----------------------------------------------------------------------------
    def _forward(self, ids, mask, pos, cache):
        if self.fp32_lm_head:  # the decoder in the engine's dtype, the head in fp32
            out = self.model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                   use_cache=True)
            weight = self.model.get_output_embeddings().weight
            return torch.nn.functional.linear(out.last_hidden_state[:, -1].float(), weight.float())
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _prefill(self, prompts: list[list[int]], cache):
        """Left-padded forward of distinct prompts -> (last logits [U, V], mask [U, W], routes [U, W, L, k])."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids, mask, pos, cache)
        return logits, mask, self._take_routes(len(prompts))

    @torch.no_grad()
    def _generate_chunk(self, requests: list[Request], sampling: SamplingParams) -> list[Sample]:
        """Decode `requests` (all with `sampling`) as one batch; one sample each, in order."""
        from transformers import DynamicCache

        if self.model is None:
            raise RuntimeError("the engine is closed")
        steps = sampling.max_tokens
        dev = self.device
        seqs = [r.stream for r in requests]
        uniforms = stream_uniforms(sampling.seed, seqs, steps).to(dev)
        stops = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=dev)

        # each distinct prompt prefilled once, in order of its stream's prompt index
        prompts = [list(r.prompt_ids) for r in requests]
        uniq = sorted({(r.stream[0], r.prompt_ids) for r in requests})
        cache = DynamicCache(config=self.model.config)
        logits, mask, prompt_routes = self._prefill([list(p) for _, p in uniq], cache)
        width = mask.shape[1]

        # one row per sequence
        row_of = {u: r for r, u in enumerate(uniq)}
        prefill_row = [row_of[(r.stream[0], r.prompt_ids)] for r in requests]
        rows = torch.tensor(prefill_row, device=dev)
        cache.batch_select_indices(rows)
        mask, logits = mask[rows], logits[rows]
        next_pos = mask.sum(-1)

        num = len(seqs)
        tokens = torch.full((num, steps), -1, dtype=torch.long, device=dev)
        logprobs = torch.zeros(num, steps, dtype=torch.float32, device=dev)
        length = torch.zeros(num, dtype=torch.long, device=dev)
        stopped = torch.zeros(num, dtype=torch.bool, device=dev)
        routes = None
        if prompt_routes is not None:
            routes = torch.zeros(num, max(steps - 1, 1), *prompt_routes.shape[2:], dtype=torch.int16, device=dev)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (running rows, their keep masks) per step
        alive = torch.arange(num, device=dev)  # sequence index of each row of the running batch
        version = self.policy_version  # of the weights that computed `logits`
        versions = torch.full((num, steps), version, dtype=torch.int32, device=dev)

        for t in range(steps):
            tok, lp, keep = sample_step(logits, uniforms[alive, t], sampling)
            tokens[alive, t], logprobs[alive, t] = tok, lp
            versions[alive, t] = version
            length[alive] = t + 1
            if sampling.return_kept_ids:
                kept.append((alive, keep))
            hit = torch.isin(tok, stops)
            stopped[alive] = hit
            go = ~hit
            if t == steps - 1 or not bool(go.any()):
                break
            if not bool(go.all()):
                idx = go.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                alive, tok, mask, next_pos = alive[idx], tok[idx], mask[idx], next_pos[idx]
            if self.gate.boundary(t) and self.policy_version != version:  # new weights while parked
                version = self.policy_version
                cache = DynamicCache(config=self.model.config)
                rows_ids = [prompts[s] + tokens[s, :t + 1].tolist() for s in alive.tolist()]
                logits, mask, new_routes = self._prefill(rows_ids, cache)
                next_pos = mask.sum(-1)
                if routes is not None:  # the one position no earlier forward processed: token t's
                    routes[alive, t] = new_routes[:, -1]
                continue
            mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype, device=dev)], dim=-1)
            logits = self._forward(tok[:, None], mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
            if routes is not None:
                routes[alive, t] = self._take_routes(len(alive))[:, 0]

        kept_ids = self._kept_ids(kept, num) if sampling.return_kept_ids else [None] * num
        # samples are broadcast to every rank: host tensors
        tokens, logprobs, length, stopped, versions = (tokens.cpu(), logprobs.cpu(), length.cpu(), stopped.cpu(),
                                                       versions.cpu())
        if routes is not None:
            routes, prompt_routes = routes.cpu(), prompt_routes.cpu()
        samples = []
        for s, (i, j) in enumerate(seqs):
            r = int(length[s])
            routed = None
            if routes is not None:
                p = len(prompts[s])
                routed = torch.cat([prompt_routes[prefill_row[s], width - p:], routes[s, :r - 1]])
            samples.append(Sample(
                prompt_ids=torch.tensor(prompts[s], dtype=torch.long), response_ids=tokens[s, :r].clone(),
                rollout_logprobs=logprobs[s, :r].clone(), finish_reason="stop" if stopped[s] else "length",
                policy_version=int(versions[s, 0]), prompt_index=i, sample_index=j,
                routed_experts=routed, kept_ids=kept_ids[s], token_versions=_mixed(versions[s, :r])))
        return samples

    @staticmethod
    def _kept_ids(kept, num: int) -> list[torch.Tensor]:
        """Per sequence [R, K] kept token ids (ascending), padded with -1 to the widest position."""
        per_seq: list[list[torch.Tensor]] = [[] for _ in range(num)]
        for alive, keep in kept:
            keep = keep.cpu()
            for row, s in enumerate(alive.tolist()):
                per_seq[s].append(keep[row].nonzero().squeeze(-1))
        out = []
        for ids in per_seq:
            width = max(len(x) for x in ids)
            padded = torch.full((len(ids), width), -1, dtype=torch.long)
            for t, x in enumerate(ids):
                padded[t, :len(x)] = x
            out.append(padded)
        return out


def _mixed(versions: torch.Tensor) -> torch.Tensor | None:
    """A sample's [R] int32 token versions when they differ (it crossed a weight update), else None."""
    return versions.clone() if bool((versions != versions[0]).any()) else None


def make_embedded_engine(request: EngineRequest) -> EmbeddedEngine:
    """The `embedded` engine of a run: rollout.dtype, rollout.quantization, rollout.max_batch_size, on rollout.device
    (null: beside the trainer's model, where its weights are synced on-device)."""
    r = request.rollout
    device = r.device or request.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"rollout.device={device}: this machine has no CUDA; use rollout.device=cpu or null "
                         f"(the trainer's device)")
    return EmbeddedEngine(request.arch, dtype=r.dtype, max_batch_size=r.max_batch_size, device=device,
                          fp32_lm_head=request.needs.fp32_lm_head, quantization=r.quantization)


EMBEDDED = EngineSpec(make=make_embedded_engine, in_flight_updates=("wait", "pause", "abort"),
                      quantizations=("fp8_tensor", "fp8_block", "mxfp8"))
