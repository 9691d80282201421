"""vLLM's dialect of the serving layer (rollout/serving/dialect.py): `vllm serve`'s command line and
flags, its token-in/token-out `/inference/v1/generate` (bodies, caps and the strict parse:
protocol.py), and its control calls, development endpoints all (VLLM_SERVER_DEV_MODE=1):
pause `/pause?mode=keep`, resume `/reset_prefix_cache?reset_running_requests=true` then `/resume`,
abort `/abort_requests` (no ids: all of them), or `/pause?mode=abort` for a paused server.
Its receivers: every weight sync of weight_sync.TAKES, in memory over the weight-transfer API
(transfer.py: its flags, MemorySync), from a folder by reload_weights or a restart (weight_sync.py),
labelled by `/update_weight_version`. Its parity probe: `/v1/completions` with prompt_logprobs.
Registered as "vllm" (rollout/registered.py); the engine's default.

    VLLM_DIALECT.server_argv(model_dir, "policy", "127.0.0.1", port, VLLM_DIALECT.server_flags(cfg, ...))

Cost: pure; a body O(prompt), a parse O(answer) (protocol.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rl.rollout.serving.dialect import Control, Parsed
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import protocol
from megatron_rl.rollout.vllm.config import VllmConfig

if TYPE_CHECKING:  # the receivers' modules, imported where used (not needed to launch or send requests)
    from megatron_rl.rollout.serving.handle import ServerHandle
    from megatron_rl.rollout.serving.receivers import DiskReceiver
    from megatron_rl.rollout.vllm.transfer import Backend, MemorySync

AUTH_MIDDLEWARE = "megatron_rl_vllm_auth.RequireBearerKey"  # server_plugin/: the bearer key on every path


@dataclass(frozen=True)
class VllmDialect:
    """vLLM's OpenAI-compatible server with --enable-scale-out (module docstring)."""

    name: str = "vLLM"
    module: str = "vllm.entrypoints.openai.api_server"
    generate_path: str = protocol.GENERATE
    health_path: str = "/health"
    control_hint: str = "the development endpoints (VLLM_SERVER_DEV_MODE=1)"

    def server_flags(self, cfg: VllmConfig, max_model_len: int, logprobs_mode: str, max_logprobs: int,
                     receiver: Sequence[str] = ()) -> list[str]:
        """`vllm serve` flags of a launched server (receiver: the in-memory sync's flags, which start
        it on random weights that every sync streams in; empty for disk syncs)."""
        c = cfg
        args = ["--dtype", c.dtype, "--max-model-len", str(max_model_len), "--seed", str(c.seed),
                "--logprobs-mode", logprobs_mode, "--max-logprobs", str(max_logprobs),
                "--tensor-parallel-size", str(c.tensor_parallel_size), "--skip-tokenizer-init",
                "--enable-scale-out",  # mounts the token-in/token-out /inference/v1/generate the requests use
                "--enable-prompt-tokens-details"]  # each answer's cached prompt tokens (prefix caching is on by default)
        if c.max_num_seqs:
            args += ["--max-num-seqs", str(c.max_num_seqs)]
        if c.enforce_eager:
            args.append("--enforce-eager")
        if c.quantization:
            args += ["--quantization", c.quantization]
        if c.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        if c.enable_return_routed_experts:
            args.append("--enable-return-routed-experts")
        if receiver:
            args += ["--load-format", "dummy", *receiver]
        return args + list(c.extra_args)

    def server_argv(self, model_dir: str, model_name: str, host: str, port: int, flags: Sequence[str]) -> list[str]:
        return ["-m", self.module, "--model", model_dir, "--served-model-name", model_name, "--host", host,
                "--port", str(port), "--middleware", AUTH_MIDDLEWARE, *flags]

    def generate_body(self, model: str, prompt: list[int], sampling: SamplingParams, seed: int,
                      num_logprobs: int = 0) -> dict:
        return protocol.generate_body(model, prompt, sampling, seed, num_logprobs)

    def answer_cap(self, prompt_len: int, sampling: SamplingParams, num_logprobs: int = 0,
                   routed_values: int = 0) -> int:
        return protocol.generate_answer_cap(prompt_len, sampling, num_logprobs, routed_values)

    def parse_generate(self, resp, prompt_len: int, sampling: SamplingParams, vocab_size: int,
                       max_model_len: int | None = None, num_logprobs: int = 0) -> Parsed:
        return protocol.parse_generate(resp, prompt_len, sampling, vocab_size, max_model_len, num_logprobs)

    def pause_calls(self) -> list[Control]:
        # clear_cache=false: the caches are dropped once the new weights are in (resume), not
        # twice (vLLM 0.32 still reads it for mode=keep, though it is documented as ignored)
        return [Control("POST", "/pause?mode=keep&clear_cache=false", {})]

    def resume_calls(self) -> list[Control]:
        # The frozen requests' KV (and the prefix cache) came from the old weights: preempting them
        # makes vLLM recompute prompt + tokens so far on the new weights before going on, so every
        # later token is the new policy's given its prefix (as the embedded engine does).
        return [Control("POST", "/reset_prefix_cache?reset_running_requests=true", {}), Control("POST", "/resume", {})]

    def abort_calls(self, paused: bool) -> list[Control]:
        # paused: /pause?mode=abort ends the frozen requests and the server stays paused;
        # clear_cache=false: nothing of the (maybe half loaded) model is touched
        return [Control("POST", "/pause?mode=abort&clear_cache=false" if paused else "/abort_requests", {})]

    def read_control(self, call: Control, answer) -> None:
        """vLLM's control endpoints answer 200 once done; their bodies say nothing more."""

    @property
    def weight_syncs(self) -> tuple[str, ...]:
        from megatron_rl.rollout.vllm.weight_sync import TAKES

        return TAKES

    def receiver_flags(self, backend: Backend) -> list[str]:
        from megatron_rl.rollout.vllm.transfer import weight_transfer_args

        return weight_transfer_args(backend)

    def memory_receiver(self, server: ServerHandle, backend: Backend, bucket_bytes: int, host: str) -> MemorySync:
        from megatron_rl.rollout.vllm.transfer import MemorySync

        return MemorySync(server, backend, bucket_bytes, host)

    def disk_receiver(self, weight_sync: str) -> DiskReceiver:
        from megatron_rl.rollout.vllm.weight_sync import DiskReloadSync, RestartSync

        return RestartSync() if weight_sync == "restart" else DiskReloadSync()

    def version_label(self, version: int) -> Control:
        return Control("POST", "/update_weight_version", {"new_version": str(version)})

    def score_call(self, model: str, tokens: list[int]) -> Control:
        return Control("POST", "/v1/completions", protocol.prompt_logprobs_body(model, tokens))

    def score_cap(self, num_tokens: int) -> int:
        return protocol.prompt_logprobs_answer_cap(num_tokens)

    def parse_score(self, answer, tokens: list[int]) -> torch.Tensor:
        return protocol.parse_prompt_logprobs(answer, tokens)


VLLM_DIALECT = VllmDialect()
