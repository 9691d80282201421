"""The embedded rollout engine: in-process generation with a `transformers` model.

    engine = EmbeddedEngine(arch, dtype="bf16")
    engine.update_weights(export_hf_weights(model, arch, groups), version=step)
    samples = engine.generate(prompts, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=8))

The model runs in its own dtype through transformers' modelling code (eager attention by
default), a genuinely different numeric path from the fp32 megatron trainer, which is what
makes the training-inference mismatch real on CPU.

Decoding (rollout/decoding.py): one sequence per request (rollout/types.py `Request`; a generate()
call's sequence (prompt i, sample j) is request (i, j) of `requests_of`). generate_requests decodes
the requests of one sampling class in chunks of `max_batch_size`, in their order: a chunk prefills
each distinct prompt once (left padding, attention mask, explicit position ids), the KV cache is
then expanded to one row per sequence, and every step feeds one token per running row; a row that
hits a stop token or its max_tokens is dropped from the batch and its cache. `serve(inbox)` is the
same loop kept running (continuous batching): requests that arrive join the running batch at the
next step boundary and each sample is delivered as its row ends (rollout/requests.py uses it for
env.turns=async).

Sampling (one step, pure functions in rollout/sampling.py): logits / T -> reported log-prob =
log_softmax of the sampled token in fp32 before truncation -> top-k then top-p keep-mask ->
inverse-CDF draw from the renormalised kept distribution. T = 0 is greedy argmax (log-prob and
kept set at T = 1).

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

from collections.abc import Callable, Iterable, Sequence

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.decoding import Decoding, Inbox, class_of
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
)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        """One sample per request, in order. Requests of one sampling class (equal SamplingParams
        but for max_tokens and seed) are decoded together, in chunks of max_batch_size in their
        order (rollout/decoding.py: a chunk prefills each distinct (stream prompt index, prompt)
        once); each draws from its own stream and stops at its own max_tokens. Parks between decode
        steps and between chunks while `pause()` holds it."""
        check_requests(list(requests), self.arch.vocab_size, self.arch.max_position_embeddings)
        by_class: dict[SamplingParams, list[int]] = {}
        for k, r in enumerate(requests):
            by_class.setdefault(class_of(r.sampling), []).append(k)
        out: list[Sample | None] = [None] * len(requests)
        with self.gate.generating():
            for sampling, ks in by_class.items():
                for start in range(0, len(ks), self.max_batch_size):
                    self.gate.boundary(-1)  # a chunk's prefill never runs while the weights change
                    chunk = ks[start:start + self.max_batch_size]
                    d = self._decoding(sampling)
                    d.join([requests[k] for k in chunk])
                    step = 0
                    while d.running():
                        for s in d.step(step):
                            out[chunk[s]] = d.sample(s)
                        step += 1
        return out

    def serve(self, inbox: Inbox) -> None:
        """Decode the requests put into `inbox` until it is closed (continuous batching): requests
        that arrive while a batch decodes join it at the next step boundary when they share its
        sampling class and it has room (max_batch_size), else start the next batch once it is done;
        each sample is delivered as soon as its sequence finishes. An error (GenerationAborted, a
        closed engine) is delivered to every request it leaves unfinished, then raised."""
        held: list = []  # (request, deliver) waiting for a batch of their class
        deliver: dict[int, Callable] = {}
        try:
            while True:
                more = inbox.take(block=not held)
                if more is None and not held:
                    return
                held += more or []
                cls = class_of(held[0][0].sampling)
                d = self._decoding(cls, trim=True)
                with self.gate.generating():
                    step = 0
                    while True:
                        joining = [x for x in held if class_of(x[0].sampling) == cls][:d.room()]
                        if joining:
                            held = [x for x in held if all(x is not y for y in joining)]
                            base = len(d.requests)
                            deliver.update({base + k: f for k, (_, f) in enumerate(joining)})
                            d.join([r for r, _ in joining])
                        if not d.running():
                            break
                        for s in d.step(step):
                            deliver.pop(s)(d.sample(s))
                        step += 1
                        held += inbox.take(block=False) or []
        except BaseException as e:
            for f in list(deliver.values()) + [f for _, f in held] + [f for _, f in inbox.take(block=False) or []]:
                f(e)
            raise

    def _decoding(self, sampling: SamplingParams, trim: bool = False) -> Decoding:
        if self.model is None:
            raise RuntimeError("the engine is closed")
        return Decoding(self, sampling, trim)

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
