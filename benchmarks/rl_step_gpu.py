"""One RL training step on one GPU at a real model shape: where the time goes.

    python benchmarks/rl_step_gpu.py                         # qwen3-1.7b, and qwen3-moe-30b-a3b cut to 2 layers
    python benchmarks/rl_step_gpu.py --dense-layers 4        # both cut to a few layers (make gpu-check)
    python benchmarks/rl_step_gpu.py --preset qwen3-1.7b --rows 8 --response-len 4096 --json out.json

Run it as one process (no torchrun) on a machine with one CUDA GPU; tools/gpu_check.py does. Its
last line, `summary: ...`, gives each preset's two ratios against their targets in one line.

THE STEP IS THE TRAINER'S OWN CODE: the run context is megatron_rl.trainer.setup.build_context's, from a
load_config config (preset, dtype, rollout sizes, loss.recipe, micro-batches, mini-batches), and the
timed phases are megatron_rl.trainer.rl_step's, called one by one, synchronised before and after:
    make_batch     advantages, the padded training batch, its copy to the GPU       (bookkeeping)
    old_logprobs   π_old forward pass and mismatch values                           (model)
    update         train pass (forward+backward of the policy loss, per mini-batch) (model)
                   + optimizer step(s), timed inside update by wrapping optimizer.step
    sync           weight export + load into the embedded engine on this GPU        (non-model)
    step_metrics   the one metrics reduction and host-side numbers                  (bookkeeping)
GENERATION IS NOT RUN. THE ROLLOUT IS SYNTHETIC: one group of --rows random responses to one random
prompt, rewards alternating 0/1, μ = the model's own log-probs (one forward pass) + small noise.
Weights are random (HF shapes).

Reference, same process, model and micro-batches: a plain megatron LM-loss forward+backward (the
GPT model's output layer + vocab-parallel cross-entropy on the response tokens) through
trainer.stack.forward_backward, without an optimizer step; it is compared with the train pass =
update minus its optimizer steps (both zero and finalise the grads the same way).

Targets: train pass >= 0.85x the plain LM step; non-model time (make_batch + sync + step_metrics)
<= 15% of the step. --strict exits 1 when missed; exits 2 without a CUDA GPU. Nothing is saved: the
temporary run_dir is not checked for room for a checkpoint, and the model's real vocabulary is not
checked against the toy tasks' tokenizer: no sampled id is decoded (trainer/setup.py: build_context, without
the run's checks).

A PRESET THAT FAILS (out of GPU memory, or any other error) is that preset's outcome: its error, the
GPU memory at the failure (peak, allocated, reserved, capacity) and the estimate below go into the
table and the JSON, its memory is freed and the next preset runs; the exit code is then 1. A
SIGINT (Ctrl-C, or tools/gpu_check.py's part time limit) stops the run with the JSON written.

MEMORY (one H100: 79.6 GiB). The default --recompute core_attn is megatron-core's selective
recompute of core attention (model.recompute): without Transformer Engine megatron runs its local
DotProductAttention (no flash attention), which keeps every layer's attention scores for the
backward: fp32 softmax output + bf16 probabilities, 6 bytes x 16 heads x 4351^2 = 1.69 GiB a layer
for qwen3-1.7b at 256 + 4096 tokens (mb 1), 47 GiB over 28 layers; with recompute a layer keeps q,
k, v only and recomputes the scores in its backward (same loss and gradients; one more attention
forward a layer). qwen3-1.7b (1.72e9 parameters, tied embeddings), bf16, 8 rows x 4351 tokens, mb 1:
  weights + grads + optimizer  18 B/param (bf16 weights 2, fp32 main grads 4, fp32 master 4,
                               Adam 8) x 1.72e9                                       = 28.8 GiB
  embedded engine              bf16 weights, 2 B x 1.72e9                              =  3.2 GiB
  activations of one micro-batch (saved for the backward; ~164 KiB a token a layer with
                               core_attn recompute, measured on the CPU with saved-tensor hooks)
                               164 KiB x 4351 x 28                                     = 19.1 GiB
  transients, one at a time    the recomputed layer's scores and their gradients
                               (~16-20 B x 16 x 4351^2 = 4.5-5.6 GiB), or the plain LM step's
                               logits (bf16 + fp32 copy + fp32 softmax, 10 B x 4351 x 151936
                               = 6.2 GiB)                                             <= 6.2 GiB
  total                                                                               ~ 57 GiB
  (without recompute: + 28 x 1.69 = 47.4 GiB of kept scores ~ 105 GiB: out of memory.)
The MoE preset (qwen3-moe-30b-a3b cut to 2 layers: 1.87e9 parameters, 32 heads) needs ~31.3 +
3.5 + 1.9 (230 KiB a token a layer) + ~10 GiB of one layer's attention transients ~ 47 GiB.
`memory_estimate` prints this estimate for every preset before it runs; the table shows the
measured peak beside it.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_PRESETS = ["qwen3-1.7b", "qwen3-moe-30b-a3b"]
TARGET_TRAIN_VS_LM = 0.85
TARGET_NON_MODEL = 0.15
PHASES = (("make_batch", "make_batch (advantages, batch to GPU)"),
          ("old_logprobs", "old_logprobs (π_old forward)"),
          ("train_pass", "update: train pass (fwd+bwd)"),
          ("optimizer", "update: optimizer step(s)"),
          ("sync", "sync (weight export + engine load)"),
          ("step_metrics", "step_metrics (reductions)"))
NON_MODEL = ("make_batch", "sync", "step_metrics")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="rl_step_gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", default=None,
                   help=f"model preset (megatron_rl/model/presets.py), repeatable; default {DEFAULT_PRESETS}")
    p.add_argument("--layers", type=int, default=None, help="override num_layers of every preset")
    p.add_argument("--dense-layers", type=int, default=None,
                   help="num_layers of real dense presets (default: the preset's own)")
    p.add_argument("--moe-layers", type=int, default=2, help="num_layers of real MoE presets (default 2: one GPU)")
    p.add_argument("--rows", type=int, default=8, help="sequences per step (one group; default 8)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence (default 256)")
    p.add_argument("--response-len", type=int, default=4096, help="response tokens per sequence (default 4096)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="train.micro_batch_size (default 1)")
    p.add_argument("--num-minibatches", type=int, default=1, help="train.num_minibatches (default 1)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="model.dtype (default bf16)")
    p.add_argument("--recipe", default="dapo", help="loss.recipe (default dapo: ppo_clip 0.2/0.28, token mean)")
    p.add_argument("--recompute", default="core_attn", choices=["none", "core_attn"],
                   help="model.recompute (default core_attn: without it the 4k-token default runs out of "
                        "memory on an 80 GB GPU without Transformer Engine; see MEMORY above)")
    p.add_argument("--no-engine-sync", action="store_true",
                   help="drop the embedded engine after setup (frees its GPU copy): sync = weight export only")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override (e.g. moe.router_replay=r2, rollout.device=cpu), repeatable")
    p.add_argument("--tmp-dir", default=None, help="parent of the temporary run_dir (default: the system's)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions; medians are reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- pure parts


def config_overrides(name: str, args, run_dir: str) -> list[str]:
    """load_config overrides for preset `name` at the benchmark's sizes. The vocabulary is pinned
    to the preset's (the trainer would otherwise size it to its character tokenizer)."""
    from megatron_rl.model.presets import PRESETS, REAL_PRESETS

    if name not in REAL_PRESETS and name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose from {sorted(REAL_PRESETS) + sorted(PRESETS)}")
    real = REAL_PRESETS.get(name)
    kind = real["arch"] if real else "qwen3_moe"
    model = {"vocab_size": (real or PRESETS[name])["vocab_size"]}
    if args.layers is not None:
        model["num_layers"] = args.layers
    elif real and kind == "qwen3_moe":
        model["num_layers"] = args.moe_layers
    elif real and args.dense_layers is not None:
        model["num_layers"] = args.dense_layers
    return [f"model.arch={kind}", f"model.size={name}", f"model.dtype={args.dtype}",
            f"model.overrides={json.dumps(model)}", f"model.recompute={args.recompute}", "rollout.prompts_per_step=1",
            f"rollout.group_size={args.rows}", f"rollout.max_tokens={args.response_len}", f"loss.recipe={args.recipe}",
            f"train.micro_batch_size={args.micro_batch_size}", f"train.num_minibatches={args.num_minibatches}",
            f"train.seed={args.seed}", f"train.run_dir={run_dir}", "train.resume=false", "train.eval_size=0",
            "train.steps=1", "sft.steps=0", "optim.lr=1e-7", "log.tensorboard=false", "log.jsonl=false",
            "log.progress=false", *args.override]


