"""Peak memory of tools/convert_hf_to_mcore.py against the largest tensor it converts.

    python benchmarks/convert_memory.py                         # ~2 GB random Qwen3 (fp32)
    python benchmarks/convert_memory.py --layers 4 --out benchmarks/results/convert_memory_cpu.md

A random-initialised Hugging Face model is written to disk by a separate process, then converted
(HF -> megatron dist checkpoint) twice, each in a fresh process whose peak resident memory
(ru_maxrss from wait4) is read: once for the big model and once for a tiny one of the same family.
The tiny run is the constant (Python, torch, megatron-core, transformers imports and buffers),
measured in the same run. The target (issue: the converter streams) is

    peak(big) - peak(tiny)  <=  1.3 x the largest tensor

where an in-memory converter would need at least the whole model. A converted checkpoint is then
loaded and compared with the source, so the number belongs to a conversion that worked.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")

MAKE = """
import json, sys, torch
from megatron_rl.model.arch import ModelArch
from megatron_rl.model.parity import random_hf_model
arch = ModelArch(**json.loads(sys.argv[1]))
random_hf_model(arch, seed=0, std=0.02).save_pretrained(sys.argv[2], max_shard_size="100GB")
"""

CHECK = """
import sys, torch
from tests.mcore_setup import init_single_process, setup_parallel
from megatron_rl.platform import apply_platform_workarounds
apply_platform_workarounds(); init_single_process(); groups = setup_parallel()
from megatron_rl.model import BuildOptions, build_gpt_model
from megatron_rl.model.hf_io import SafetensorsReader, export_hf_weights, load_arch
from megatron_rl.trainer.checkpoint import load_checkpoint
if __name__ == "__main__":
    arch = load_arch(sys.argv[1])
    model = build_gpt_model(arch, groups, BuildOptions(seed=3))
    load_checkpoint(sys.argv[2], model)
    read = SafetensorsReader(sys.argv[1])
    bad = [n for n, t in export_hf_weights(model, arch, groups) if not torch.equal(t, read(n))]
    print("EQUAL" if not bad else f"DIFFER {bad[:3]}")
"""


def shape(layers: int, big: bool) -> dict:
    """Qwen3 dense, untied: the two [V, H] embeddings are the largest tensors."""
    if not big:
        return dict(arch="qwen3", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                    num_kv_heads=2, head_dim=16, ffn_hidden_size=128)
    return dict(arch="qwen3", vocab_size=151936, hidden_size=1024, num_layers=layers, num_attention_heads=16,
                num_kv_heads=8, head_dim=64, ffn_hidden_size=3072, tie_word_embeddings=False)


def peak_rss_of(cmd: list[str]) -> tuple[int, float, str]:
    """(peak RSS bytes, seconds, output) of one fresh process."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return usage.ru_maxrss * 1024, time.time() - start, out


def tensor_sizes(hf_dir: str) -> list[int]:
    from megatron_rl.model.hf_io import SafetensorsReader

    read = SafetensorsReader(hf_dir)
    return [end - begin for _, _, info in read._where.values() for begin, end in [info["data_offsets"]]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="decoder layers of the big model (16: ~2 GB fp32)")
    p.add_argument("--out", default=None, help="also write the result table (markdown) here")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, big in (("tiny", False), ("big", True)):
            hf, mcore = os.path.join(tmp, f"hf_{name}"), os.path.join(tmp, f"mcore_{name}")
            subprocess.run([sys.executable, "-c", MAKE, json.dumps(shape(args.layers, big)), hf], cwd=ROOT,
                           env=ENV, check=True)
            sizes = tensor_sizes(hf)
            rss, secs, _ = peak_rss_of([sys.executable, "tools/convert_hf_to_mcore.py", "--hf-dir", hf,
                                        "--mcore-dir", mcore])
            rows[name] = {"model_bytes": sum(sizes), "largest": max(sizes), "peak": rss, "seconds": secs}
            print(f"{name}: model {sum(sizes) / 2**30:.2f} GiB, largest tensor {max(sizes) / 2**30:.3f} GiB, "
                  f"converter peak RSS {rss / 2**30:.2f} GiB in {secs:.0f} s", flush=True)
        check = subprocess.run([sys.executable, "-c", CHECK, os.path.join(tmp, "hf_big"),
                                os.path.join(tmp, "mcore_big", "iter_0000000")], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, check=False)
        verdict = check.stdout.strip().splitlines()[-1] if check.stdout.strip() else check.stderr[-2000:]
    big, tiny = rows["big"], rows["tiny"]
    over = big["peak"] - tiny["peak"]
    ratio = over / big["largest"]
    ok = ratio <= 1.3 and verdict == "EQUAL"
    gib = 2 ** 30
    lines = [
        f"# Converter peak memory ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, CPU)",
        "",
        (f"`python benchmarks/convert_memory.py --layers {args.layers}`: HF -> megatron dist checkpoint, "
         "fp32, one process."),
        "",
        "| model | weights | largest tensor | converter peak RSS | time |",
        "|---|---|---|---|---|",
        *(f"| {n} | {r['model_bytes'] / gib:.3f} GiB | {r['largest'] / gib:.3f} GiB | {r['peak'] / gib:.3f} GiB "
          f"| {r['seconds']:.0f} s |" for n, r in rows.items()),
        "",
        (f"peak(big) - peak(tiny) = {over / gib:.3f} GiB = **{ratio:.2f} x the largest tensor** "
         f"({over / big['model_bytes']:.2f} x the model); target <= 1.3 x: {'met' if ratio <= 1.3 else 'NOT met'}."),
        f"Reloaded checkpoint against the source: {verdict}.",
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
