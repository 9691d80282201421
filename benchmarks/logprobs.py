"""Peak memory and time of per-token log-probs + entropy (forward + backward), ours vs full logits.

The straightforward path materialises `[T, V]` fp32 logits (log_softmax, gather, entropy,
backward: several `[T, V]` temporaries); ours (`megatron_rl.logprobs.token_logprobs_and_entropy`)
holds two `[chunk, V/TP]` buffers. Qwen vocabulary V = 151,936, hidden 256, fp32, CPU.

    python benchmarks/logprobs.py            # full table: T in {1k,2k,4k} side by side,
                                             # then ours alone at T in {8k,32k,64k}, TP=1 and CP=2
    python benchmarks/logprobs.py --quick    # T = 2k side by side only

Method: every configuration runs in a fresh process (`--child`). It allocates its inputs
(`h [T, H]`, `W [V, H]`, labels), runs a 16-token warm-up, records its resident set size, runs
one forward+backward of `Σ logprob + 0.1·Σ entropy`, and reports peak memory = `ru_maxrss` at
the end minus that RSS (so it counts everything the computation allocates, gradients of h and W
included, but not the inputs). CP=2 runs two gloo processes with one thread each, each holding
half of the tokens, and includes the CP all-reduce of the weight gradient (what megatron's DDP
does over DP×CP); its memory is per process. Each child measures this machine's fp32 GEMM
throughput (2048³ matmul, same thread count) right before and right after its run; GEMM
efficiency = the GEMM FLOPs ours executes (4 projections: forward, recomputation, dh, dW =
8·T·V·H) per second over the mean of the two. The machine may be shared: both throughputs are
then taken under (nearly) the same load, and the table prints the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

V, HID = 151_936, 256
GiB = 2**30


# ------------------------------------------------------------------------------------- child
def _gemm_gflops(reps: int = 4) -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * 2048**3 * reps / (time.perf_counter() - t) / 1e9


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    cp_group = None
    if args.cp_size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.cp_rank, world_size=args.cp_size)
        cp_group = dist.group.WORLD
    from megatron_rl.logprobs import reference_logprobs_and_entropy, token_logprobs_and_entropy

    g = torch.Generator().manual_seed(args.cp_rank)
    n = args.tokens // args.cp_size
    h = torch.randn(n, HID, generator=g).requires_grad_()
    w = (torch.randn(V, HID, generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, V, (n,), generator=g)

    def step(hh, yy):
        if args.path == "naive":
            out = reference_logprobs_and_entropy(hh, w, yy)
        else:
            out = token_logprobs_and_entropy(hh, w, yy, chunk_size=args.chunk)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        if cp_group is not None:
            torch.distributed.all_reduce(w.grad, group=cp_group)

    def barrier():
        if cp_group is not None:
            torch.distributed.barrier()

    step(h[:16].detach().requires_grad_(), y[:16])
    w.grad = None
    barrier()
    gemm_before = _gemm_gflops()
    barrier()
    base = _rss_bytes()
    t = time.perf_counter()
    step(h, y)
    sec = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    barrier()
    gemm_after = _gemm_gflops()
    return {"sec": sec, "peak": peak, "gemm": (gemm_before + gemm_after) / 2}


# ------------------------------------------------------------------------------------ parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path: str, tokens: int, chunk: int, cp: int = 1, timeout: int = 1800) -> dict | None:
    """Launch the configuration's process(es); None if one was killed (out of memory)."""
    port = _free_port()
    threads = 2 if cp == 1 else 1
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--child", "--path", path, "--tokens", str(tokens), "--chunk", str(chunk),
         "--threads", str(threads), "--cp-rank", str(r), "--cp-size", str(cp), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(cp)]
    load = os.getloadavg()[0]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            print(f"  [{path} T={tokens} cp={cp}] exited {p.returncode}: {err.strip()[-300:]}", flush=True)
            return None
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"sec": max(r["sec"] for r in results), "peak": max(r["peak"] for r in results),
            "gemm": sum(r["gemm"] for r in results), "load": max(load, os.getloadavg()[0])}


def _k(t: int) -> str:
    return f"{t // 1024}k"


