"""The parity probe: does the server (any kind: its dialect) run the weights we just gave it?

After a sync the server scores a fixed token sequence (its dialect's score_call; vLLM's
`/v1/completions` with `prompt_logprobs`: log p(x_t | x_<t) at temperature 1, no sampling involved)
and a reference scores the same tokens in-process; the
largest absolute difference is the metric `vllm/probe_max_abs_diff`. The reference is a callable
`tokens -> [len - 1] fp32 log-probs` (e.g. the trainer's own forward); by default
`hf_reference` runs `transformers` in fp32 on the exported directory, and after an in-memory
sync (no directory) `StreamedReference` fills the same model from the stream the server got.
A server that refuses the probe (e.g. HTTP 400 for log-probs it cannot write as JSON: NaN or inf)
or answers it without usable prompt log-probs raises ProbeError naming the server and cause.

Cost: one scoring request per server and sync, O(probe tokens x vocab) on the server; the
reference holds the model in fp32 on the engine's rank while it lives (see StreamedReference).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import ProbeError
from megatron_rl.rollout.serving.http import BadResponse, HttpStatusError
from megatron_rl.rollout.serving.loop import RequestLoop

Reference = Callable[[list[int]], torch.Tensor]


def probe_tokens(vocab_size: int, length: int, seed: int = 20240611) -> list[int]:
    """A fixed pseudo-random token sequence (the same for every sync of a run)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def _fp32_model(arch):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(arch.to_hf_config(), dtype=torch.float32,
                                            attn_implementation="eager").eval()


def _scorer(model) -> Reference:
    @torch.no_grad()
    def reference(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        logits = model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)

    return reference


def hf_reference(model_dir: str) -> Reference:
    """fp32 `transformers` log-probs of the model in `model_dir` (loaded on first call)."""
    scorer = None

    def reference(tokens: list[int]) -> torch.Tensor:
        nonlocal scorer
        if scorer is None:
            from megatron_rl.model.hf_io import SafetensorsReader, load_arch
            from megatron_rl.rollout.hf_state import load_checkpoint_tensors, rules_for

            arch = load_arch(model_dir)
            model = _fp32_model(arch)
            read = SafetensorsReader(model_dir)
            load_checkpoint_tensors(model, ((name, read(name)) for name in read.keys()), rules_for(arch.arch))  # noqa: SIM118 - a reader, not a dict
            scorer = _scorer(model)
        return scorer(tokens)

    return reference


class StreamedReference:
    """The reference of an in-memory sync, which writes no folder: an fp32 `transformers` model
    filled from the same stream the server receives.

        ref = StreamedReference(arch)
        send(ref.tee(named))          # each (name, tensor) is copied into the model as it passes
        probe_diff(..., ref.reference, ...)

    Cost: the model in fp32 on the engine's rank while it lives (what `hf_reference` costs after
    a disk sync); nothing when the probe is off (probe_every=0)."""

    def __init__(self, arch):
        from megatron_rl.rollout.hf_state import CheckpointLoader, rules_for

        model = _fp32_model(arch)
        self.loader = CheckpointLoader(model, rules_for(arch.arch))
        self.reference: Reference = _scorer(model)

    def tee(self, named):
        """`named`, unchanged; raises at its end if the model did not get every tensor once."""
        for name, tensor in named:
            self.loader.take(name, tensor)
            yield name, tensor
        self.loader.finish()


async def server_logprobs(requests: RequestLoop, url: str, model: str, tokens: list[int], timeout: float,
                          api_key: str | None = None, *, dialect: Dialect, section: str) -> torch.Tensor:
    """[len - 1] fp32: the server's log p(tokens[t] | tokens[:t]), by its dialect's scoring request,
    awaited on the engine's request loop (`requests`, loop.py).
    ProbeError, naming the server and the cause, when it refuses the probe or answers without
    usable log-probs; a server that does not answer raises http.TransportError (dead or hung: the
    caller's case). section: where the engine's settings live (messages name its fields)."""
    call = dialect.score_call(model, tokens)
    try:
        answer = await requests.json(url + call.path, call.body if call.method == "POST" else None, timeout=timeout,
                                     api_key=api_key, max_bytes=dialect.score_cap(len(tokens)),
                              setting=f"{section}.request_timeout_s")
        return dialect.parse_score(answer, tokens)
    except HttpStatusError as e:
        if "Out of range float" in e.body:
            why = ("its log-probs of the probe tokens are not finite (NaN or inf, which vLLM cannot write as JSON): "
                   "the weights it got are broken")
        else:
            why = f"it refused the probe's {call.path} request"
        raise ProbeError(f"the parity probe failed on the {dialect.name} server at {url}: {why} ({e})") from None
    except BadResponse as e:
        raise ProbeError(f"the parity probe failed on the {dialect.name} server at {url}: {e}. The probe needs a "
                         f"server that answers {call.path} as {dialect.name} does (its score_call); "
                         f"{section}.probe_every=0 turns it off") from None


def probe_diff(requests: RequestLoop, url: str, model: str, tokens: list[int], reference: Reference, timeout: float,
               api_key: str | None = None, *, dialect: Dialect, section: str) -> float:
    """max |server - reference| over the probe's log-probs (`api_key`: the server's key): the
    server's by a request on the engine's loop, the reference's here, in the calling thread."""
    got = requests.call(server_logprobs(requests, url, model, tokens, timeout, api_key, dialect=dialect,
                                        section=section))
    want = reference(tokens).float().reshape(-1)
    if want.shape != got.shape:
        raise ValueError(f"reference gave {tuple(want.shape)} log-probs for {len(tokens)} tokens, expected "
                         f"{tuple(got.shape)}")
    return float((got - want).abs().max())
