"""The mismatch bucket table: aggregation over steps, text report from a run directory, figure."""
import json

from megatron_rl.metrics.mismatch import bucket_labels
from megatron_rl.metrics.report import bucket_figure, bucket_rows, format_bucket_table, merge_bucket_rows


def _step(step, counts, absd, k3):
    d = {"step": step, "mismatch/kl_k3": sum(c * k for c, k in zip(counts, k3)) / sum(counts)}
    for label, c, a, k in zip(bucket_labels(), counts, absd, k3):
        d.update({f"mismatch/bucket/{label}/count": c, f"mismatch/bucket/{label}/abs_diff": a,
                  f"mismatch/bucket/{label}/kl_k3": k})
    return d


def test_merge_is_count_weighted():
    a = _step(1, [1, 0, 0, 0, 0, 0, 3], [0.5] * 7, [0.2] * 7)
    b = _step(2, [3, 0, 0, 0, 0, 0, 1], [0.1] * 7, [0.0] * 7)
    rows = {r[0]: r[1:] for r in merge_bucket_rows([a, b])}
    first, last = bucket_labels()[0], bucket_labels()[-1]
    assert rows[first] == (4, (0.5 + 3 * 0.1) / 4, 0.2 / 4)
    assert rows[last] == (4, (3 * 0.5 + 0.1) / 4, 3 * 0.2 / 4)
    assert len(bucket_rows(a)) == 7


def test_report_tool_prints_the_table(tmp_path, capsys):
    from tools.mismatch_report import main

    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "sft/nll": 1.0}) + "\n")
        f.write(json.dumps(_step(1, [10, 0, 0, 0, 5, 5, 80], [1e-1] * 7, [2e-2] * 7)) + "\n")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0-0.0001" in out and "0.9-1" in out and "80.0%" in out
    assert main([str(tmp_path / "nope")]) == 2


def test_compare_puts_runs_side_by_side(tmp_path, capsys):
    from tools.mismatch_report import main

    for name, absd in (("bf16", 2e-2), ("fp16", 3e-3)):
        (tmp_path / name).mkdir()
        row = _step(1, [10, 0, 0, 0, 5, 5, 80], [absd] * 7, [absd / 10] * 7)
        row["mismatch/kl_k3"] = absd / 10
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["--compare", str(tmp_path / "bf16"), str(tmp_path / "fp16")]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.strip().startswith("0-0.0001"))
    assert "2.00e-02 / 2.00e-03" in first and "3.00e-03 / 3.00e-04" in first
    assert "bf16" in out.splitlines()[1] and "fp16" in out.splitlines()[1]
    kl = next(line for line in out.splitlines() if "mismatch/kl_k3" in line)
    assert "2.0000e-03" in kl and "3.0000e-04" in kl
    assert "-" in next(line for line in out.splitlines() if line.strip().startswith("0.0001-0.001"))


def test_figure_and_text():
    rows = bucket_rows(_step(1, [1, 2, 3, 4, 5, 6, 7], [0.1] * 7, [1e-3] * 7))
    assert "KL k3" in format_bucket_table(rows)
    assert bucket_figure(rows, 1) is not None


