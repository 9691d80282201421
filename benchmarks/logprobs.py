"""Peak memory and time of per-token log-probs + entropy (forward + backward), ours vs full logits.

The straightforward path materialises `[T, V]` fp32 logits (log_softmax, gather, entropy,
backward: several `[T, V]` temporaries); ours (`megatron_rl.logprobs.token_logprobs_and_entropy`)
holds two `[chunk, V/TP]` buffers. Qwen vocabulary V = 151,936, hidden 256, fp32, CPU.

    python benchmarks/logprobs.py            # full table: ours recompute vs loss-fused at T in {2k,8k},
                                             # T in {1k,2k,4k} side by side with full logits,
                                             # then ours alone at T in {8k,32k,64k}, TP=1 and CP=2
    python benchmarks/logprobs.py --quick    # T = 2k only
    python benchmarks/logprobs.py --device cuda   # the GPU table: bf16, H=4096, peers (logprobs_cuda.py)

Method: every configuration runs in a fresh process (`--child`). It allocates its inputs
(`h [T, H]`, `W [V, H]`, labels), runs a 16-token warm-up, records its resident set size, runs
one forward+backward of `Σ logprob + 0.1·Σ entropy`, and reports peak memory = `ru_maxrss` at
the end minus that RSS (so it counts everything the computation allocates, gradients of h and W
included, but not the inputs). CP=2 runs two gloo processes with one thread each, each holding
half of the tokens, and includes the CP all-reduce of the weight gradient (what megatron's DDP
does over DP×CP); its memory is per process.

Speed: wall time, and CPU time (`time.process_time`, summed over CP processes), since the
machine may be shared (the table prints the 1-minute load average). Each child measures this
machine's fp32 GEMM throughput (2048³ matmul, same thread count) right before and right after its
run, both per wall second and per CPU second. GEMM efficiency = the projection FLOPs ours
executes (4 GEMMs: forward, recomputation, dh, dW = 8·T·V·H) per second over that throughput:
`wall` uses wall seconds, `cpu` uses CPU seconds on both sides (robust to other processes taking
cores, not to them thrashing caches).
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
def _gemm_rates(reps: int = 4) -> tuple[float, float]:
    """fp32 GEMM throughput in GFLOP per wall second and per CPU second (2048³ matmul)."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t, c = time.perf_counter(), time.process_time()
    for _ in range(reps):
        a @ b
    flops = 2 * 2048**3 * reps / 1e9
    return flops / (time.perf_counter() - t), flops / (time.process_time() - c)


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
    from megatron_rl.logprobs.loss_fused import fused_token_loss

    g = torch.Generator().manual_seed(args.cp_rank)
    n = args.tokens // args.cp_size
    h = torch.randn(n, HID, generator=g).requires_grad_()
    w = (torch.randn(V, HID, generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, V, (n,), generator=g)

    def step(hh, yy):
        if args.path == "loss_fused":
            loss, _ = fused_token_loss(hh, w, yy, lambda rows, lp, ent, kept: lp.sum() + 0.1 * ent.sum(),
                                       chunk_size=args.chunk)
            loss.backward()
        else:
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
    before = _gemm_rates()
    barrier()
    base = _rss_bytes()
    t, c = time.perf_counter(), time.process_time()
    step(h, y)
    sec, cpu = time.perf_counter() - t, time.process_time() - c
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    barrier()
    after = _gemm_rates()
    return {"sec": sec, "cpu": cpu, "peak": peak,
            "gemm": (before[0] + after[0]) / 2, "gemm_cpu": (before[1] + after[1]) / 2}


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
    return {"sec": max(r["sec"] for r in results), "cpu": sum(r["cpu"] for r in results),
            "peak": max(r["peak"] for r in results), "gemm": sum(r["gemm"] for r in results),
            "gemm_cpu": sum(r["gemm_cpu"] for r in results) / len(results),
            "load": max(load, os.getloadavg()[0])}


def _k(t: int) -> str:
    return f"{t // 1024}k"


def _eff(r: dict, tokens: int, cpu: bool = False, gemms: int = 4) -> float:
    flops = 2 * gemms * tokens * V * HID / 1e9
    return flops / r["cpu"] / r["gemm_cpu"] if cpu else flops / r["sec"] / r["gemm"]


def _loss_fused_table(tokens: list[int], chunk: int) -> None:
    """Ours as the trainer runs it today (recompute: 4 GEMMs) against the loss-fused variant
    (`loss_fused.fused_token_loss`: gradients in the forward, 3 GEMMs), same loss, same chunk;
    runs alternate so both see the same machine."""
    print("(o) ours: recompute (4 GEMMs: the trainer's path) vs loss-fused (3 GEMMs), TP=1, 2 threads;"
          " GEMM eff = the FLOPs each executes over the fp32 GEMM rate")
    print(f"{'T':>4} | {'recompute: peak':>15} {'wall/cpu s':>11} {'eff':>4} | {'loss-fused: peak':>16} "
          f"{'wall/cpu s':>11} {'eff':>4} | {'speedup wall/cpu':>16} | {'load':>4}")
    for t in tokens:
        rec, fus = _run("fused", t, chunk), _run("loss_fused", t, chunk)
        if rec is None or fus is None:
            print(f"{_k(t):>4} | failed")
            continue
        cells = [f"{r['peak'] / GiB:>{w}.2f} GiB {r['sec']:>5.1f}/{r['cpu']:<5.1f} {_eff(r, t, gemms=g):>4.0%}"
                 for r, g, w in ((rec, 4, 11), (fus, 3, 12))]
        speedup = f"{rec['sec'] / fus['sec']:.2f}x/{rec['cpu'] / fus['cpu']:.2f}x"
        print(f"{_k(t):>4} | {cells[0]} | {cells[1]} | {speedup:>16} | {max(rec['load'], fus['load']):>4.1f}",
              flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only T = 2k")
    ap.add_argument("--tables", default="o,i,ii", help="which CPU tables, comma-separated (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu (this table) | cuda (benchmarks/logprobs_cuda.py's table)")
    ap.add_argument("--gpu-tokens", type=int, nargs="*", default=[4096, 16384, 65536],
                    help="--device cuda: values of T")
    ap.add_argument("--out", default=None, help="--device cuda: also write the table (Markdown) here")
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
    if args.device != "cpu":
        import torch

        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            print("logprobs.py --device cuda: torch.cuda.is_available() is False here; run it on a GPU machine "
                  "(tools/gpu_check.py does)", file=sys.stderr)
            sys.exit(2)
        from logprobs_cuda import table

        text = table(args.gpu_tokens, V, 4096, args.device)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return

    import torch

    from megatron_rl.logprobs import auto_chunk_size

    chunk = args.chunk_size or auto_chunk_size(V)
    print(f"log-prob + entropy, forward+backward, fp32, V={V:,}, H={HID}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; ours: chunk={chunk} tokens")
    print("peak = ru_maxrss at the end of the run minus RSS before it (fresh process per configuration,"
          " inputs allocated, 16-token warm-up); gradients of h and W are included, inputs are not.")
    print("speed: wall s / CPU s; GEMM eff wall/cpu = executed projection FLOPs (8·T·V·H, incl. the"
          " backward recomputation) per wall/CPU second over the fp32 GEMM throughput (2048³) measured per"
          " wall/CPU second in the same process(es) right before and after the run; load = 1-min load avg.\n")

    tables = set(args.tables.split(","))
    if "o" in tables:
        _loss_fused_table([2048] if args.quick else [2048, 8192], chunk)
    if "i" not in tables and "ii" not in tables:
        return
    side = [2048] if args.quick else [1024, 2048, 4096]
    print("(i) side by side, TP=1, 2 threads")
    print(f"{'T':>4} | {'naive peak':>10} {'wall/cpu s':>11} | {'ours peak':>9} {'wall/cpu s':>11} | "
          f"{'mem ratio':>9} {'speedup wall/cpu':>16} | {'GEMM eff wall/cpu':>17} | {'load':>9}")
    ref_4k = None
    for t in side if "i" in tables else []:
        ours = _run("fused", t, chunk)
        naive = _run("naive", t, chunk)
        if ours is None:
            print(f"{_k(t):>4} | ours failed")
            continue
        if t == 4096:
            ref_4k = ours
        o_time = f"{ours['sec']:.1f}/{ours['cpu']:.1f}"
        if naive:
            n_peak, n_time = f"{naive['peak'] / GiB:.2f} GiB", f"{naive['sec']:.1f}/{naive['cpu']:.1f}"
            mem = f"{naive['peak'] / ours['peak']:.1f}x"
            spd = f"{naive['sec'] / ours['sec']:.2f}x/{naive['cpu'] / ours['cpu']:.2f}x"
            load = f"{ours['load']:.1f} {naive['load']:.1f}"
        else:
            n_peak, n_time, mem, spd, load = "killed", "-", "-", "-", f"{ours['load']:.1f}"
        eff = f"{_eff(ours, t):.0%}/{_eff(ours, t, cpu=True):.0%}"
        print(f"{_k(t):>4} | {n_peak:>10} {n_time:>11} | {ours['peak'] / GiB:>5.2f} GiB {o_time:>11} | "
              f"{mem:>9} {spd:>16} | {eff:>17} | {load:>9}", flush=True)
    if args.quick or "ii" not in tables:
        return

    print("\n(ii) ours alone (the full-logits path does not fit: its [T, V] fp32 logits alone are the"
          " last column)")
    print("'vs 4k': CPU time per token relative to ours at T=4k (TP=1).")
    print(f"{'T':>4} {'layout':>17} | {'peak':>9} {'wall/cpu s':>12} {'us/token wall/cpu':>17} {'vs 4k':>6} | "
          f"{'GEMM eff wall/cpu':>17} | {'load':>4} | {'naive logits':>12}")
    for t in (8192, 32768, 65536):
        for cp in (1, 2):
            r = _run("fused", t, chunk, cp=cp)
            layout = "TP=1, 2 threads" if cp == 1 else "CP=2, 2 procs x1"
            if r is None:
                print(f"{_k(t):>4} {layout:>17} | failed")
                continue
            rel = f"{r['cpu'] / t / (ref_4k['cpu'] / 4096):.2f}x" if ref_4k and cp == 1 else "-"
            times = f"{r['sec']:.1f}/{r['cpu']:.1f}"
            per_tok = f"{r['sec'] / t * 1e6:.0f}/{r['cpu'] / t * 1e6:.0f}"
            eff = f"{_eff(r, t):.0%}/{_eff(r, t, cpu=True):.0%}"
            print(f"{_k(t):>4} {layout:>17} | {r['peak'] / GiB:>5.2f} GiB {times:>12} {per_tok:>17} {rel:>6} | "
                  f"{eff:>17} | {r['load']:>4.1f} | {t * V * 4 / GiB:>8.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
