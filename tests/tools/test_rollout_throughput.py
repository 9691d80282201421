"""benchmarks/rollout_throughput.py at a small size: both modes give the same trajectories' turn
counts, every environment latency is drawn the same way in both, and the table is written."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import rollout_throughput as bench


def test_latencies_are_fixed_by_their_key_and_heavy_tailed_as_asked():
    draws = sorted(bench.latency_s(50.0, 1000.0, f"k/{i}") for i in range(4000))
    assert draws == sorted(bench.latency_s(50.0, 1000.0, f"k/{i}") for i in range(4000))
    assert 0.045 < draws[2000] < 0.055 and 0.8 < draws[3960] < 1.25   # median 50 ms, p99 1 s


def test_a_small_run_writes_the_table(tmp_path, capsys):
    out = tmp_path / "table.md"
    bench.main(["--trajectories", "8", "--group-size", "2", "--median-ms", "1", "--p99-ms", "4", "--repeats", "1",
                "--max-tokens", "3", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| multi-turn", "| single-turn"))]
    assert len(rows) == 4
    turns = [row.split("|")[-2].strip() for row in rows]
    assert turns[0] == turns[1] == "2.50" and turns[2] == turns[3] == "1.00"   # single-turn: one per sample
    assert "speed-up (multi-turn)" in capsys.readouterr().out
