"""Golden numbers of a 3-step CPU RL run per loss recipe (and R2/R3 router replay).

One tiny, fully deterministic run configuration (`BASE`) is trained for `STEPS` RL steps under
every case in `cases()` (each loss recipe, plus GRPO with R2 and R3 router replay); the per-step
values of `KEYS` are stored in `GOLDEN_PATH` and compared by tests/e2e/test_golden.py, so a
refactor of the trainer that should not change the math is checked by numbers.

    python tools/record_golden.py                  # rewrite tests/assets/golden/rl_3step.json
    MEGATRON_RL_REGEN_GOLDEN=1 pytest tests/e2e/test_golden.py    # the same, through the test

Every case runs through the real loop (`megatron_rl.trainer.loop.run`, as pretrain_rl.py does)
in ONE fresh single-rank gloo process (tests/spawn.py: OMP_NUM_THREADS=1, torch threads 1); the
policy, optimizer and engine are rebuilt from the seed for each case. The rollout engine is the
embedded transformers engine in bf16 against the fp32 trainer, so the training-inference
mismatch (KL) is non-zero; a dense reward (fraction of digits in the response) gives every group
mixed rewards, so the updates are non-trivial from step one without an SFT warm start.
"""
from __future__ import annotations

import json
import math
import os
import tempfile

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "golden", "rl_3step.json")
REGEN_ENV = "MEGATRON_RL_REGEN_GOLDEN"
STEPS = 3
REWARD = "golden_digit_fraction"

# The run: tiny MoE (4 experts, top-2), random megatron init with a large std so logits are far
# from uniform (sampled tokens and routing are decisive, not near-ties), 8 prompts x 4 samples,
# 2 optimizer steps per RL step (so the second mini-batch is off-policy), bf16 engine. No SFT,
# no eval, no TensorBoard, no progress bars. train.run_dir is appended per case.
BASE = [
    "model.arch=qwen3_moe", "model.size=tiny", "model.dtype=fp32", "model.init_std=0.2",
    "rollout.backend=embedded", "rollout.dtype=bf16", "rollout.prompts_per_step=8", "rollout.group_size=4",
    "rollout.max_tokens=8", "rollout.temperature=1.0",
    "data.tasks=[sorting]", f"data.reward={REWARD}", "data.heldout_size=8",
    "optim.lr=3e-3", "optim.clip_grad=1.0",
    f"train.steps={STEPS}", "train.num_minibatches=2", "train.micro_batch_size=4", "train.seed=1234",
    "train.eval_every=0", "train.eval_size=0", "train.resume=false",
    "sft.steps=0",
    "log.tensorboard=false", "log.jsonl=true", "log.progress=false", "log.figure_every=0",
    # the numbers were recorded on the recompute path; tests/e2e/test_golden.py checks the default
    # (gradients formed in the log-prob kernel's forward) against their first step
    "loss.head_gradients=recompute",
]

# Recorded per step when the run reports them (the moe/* keys only exist under router replay).
KEYS = (
    "loss/policy",
    "optim/grad_norm",
    "mismatch/kl_k3",
    "mismatch/kl_k1",
    "rollout/reward_mean",
    "moe/route_agree_rollout_train",
    "moe/route_agree_old_new",
    "moe/replayed_token_fraction",
)
REQUIRED_KEYS = KEYS[:5]  # every case must report these


def register_reward() -> None:
    """The dense test reward (idempotent: the registry refuses a second registration)."""
    from megatron_rl.rewards import register_reward as register
    from megatron_rl.rewards.registry import REWARDS

    if REWARD in REWARDS:
        return

    @register(REWARD)
    def digit_fraction(prompt: str, response: str, label: str) -> float:
        return sum(c.isdigit() for c in response) / max(len(response), 1)