def synthetic_rollout(vocab_size: int, rows: int, prompt_len: int, response_len: int, seed: int):
    """A trainer.rollouts.Rollout of one group: `rows` random responses to one random prompt (SYNTHETIC),
    rewards alternating 0/1 (a mixed group), rollout log-probs 0 until `with_rollout_logprobs`."""
    import torch

    from megatron_rl.rollout.types import Sample
    from megatron_rl.trainer.rollouts import Rollout

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_len,), generator=g)
    samples = [Sample(prompt_ids=prompt.clone(), response_ids=torch.randint(0, vocab_size, (response_len,), generator=g),
                      rollout_logprobs=torch.zeros(response_len), finish_reason="length", policy_version=0,
                      prompt_index=0, sample_index=i) for i in range(rows)]
    return Rollout(samples, torch.tensor([float(i % 2) for i in range(rows)]), {})


def with_rollout_logprobs(rollout, rows, logprobs, noise: float, seed: int):
    """`rollout` with μ = logprobs + noise (clamped to <= 0) on every response token.
    logprobs: [N, L] in the training batch's label layout; rows: the sample index of each row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    samples = list(rollout.samples)
    for k, i in enumerate(rows.tolist()):
        s = samples[i]
        p, r = len(s.prompt_ids), len(s.response_ids)
        mu = logprobs[k, p - 1:p - 1 + r].float().cpu() + noise * torch.randn(r, generator=g)
        samples[i] = replace(s, rollout_logprobs=mu.clamp(max=0.0))
    return replace(rollout, samples=samples)


@dataclass(frozen=True)
class Summary:
    step: float  # seconds of the RL step (all timed phases; no generation)
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
    ok = {True: "ok", False: "MISSED"}
    lines = [f"{name}: {desc}", f"  {'phase (megatron_rl.trainer.phases)':<40} {'seconds':>9} {'share':>7}",
             f"  {'generate (SKIPPED: synthetic rollout)':<40} {'-':>9} {'-':>7}"]
    for key, label in PHASES:
        lines.append(f"  {label:<40} {phases[key]:>9.3f} {100 * phases[key] / s.step:>6.1f}%")
    lines += [
        f"  {'RL step (no generation)':<40} {s.step:>9.3f} {100.0:>6.1f}%",
        f"  {'plain megatron LM loss fwd+bwd':<40} {lm:>9.3f}",
        f"  train pass tokens/s: {s.train_tokens_per_s:,.0f}   plain LM tokens/s: {s.lm_tokens_per_s:,.0f}",
        (f"  train pass vs plain LM: {s.train_vs_lm:.3f}x (target >= {TARGET_TRAIN_VS_LM}) "
         f"{ok[s.train_vs_lm >= TARGET_TRAIN_VS_LM]}"),
        (f"  non-model time: {100 * s.non_model_share:.1f}% of the step (target <= {100 * TARGET_NON_MODEL:.0f}%) "
         f"{ok[s.non_model_share <= TARGET_NON_MODEL]}"),
    ]
    lines += [f"  {k}: {v}" for k, v in extra.items()]
    return "\n".join(lines)


def targets_met(s: Summary) -> bool:
    return s.train_vs_lm >= TARGET_TRAIN_VS_LM and s.non_model_share <= TARGET_NON_MODEL


def summary_line(results: list[dict]) -> str:
    """Every preset's outcome in one line (the benchmark's last; tools/gpu_check.py shows it at the
    end of the call): the two ratios against their targets, or what went wrong."""
    ok = {True: "ok", False: "MISSED"}
    parts = []
    for r in results:
        if r["outcome"] != "ok":
            parts.append(f"{r['preset']}: {r['outcome'].upper()}")
            continue
        s, layers = r["summary"], r["arch"]["num_layers"]
        parts.append(f"{r['preset']} ({layers} layers): train pass {s['train_vs_lm']:.2f}x plain LM "
                     f"(>= {TARGET_TRAIN_VS_LM} {ok[s['train_vs_lm'] >= TARGET_TRAIN_VS_LM]}), non-model "
                     f"{100 * s['non_model_share']:.1f}% (<= {100 * TARGET_NON_MODEL:.0f}% "
                     f"{ok[s['non_model_share'] <= TARGET_NON_MODEL]}), step {s['step']:.2f} s")
    return "summary: " + ("; ".join(parts) or "no preset ran")


def memory_estimate(arch, dtype: str, micro_batch: int, seq_len: int, recompute: str,
                    engine_dtype: str = "bf16") -> dict[str, float]:
    """A rough peak-GPU-memory estimate of the benchmark (GiB), as in the docstring's MEMORY: the
    model state (exact), the engine's weights (exact), one micro-batch's saved activations (per
    token and layer 2 or 4 bytes x (32 x hidden + the MLP's 3 x ffn, or top-k x (3 x expert ffn +
    2 x hidden)): calibrated on the CPU with saved-tensor hooks, +-15%), the attention scores every
    layer keeps without recompute (fp32 softmax + probabilities in the model dtype), and the
    largest transient (one layer's scores and their gradients, ~18 B a score, or the plain LM
    step's logits, 10 B a logit)."""
    gib = 2**30
    params = arch.num_parameters()
    act = 4 if dtype == "fp32" else 2
    state = (16 if dtype == "fp32" else 18) * params  # fp32: weights, grads, Adam; else + fp32 master
    h = arch.hidden_size
    per_token = 0
    for layer in range(arch.num_layers):
        mlp = (arch.moe_topk * (3 * arch.moe_ffn_hidden_size + 2 * h) + 3 * arch.moe_shared_expert_ffn_hidden_size
               if arch.is_moe_layer(layer) else 3 * arch.ffn_hidden_size)
        per_token += act * (32 * h + mlp)
    scores = micro_batch * arch.num_attention_heads * seq_len**2
    kept = 0 if recompute == "core_attn" else arch.num_layers * (4 + act) * scores
    transient = max(18 * scores, 10 * micro_batch * seq_len * arch.vocab_size)
    engine = params * (4 if engine_dtype == "fp32" else 2)
    out = {"weights + grads + optimizer": state / gib, "embedded engine": engine / gib,
           "activations": micro_batch * seq_len * per_token / gib, "attention scores kept": kept / gib,
           "largest transient": transient / gib}
    out["total"] = sum(out.values())
    return out


def format_memory(est: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in est.items()) + " GiB"


def format_failure(name: str, record: dict) -> str:
    """The table of a preset that did not finish: its error and the memory known at that point."""
    lines = [f"{name}: FAILED ({record['outcome']})", f"  error: {record['error']}"]
    lines += [f"  {k}: {v}" for k, v in record.get("memory_at_failure", {}).items()]
    if record.get("memory_estimate_gib"):
        lines.append(f"  estimate: {format_memory(record['memory_estimate_gib'])}")
    return "\n".join(lines)


def gpu_memory() -> dict[str, str]:
    """This GPU's memory now (peak since the preset's start, allocated, reserved, free of total)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    gib = 2**30
    free, total = torch.cuda.mem_get_info()
    return {"peak GPU memory": f"{torch.cuda.max_memory_allocated() / gib:.1f} GiB (since the preset's start)",
            "allocated at failure": f"{torch.cuda.memory_allocated() / gib:.1f} GiB",
            "reserved at failure": f"{torch.cuda.memory_reserved() / gib:.1f} GiB",
            "device free / total": f"{free / gib:.1f} / {total / gib:.1f} GiB"}


# ------------------------------------------------------------------------------------- GPU parts


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _sync() -> float:
    """Wait for the GPU's queued work; return the time after it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def timed(times: dict, key: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), its synchronised wall time appended to times[key]."""
    t0 = _sync()
    out = fn(*args, **kwargs)
    times.setdefault(key, []).append(_sync() - t0)
    return out


@contextmanager
def timed_optimizer_steps(optimizer, times: list[float]):
    """Time every optimizer.step() (synchronised) made inside the block, e.g. by phases.update."""
    step, own = optimizer.step, "step" in vars(optimizer)

    def timed_step(*args, **kwargs):
        t0 = _sync()
        out = step(*args, **kwargs)
        times.append(_sync() - t0)
        return out

    optimizer.step = timed_step
    try:
        yield
    finally:
        if own:
            optimizer.step = step
        else:
            del optimizer.step  # the class's method again


def plain_lm_pass(ctx, batch, counts) -> None:
    """The reference: megatron's own LM loss (output layer + vocab-parallel cross-entropy) on the
    response tokens, forward+backward over the update's micro-batches; no optimizer step."""
    import torch

    from megatron_rl.model import causal_mask
    from megatron_rl.trainer.passes import micro_batches
    from megatron_rl.trainer.stack import forward_backward

    def forward_step_for(num_tokens):
        def step(data_iterator, m):
            mb = next(data_iterator)
            inp = mb["input_ids"]
            out = m(inp, mb["position_ids"], causal_mask(inp.shape[1], device=inp.device), labels=mb["labels"])

            def loss_func(per_token):
                loss = (per_token.float() * mb["loss_mask"]).sum() / num_tokens
                return loss, torch.ones((), dtype=torch.long, device=loss.device), {}

            return out, loss_func

        return step

    local, mbs = batch.local, batch.settings.micro_batch_size
    for sl, c in zip(batch.layout.minibatch_slices(), counts, strict=True):
        forward_backward(ctx.policy.model, forward_step_for(c.num_tokens), iter(micro_batches(local, sl)), len(sl),
                         local.input_len, mbs, optimizer=ctx.policy.optimizer)


def bench_preset(name: str, args, groups, info: dict | None = None) -> dict:
    """Time one preset's RL step. `info` (if given) receives its config overrides and memory
    estimate before anything is built, for the caller's record of a preset that fails."""
    import torch

    from megatron_rl.configure import load_config
    from megatron_rl.trainer import phases
    from megatron_rl.trainer.loop import close
    from megatron_rl.trainer.passes import global_counts, logprob_pass
    from megatron_rl.trainer.policy import arch_from_config
    from megatron_rl.trainer.setup import build_context

    info = {} if info is None else info
    run_dir = tempfile.mkdtemp(prefix="rl_step_gpu-", dir=args.tmp_dir)
    overrides = config_overrides(name, args, run_dir)
    cfg = load_config(None, overrides)
    cfg.check_layout(1)
    estimate = memory_estimate(arch_from_config(cfg.model), args.dtype, cfg.train.micro_batch_size,
                               args.prompt_len + args.response_len - 1, args.recompute, cfg.rollout.dtype)
    info.update(config_overrides=overrides, memory_estimate_gib=estimate)
    print(f"{name}: memory estimate (model.recompute={args.recompute}): {format_memory(estimate)}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    ctx = None
    try:
        # policy, optimizer, loss, replay, and the embedded engine on this GPU; nothing is saved, so
        # the run_dir's room for a checkpoint (~24 GiB at 1.7B parameters) is not checked, and no
        # sampled id is decoded, so the preset's vocabulary may differ from the tokenizer's
        ctx = build_context(cfg, groups)
        hf = getattr(ctx.engine, "model", None)  # the embedded engine's transformers model
        engine_gib = sum(p.numel() * p.element_size() for p in hf.parameters()) / 2**30 if hf is not None else 0.0
        engine_where = f"{engine_gib:.2f} GiB of weights on {ctx.engine.device}" if hf is not None else str(ctx.engine)
        if args.no_engine_sync and ctx.engine is not None:
            ctx.engine.close()
            ctx.engine, engine_where = None, "dropped (--no-engine-sync): sync = weight export only"
            gc.collect()
            torch.cuda.empty_cache()  # a no-op without CUDA
        arch, policy = ctx.policy.arch, ctx.policy
        # μ: the model's own log-probs (one forward pass of the trainer's log-prob path) + noise
        rollout = synthetic_rollout(arch.vocab_size, args.rows, args.prompt_len, args.response_len, args.seed)
        first = phases.make_batch(ctx, rollout)
        mu, _ = logprob_pass(policy.model, ctx.groups, first.local, first.settings, need_entropy=False)
        rollout = with_rollout_logprobs(rollout, first.rows, mu, noise=0.01, seed=args.seed)
        slices = first.layout.minibatch_slices()
        counts = [global_counts(first.local, sl, ctx.groups, first.seq) for sl in slices]

        times: dict[str, list[float]] = {}
        for _ in range(args.warmup + args.repeats):
            batch = timed(times, "make_batch", phases.make_batch, ctx, rollout)
            old = timed(times, "old_logprobs", phases.old_logprobs, ctx, batch)
            steps: list[float] = []
            with timed_optimizer_steps(policy.optimizer, steps):
                updates = timed(times, "update", phases.update, ctx, batch, old)
            times.setdefault("optimizer", []).append(sum(steps))
            times.setdefault("train_pass", []).append(times["update"][-1] - sum(steps))
            timed(times, "sync", phases.sync, ctx)
            metrics = timed(times, "step_metrics", phases.step_metrics, ctx, batch, old, updates)
            timed(times, "plain_lm", plain_lm_pass, ctx, batch, counts)
        per_step = {k: statistics.median(v[args.warmup:]) for k, v in times.items()}
        lm, update = per_step.pop("plain_lm"), per_step.pop("update")
        tokens = batch.local.input_ids.numel()
        s = summarize(per_step, lm, tokens)
        params = sum(p.numel() for p in policy.model.parameters())
        loss = metrics.get("loss/policy", float("nan"))
        desc = (f"{arch.num_layers} layers, {params / 1e9:.2f}B params, {args.dtype}, loss.recipe={args.recipe}; "
                f"{args.rows} rows x ({args.prompt_len} prompt + {args.response_len} response) tokens, "
                f"micro-batch {cfg.train.micro_batch_size}, {cfg.train.num_minibatches} optimizer step(s); "
                f"SYNTHETIC rollout (random tokens, μ = own log-probs + noise)")
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        extra = {"peak GPU memory": f"{peak:.1f} GiB (since setup; estimate {estimate['total']:.1f} GiB)",
                 "model.recompute": args.recompute, "rollout engine": engine_where,
                 "update (train pass + optimizer)": f"{update:.3f} s",
                 "loss/policy (last repeat)": f"{loss:.4g}", "generation": "not run (synthetic rollout)"}
        print(format_table(name, desc, per_step, lm, s, extra), flush=True)
        return {"preset": name, "outcome": "ok", "config_overrides": overrides, "arch": arch.to_dict(), "params": params,
                "memory_estimate_gib": estimate, "peak_gpu_memory_gib": peak,
                "tokens_per_step": tokens, "phases_s": per_step, "update_s": update, "plain_lm_s": lm,
                "summary": s.__dict__, "targets_met": targets_met(s), "finite_loss": math.isfinite(loss),
                "engine_sync": ctx.engine is not None, "engine_weights_gib": engine_gib, **extra}
    finally:
        if ctx is not None:
            try:
                close(ctx)
            except Exception as e:  # noqa: BLE001 - never in place of the error that got us here
                print(f"{name}: closing the run context failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    presets = args.preset or DEFAULT_PRESETS
    for name in presets:  # an unknown name stops here, before any GPU time is spent
        config_overrides(name, args, "unused")
    # fewer out-of-memory errors from fragmentation (read when CUDA's allocator starts, below)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not cuda_available():
        print("rl_step_gpu.py: needs a CUDA GPU, and torch.cuda.is_available() is False here. "
              "Run it on a GPU machine (tools/gpu_check.py does).", file=sys.stderr)
        return 2
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's "no Apex/TE" notices
    # torch.compile stays as the environment has it: on, as pretrain_rl.py leaves it beside a GPU
    # (megatron's fused kernels, the compiled log-prob chunk math)
    import megatron.core

    from megatron_rl.parallel import ParallelConfig, destroy_parallel, init_distributed, init_parallel
    from megatron_rl.platform import apply_platform_workarounds, capabilities

    applied = apply_platform_workarounds()
    _, world = init_distributed()
    if world != 1:
        print("rl_step_gpu.py: runs on one GPU (one process)", file=sys.stderr)
        return 2
    groups = init_parallel(ParallelConfig(), seed=args.seed)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (NOT A MEASUREMENT)"
    print(f"{device} | torch {torch.__version__} | megatron-core {megatron.core.__version__} | "
          f"{capabilities().describe()} | workarounds {applied} | "
          f"TORCHDYNAMO_DISABLE={os.environ.get('TORCHDYNAMO_DISABLE')} | "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}", flush=True)
    results: list[dict] = []
    try:
        run_presets(presets, args, groups, results)
    finally:
        destroy_parallel()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "torch": torch.__version__, "megatron_core": megatron.core.__version__,
                           "args": vars(args), "results": results}, f, indent=1, default=str)
        print(summary_line(results), flush=True)
    return exit_code(results, presets, args.strict)


def run_presets(presets: list[str], args, groups, results: list[dict]) -> list[dict]:
    """bench_preset for each preset in turn, each one's record appended to `results`. A preset
    that raises (out of GPU memory, or any other error) is recorded as its outcome, with the GPU
    memory at that point, its memory is freed, and the next preset runs; a KeyboardInterrupt
    (SIGINT: the part's time limit) is recorded and stops the loop."""
    import torch

    for name in presets:
        info: dict = {}
        try:
            results.append(bench_preset(name, args, groups, info))
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - each preset's outcome is recorded
            outcome = ("out of GPU memory" if isinstance(e, torch.cuda.OutOfMemoryError)
                       else "interrupted" if isinstance(e, KeyboardInterrupt) else "error")
            record = {"preset": name, "outcome": outcome, "error": f"{type(e).__name__}: {e}".strip(),
                      "traceback": traceback.format_exc(limit=-12), "memory_at_failure": gpu_memory(), **info}
            results.append(record)
            print(format_failure(name, record), flush=True)
            print(record["traceback"], file=sys.stderr, flush=True)
            if outcome == "interrupted":
                break
        finally:
            # this preset's memory, before the next one is built (the exception, whose traceback's
            # frames hold the preset's tensors, is gone once its except block has ended)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(flush=True)
    return results


def exit_code(results: list[dict], presets: list[str], strict: bool) -> int:
    """1 if a preset failed or did not run, or a loss was not finite (or, with --strict, a target
    was missed); else 0."""
    failed = [f"{r['preset']} ({r['outcome']})" for r in results if r["outcome"] != "ok"]
    failed += [f"{name} (not run)" for name in presets[len(results):]]
    if failed:
        print(f"rl_step_gpu.py: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not all(r["finite_loss"] for r in results):
        print("rl_step_gpu.py: a loss was not finite", file=sys.stderr)
        return 1
    return 1 if strict and not all(r["targets_met"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
