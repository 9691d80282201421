"""tools/ci_time.py reads pytest's JUnit report: tiers from the test's folder, times summed per tier,
the slowest tests first, outcomes counted; a missing report is a usage error (exit 2)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import ci_time

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="5" time="75.5">
<testcase classname="tests.unit.losses.test_surrogates" name="test_a[x]" time="0.25"/>
<testcase classname="tests.unit.losses.test_surrogates" name="test_b" time="0.75"><skipped message="no"/></testcase>
<testcase classname="tests.distributed.test_rl_loop" name="test_loop" time="40.0"/>
<testcase classname="tests.distributed.test_rl_loop.TestGroup" name="test_in_class" time="2.0">
<failure message="boom"/></testcase>
<testcase classname="tests.e2e.test_drills" name="test_drill" time="30.0"/>
</testsuite></testsuites>
"""


def test_tiers_times_and_slowest(tmp_path):
    path = tmp_path / "lane1.xml"
    path.write_text(REPORT)
    cases = ci_time.read_cases(str(path))
    assert [c.tier for c in cases] == ["unit", "unit", "distributed", "distributed", "e2e"]
    assert cases[3].node == "tests/distributed/test_rl_loop.py::test_in_class" and cases[3].outcome == "failed"
    assert cases[1].outcome == "skipped"
    text = ci_time.report(str(path), top=2)
    assert "5 tests, 1 min 15.5 s wall" in text
    tiers = [line.split()[0] for line in text.splitlines()[3:6]]
    assert tiers == ["distributed", "e2e", "unit"]  # by time, most first
    assert "distributed       2       1        0       1   0 min 42.0 s" in text
    assert ci_time.file_seconds(cases) == {"distributed/test_rl_loop.py": 42.0, "e2e/test_drills.py": 30.0,
                                           "unit/losses/test_surrogates.py": 1.0}
    files = text.split("slowest 2 files (tests/order.py):\n")[1].splitlines()[:2]
    assert files == ["    42.0 s  distributed/test_rl_loop.py", "    30.0 s  e2e/test_drills.py"]
    slowest = text.split("slowest 2:\n")[1].splitlines()
    assert slowest == ["    40.0 s  tests/distributed/test_rl_loop.py::test_loop",
                       "    30.0 s  tests/e2e/test_drills.py::test_drill"]


def test_no_report_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ci_time, "TIMES", str(tmp_path))
    assert ci_time.main([]) == 2
    assert "run make test" in capsys.readouterr().err
