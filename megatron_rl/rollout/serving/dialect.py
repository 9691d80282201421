"""What one kind of inference server supplies to the serving layer (serving/__init__.py): its
command line and health path (LAUNCH), the wire format of its token-in/token-out generate
requests (REQUESTS), the control calls that park its generation for a weight update (CONTROL), its
weight receivers (RECEIVERS) and the parity probe's scoring request (SCORE).
Everything else (processes, keys, HTTP, the pool, failover, when to pause) is the layer's.

    dialect = DIALECTS.get("vllm")
    flags = dialect.server_flags(cfg, max_model_len, logprobs_mode, max_logprobs, receiver_flags)
    argv = dialect.server_argv(model_dir, model_name, host, port, flags)    # after the interpreter
    body = dialect.generate_body(model_name, prompt_ids, sampling, seed, num_logprobs)
    answer = POST(server.url + dialect.generate_path, body, max_bytes=dialect.answer_cap(...))
    parsed = dialect.parse_generate(answer, len(prompt_ids), sampling, vocab_size, max_model_len, num_logprobs)
    for call in dialect.pause_calls():         # also resume_calls(), abort_calls(paused)
        dialect.read_control(call, SEND(server.url + call.path, call.method, call.body))

A new server kind is one module with its dialect object plus one `DIALECTS.add` line
(rollout/registered.py; a test may register a toy one itself: tests/vllm/test_toy_dialect.py).
An entry is an object that has every member of `Dialect` (checked when it is registered).

Control. A pause freezes the server's running requests in place (requests that arrive meanwhile
queue), a resume lets them go on after new weights came in (on those weights), an abort ends them
(each answer comes back, marked aborted). Each is a short list of `Control` calls the layer sends
in order to one server, every server at once (generation.py); `read_control` raises
BadResponse for an answer that says the call did not take. A server that answers a control call
with HTTP 4xx cannot do it (`control_hint` says what it needs): a refused pause stops the run, a
refused abort lets the requests run to their end.

Weights (RECEIVERS). `weight_syncs` names the rollout.weight_sync ways its servers take weights
(first: the kind's preferred); for each the dialect gives the receiver the engine drives: the
launch flags and one receiver per server for "memory" (tensors streamed in), the folder loader for
"reload" / "restart", and the call that labels a server's weights with the trainer version after an
in-place load. vLLM's are rollout/vllm/transfer.py and weight_sync.py; a new kind may reuse them
(its server loads as vLLM's does) or bring its own.

Probe (SCORE). After a weight sync the engine checks each server runs the weights it got: the
server scores a fixed token sequence (`score_call`, `parse_score`) against a reference in-process.

Errors. `parse_generate` raises BadResponse (serving/http.py) for an answer
that is not a valid one to its request: the layer counts and retries it and never turns it into a
sample; it may raise another error to stop the call (e.g. an unsupported setting).

Cost: pure functions of their arguments; a body is O(prompt), a parse O(answer), a cap O(1).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from megatron_rl.registry import Registry
from megatron_rl.rollout.types import SamplingParams


class Control(NamedTuple):
    """One control call: `method` "POST" (with JSON `body`) or "GET" (body None) on `path` (after
    the server's URL, query string included)."""

    method: str
    path: str
    body: dict | None = None


class Parsed(NamedTuple):
    """One validated answer. ids [R] int64, logprobs [R] fp32, finish "stop" | "length", kept
    [R, K] int64 (-1 padded) or None, routed: routed experts as base64 .npy or None, versions [R]
    int32 (each token's weight version) or None (unlabelled: the call's version), cached_tokens:
    how many prompt tokens the server found in its prefix cache, or None (not reported)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    finish: str
    kept: torch.Tensor | None
    routed: str | None
    versions: torch.Tensor | None
    cached_tokens: int | None = None


@runtime_checkable
class Dialect(Protocol):
    """A server kind's launch and request format (module docstring).

    name: how logs and errors name the server kind ("vLLM").
    generate_path: the token-in/token-out generate endpoint ("/inference/v1/generate").
    health_path: answers 200 while the server can serve ("/health").
    control_hint: what a server needs to take the control calls, said when one refuses them
        (vLLM: "the development endpoints (VLLM_SERVER_DEV_MODE=1)").
    """

    name: str
    generate_path: str
    health_path: str
    control_hint: str

    def server_flags(self, cfg, max_model_len: int, logprobs_mode: str, max_logprobs: int,
                     receiver: Sequence[str] = ()) -> list[str]:
        """The launched server's flags from `cfg` (the engine's config section, e.g. VllmConfig),
        with `receiver`, the weight receiver's own flags (empty when weights come from a folder),
        before the config's extra arguments (last: they override)."""
        ...

    def server_argv(self, model_dir: str, model_name: str, host: str, port: int, flags: Sequence[str]) -> list[str]:
        """The launched server's arguments after its Python interpreter ("-m", module, ...): serving
        `model_dir` as `model_name` on host:port, with `flags` (what the config asks for) last."""
        ...

    def generate_body(self, model: str, prompt: list[int], sampling: SamplingParams, seed: int,
                      num_logprobs: int = 0) -> dict:
        """The JSON body asking for one sample of `prompt`, drawn with `seed`, with `num_logprobs`
        top log-probs per token besides the sampled one's (0: the sampled token's alone)."""
        ...

    def answer_cap(self, prompt_len: int, sampling: SamplingParams, num_logprobs: int = 0,
                   routed_values: int = 0) -> int:
        """The most bytes a valid answer to that body takes (the layer reads no further)."""
        ...

    def parse_generate(self, resp, prompt_len: int, sampling: SamplingParams, vocab_size: int,
                       max_model_len: int | None = None, num_logprobs: int = 0) -> Parsed:
        """Validate one answer (decoded JSON) and return it as `Parsed`; BadResponse otherwise."""
        ...

    def pause_calls(self) -> Sequence[Control]:
        """Freeze the running requests where they are, keeping their state (KV cache); requests
        that arrive meanwhile queue. The server's weights may change before resume."""
        ...

    def resume_calls(self) -> Sequence[Control]:
        """After pause_calls and new weights: the frozen requests go on, every later token computed
        on the new weights given the tokens so far (not on state the old weights made)."""
        ...

    def abort_calls(self, paused: bool) -> Sequence[Control]:
        """End every running request (each answer comes back, its finish marked aborted). `paused`:
        the server is frozen by pause_calls and its weights may be half loaded; end the frozen
        requests and leave it frozen (it is never resumed)."""
        ...

    def read_control(self, call: Control, answer) -> None:
        """Check the answer (decoded JSON) to `call`: BadResponse when it says the call did not take."""
        ...

    weight_syncs: tuple[str, ...]
    """The rollout.weight_sync names its servers take (WEIGHT_SYNCS: memory, reload, restart)."""

    def receiver_flags(self, backend) -> list[str]:
        """The launch flags of a server that takes weights in memory over `backend` (the in-memory
        sync's transfer backend, rollout/vllm/transfer.py): it starts on random weights."""
        ...

    def memory_receiver(self, server, backend, bucket_bytes: int, host: str):
        """One server's in-memory receiver (weight_sync=memory; receivers.py Receiver): what the
        engine's push drives, with open / close per server process (vLLM's: rollout/vllm/transfer.py
        MemorySync, pushed by transfer.push_all)."""
        ...

    def disk_receiver(self, weight_sync: str):
        """What makes a running server serve an HF folder for `weight_sync` ("reload" | "restart"):
        apply(server, model_dir, timeout, warmup) -> timings (receivers.py DiskReceiver; vLLM's:
        rollout/vllm/weight_sync.py)."""
        ...

    def version_label(self, version: int) -> Control | None:
        """The call labelling a server's weights as trainer `version` after an in-place load from a
        folder (its answers then say which version made each token); None: the kind labels none."""
        ...

    def score_call(self, model: str, tokens: list[int]) -> Control:
        """The request scoring fixed `tokens` (the parity probe after a weight sync, probe.py):
        log p(tokens[t] | tokens[:t]) at temperature 1, nothing sampled that matters."""
        ...

    def score_cap(self, num_tokens: int) -> int:
        """The most bytes a valid answer to score_call of `num_tokens` tokens takes."""
        ...

    def parse_score(self, answer, tokens: list[int]) -> torch.Tensor:
        """[len(tokens) - 1] fp32 log-probs from the answer to score_call; BadResponse otherwise."""
        ...


DIALECTS: Registry[Dialect] = Registry("serving dialect", Dialect)