def cases() -> dict[str, list[str]]:
    """case name -> config overrides on top of BASE: every loss recipe (minirl_r2 / minirl_r3
    switch router replay on by themselves), plus GRPO with R2 and with R3, plus two trainer paths
    the recipes leave idle here: IcePop with a band narrow enough to drop tokens (its default
    [0.5, 5] keeps every token of this run, so `icepop` equals `grpo`), and top-p sampling with
    the kept-set log-probs (loss.keep_sampling_mask)."""
    from megatron_rl.losses import RECIPES

    out = {name: [f"loss.recipe={name}"] for name in sorted(RECIPES.names())}
    out["grpo+r2"] = ["loss.recipe=grpo", "moe.router_replay=r2"]
    out["grpo+r3"] = ["loss.recipe=grpo", "moe.router_replay=r3"]
    out["icepop+narrow_band"] = ["loss.recipe=icepop", "loss.corrections=[{name: icepop, alpha: 0.95, beta: 1.05}]"]
    out["grpo+keep_sampling_mask"] = ["loss.recipe=grpo", "rollout.top_p=0.9", "loss.keep_sampling_mask=true"]
    return out


def run_cases(rank: int, world: int, cases: dict[str, list[str]], run_root: str, extra: list[str] = ()) -> dict:
    """In a spawned rank (tests.spawn.run_ranks): run every case; return {"numerics": numerics(),
    "values": {case: [{key: value} for each step]}} with the values of KEYS each step reported.
    extra: overrides applied after every case's own (negative controls, experiments)."""
    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.loop import run

    apply_platform_workarounds()
    register_reward()
    out = {}
    for name, overrides in cases.items():
        # a fresh directory: the metrics sink appends to an existing metrics.jsonl
        run_dir = tempfile.mkdtemp(prefix=name.replace("+", "_") + "-", dir=run_root)
        cfg = load_config(None, [*BASE, f"train.run_dir={run_dir}", *overrides, *extra])
        run(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        out[name] = [{k: row[k] for k in KEYS if k in row} for row in rows]
    return {"numerics": numerics(), "values": out}


def run_fresh(run_root: str, cases_: dict[str, list[str]] | None = None, extra: list[str] = (),
              timeout: float = 900.0) -> dict:
    """run_cases in one fresh single-rank process (deterministic thread count, clean globals):
    {"numerics": ..., "values": ...}."""
    from tests.spawn import run_ranks

    [out] = run_ranks(run_cases, world_size=1, timeout=timeout, fresh=True, cases=cases_ if cases_ is not None else cases(),
                      run_root=run_root, extra=list(extra))
    return out


def versions() -> dict[str, str]:
    """The software the numbers depend on (the CPU's part is `numerics()`)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "megatron-core", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    out["python"] = platform.python_version()
    out["machine"] = platform.machine()
    return out


def numerics() -> dict[str, str]:
    """What the golden numbers depend on in the CPU: torch's kernel capability (AVX2, AVX512, ...)
    and a hash of a probe of the kernels the run uses (fp32 and bf16 matmuls, which MKL and oneDNN
    pick by CPU, and torch's vectorised math), computed in the calling process (the golden run's
    own, one thread). Two machines with equal values give the same golden numbers."""
    import hashlib

    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 64, generator=g), torch.randn(96, 64, generator=g)
    x = torch.randn(8, 151, generator=g) * 4
    outs = [a @ b.t(), F.linear(a, b), a.bfloat16() @ b.bfloat16().t(), F.linear(a.bfloat16(), b.bfloat16()),
            x.log_softmax(-1), x.softmax(-1), x.exp(), x.abs().log1p(), x.tanh(), F.silu(x), x.abs().rsqrt(),
            x.sum(-1), x.cumsum(-1), x.bfloat16().float(), x.bfloat16().softmax(-1)]
    digest = hashlib.sha256()
    for t in outs:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "probe": digest.hexdigest()[:16]}


def sanity(values: dict, steps: int = STEPS) -> list[str]:
    """What makes the numbers worth comparing: `steps` steps per case, every required key, finite
    values, a real update (grad norm > 0) and a real bf16-vs-fp32 mismatch (kl_k3 > 0)."""
    problems = []
    for case, rows in values.items():
        if len(rows) != steps:
            problems.append(f"{case}: {len(rows)} steps, expected {steps}")
        for i, row in enumerate(rows, start=1):
            missing = [k for k in REQUIRED_KEYS if k not in row]
            if missing:
                problems.append(f"{case} step {i}: missing {missing}")
                continue
            if not all(math.isfinite(v) for v in row.values()):
                problems.append(f"{case} step {i}: non-finite value in {row}")
            if not row["optim/grad_norm"] > 0:
                problems.append(f"{case} step {i}: optim/grad_norm={row['optim/grad_norm']} (no update)")
            if not row["mismatch/kl_k3"] > 0:
                problems.append(f"{case} step {i}: mismatch/kl_k3={row['mismatch/kl_k3']} (no mismatch)")
    return problems


def golden_document(records: list[dict]) -> dict:
    return {
        "description": "Per-step metrics of a 3-step single-rank CPU RL run for every loss recipe and for "
                       "R2/R3 router replay, one record per CPU numerics; compared by tests/e2e/test_golden.py. "
                       "Regenerate with `python tools/record_golden.py` (see tests/golden.py).",
        "steps": STEPS,
        "config": {"base_overrides": BASE, "cases": cases(), "reward": "fraction of digits in the response",
                   "process": "one fresh single-rank gloo process, OMP_NUM_THREADS=1, torch threads 1"},
        "keys": list(KEYS),
        "records": records,
    }


def matches(record: dict, numerics_: dict) -> bool:
    """A record applies to a machine whose numerics() agree with every field the record has (the
    first record, from before the probe existed, has only the capability)."""
    return all(numerics_.get(k) == v for k, v in record["numerics"].items())


def find_record(golden: dict, numerics_: dict) -> dict | None:
    return next((r for r in golden["records"] if matches(r, numerics_)), None)


def write_golden(run: dict, path: str = GOLDEN_PATH, keep_other_cpus: bool = False) -> None:
    """Write run_fresh's result as the record of its numerics. The records of other CPUs are dropped
    (numbers recorded before a change of the math are stale) unless keep_other_cpus (adding a CPU,
    or refreshing one, with the math unchanged)."""
    here = {"numerics": run["numerics"], "versions": versions(), "values": run["values"]}
    others = []
    if keep_other_cpus and os.path.exists(path):
        others = [r for r in load_golden(path)["records"] if not matches(r, run["numerics"])]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        # json writes floats with repr(): the shortest string that round-trips the exact double
        json.dump(golden_document(others + [here]), f, indent=1)
        f.write("\n")


def load_golden(path: str = GOLDEN_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def compare(golden: dict, got: dict, rtol: float, atol: float) -> list[str]:
    """Every (case, step, key) whose value moved beyond |got - golden| <= atol + rtol * |golden|,
    or that is missing on one side, as one readable line each."""
    problems = []
    for case in sorted(set(golden) | set(got)):
        if case not in got:
            problems.append(f"{case}: not run (in the golden file only)")
            continue
        if case not in golden:
            problems.append(f"{case}: no golden values (new case? regenerate the golden file)")
            continue
        want_steps, got_steps = golden[case], got[case]
        if len(want_steps) != len(got_steps):
            problems.append(f"{case}: {len(got_steps)} steps logged, golden has {len(want_steps)}")
        for step, (want, have) in enumerate(zip(want_steps, got_steps), start=1):
            for key in sorted(set(want) | set(have)):
                if key not in have:
                    problems.append(f"{case} step {step} {key}: missing (golden {want[key]!r})")
                elif key not in want:
                    problems.append(f"{case} step {step} {key}: new key (got {have[key]!r}, not in golden)")
                else:
                    a, b = have[key], want[key]
                    same_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
                    if not same_nan and not abs(a - b) <= atol + rtol * abs(b):
                        rel = abs(a - b) / abs(b) if b else math.inf
                        problems.append(f"{case} step {step} {key}: got {a!r}, golden {b!r} "
                                        f"(abs diff {abs(a - b):.3e}, rel {rel:.3e})")
    return problems


def table(values: dict, keys=("loss/policy", "optim/grad_norm", "mismatch/kl_k3")) -> str:
    """A markdown table case x step of `keys` (for reports and the record script's output)."""
    head = "| case | step | " + " | ".join(keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for case, steps in values.items():
        for i, row in enumerate(steps, start=1):
            lines.append(f"| {case} | {i} | " + " | ".join(f"{row[k]:.10g}" if k in row else "-" for k in keys) + " |")
    return "\n".join(lines)
