"""benchmarks/rl_step_gpu.py on a machine without a GPU: --help, a clear exit 2, its arithmetic, its
config and synthetic rollout, its memory estimate, a failing preset recorded as that preset's
outcome, the trainer's make_batch on that rollout, and the recompute of core attention its default
relies on (model.recompute=core_attn: the same loss and gradients). Nothing here measures
anything: the benchmark itself runs on a GPU machine (tools/gpu_check.py)."""
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "rl_step_gpu.py")


def _module():
    spec = importlib.util.spec_from_file_location("rl_step_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _run(*args, **env):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_help():
    run = _run("--help")
    assert run.returncode == 0
    for text in ("SYNTHETIC", "GENERATION IS NOT RUN", "--preset", "--recipe", "--no-engine-sync", "--strict",
                 "--recompute", "MEMORY", "A PRESET THAT FAILS"):
        assert text in run.stdout


def test_exits_2_without_cuda():
    run = _run("--preset", "qwen3-1.7b", CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 2
    assert "needs a CUDA GPU" in run.stderr
    run = _run("--preset", "qwen9", CUDA_VISIBLE_DEVICES="")   # a wrong name stops first
    assert run.returncode != 0 and "unknown preset 'qwen9'" in run.stderr


def test_summary_and_table():
    mod = _module()
    phases = {"make_batch": 0.1, "old_logprobs": 1.0, "train_pass": 3.0, "optimizer": 0.4, "sync": 0.3,
              "step_metrics": 0.2}
    s = mod.summarize(phases, lm=2.7, tokens=30000)
    assert s.step == pytest.approx(5.0) and s.model == pytest.approx(4.4)
    assert s.non_model_share == pytest.approx(0.6 / 5.0)
    assert s.train_vs_lm == pytest.approx(0.9) and mod.targets_met(s)
    assert s.train_tokens_per_s == pytest.approx(10000)
    table = mod.format_table("qwen3-1.7b", "test", phases, 2.7, s, {"peak GPU memory": "1 GiB"})
    assert "0.900x (target >= 0.85) ok" in table and "12.0% of the step (target <= 15%) ok" in table
    assert "generate (SKIPPED: synthetic rollout)" in table
    slow = mod.summarize(dict(phases, train_pass=4.0), lm=2.7, tokens=30000)
    assert not mod.targets_met(slow) and "MISSED" in mod.format_table("x", "y", phases, 2.7, slow, {})
    heavy = mod.summarize(dict(phases, sync=1.5), lm=2.7, tokens=30000)  # non-model time over 15%
    assert not mod.targets_met(heavy)
    line = mod.summary_line([{"preset": "qwen3-1.7b", "outcome": "ok", "summary": s.__dict__, "arch": {"num_layers": 4}},
                             {"preset": "qwen3-moe-30b-a3b", "outcome": "out of GPU memory"}])
    assert line == ("summary: qwen3-1.7b (4 layers): train pass 0.90x plain LM (>= 0.85 ok), non-model 12.0% "
                    "(<= 15% ok), step 5.00 s; qwen3-moe-30b-a3b: OUT OF GPU MEMORY")
    assert mod.summary_line([]) == "summary: no preset ran"


def _args(mod, *argv):
    return mod.parse_args(list(argv))


def test_config_overrides_make_a_valid_config(tmp_path):
    from megatron_rl.configure import load_config

    mod = _module()
    args = _args(mod, "--rows", "8", "--response-len", "4096", "--micro-batch-size", "2", "--num-minibatches", "2",
                 "--recipe", "grpo")
    dense = load_config(None, mod.config_overrides("qwen3-1.7b", args, str(tmp_path)))
    dense.check_layout(1)
    assert (dense.model.arch, dense.model.size, dense.model.dtype) == ("qwen3", "qwen3-1.7b", "bf16")
    assert dense.model.overrides == {"vocab_size": 151936}  # the real vocabulary, not the tokenizer's
    assert dense.model.recompute == "core_attn"   # the default: see the docstring's MEMORY
    assert (dense.rollout.prompts_per_step, dense.rollout.group_size, dense.rollout.max_tokens) == (1, 8, 4096)
    assert (dense.train.micro_batch_size, dense.train.num_minibatches, dense.loss.recipe) == (2, 2, "grpo")
    assert not dense.log.tensorboard and not dense.log.jsonl and dense.sft.steps == 0 and dense.train.eval_size == 0
    assert dense.train.run_dir == str(tmp_path) and not dense.train.resume
    moe = load_config(None, mod.config_overrides("qwen3-moe-30b-a3b", _args(mod, "--override", "moe.router_replay=r2"),
                                                 str(tmp_path)))
    assert moe.model.overrides == {"vocab_size": 151936, "num_layers": 2} and moe.moe.router_replay == "r2"
    assert load_config(None, mod.config_overrides("tiny", _args(mod, "--layers", "1"), str(tmp_path))).model.overrides \
        == {"vocab_size": 64, "num_layers": 1}
    # make gpu-check's cut: the dense preset to 4 layers, the MoE one keeps --moe-layers
    cut = _args(mod, "--dense-layers", "4")
    assert load_config(None, mod.config_overrides("qwen3-1.7b", cut, str(tmp_path))).model.overrides \
        == {"vocab_size": 151936, "num_layers": 4}
    assert load_config(None, mod.config_overrides("qwen3-moe-30b-a3b", cut, str(tmp_path))).model.overrides \
        == {"vocab_size": 151936, "num_layers": 2}
    with pytest.raises(SystemExit, match="unknown preset"):
        mod.config_overrides("qwen9", args, str(tmp_path))
    plain = load_config(None, mod.config_overrides("qwen3-1.7b", _args(mod, "--recompute", "none"), str(tmp_path)))
    assert plain.model.recompute == "none"
    with pytest.raises(ValueError, match="model.recompute='full': choose one of none, core_attn"):
        load_config(None, ["model.recompute=full"])


def test_memory_estimate_of_the_default_fits_an_80_gb_gpu_and_without_recompute_does_not():
    """The docstring's MEMORY arithmetic: qwen3-1.7b, bf16, mb 1, 256 + 4096 tokens (4351 inputs)."""
    from megatron_rl.model.presets import preset_arch

    mod = _module()
    arch = preset_arch("qwen3", "qwen3-1.7b")
    est = mod.memory_estimate(arch, "bf16", 1, 4351, "core_attn")
    assert est["weights + grads + optimizer"] == pytest.approx(18 * 1_720_574_976 / 2**30)   # 28.8
    assert est["embedded engine"] == pytest.approx(3.2, abs=0.05)
    assert est["activations"] == pytest.approx(19.1, abs=0.1) and est["attention scores kept"] == 0
    assert est["largest transient"] == pytest.approx(6.2, abs=0.05)   # the plain LM step's logits
    assert 55 < est["total"] < 60
    plain = mod.memory_estimate(arch, "bf16", 1, 4351, "none")
    assert plain["attention scores kept"] == pytest.approx(28 * 6 * 16 * 4351**2 / 2**30)   # 47.4
    assert plain["total"] > 100   # an H100 has 79.6 GiB
    moe = mod.memory_estimate(preset_arch("qwen3_moe", "qwen3-moe-30b-a3b", num_layers=2), "bf16", 1, 4351,
                              "core_attn")
    assert 45 < moe["total"] < 50 and moe["activations"] == pytest.approx(1.9, abs=0.1)
    assert "total 57." in mod.format_memory(est)


def test_a_failing_preset_is_its_outcome_and_the_next_one_runs(monkeypatch):
    """Out of GPU memory in the first preset: recorded (error, memory, estimate) and printed, the
    second preset still runs, the exit code says the run failed; an interrupt stops the loop."""
    mod = _module()
    calls = []

    def bench(name, args, groups, info):
        calls.append(name)
        info.update(memory_estimate_gib={"total": 57.0}, config_overrides=["x=1"])
        if name == "big":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.69 GiB.")
        if name == "stop":
            raise KeyboardInterrupt
        return {"preset": name, "outcome": "ok", "finite_loss": True, "targets_met": True}

    monkeypatch.setattr(mod, "bench_preset", bench)
    results = []
    mod.run_presets(["big", "small"], mod.parse_args([]), None, results)
    assert calls == ["big", "small"] and [r["outcome"] for r in results] == ["out of GPU memory", "ok"]
    big = results[0]
    assert big["error"].startswith("OutOfMemoryError: CUDA out of memory") and "Traceback" in big["traceback"]
    assert big["memory_estimate_gib"] == {"total": 57.0} and big["config_overrides"] == ["x=1"]
    json.dumps(big)   # goes into the JSON as it is
    assert "big: FAILED (out of GPU memory)" in mod.format_failure("big", big)
    assert mod.exit_code(results, ["big", "small"], strict=False) == 1
    assert mod.exit_code(results[1:], ["small"], strict=False) == 0

    results = []
    mod.run_presets(["stop", "small"], mod.parse_args([]), None, results)
    assert [r["outcome"] for r in results] == ["interrupted"] and calls[-1] == "stop"
    assert mod.exit_code(results, ["stop", "small"], strict=False) == 1


def test_synthetic_rollout():
    rollout = _module().synthetic_rollout(vocab_size=64, rows=4, prompt_len=5, response_len=7, seed=0)
    s = rollout.samples
    assert len(s) == 4 and all(len(x.prompt_ids) == 5 and len(x.response_ids) == 7 for x in s)
    assert all(torch.equal(x.prompt_ids, s[0].prompt_ids) for x in s)  # one group: one prompt
    assert all(int(x.response_ids.max()) < 64 for x in s)
    assert rollout.rewards.tolist() == [0.0, 1.0, 0.0, 1.0] and rollout.reward_stats == {}


def test_with_rollout_logprobs_reads_the_label_layout():
    mod = _module()
    rollout = mod.synthetic_rollout(vocab_size=64, rows=2, prompt_len=3, response_len=4, seed=0)
    # label index t holds -(100 + t) in row 0 and -t in row 1; row k is sample rows[k] (here reversed)
    logprobs = -torch.arange(8, dtype=torch.float32).expand(2, 8) - torch.tensor([[100.0], [0.0]])
    out = mod.with_rollout_logprobs(rollout, torch.tensor([1, 0]), logprobs, noise=0.0, seed=0)
    assert out.samples[0].rollout_logprobs.tolist() == [-2.0, -3.0, -4.0, -5.0]  # label indices P-1 .. P+R-2
    assert out.samples[1].rollout_logprobs.tolist() == [-102.0, -103.0, -104.0, -105.0]
    noisy = mod.with_rollout_logprobs(rollout, torch.tensor([0, 1]), torch.zeros(2, 8), noise=0.5, seed=0)
    assert all(bool((x.rollout_logprobs <= 0).all()) for x in noisy.samples)  # clamped: log-probs
    assert rollout.samples[0].rollout_logprobs.abs().sum() == 0  # the input is left as it was


def test_timed_optimizer_steps_restores_the_method():
    mod = _module()

    class Opt:
        def step(self):
            return True, 1.0, None

    opt, times = Opt(), []
    with mod.timed_optimizer_steps(opt, times):
        assert opt.step() == (True, 1.0, None) and opt.step()[0]
    assert len(times) == 2 and "step" not in vars(opt)


def _one_gloo_process(script: str, tmp_path) -> dict:
    """Run `script` (argv: this benchmark's path, tmp_path) as one gloo process on the CPU; the JSON
    object on its last stdout line."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = subprocess.run([sys.executable, "-c", script, SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(port),
                              "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


_MAKE_BATCH = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("rl_step_gpu", sys.argv[1])
mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
from megatron_rl.configure import load_config
from megatron_rl.parallel import destroy_parallel, init_distributed, init_parallel
from megatron_rl.platform import apply_platform_workarounds
from megatron_rl.trainer import phases
from megatron_rl.trainer.loop import close
from megatron_rl.trainer.setup import setup
apply_platform_workarounds()
init_distributed("gloo")
args = mod.parse_args(["--rows", "4", "--prompt-len", "5", "--response-len", "7", "--micro-batch-size", "2",
                       "--num-minibatches", "2"])
cfg = load_config(None, mod.config_overrides("tiny", args, sys.argv[2]))
ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
try:
    batch = phases.make_batch(ctx, mod.synthetic_rollout(ctx.policy.arch.vocab_size, 4, 5, 7, seed=0))
    local = batch.local
    print(json.dumps({"shape": list(local.input_ids.shape), "masked": int(local.loss_mask.sum()),
                      "rows": batch.rows.tolist(), "adv": local.advantages.abs().sum(1).tolist(),
                      "mbs": batch.settings.micro_batch_size,
                      "engine": type(ctx.engine).__name__}))
finally:
    close(ctx)
    destroy_parallel()
"""


# a subprocess that builds the tiny trainer and engine (~10 s)
def test_make_batch_on_the_synthetic_rollout(tmp_path):
    """The trainer's setup + make_batch on the benchmark's config and rollout (tiny preset, CPU, one
    gloo process in a subprocess): the shapes the timed phases would get. No timing."""
    out = _one_gloo_process(_MAKE_BATCH, tmp_path)
    assert out["shape"] == [4, 11] and out["masked"] == 4 * 7  # 5 + 7 tokens -> 11 inputs per row
    assert out["rows"] == [0, 1, 2, 3] and out["mbs"] == 2 and out["engine"] == "EmbeddedEngine"
    assert all(a != 0 for a in out["adv"])  # a mixed group: every sample's tokens have an advantage


_BENCH_FLOW = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("rl_step_gpu", sys.argv[1])
mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
from megatron_rl.parallel import ParallelConfig, destroy_parallel, init_distributed, init_parallel
from megatron_rl.platform import apply_platform_workarounds
apply_platform_workarounds()
init_distributed("gloo")
groups = init_parallel(ParallelConfig(), seed=1)
# a vocabulary other than the toy tokenizer's, as every real preset has (151,936 rows)
args = mod.parse_args(["--rows", "4", "--prompt-len", "5", "--response-len", "7", "--micro-batch-size", "2",
                       "--num-minibatches", "2", "--warmup", "1", "--repeats", "1", "--tmp-dir", sys.argv[2],
                       "--override", "model.overrides={vocab_size: 96}"])
try:
    r = mod.bench_preset("tiny", args, groups)
finally:
    destroy_parallel()
print(json.dumps({k: r[k] for k in ("phases_s", "plain_lm_s", "update_s", "summary", "finite_loss", "engine_sync",
                                      "tokens_per_step")}))
"""


# a subprocess that builds the tiny trainer and engine and runs two steps (~15 s)
def test_the_whole_timed_step_runs_on_the_tiny_preset(tmp_path):
    """(With the default model.recompute=core_attn, no checkpoint-space check, and a model vocabulary
    of 96 rows beside the 64-symbol tokenizer, as a real preset's 151,936 are.)"""
    """bench_preset end to end on the CPU (one gloo process): every phase of the trainer's step, the
    engine sync and the plain megatron LM step run and are reported, with a finite loss. It
    checks the benchmark's code path only; its times here are not a measurement."""
    out = _one_gloo_process(_BENCH_FLOW, tmp_path)   # fails if setup refuses the 96-row vocabulary
    assert set(out["phases_s"]) == {"make_batch", "old_logprobs", "train_pass", "optimizer", "sync", "step_metrics"}
    assert all(t >= 0 for t in out["phases_s"].values()) and out["plain_lm_s"] > 0 and out["update_s"] > 0
    assert out["finite_loss"] and out["engine_sync"] and out["tokens_per_step"] == 4 * 11
    assert out["summary"]["train_vs_lm"] > 0 and 0 <= out["summary"]["non_model_share"] < 1
    assert list(tmp_path.iterdir()) == []   # the temporary run_dir is removed


def _recompute_matches(rank, world, arch_name):
    """One gloo rank: the tiny model built with model.recompute none and core_attn, forward +
    backward through the trainer's wrapping (megatron DDP, Float16Module for bf16): the losses and
    every main_grad, and how often core attention ran."""
    from megatron_rl.model import BuildOptions, build_gpt_model, causal_mask
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer.stack import OptimSettings, wrap_model
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel()
    arch = preset_arch(arch_name, "tiny")
    out = {}
    for dtype in ("fp32", "bf16"):
        runs = []
        for recompute in ("none", "core_attn"):
            model = build_gpt_model(arch, groups, BuildOptions(dtype=dtype, seed=3, recompute=recompute))
            calls = []
            for m in model.modules():
                if type(m).__name__ == "DotProductAttention":   # megatron's local (non-TE) attention
                    m.register_forward_hook(lambda *_, calls=calls: calls.append(1))
            ddp = wrap_model(model, OptimSettings(dtype=dtype))
            ddp.train()
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=g)
            loss = ddp(tokens, torch.arange(24).expand(2, -1), causal_mask(24), labels=tokens)
            loss.float().mean().backward()
            runs.append((loss.detach().float(), [p.main_grad.clone() for p in ddp.parameters()], len(calls)))
        (a, ga, na), (b, gb, nb) = runs
        out[dtype] = {"loss_equal": torch.equal(a, b), "grads": len(ga),
                      "grads_equal": all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True)),
                      "attention_calls": (na, nb), "layers": arch.num_layers}
    return out


# one spawned gloo rank building four tiny models (~15 s)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_recompute_of_core_attention_gives_the_same_loss_and_gradients(arch):
    """model.recompute=core_attn (the benchmark's default) with megatron's local attention: core
    attention runs again in the backward (twice per layer), the loss and gradients are bitwise
    the same as without."""
    from tests.spawn import run_ranks

    [out] = run_ranks(_recompute_matches, world_size=1, timeout=300, arch_name=arch)
    for dtype, r in out.items():
        assert r["loss_equal"] and r["grads_equal"] and r["grads"] > 10, (dtype, r)
        assert r["attention_calls"] == (r["layers"], 2 * r["layers"]), (dtype, r)
