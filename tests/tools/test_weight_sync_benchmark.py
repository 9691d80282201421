"""benchmarks/weight_sync.py drives the engine's public sync calls: `memory` streams tensors
(update_weights), `reload` / `restart` write a folder and hand it over (load_weights_from). No
server is started here (the engine starts one on its first weights); the benchmark's real runs
are in benchmarks/results/weight_sync_cpu.md. Its GPU mode (--device cuda): the arguments, the
real presets cut to a few layers (checked against a hand count of their parameters), the
checkpoint-format tensors it sends, and the call that cannot measure (no vLLM, no CUDA, one GPU),
which says so, writes no number and exits 0."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import weight_sync as bench
import weight_sync_runs as runs

from megatron_rl.model.hf_files import expected_names
from megatron_rl.model.presets import preset_arch
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import tiny_arch


@pytest.mark.parametrize(("kind", "call"), [("memory", "update_weights"), ("reload", "load_weights_from"),
                                            ("restart", "load_weights_from")])
def test_each_sync_kind_uses_its_engine_call(tmp_path, monkeypatch, kind, call):
    engine = VllmEngine(tiny_arch(), VllmConfig(dtype="float32"), str(tmp_path), weight_sync=kind)
    calls = []
    monkeypatch.setattr(engine, "update_weights", lambda named, version: calls.append(("update_weights", version)))
    monkeypatch.setattr(engine, "load_weights_from", lambda path, version: calls.append(("load_weights_from", version)))
    monkeypatch.setattr(runs.DiskTransport, "write", lambda self, named, version: str(tmp_path / f"v{version}"))
    runs.sync_fn(engine, [], 3, str(tmp_path))()
    assert calls == [(call, 3)]


def test_arguments_of_each_device():
    cpu = bench.parse_args([])
    assert (cpu.device, cpu.shapes, cpu.bucket_mib) == ("cpu", ["dense", "moe"], 64)
    cuda = bench.parse_args(["--device", "cuda"])
    assert (cuda.preset, cuda.layers, cuda.bucket_mib) == (["qwen3-1.7b", "qwen3-moe-30b-a3b"], None, 1024)
    one = bench.parse_args(["--device", "cuda", "--preset", "qwen3-8b", "--layers", "2", "--bucket-mib", "256"])
    assert (one.preset, one.layers, one.bucket_mib) == (["qwen3-8b"], 2, 256)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "qwen3-8b"], "--preset and --layers are for --device cuda"),
    (["--device", "cuda", "--shapes", "dense"], "--shapes are the CPU shapes"),
    (["--device", "cuda", "--layers", "0"], "--layers must be >= 1"),
])
def test_arguments_of_the_other_device_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def _qwen3_dense_params(v, h, heads, kv, d, ffn, layers):
    """By hand: tied embedding + final norm; per layer q, k, v, o, the QK-norms, 2 norms, SwiGLU."""
    return v * h + h + layers * (h * d * (heads + 2 * kv) + heads * d * h + 2 * d + 2 * h + 3 * h * ffn)


def test_presets_are_cut_to_a_few_layers_and_sent_in_bf16(capsys):
    dense, moe = bench.cut_preset("qwen3-1.7b"), bench.cut_preset("qwen3-moe-30b-a3b")
    assert (dense.num_layers, moe.num_layers, bench.cut_preset("qwen3-1.7b", 3).num_layers) == (4, 2, 3)
    assert (dense.hidden_size, moe.num_experts) == (2048, 128)   # the rest is the preset's
    rows = bench.shape_table(["qwen3-1.7b", "qwen3-moe-30b-a3b"], [dense, moe])
    params = _qwen3_dense_params(151936, 2048, 16, 8, 128, 6144, 4)
    assert round(params / 1e9, 2) == 0.51
    assert rows[2] == f"| qwen3-1.7b | qwen3 | 4 of 28 | 2048 | - | 0.51e9 | {2 * params / 2**30:.2f} |"
    assert rows[3].startswith("| qwen3-moe-30b-a3b | qwen3_moe | 2 of 48 | 2048 | 128 | 1.87e9 | 3.4")
    cfg = runs.server_config(1 << 30, None, "cuda", "1", 0.5)   # the server on a GPU of its own
    assert (cfg.dtype, cfg.device, cfg.env, cfg.gpu_memory_utilization) == ("bfloat16", "cuda",
                                                                            {"CUDA_VISIBLE_DEVICES": "1"}, 0.5)
    cpu = runs.server_config(1 << 26, None)   # the CPU rows' server, as before
    assert (cpu.dtype, cpu.env, cpu.probe_every, cfg.probe_every) == ("float32", {}, 0, 0)
    with pytest.raises(SystemExit, match="qwen3-1.7b has 28 layers"):
        bench.cut_preset("qwen3-1.7b", 29)
    with pytest.raises(SystemExit, match="not a real preset"):
        bench.cut_preset("tiny")


def test_the_tensors_sent_are_the_checkpoint_format_ones():
    """Experts one by one, as the export yields them, holding exactly the model's parameters."""
    arch = preset_arch("qwen3_moe", "tiny")
    shapes = runs.checkpoint_shapes(arch)
    assert [n for n, _ in shapes] == list(dict.fromkeys(expected_names(arch)))
    assert dict(shapes)["model.layers.1.mlp.experts.3.gate_proj.weight"] == (arch.moe_ffn_hidden_size, arch.hidden_size)
    assert sum(torch.Size(s).numel() for _, s in shapes) == arch.num_parameters()
    weights = runs.device_weights(shapes, 0, "cpu", torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and tuple(t.shape) == s for (_, t), (_, s) in zip(weights, shapes))
    assert not torch.equal(weights[0][1], runs.device_weights(shapes[:1], 1, "cpu", torch.bfloat16)[0][1])


