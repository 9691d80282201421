"""benchmarks/rl_step_gpu.py on a machine without a GPU: --help, a clear exit 2, and its arithmetic.
(The benchmark itself runs on a GPU machine: tools/gpu_check.sh.)"""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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
    assert "SYNTHETIC" in run.stdout and "--preset" in run.stdout


def test_exits_2_without_cuda():
    run = _run("--preset", "qwen3-1.7b", CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 2
    assert "needs a CUDA GPU" in run.stderr


def test_summary_and_table():
    mod = _module()
    phases = {"bookkeeping_batch": 0.1, "old_logprobs": 1.0, "train_pass": 3.0, "optimizer": 0.4,
              "weight_export": 0.3, "bookkeeping_metrics": 0.2}
    s = mod.summarize(phases, lm=2.7, tokens=30000)
    assert s.step == pytest.approx(5.0)
    assert s.non_model_share == pytest.approx(0.6 / 5.0)
    assert s.train_vs_lm == pytest.approx(0.9) and mod.targets_met(s)
    assert s.train_tokens_per_s == pytest.approx(10000)
    table = mod.format_table("qwen3-1.7b", "test", phases, 2.7, s, {"peak GPU memory": "1 GiB"})
    assert "0.900x (target >= 0.85) ok" in table and "12.0% of the step (target <= 15%) ok" in table
    slow = mod.summarize(dict(phases, train_pass=4.0), lm=2.7, tokens=30000)
    assert not mod.targets_met(slow) and "MISSED" in mod.format_table("x", "y", phases, 2.7, slow, {})


def test_synthetic_samples():
    from megatron_rl.model.presets import preset_arch

    samples = _module().synthetic_samples(preset_arch("qwen3", "tiny"), rows=3, prompt_len=5, response_len=7, seed=0)
    assert len(samples) == 3
    assert all(len(s.prompt_ids) == 5 and len(s.response_ids) == 7 for s in samples)
    assert all(int(s.response_ids.max()) < 64 for s in samples)
