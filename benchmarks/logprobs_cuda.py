"""Log-probs + entropy on one GPU: ours against the straightforward path and two peers, one table.

    python benchmarks/logprobs.py --device cuda                      # T in {4k, 16k, 64k}
    python benchmarks/logprobs.py --device cuda --gpu-tokens 16384 65536   # make gpu-check's table
    python benchmarks/logprobs.py --device cuda --gpu-tokens 4096 --out benchmarks/results/logprobs_gpu.md

bf16 hidden `[T, H]` and weight `[V, H]` (V = 151,936, H = 4,096), forward + backward of
`Σ logprob + 0.1 · Σ entropy`. Paths, one after another in this process:

    straightforward  full `[T, V]` logits (`reference_logprobs_and_entropy`: bf16 GEMM, upcast,
                     log_softmax); "does not fit" when it runs out of memory
    ours             `token_logprobs_and_entropy` (fp32 logits from the mixed GEMM, chunked; on a
                     GPU with Triton the chunk math is Inductor-compiled, `compiled_math`)
    ours untiled     the same, with the backward in the forward's chunks over the whole vocabulary
                     (`grad_tile=(chunk, V)`) instead of `auto_grad_tile`'s tiles, to show what
                     tiling buys (the weight-gradient GEMM's inner dimension: 384 vs 4096 tokens)
    ours eager       the same with the eager in-place chunk math (`kernels=None`, untiled), to show
                     what compiling buys
    ours loss-fused  `loss_fused.fused_token_loss`: the loss (token-local here) and its gradients in
                     the forward's chunk loop, three GEMMs instead of four; the trainer's update pass
                     for a token-local loss (loss.head_gradients=auto)
    ours loss-fused 1.5k  the same in chunks of 1,536 tokens instead of `auto_loss_chunk_size`'s 832
                     (V = 151,936): each chunk's weight-gradient GEMM reads and writes the whole fp32
                     `main_grad` (5 GB) for 832 or 1,536 tokens of arithmetic, so this shows whether
                     that traffic bounds it, at about 1.4 GiB of buffers instead of 0.8
    verl             `verl.utils.kernel.linear_cross_entropy` (log-probs and entropy), if installed
                     (without Ray: see `peer_module`)
    liger            Liger's fused linear cross entropy (log-probs only, no entropy), if installed

The "ours" rows run as in the trainer: the weight carries megatron DDP's fp32 `main_grad`,
allocated with the inputs, and the weight gradient is accumulated into it (no `[V, H]` buffer of
its own; without one, an fp32 `[V, H]` accumulator, 2.3 GiB here, adds to the peak).

Per path and T: time = median of 3 CUDA-event timings after a warm-up; peak = the most memory
allocated during one run beyond what was allocated before it (the inputs) and beyond the returned
gradients of h and W; floor = 3 × the time of one `[T, H] × [H, V]` bf16 GEMM measured in the
same run (forward, d_hidden, d_weight), and `% of floor` = floor / time. Ours recomputes the
logits in the backward, a fourth GEMM: its own bound is 4/3 of the floor (75% of floor); the
loss-fused path does not (its bound is the floor).
Accuracy at the largest T (64k by default): the largest |log-prob − float64| and |entropy −
float64| over every token, from the same bf16 inputs; the float64 reference runs 2,048 tokens at
a time (its whole `[T, V]` logits would be 80 GB at 64k). A peer is only imported from an
installed package, never vendored.

Targets for ours at T = 64k (the trainer's two paths, `ours` and `ours loss-fused`): time <= 0.45 s,
peak beyond the inputs <= 1 GiB, error vs float64 <= 2e-5; the table's last lines check them, and
its very last line, `summary: ...`, gives every path at the largest T in one line (for
tools/gpu_check.py's end-of-call summary).

`table()` also runs on the CPU at small sizes (times from perf_counter, no memory column): that
is what tests/tools/test_logprobs_benchmark.py runs, so this file cannot rot unseen.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

GiB = 2**30


# ----------------------------------------------------------------------------- paths


def _ours(h, w, y):
    from megatron_rl.logprobs import token_logprobs_and_entropy

    out = token_logprobs_and_entropy(h, w, y)
    return out.logprobs, out.entropy, None


def _ours_untiled(h, w, y):
    from megatron_rl.logprobs import auto_chunk_size, token_logprobs_and_entropy

    out = token_logprobs_and_entropy(h, w, y, grad_tile=(auto_chunk_size(w.shape[0]), w.shape[0]))
    return out.logprobs, out.entropy, None


def _ours_eager(h, w, y):
    from megatron_rl.logprobs import token_logprobs_and_entropy

    out = token_logprobs_and_entropy(h, w, y, kernels=None)
    return out.logprobs, out.entropy, None


def _ours_loss_fused(h, w, y):
    from megatron_rl.logprobs.loss_fused import fused_token_loss

    loss, out = fused_token_loss(h, w, y, lambda rows, lp, ent, kept: lp.sum() + 0.1 * ent.sum())
    return out.logprobs, out.entropy, loss


def _ours_loss_fused_wide(h, w, y):
    from megatron_rl.logprobs.loss_fused import fused_token_loss

    loss, out = fused_token_loss(h, w, y, lambda rows, lp, ent, kept: lp.sum() + 0.1 * ent.sum(),
                                 chunk_size=WIDE_CHUNK)
    return out.logprobs, out.entropy, loss


def _straightforward(h, w, y):
    from megatron_rl.logprobs import reference_logprobs_and_entropy

    out = reference_logprobs_and_entropy(h, w, y)
    return out.logprobs, out.entropy, None


def _verl(h, w, y):
    lce = peer_module(PEER_MODULES["verl"])
    logprobs, entropy = lce.linear_cross_entropy(h, w, y, 1.0, "none")
    # its backward asserts contiguous gradients; a sum's gradient arrives as an expanded view
    for t in (logprobs, entropy):
        if t.requires_grad:   # not under no_grad (the accuracy pass)
            t.register_hook(lambda g: g.contiguous())
    return logprobs, entropy, None


def _liger(h, w, y):
    liger = peer_module(PEER_MODULES["liger"])
    return -liger.LigerFusedLinearCrossEntropyLoss(reduction="none")(w, h, y), None, None


PEER_MODULES = {"verl": "verl.utils.kernel.linear_cross_entropy", "liger": "liger_kernel.transformers"}


def peer_module(name: str) -> types.ModuleType:
    """Import module `name` of an installed peer package.

    verl's top-level `__init__` imports its trainer stack (Ray, tensordict, ...), which a GPU box
    set up only to benchmark need not have, while its kernel module needs only torch and Triton.
    So when the plain import fails on a missing module other than the package itself, the parent
    packages are registered bare (their `__path__` pointing at the installed folders, their
    `__init__` not run) and the module is imported from the installed files under them. The code
    that runs is the installed package's own; nothing of it is copied here.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = name.split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None or e.name == top or not spec.submodule_search_locations:
            raise
    for key in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
        del sys.modules[key]   # what the failed import left half-initialised
    folder = Path(spec.submodule_search_locations[0])
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = types.ModuleType(".".join(parts[:i]))
        parent.__path__ = [str(folder.joinpath(*parts[1:i]))]
        parent.__spec__ = importlib.machinery.ModuleSpec(parent.__name__, None, is_package=True)
        parent.__spec__.submodule_search_locations = parent.__path__
        sys.modules[parent.__name__] = parent
    return importlib.import_module(name)


