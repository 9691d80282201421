"""The measured part of benchmarks/weight_sync.py: weights to send, one engine per sync kind, the
timing and memory of each sync. Imported only once the benchmark runs (it imports torch, the
engine and, for the GPU weights, transformers); the entry script decides first whether it can.

Per sync: seconds, the trainer's peak extra host memory (VmHWM, reset through
/proc/self/clear_refs before the sync, minus VmRSS then) and, on CUDA, its peak extra GPU memory
(torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated then). The
weights themselves are held before the sync starts, so neither counts them.
"""
from __future__ import annotations

import os
import platform
import subprocess
import tempfile
import time

import torch

from megatron_rl.model.hf_files import expected_names
from megatron_rl.model.hf_io import SafetensorsReader
from megatron_rl.model.parity import random_hf_model
from megatron_rl.rollout.hf_state import checkpoint_layout, rules_for, state_tensors
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.trainer.transport import DiskTransport, TransportInputs


def checkpoint_weights(arch, seed: int, tmp: str) -> list:
    """HF checkpoint-format (name, tensor) pairs (experts one by one), as export_hf_weights yields them."""
    path = os.path.join(tmp, f"hf-{arch.arch}-{seed}")
    random_hf_model(arch, seed=seed).save_pretrained(path)
    read = SafetensorsReader(path)
    return [(name, read(name).clone()) for name in read.keys()]  # noqa: SIM118 - a reader, not a dict


def checkpoint_shapes(arch) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every HF checkpoint-format tensor of `arch` (experts one by one, the global
    ones first, then layer by layer, as export_hf_weights yields them), without allocating it:
    transformers' model is built on the meta device, and its fused expert tensors are cut per
    expert by the layout the embedded engine loads checkpoints with (rollout/hf_state.py)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch.to_hf_config())
    params = {n: tuple(p.shape) for n, p in state_tensors(model).items()}
    layout = checkpoint_layout(params, rules_for(arch.arch))
    shapes = []
    for name in dict.fromkeys(expected_names(arch)):  # a tied head names the embedding again
        target = layout[name]
        shape = params[target.param]
        if target.expert is not None:  # [E, R, C] -> this expert's rows [r, C]
            shape = (target.rows[1] - target.rows[0], *shape[2:])
        shapes.append((name, shape))
    return shapes


@torch.no_grad()
def device_weights(shapes, seed: int, device: str, dtype: torch.dtype) -> list:
    """Random (name, tensor) pairs of `shapes` made on `device`: matrices ~ N(0, 0.02), vectors
    (norms) ~ 1 + N(0, 0.1). Two seeds give two versions to alternate between."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for name, shape in shapes:
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        out.append((name, (t.mul_(0.02) if len(shape) >= 2 else t.mul_(0.1).add_(1.0)).to(dtype)))
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measured(fn, cuda: bool = False) -> tuple[float, ...]:
    """(seconds, peak extra resident host MiB) of fn(), and with cuda its peak extra allocated GPU MiB."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_base = torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    out = (time.perf_counter() - t0, (_status_kib("VmHWM") - base) / 1024)
    if cuda:
        out += ((torch.cuda.max_memory_allocated() - gpu_base) / 2**20,)
    return out


def sync_fn(engine, named, version: int, run_dir: str):
    """One sync as rank 0 does it: the `memory` transport, or `disk` (write, then hand over)."""
    if engine.backend is not None:  # rollout.weight_sync=memory
        return lambda: engine.update_weights(named, version)
    disk = DiskTransport(TransportInputs(None, engine.arch, run_dir))
    return lambda: engine.load_weights_from(disk.write(named, version), version)


def server_config(bucket_bytes: int, python: str | None, device: str = "cpu",
                  server_gpus: str | None = None, gpu_memory_utilization: float | None = None) -> VllmConfig:
    """The server of one row: fp32 on CPU, bf16 on a GPU (CUDA_VISIBLE_DEVICES=server_gpus: not
    the trainer's); short context, parity probe off."""
    return VllmConfig(python=python, device="cuda" if device == "cuda" else "auto",
                      env={"CUDA_VISIBLE_DEVICES": server_gpus} if server_gpus else {},
                      dtype="bfloat16" if device == "cuda" else "float32", max_model_len=256, max_num_seqs=8,
                      probe_every=0, bucket_bytes=bucket_bytes,
                      gpu_memory_utilization=gpu_memory_utilization, startup_timeout_s=1800.0,
                      request_timeout_s=1800.0, health_timeout_s=120.0)


def bench(arch, kind: str, cfg: VllmConfig, weights: list, repeats: int, tmp: str, cuda: bool = False) -> list[tuple]:
    """`repeats` syncs of one engine taking weights by `kind` (rollout.weight_sync: memory, reload,
    restart), alternating the two weight versions; the server's first start, on weights[0], is not
    a sync and is not counted. One measured() tuple a sync."""
    run_dir = tempfile.mkdtemp(prefix=f"{kind}-", dir=tmp)
    engine = VllmEngine(arch, cfg, run_dir, weight_sync=kind)
    rows = []
    try:
        sync_fn(engine, weights[0], 0, run_dir)()  # starts the server: not a sync
        for k in range(repeats):
            row = measured(sync_fn(engine, weights[(k + 1) % 2], k + 1, run_dir), cuda)
            rows.append(row)
            gpu = f" host, +{row[2]:.0f} MiB GPU" if cuda else ""
            print(f"  {kind} sync {k + 1}: {row[0]:.3f} s, +{row[1]:.0f} MiB{gpu}", flush=True)
    finally:
        engine.close()
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except StopIteration:
        pass
    if not torch.cuda.is_available():
        return f"{os.cpu_count()}-core {platform.machine()} {cpu}, no GPU"
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} ({gib:.0f} GiB), torch {torch.__version__}; "
            f"{os.cpu_count()}-core {cpu}")