@pytest.mark.parametrize("missing", ["no vllm", "no cuda", "one gpu"])
def test_without_vllm_or_two_gpus_it_says_so_and_measures_nothing(tmp_path, monkeypatch, capsys, missing):
    found = None if missing == "no vllm" else object()
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: found if name == "vllm" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: missing == "one gpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "ws.md"
    assert bench.main(["--device", "cuda", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith(f"summary: not run: {missing} (")
    text = out.read_text()
    assert text.startswith(bench.CUDA_TITLE) and f"not run: {missing} (" in text
    assert "|" not in text and "MiB" not in text   # no table, no number


def test_the_gpu_rows_and_summary(tmp_path, monkeypatch):
    """run_cuda's control flow with the measured syncs replaced: medians, the ratio to the memory
    row, the server on the second visible GPU, one summary line."""
    seconds = {"memory": [1.0, 3.0, 2.0], "reload": [6.0, 5.0, 7.0]}
    seen = []

    def fake_bench(arch, kind, cfg, weights, repeats, tmp, cuda):
        seen.append((kind, cfg.env, cfg.dtype, repeats, cuda))
        return [(s, 3.0, 1024.0 if kind == "memory" else 0.0) for s in seconds[kind]]

    monkeypatch.setattr(runs, "bench", fake_bench)
    monkeypatch.setattr(runs, "device_weights", lambda shapes, seed, device, dtype: [])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    args = bench.parse_args(["--device", "cuda", "--preset", "qwen3-0.6b", "--layers", "1"])
    text, summary = bench.run_cuda(args, str(tmp_path))
    assert seen == [("memory", {"CUDA_VISIBLE_DEVICES": "5"}, "bfloat16", 3, True),
                    ("reload", {"CUDA_VISIBLE_DEVICES": "5"}, "bfloat16", 3, True)]
    assert "| qwen3-0.6b x 1 | memory | 2.000 | 1024 | 3 | 1.0 |" in text
    assert "| qwen3-0.6b x 1 | reload | 6.000 | 0 | 3 | 3.0 |" in text
    assert "server on GPU 5" in text and "| qwen3-0.6b | qwen3 | 1 of 28 |" in text
    assert summary == "qwen3-0.6b x1 memory 2.00 s (+1024 MiB GPU), reload 6.00 s (3.0x)"


def test_the_gpu_memory_of_a_sync_is_its_peak_over_what_was_allocated_before(monkeypatch):
    """The CUDA allocator's counters replaced: 100 MiB held before, a 64 MiB bucket during the sync."""
    mib = 1 << 20
    state = {"allocated": 100 * mib, "peak": 500 * mib}   # an earlier peak must not count
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    _, _, gpu = runs.measured(lambda: state.update(peak=state["allocated"] + 64 * mib), cuda=True)
    assert gpu == 64.0
    assert len(runs.measured(lambda: None)) == 2   # the CPU rows: seconds and host MiB only
