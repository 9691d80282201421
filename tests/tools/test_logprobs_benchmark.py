"""benchmarks/logprobs_cuda.py runs end to end at a small size on the CPU (the GPU table's code
path minus CUDA events and memory statistics), and its accuracy column can tell fp32 logits from
bf16-rounded ones. No GPU result is produced or checked here."""
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import logprobs_cuda as bench


def test_table_runs_on_cpu_at_a_small_size():
    text = bench.table([256], vocab=512, hidden=64, device="cpu")
    assert "| 256 |" in text and "of floor" in text and "all T=256 tokens" in text   # accuracy at the largest T
    assert "| ours |" in text and "| straightforward |" in text and "| ours loss-fused |" in text
    assert "does not fit" not in text and "Error" not in text
    last = text.splitlines()[-1]
    assert last.startswith("summary: T=256: ") and "ours loss-fused " in last and ", error " in last
    assert "targets at" not in text   # only where T = 64k was measured


def test_the_float64_reference_in_chunks_is_the_whole_one():
    h, w, y = bench.inputs(300, 512, 64, "cpu")
    lp, ent = bench.float64_reference(h, w, y, chunk=128)   # 128 + 128 + 44 tokens
    from megatron_rl.logprobs import reference_logprobs_and_entropy

    whole = reference_logprobs_and_entropy(h.double(), w.double(), y)
    assert torch.equal(lp, whole.logprobs) and torch.equal(ent, whole.entropy)


def test_targets_at_64k_and_the_summary_line():
    gib = bench.GiB
    measured = {"straightforward": {"error": "does not fit"}, "ours": {"time": 0.41, "peak": 0.8 * gib},
                "ours loss-fused": {"time": 0.47, "peak": 0.7 * gib}, "liger": {"time": 0.5, "peak": 1.5 * gib}}
    errors = {"ours": {"logprob": 1.1e-5, "entropy": 9e-6}, "ours loss-fused": {"logprob": 1e-5, "entropy": 3e-5},
              "liger": {"logprob": 2e-2}, "straightforward": {"error": "does not fit"}}
    assert bench.summary_line(65536, measured, errors) == (
        "summary: T=64k: straightforward does not fit; ours 0.410 s, 0.80 GiB, error 1.1e-05 (ok); "
        "ours loss-fused 0.470 s, 0.70 GiB, error 3.0e-05 (MISSED); liger 0.500 s, 1.50 GiB, error 2.0e-02")
    # without the accuracy at this T, or the peak (CPU), the verdict is on what was measured
    assert bench.summary_line(65536, {"ours": {"time": 0.4, "peak": None}}, None) == \
        "summary: T=64k: ours 0.400 s, peak n/a (ok so far)"
    assert bench.summary_line(16384, {"ours": {"time": 0.1, "peak": 0.2 * gib}}, None) == \
        "summary: T=16k: ours 0.100 s, 0.20 GiB"


def test_accuracy_column_separates_fp32_logits_from_bf16_rounded_ones():
    ours = bench.accuracy("ours", 128, 2048, 64, "cpu")
    fused = bench.accuracy("ours loss-fused", 128, 2048, 64, "cpu")
    straightforward = bench.accuracy("straightforward", 128, 2048, 64, "cpu")
    assert max(ours.values()) < 2e-5 and max(fused.values()) < 2e-5 and len(fused) == 2
    assert straightforward["logprob"] > 10 * ours["logprob"]


def _peer_package(root):
    """An installed package laid out like verl: its `__init__` (and a sub-package's) imports a
    dependency that is not installed; the kernel module needs only a sibling and another sub-package."""
    files = {
        "peerpkg/__init__.py": "import not_installed_trainer_stack\nFROM_INIT = 1\n",
        "peerpkg/utils/__init__.py": "import not_installed_config_lib\n",
        "peerpkg/utils/device.py": "NAME = 'cuda'\n",
        "peerpkg/utils/kernel/__init__.py": "",
        "peerpkg/utils/kernel/kernels.py": "from peerpkg.utils.device import NAME\n",
        "peerpkg/utils/kernel/lce.py": "from . import kernels\nDEVICE = kernels.NAME\n",
        "peerpkg/utils/kernel/broken.py": "import not_installed_kernel_dependency\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_peer_module_skips_a_package_init_that_needs_a_missing_dependency(tmp_path, monkeypatch):
    _peer_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        lce = bench.peer_module("peerpkg.utils.kernel.lce")
        assert lce.DEVICE == "cuda" and lce.__file__ == str(tmp_path / "peerpkg/utils/kernel/lce.py")
        assert not hasattr(sys.modules["peerpkg"], "FROM_INIT")   # the package's __init__ did not run
        # the kernel module's own missing dependency is not hidden
        with pytest.raises(ModuleNotFoundError, match="not_installed_kernel_dependency"):
            bench.peer_module("peerpkg.utils.kernel.broken")
        # an absent package is absent
        with pytest.raises(ModuleNotFoundError):
            bench.peer_module("not_installed_peer.kernels")
    finally:
        for key in [k for k in sys.modules if k == "peerpkg" or k.startswith("peerpkg.")]:
            del sys.modules[key]


def test_the_gpu_table_exits_2_without_cuda():
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "logprobs.py")
    run = subprocess.run([sys.executable, script, "--device", "cuda"], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and "torch.cuda.is_available() is False" in run.stderr, run.stderr[-2000:]
