"""benchmarks/logprobs_cuda.py runs end to end at a small size on the CPU (the GPU table's code
path minus CUDA events and memory statistics), and its accuracy column can tell fp32 logits from
bf16-rounded ones. No GPU result is produced or checked here."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

import logprobs_cuda as bench


def test_table_runs_on_cpu_at_a_small_size():
    text = bench.table([256], vocab=512, hidden=64, device="cpu", accuracy_tokens=128)
    assert "| 256 |" in text and "of floor" in text
    assert "| ours |" in text and "| straightforward |" in text
    assert "does not fit" not in text


def test_accuracy_column_separates_fp32_logits_from_bf16_rounded_ones():
    ours = bench.accuracy("ours", 128, 2048, 64, "cpu")
    straightforward = bench.accuracy("straightforward", 128, 2048, 64, "cpu")
    assert ours["logprob"] < 2e-5 and ours["entropy"] < 2e-5
    assert straightforward["logprob"] > 10 * ours["logprob"]