def test_compare_keeps_runs_whose_folders_share_a_name(tmp_path, capsys):
    """--compare a/run b/run showed one column: the runs were keyed by the folder's name."""
    from tools.mismatch_report import main, run_labels

    for parent, absd in (("a", 2e-2), ("b", 3e-3)):
        (tmp_path / parent / "run").mkdir(parents=True)
        row = _step(1, [10, 0, 0, 0, 5, 5, 80], [absd] * 7, [absd / 10] * 7)
        (tmp_path / parent / "run" / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    a, b = str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")
    assert main(["--compare", a, b]) == 0
    out = capsys.readouterr().out
    assert a in out.splitlines()[1] and b in out.splitlines()[1]
    first = next(line for line in out.splitlines() if line.strip().startswith("0-0.0001"))
    assert "2.00e-02 / 2.00e-03" in first and "3.00e-03 / 3.00e-04" in first
    assert run_labels(["x/run", "y/other", "x/run/"]) == ["x/run #1", "other", "x/run #2"]


def test_a_row_nested_too_deeply_is_skipped_with_its_line(tmp_path, capsys):
    from tools.mismatch_report import read_history

    row = _step(1, [10, 0, 0, 0, 5, 5, 80], [1e-1] * 7, [2e-2] * 7)
    (tmp_path / "metrics.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n" + json.dumps(row) + "\n")
    assert len(read_history(str(tmp_path))) == 1
    assert "metrics.jsonl:1: skipped, a JSON row nested too deeply to read" in capsys.readouterr().err


def test_the_turn_table_weights_each_step_by_its_tokens_and_the_tool_prints_it_for_multi_turn_runs(tmp_path, capsys):
    from megatron_rl.metrics.report import merge_turn_rows, turn_rows
    from tools.mismatch_report import main

    def step(n, tokens, k3):
        row = {"step": n, "mismatch/kl_k3": 0.1, "env/turns": 2.0}
        for label, t, k in zip(("0", "1", "2", "3_or_later"), tokens, k3):
            row.update({f"mismatch/turn/{label}/tokens": t, f"mismatch/turn/{label}/kl_k3": k,
                        f"mismatch/turn/{label}/abs_logprob_diff": 2 * k})
        return row

    a, b = step(1, [30, 10, 0, 0], [1e-3, 4e-3, 0, 0]), step(2, [10, 30, 5, 0], [3e-3, 8e-3, 1e-2, 0])
    assert turn_rows({"step": 1, "mismatch/kl_k3": 0.1}) == []  # single-turn rows have none
    rows = {r[0]: r[1:] for r in merge_turn_rows([a, b])}
    assert rows["1"] == (40, 2 * (10 * 4e-3 + 30 * 8e-3) / 40, (10 * 4e-3 + 30 * 8e-3) / 40)
    assert rows["3_or_later"] == (0, 0.0, 0.0)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mismatch by policy turn" in out and "3_or_later" in out and "env/turns" in out


def test_the_environment_reward_table_weights_each_step_by_its_turns(tmp_path, capsys):
    from megatron_rl.metrics.report import env_turn_rows, merge_env_turn_rows
    from tools.mismatch_report import main

    a = {"step": 1, "mismatch/kl_k3": 0.1, "env/turn/0/turns": 8.0, "env/turn/0/reward": 0.25,
         "env/turn/1/turns": 2.0, "env/turn/1/reward": 1.0}
    b = {"step": 2, "mismatch/kl_k3": 0.1, "env/turn/0/turns": 8.0, "env/turn/0/reward": 0.5}
    assert env_turn_rows({"step": 1}) == [] and env_turn_rows(b) == [("0", 8.0, 0.5)]
    assert merge_env_turn_rows([a, b]) == [("0", 16.0, (8 * 0.25 + 8 * 0.5) / 16), ("1", 2.0, 1.0)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "environment reward by policy turn, steps 1-2" in out and "0.3750" in out


def test_the_routing_agreement_by_turn_weights_each_step_by_the_turns_tokens(tmp_path, capsys):
    from megatron_rl.metrics.report import merge_agreement_turn_rows
    from tools.mismatch_report import main

    a = {"step": 1, "mismatch/kl_k3": 0.1, "mismatch/turn/0/tokens": 30.0, "mismatch/turn/1/tokens": 10.0,
         "moe/route_agree_rollout_train/turn/0": 0.9, "moe/route_agree_rollout_train/turn/1": 0.5}
    b = {"step": 2, "mismatch/kl_k3": 0.1, "mismatch/turn/0/tokens": 10.0, "mismatch/turn/1/tokens": 0.0,
         "moe/route_agree_rollout_train/turn/0": 0.7, "moe/route_agree_rollout_train/turn/1": 0.0}
    for row in (a, b):  # the rest of a per-turn mismatch row
        row.update({f"mismatch/turn/{t}/{c}": 0.01 for t in ("0", "1") for c in ("abs_logprob_diff", "kl_k3")})
    rows = merge_agreement_turn_rows([a, b])
    assert rows[0][:2] == ("0", 40.0) and abs(rows[0][2] - (30 * 0.9 + 10 * 0.7) / 40) < 1e-12
    assert rows[1] == ("1", 10.0, 0.5)  # a step without turn-1 tokens does not dilute it
    assert merge_agreement_turn_rows([{"step": 1, "mismatch/kl_k3": 0.1}]) == []  # no replay: no table
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "MoE routing agreement (engine vs trainer) by policy turn, steps 1-2" in out and "0.8500" in out