WIDE_CHUNK = 1536
MAIN_GRAD_PATHS = {"ours", "ours untiled", "ours eager", "ours loss-fused", "ours loss-fused 1.5k"}
PATHS: dict[str, Callable] = {"straightforward": _straightforward, "ours": _ours, "ours untiled": _ours_untiled,
                              "ours eager": _ours_eager, "ours loss-fused": _ours_loss_fused,
                              "ours loss-fused 1.5k": _ours_loss_fused_wide, "verl": _verl, "liger": _liger}


# ----------------------------------------------------------------------------- measurement


class _Timer:
    """CUDA events on a GPU (device time), perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def inputs(tokens: int, vocab: int, hidden: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = (torch.randn(tokens, hidden, device=device, generator=g)).bfloat16()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * hidden**-0.5).bfloat16()
    y = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    return h, w, y


def gemm_floor(tokens: int, vocab: int, hidden: int, device) -> float:
    """3 × the time of one [T, H] x [H, V] bf16 GEMM (median of 3 after a warm-up)."""
    h, w, _ = inputs(tokens, vocab, hidden, device)
    timer = _Timer(torch.device(device))
    torch.mm(h, w.t())
    return 3 * statistics.median(timer(lambda: torch.mm(h, w.t())) for _ in range(3))


def measure(path: str, tokens: int, vocab: int, hidden: int, device, reps: int = 3) -> dict:
    """{"time", "peak"} of one path at T = tokens, or {"error": text}."""
    dev = torch.device(device)
    fn = PATHS[path]
    h, w, y = inputs(tokens, vocab, hidden, dev)
    h.requires_grad_(), w.requires_grad_()
    if path in MAIN_GRAD_PATHS:   # megatron DDP's gradient buffer, part of the model's memory
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=dev)

    def once():
        h.grad = w.grad = None
        logprobs, entropy, loss = fn(h, w, y)
        if loss is None:   # the loss-fused path computes it (and its gradients) itself
            loss = logprobs.float().sum() + (0.1 * entropy.float().sum() if entropy is not None else 0.0)
        loss.backward()

    timer = _Timer(dev)
    try:
        once()  # warm-up (kernel compilation, autotuning)
        times = [timer(once) for _ in range(reps)]
        peak = None
        if dev.type == "cuda":
            h.grad = w.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            once()
            grads = sum(g.numel() * g.element_size() for g in (h.grad, w.grad) if g is not None)
            peak = torch.cuda.max_memory_allocated() - base - grads
    except torch.OutOfMemoryError:
        return {"error": "does not fit"}
    except Exception as e:  # noqa: BLE001 - a peer's API or kernel failing is a table entry, not a crash
        first = (str(e).splitlines() or [""])[0][:80]   # an AssertionError may have no message
        return {"error": f"{type(e).__name__}: {first}" if first else type(e).__name__}
    finally:
        h.grad = w.grad = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"time": statistics.median(times), "peak": peak}


def float64_reference(h, w, y, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) in float64 from the same low-precision inputs, `chunk` tokens at a time:
    a chunk's float64 logits are chunk x V x 8 bytes (2.5 GB at 2,048 x 151,936), and the
    reference holds a few such temporaries at once, against 80 GB for the logits of 64k tokens."""
    from megatron_rl.logprobs import reference_logprobs_and_entropy

    wd = w.double()
    outs = [reference_logprobs_and_entropy(h[i:i + chunk].double(), wd, y[i:i + chunk])
            for i in range(0, y.numel(), chunk)]
    return torch.cat([o.logprobs for o in outs]), torch.cat([o.entropy for o in outs])