def _eff(r: dict, tokens: int) -> float:
    return 8 * tokens * V * HID / r["sec"] / 1e9 / r["gemm"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only T = 2k, side by side")
    ap.add_argument("--chunk-size", type=int, default=None, help="ours: tokens per chunk (default: auto_chunk_size(V))")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="fused", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--cp-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return

    import torch

    from megatron_rl.logprobs import auto_chunk_size

    chunk = args.chunk_size or auto_chunk_size(V)
    print(f"log-prob + entropy, forward+backward, fp32, V={V:,}, H={HID}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; ours: chunk={chunk} tokens")
    print("peak = ru_maxrss at the end of the run minus RSS before it (fresh process per configuration,"
          " inputs allocated, 16-token warm-up); gradients of h and W are included, inputs are not.")
    print("GEMM eff = executed projection FLOPs (8·T·V·H, incl. the backward recomputation) per second"
          " / fp32 GEMM throughput (2048³ matmul) measured in the same process(es) right before and after"
          " the run (mean; the machine is shared: 'load' is the 1-min load average).\n")

    side = [2048] if args.quick else [1024, 2048, 4096]
    print("(i) side by side, TP=1, 2 threads")
    print(f"{'T':>4} | {'naive peak':>10} {'naive s':>8} | {'ours peak':>9} {'ours s':>7} | "
          f"{'mem ratio':>9} {'speedup':>7} | {'GEMM GF/s':>9} {'GEMM eff':>8} | {'load':>9}")
    ref_4k = None
    for t in side:
        ours = _run("fused", t, chunk)
        naive = _run("naive", t, chunk)
        if ours is None:
            print(f"{_k(t):>4} | ours failed")
            continue
        if t == 4096:
            ref_4k = ours
        n_peak = f"{naive['peak'] / GiB:.2f} GiB" if naive else "killed"
        n_sec = f"{naive['sec']:.1f}" if naive else "-"
        mem = f"{naive['peak'] / ours['peak']:.1f}x" if naive else "-"
        spd = f"{naive['sec'] / ours['sec']:.2f}x" if naive else "-"
        print(f"{_k(t):>4} | {n_peak:>10} {n_sec:>8} | {ours['peak'] / GiB:>5.2f} GiB {ours['sec']:>7.1f} | "
              f"{mem:>9} {spd:>7} | {ours['gemm']:>9.0f} {_eff(ours, t):>8.0%} | "
              f"{ours['load']:>4.1f} {naive['load'] if naive else 0:>4.1f}", flush=True)
    if args.quick:
        return

    print("\n(ii) ours alone (the full-logits path does not fit: its [T, V] fp32 logits alone are the"
          " last column)")
    print("'vs 4k': time per token relative to ours at T=4k, raw and normalised by the GEMM throughput"
          " measured with each run (= ratio of GEMM efficiencies).")
    print(f"{'T':>4} {'layout':>18} | {'peak':>9} {'time s':>7} {'us/token':>8} {'vs 4k raw/norm':>14} | "
          f"{'GEMM GF/s':>9} {'GEMM eff':>8} | {'load':>4} | {'naive logits':>12}")
    for t in (8192, 32768, 65536):
        for cp in (1, 2):
            r = _run("fused", t, chunk, cp=cp)
            layout = "TP=1 (2 threads)" if cp == 1 else "CP=2 (2 procs x1)"
            if r is None:
                print(f"{_k(t):>4} {layout:>18} | failed")
                continue
            rel = "-"
            if ref_4k and cp == 1:
                rel = f"{r['sec'] / t / (ref_4k['sec'] / 4096):.2f}x/{_eff(ref_4k, 4096) / _eff(r, t):.2f}x"
            print(f"{_k(t):>4} {layout:>18} | {r['peak'] / GiB:>5.2f} GiB {r['sec']:>7.1f} "
                  f"{r['sec'] / t * 1e6:>8.0f} {rel:>14} | {r['gemm']:>9.0f} {_eff(r, t):>8.0%} | "
                  f"{r['load']:>4.1f} | {t * V * 4 / GiB:>8.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
