"""One RL training step on one GPU at a real model shape: where the time goes.

    python benchmarks/rl_step_gpu.py                         # qwen3-1.7b, and qwen3-moe-30b-a3b cut to 2 layers
    python benchmarks/rl_step_gpu.py --preset qwen3-1.7b --rows 8 --response-len 4096 --json out.json

What one step does (as megatron_rl.trainer.rl_step, on one rank): build the training batch from the
samples (bookkeeping), the old log-probs pass (forward), the update (train pass = forward+backward of
the policy loss through the fused log-prob kernel, then the optimizer step), the weight export a
weight sync sends to the engine, and the metric reductions (bookkeeping). In the same process,
with the same model and tokens, it times a plain megatron LM-loss forward+backward (the GPT
model's own output layer and vocab-parallel cross-entropy on the response tokens): the reference
the train pass is compared with.

THE ROLLOUT IS SYNTHETIC: random prompt and response token ids, rewards 0/1 at random, and rollout
log-probs μ = the model's own log-probs (a forward pass) plus small noise. Generation is not run
and not timed: generating 4k-token responses with the embedded engine would take minutes and is
not what this measures. Weights are random (HF shapes, random init).

Targets: train pass >= 0.85x the plain LM step (its time at most 1/0.85 of the LM step's);
non-model time (bookkeeping + weight export) <= 15% of the step. --strict exits 1 when missed.
Exits 2 without a CUDA GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_PRESETS = ["qwen3-1.7b", "qwen3-moe-30b-a3b"]
TARGET_TRAIN_VS_LM = 0.85
TARGET_NON_MODEL = 0.15
PHASES = (("bookkeeping_batch", "bookkeeping: batch, advantages, counts"),
          ("old_logprobs", "old log-probs (forward)"),
          ("train_pass", "train pass (forward+backward)"),
          ("optimizer", "optimizer step"),
          ("weight_export", "weight export (sync, trainer side)"),
          ("bookkeeping_metrics", "bookkeeping: metric reductions"))
NON_MODEL = ("bookkeeping_batch", "weight_export", "bookkeeping_metrics")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="rl_step_gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", default=None,
                   help=f"model preset (megatron_rl/model/presets.py), repeatable; default {DEFAULT_PRESETS}")
    p.add_argument("--layers", type=int, default=None, help="override num_layers of every preset")
    p.add_argument("--moe-layers", type=int, default=2, help="num_layers of MoE presets (default 2: one GPU)")
    p.add_argument("--rows", type=int, default=8, help="sequences per step (one group; default 8)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence (default 256)")
    p.add_argument("--response-len", type=int, default=4096, help="response tokens per sequence (default 4096)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per forward/backward (default 1)")
    p.add_argument("--num-minibatches", type=int, default=1, help="optimizer steps per rollout batch (default 1)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="training precision")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions; medians are reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Summary:
    step: float  # seconds of the RL step (all phases)
    model: float  # old log-probs + train pass + optimizer
    non_model_share: float
    train_vs_lm: float  # plain LM time / train pass time (1.0 = as fast)
    train_tokens_per_s: float
    lm_tokens_per_s: float


def summarize(phases: dict[str, float], lm: float, tokens: int) -> Summary:
    """Phase medians (seconds) and the plain LM step's -> the step's totals and the target ratios."""
    step = sum(phases[k] for k, _ in PHASES)
    non_model = sum(phases[k] for k in NON_MODEL)
    return Summary(step=step, model=step - non_model, non_model_share=non_model / step,
                   train_vs_lm=lm / phases["train_pass"], train_tokens_per_s=tokens / phases["train_pass"],
                   lm_tokens_per_s=tokens / lm)


def format_table(name: str, desc: str, phases: dict[str, float], lm: float, s: Summary, extra: dict) -> str:
    def ok(good: bool) -> str:
        return "ok" if good else "MISSED"

    lines = [f"{name}: {desc}", f"  {'phase':<40} {'seconds':>9} {'share':>7}"]
    for key, label in PHASES:
        lines.append(f"  {label:<40} {phases[key]:>9.3f} {100 * phases[key] / s.step:>6.1f}%")
    lines += [
        f"  {'RL step (no generation)':<40} {s.step:>9.3f} {100.0:>6.1f}%",
        f"  {'plain megatron LM loss fwd+bwd':<40} {lm:>9.3f}",
        f"  train pass tokens/s: {s.train_tokens_per_s:,.0f}   plain LM tokens/s: {s.lm_tokens_per_s:,.0f}",
        (f"  train pass vs plain LM: {s.train_vs_lm:.3f}x (target >= {TARGET_TRAIN_VS_LM}) "
         f"{ok(s.train_vs_lm >= TARGET_TRAIN_VS_LM)}"),
        (f"  non-model time: {100 * s.non_model_share:.1f}% of the step (target <= {100 * TARGET_NON_MODEL:.0f}%) "
         f"{ok(s.non_model_share <= TARGET_NON_MODEL)}"),
    ]
    lines += [f"  {k}: {v}" for k, v in extra.items()]
    return "\n".join(lines)


def targets_met(s: Summary) -> bool:
    return s.train_vs_lm >= TARGET_TRAIN_VS_LM and s.non_model_share <= TARGET_NON_MODEL


# ------------------------------------------------------------------------------------- GPU parts


def _sync():
    import torch

    torch.cuda.synchronize()


class Timer:
    def __init__(self):
        self.times: dict[str, list[float]] = {}

    def __call__(self, key: str, fn, *args, **kwargs):
        _sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync()
        self.times.setdefault(key, []).append(time.perf_counter() - t0)
        return out

    def medians(self, skip: int) -> dict[str, float]:
        return {k: statistics.median(v[skip:]) for k, v in self.times.items()}


def synthetic_samples(arch, rows: int, prompt_len: int, response_len: int, seed: int):
    """Random prompts and responses (labelled synthetic), rollout log-probs filled in later."""
    import torch

    from megatron_rl.rollout.types import Sample

    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(0, arch.vocab_size, (prompt_len,), generator=g),
                   response_ids=torch.randint(0, arch.vocab_size, (response_len,), generator=g),
                   rollout_logprobs=torch.zeros(response_len), finish_reason="length", policy_version=0,
                   prompt_index=0, sample_index=i) for i in range(rows)]


def bench_preset(name: str, args, groups) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_rl.config import load_config
    from megatron_rl.losses import GlobalCounts, PolicyBatch, compute_policy_loss, get_advantage, local_counts
    from megatron_rl.metrics.mismatch import mismatch_sums
    from megatron_rl.model.presets import PRESETS, REAL_PRESETS, preset_arch
    from megatron_rl.trainer.batch import build_batch, minibatch_slices, model_device
    from megatron_rl.trainer.passes import PassSettings, logprob_pass, micro_batches, train_pass
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.stack import forward_backward

    if name not in REAL_PRESETS and name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose from {sorted(REAL_PRESETS) + sorted(PRESETS)}")
    kind = REAL_PRESETS[name]["arch"] if name in REAL_PRESETS else "qwen3_moe"
    overrides = {}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    elif kind == "qwen3_moe" and name in REAL_PRESETS:
        overrides["num_layers"] = args.moe_layers
    arch = preset_arch(kind, name, **overrides)
    cfg = load_config(None, [f"model.arch={kind}", f"model.size={name}", f"model.dtype={args.dtype}",
                             "optim.lr=1e-7"])
    torch.cuda.reset_peak_memory_stats()
    policy = build_policy(cfg.model, cfg.optim, groups, arch, seed=args.seed)
    model, optimizer = policy.model, policy.optimizer
    dev = model_device()  # the current CUDA device
    mbs = args.micro_batch_size
    settings = PassSettings(micro_batch_size=mbs)
    samples = synthetic_samples(arch, args.rows, args.prompt_len, args.response_len, args.seed)
    seq_len = args.prompt_len + args.response_len
    rewards = [float(i % 2) for i in range(args.rows)]

    def make_batch(samples):
        adv = get_advantage("grpo")(torch.tensor(rewards).view(1, -1)).reshape(-1)
        batch = build_batch(samples, rewards, 0, seq_len).with_advantages(adv).to(dev)
        slices = minibatch_slices(batch.size, args.num_minibatches, mbs)
        counts = []
        for sl in slices:
            total = GlobalCounts()
            for s in sl:
                total = total + local_counts(batch.loss_mask[s])
            n = total.num_tokens.clone()
            dist.all_reduce(n, group=groups.dp_cp_group)
            counts.append(GlobalCounts(num_tokens=n))
        return batch, slices, counts

    # μ: the model's own log-probs (one forward) + noise, written back into the samples
    batch, _, _ = make_batch(samples)
    mu, _ = logprob_pass(model, groups, batch, settings, need_entropy=False)
    mu = mu.cpu()
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        noisy = mu[i, p - 1:p - 1 + len(s.response_ids)] + 0.01 * torch.randn(len(s.response_ids))
        samples[i] = replace(s, rollout_logprobs=noisy.clamp(max=0.0))

    def loss_fn_for(counts, old):
        def loss_fn(mb, logprobs, _entropy):
            pb = PolicyBatch(logprobs=logprobs, old_logprobs=old[mb["rows"]], rollout_logprobs=mb["rollout_logprobs"],
                             advantages=mb["advantages"], loss_mask=mb["loss_mask"], positions=mb["positions"])
            loss, metrics = compute_policy_loss(pb, "ppo_clip", {"eps_low": 0.2, "eps_high": 0.28},
                                                aggregation="token_mean", normaliser=counts)
            metrics = {k: v.detach().double() for k, v in metrics.items()}
            metrics.update(mismatch_sums(pb.old_logprobs, pb.rollout_logprobs, pb.loss_mask,
                                         logprobs=logprobs.detach()))
            metrics["loss/value"] = loss.detach().double()
            return loss, metrics

        return loss_fn

    def lm_forward_step(counts_all):
        from megatron_rl.model import causal_mask

        def step(data_iterator, m):
            mb = next(data_iterator)
            inp = mb["input_ids"]
            per_token = m(inp, mb["position_ids"], causal_mask(inp.shape[1], device=inp.device), labels=mb["labels"])

            def loss_func(out):
                loss = (out.float() * mb["loss_mask"]).sum() / counts_all.num_tokens
                return loss, torch.tensor(1, device=inp.device), {}

            return per_token, loss_func

        return step

    def reduce_metrics(outs, old, entropy, batch):
        sums = mismatch_sums(old, batch.rollout_logprobs, batch.loss_mask, entropy=entropy)
        for o in outs:
            for k, v in o.items():
                sums[k] = sums[k] + v if k in sums else v
        for k in sorted(sums):  # as rl_step: one all-reduce per key over DP x CP
            t = torch.as_tensor(sums[k], device=dev).detach().double().clone()
            dist.all_reduce(t, group=groups.dp_cp_group)
            sums[k] = t
        return {k: float(v) for k, v in sums.items() if v.numel() == 1}

    def export():
        n = 0
        for _, t in policy.export(dtype=torch.bfloat16):
            n += t.numel()
        return n

    timer = Timer()
    for _ in range(args.warmup + args.repeats):
        batch, slices, counts = timer("bookkeeping_batch", make_batch, samples)
        old, entropy = timer("old_logprobs", logprob_pass, model, groups, batch, settings, True)
        outs = []
        for sl, c in zip(slices, counts, strict=True):
            outs += timer("train_pass", train_pass, model, optimizer, groups, batch, sl, settings, loss_fn_for(c, old))
            timer("optimizer", optimizer.step)
        exported = timer("weight_export", export)
        metrics = timer("bookkeeping_metrics", reduce_metrics, outs, old, entropy, batch)
        for sl, c in zip(slices, counts, strict=True):
            timer("plain_lm", forward_backward, model, lm_forward_step(c), iter(micro_batches(batch, sl)), len(sl),
                  batch.input_len, mbs, optimizer=optimizer)
    # train pass and LM time per step = summed over mini-batches
    per_step = {k: statistics.median([sum(v[i:i + n]) for i in range(0, len(v), n)][args.warmup:])
                for k, v in timer.times.items()
                for n in [args.num_minibatches if k in ("train_pass", "optimizer", "plain_lm") else 1]}
    lm = per_step.pop("plain_lm")
    tokens = args.rows * (seq_len - 1)
    s = summarize(per_step, lm, tokens)
    params = sum(p.numel() for p in model.parameters())
    desc = (f"{arch.num_layers} layers, {params / 1e9:.2f}B params, {args.dtype}; {args.rows} rows x "
            f"({args.prompt_len} prompt + {args.response_len} response) tokens, micro-batch {mbs}, "
            f"{args.num_minibatches} optimizer step(s); SYNTHETIC rollout (random tokens, μ = own log-probs + noise)")
    extra = {"peak GPU memory": f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
             "exported parameters": f"{exported:,}",
             "loss (last repeat)": f"{metrics.get('loss/value', float('nan')):.4g}",
             "generation": "not run (synthetic rollout)"}
    print(format_table(name, desc, per_step, lm, s, extra), flush=True)
    result = {"preset": name, "arch": arch.to_dict(), "params": params, "tokens_per_step": tokens,
              "phases_s": per_step, "plain_lm_s": lm, "summary": s.__dict__, "targets_met": targets_met(s),
              "finite_loss": math.isfinite(metrics.get("loss/value", float("nan"))), **extra}
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("rl_step_gpu.py: needs a CUDA GPU, and torch.cuda.is_available() is False here. "
              "Run it on a GPU machine (tools/gpu_check.sh does).", file=sys.stderr)
        return 2
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's "no Apex/TE" notices
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as pretrain_rl.py, so the numbers are what it runs
    from megatron_rl.parallel import ParallelConfig, destroy_parallel, init_distributed, init_parallel
    from megatron_rl.platform import apply_platform_workarounds, capabilities

    applied = apply_platform_workarounds()
    _, world = init_distributed()
    if world != 1:
        print("rl_step_gpu.py: runs on one GPU (one process)", file=sys.stderr)
        return 2
    groups = init_parallel(ParallelConfig(), seed=args.seed)
    import megatron.core

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | megatron-core {megatron.core.__version__} | "
          f"{capabilities().describe()} | workarounds {applied} | "
          f"TORCHDYNAMO_DISABLE={os.environ.get('TORCHDYNAMO_DISABLE')}", flush=True)
    results = []
    try:
        for name in args.preset or DEFAULT_PRESETS:
            results.append(bench_preset(name, args, groups))
            gc.collect()  # the previous model's memory, before the next one is built
            torch.cuda.empty_cache()
            print(flush=True)
    finally:
        destroy_parallel()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "megatron_core": megatron.core.__version__, "args": vars(args), "results": results}, f,
                      indent=1, default=str)
    if not all(r["finite_loss"] for r in results):
        print("rl_step_gpu.py: a loss was not finite", file=sys.stderr)
        return 1
    if args.strict and not all(r["targets_met"] for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