def accuracy(path: str, tokens: int, vocab: int, hidden: int, device, ref=None) -> dict:
    """Largest |log-prob − float64| and |entropy − float64| over all tokens, from the same bf16
    inputs; `ref`: their `float64_reference` when the caller has it already."""
    h, w, y = inputs(tokens, vocab, hidden, device)
    try:
        with torch.no_grad():
            ref_lp, ref_ent = float64_reference(h, w, y) if ref is None else ref
            lp, ent, _ = PATHS[path](h, w, y)
            out = {"logprob": float((lp.double() - ref_lp).abs().max())}
            if ent is not None:
                out["entropy"] = float((ent.double() - ref_ent).abs().max())
    except torch.OutOfMemoryError:
        return {"error": "does not fit"}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}"}
    finally:
        del h, w, y
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return out


# the targets for the trainer's two paths at T = 64k, H = 4,096, V = 151,936 on one GPU
TARGET_TOKENS = 65536
TARGET_TIME_S, TARGET_PEAK, TARGET_ERROR = 0.45, 1 * GiB, 2e-5
TARGETED = ("ours", "ours loss-fused")


def _label(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def _error(a: dict) -> float | None:
    return None if "error" in a else max(v for k, v in a.items() if k in ("logprob", "entropy"))


def target_checks(path: str, r: dict, a: dict | None) -> list[tuple[str, bool | None]]:
    """[(text, met)] for time, peak and error; met is None where it was not measured (no peak on
    the CPU, no accuracy at this T)."""
    if "error" in r:
        return [(r["error"], False)]
    out = [(f"{r['time']:.3f} s", r["time"] <= TARGET_TIME_S)]
    out.append(("peak n/a", None) if r["peak"] is None else (f"{r['peak'] / GiB:.2f} GiB", r["peak"] <= TARGET_PEAK))
    err = None if a is None else _error(a)
    if a is not None and err is None:
        out.append((f"accuracy: {a['error']}", False))
    elif err is not None:
        out.append((f"error {err:.1e}", err <= TARGET_ERROR))
    return out


def _verdict(checks: list[tuple[str, bool | None]]) -> str:
    known = [met for _, met in checks if met is not None]
    return "MISSED" if not all(known) else "ok" if len(known) == 3 else "ok so far"


def summary_line(t: int, measured: dict[str, dict], errors: dict[str, dict] | None) -> str:
    """Every path at T = t in one line: time, peak, error (when measured at t), and for the
    trainer's paths at the target T whether they meet the targets."""
    cells = []
    for p, r in measured.items():
        a = (errors or {}).get(p)
        if p in TARGETED and t == TARGET_TOKENS:
            checks = target_checks(p, r, a)
            cells.append(f"{p} {', '.join(text for text, _ in checks)} ({_verdict(checks)})")
        elif "error" in r:
            cells.append(f"{p} {r['error']}")
        else:
            err = None if a is None else _error(a)
            cells.append(f"{p} {r['time']:.3f} s" + ("" if r["peak"] is None else f", {r['peak'] / GiB:.2f} GiB")
                         + ("" if err is None else f", error {err:.1e}"))
    return f"summary: T={_label(t)}: " + "; ".join(cells)


# ----------------------------------------------------------------------------- table


def available(path: str) -> bool:
    if path not in PEER_MODULES:
        return True
    try:
        peer_module(PEER_MODULES[path])
    except ImportError:
        return False
    return True


def table(tokens: list[int], vocab: int, hidden: int, device: str, accuracy_tokens: int | None = None) -> str:
    """The Markdown table; accuracy at `accuracy_tokens` (default: the largest T); target checks
    when T = 64k is measured; a one-line summary last."""
    dev = torch.device(device)
    accuracy_tokens = accuracy_tokens or max(tokens)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    paths = [p for p in PATHS if available(p)]
    missing = ", ".join(p for p in PATHS if p not in paths) or "none"
    title = (f"log-prob + entropy forward+backward, bf16 inputs, V={vocab:,}, H={hidden}, {name}, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d')}; peers not installed: {missing}")
    lines = [title, "",
             "| T | floor | " + " | ".join(paths) + " |", "|---|---|" + "---|" * len(paths)]
    measured: dict[int, dict[str, dict]] = {}
    for t in tokens:
        floor = gemm_floor(t, vocab, hidden, dev)
        cells = []
        for p in paths:
            r = measured.setdefault(t, {})[p] = measure(p, t, vocab, hidden, dev)
            if "error" in r:
                cells.append(r["error"])
                continue
            mem = f", {r['peak'] / GiB:.2f} GiB" if r["peak"] is not None else ""
            cells.append(f"{r['time']:.3f} s ({floor / r['time']:.0%} of floor){mem}")
        lines.append(f"| {_label(t)} | {floor:.3f} s | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"accuracy vs float64 from the same bf16 inputs, all T={_label(accuracy_tokens)} tokens:", "",
              "| path | max abs log-prob error | max abs entropy error |", "|---|---|---|"]
    h, w, y = inputs(accuracy_tokens, vocab, hidden, dev)
    try:
        with torch.no_grad():
            ref = float64_reference(h, w, y)
    except torch.OutOfMemoryError:
        ref = None   # then each path's accuracy() tries on its own, and says "does not fit"
    del h, w, y
    errors = {}
    for p in paths:
        a = errors[p] = accuracy(p, accuracy_tokens, vocab, hidden, dev, ref=ref)
        if "error" in a:
            lines.append(f"| {p} | {a['error']} | |")
        else:
            ent = f"{a['entropy']:.1e}" if "entropy" in a else "(no entropy)"
            lines.append(f"| {p} | {a['logprob']:.1e} | {ent} |")
    if TARGET_TOKENS in measured:
        lines += ["", (f"targets at T={_label(TARGET_TOKENS)}: time <= {TARGET_TIME_S} s, peak beyond inputs <= "
                       f"{TARGET_PEAK / GiB:.0f} GiB, log-prob and entropy error vs float64 <= {TARGET_ERROR:.0e}"), ""]
        for p in TARGETED:
            if p in measured[TARGET_TOKENS]:
                checks = target_checks(p, measured[TARGET_TOKENS][p],
                                       errors.get(p) if accuracy_tokens == TARGET_TOKENS else None)
                marks = ", ".join(f"{text} {'-' if met is None else 'ok' if met else 'MISSED'}" for text, met in checks)
                lines.append(f"- {p}: {marks}: {_verdict(checks)}")
    t = max(tokens)
    lines += ["", summary_line(t, measured[t], errors if accuracy_tokens == t else None)]
    return "\n".join(lines)
