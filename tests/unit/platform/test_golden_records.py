"""The golden file's records per CPU numerics (tests/golden.py): which record a machine compares
with, and what recording keeps. The golden run itself is tests/e2e/test_golden.py."""
import re

import pytest

from tests.golden import STEPS, cases, find_record, load_golden, matches, numerics, write_golden

AVX2_OLD = {"torch_cpu_capability": "AVX2"}                          # recorded before the probe
AVX512 = {"torch_cpu_capability": "AVX512", "probe": "ad745152c7bb81b4"}


def _record(numerics_, value):
    return {"numerics": numerics_, "versions": {}, "values": {"grpo": [{"loss/policy": value}]}}


def test_numerics_is_a_stable_key_of_this_cpu():
    here = numerics()
    assert here == numerics()
    assert set(here) == {"torch_cpu_capability", "probe"}
    assert re.fullmatch(r"[0-9a-f]{16}", here["probe"])


@pytest.mark.parametrize("machine,want", [
    ({"torch_cpu_capability": "AVX2", "probe": "0123456789abcdef"}, 0.0),   # any AVX2 probe: the old record
    (AVX512, 1.0),
    ({"torch_cpu_capability": "AVX512", "probe": "fedcba9876543210"}, None),   # another AVX-512 kernel set
    ({"torch_cpu_capability": "DEFAULT", "probe": "ad745152c7bb81b4"}, None),
])
def test_a_machine_compares_with_the_record_of_its_numerics(machine, want):
    golden = {"records": [_record(AVX2_OLD, 0.0), _record(AVX512, 1.0)]}
    record = find_record(golden, machine)
    assert (record["values"]["grpo"][0]["loss/policy"] if record else None) == want
    assert matches(_record(AVX512, 1.0), AVX512) and not matches(_record(AVX512, 1.0), AVX2_OLD)


def test_recording_replaces_this_cpus_record_and_keeps_or_drops_the_others(tmp_path):
    path = str(tmp_path / "golden.json")
    write_golden({"numerics": AVX2_OLD, "values": {"grpo": [{"loss/policy": 0.0}]}}, path)
    write_golden({"numerics": AVX512, "values": {"grpo": [{"loss/policy": 1.0}]}}, path, keep_other_cpus=True)
    assert [r["numerics"] for r in load_golden(path)["records"]] == [AVX2_OLD, AVX512]

    # an AVX2 machine adding its full record replaces the old one it matched, keeps AVX-512's
    avx2 = {"torch_cpu_capability": "AVX2", "probe": "0123456789abcdef"}
    write_golden({"numerics": avx2, "values": {"grpo": [{"loss/policy": 2.0}]}}, path, keep_other_cpus=True)
    assert [r["numerics"] for r in load_golden(path)["records"]] == [AVX512, avx2]

    # a change of the math: only the machine that recorded it keeps a record
    write_golden({"numerics": AVX512, "values": {"grpo": [{"loss/policy": 3.0}]}}, path)
    [only] = load_golden(path)["records"]
    assert only["numerics"] == AVX512 and only["values"]["grpo"][0]["loss/policy"] == 3.0


def test_every_record_in_the_file_holds_every_case_and_step():
    records = load_golden()["records"]
    assert records
    for r in records:
        assert set(r["numerics"]) <= {"torch_cpu_capability", "probe"}
        assert set(r["values"]) == set(cases()), r["numerics"]
        assert all(len(steps) == STEPS for steps in r["values"].values()), r["numerics"]
