"""Where the test time goes: each tier's time and the slowest tests of the last run of each lane.

    python tools/ci_time.py                    # the last `make test` / `make test-lane2` / `make test-fast`
    python tools/ci_time.py --top 50 build/test-times/lane1.xml

`make test`, `make test-lane2` and `make test-fast` have pytest write a JUnit XML report per lane
to build/test-times/ (lane1.xml, lane2.xml, fast.xml); this reads them. A test's time is setup +
call + teardown, so a module- or session-scoped fixture (a shared finished run, a worker pool's
start) is counted in the first test that uses it. The tier of a test is its folder under tests/
(unit, distributed, tools, e2e, vllm, gpu). The README's CI line quotes these tables; the
slowest files' seconds are what tests/order.py's LONG_FILES (the order files go to the xdist
workers) is updated from.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES = os.path.join(ROOT, "build", "test-times")


@dataclass(frozen=True)
class Case:
    tier: str
    node: str        # pytest's node id, e.g. tests/unit/losses/test_x.py::test_y[a]
    seconds: float
    outcome: str     # passed, failed, error, skipped


def read_cases(path: str) -> list[Case]:
    """Every <testcase> of a JUnit XML file written by pytest (--junitxml)."""
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        module = tc.get("classname", "")
        parts = module.split(".")
        # classname is the dotted module (plus the class for a test method): tests.unit.losses.test_x
        tier = parts[1] if len(parts) > 1 and parts[0] == "tests" else parts[0]
        file_parts = [p for p in parts if p]
        while file_parts and not file_parts[-1].startswith("test_"):
            file_parts.pop()  # a test class's name, not a file
        node = "/".join(file_parts) + ".py::" + tc.get("name", "")
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if tc.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        cases.append(Case(tier, node, float(tc.get("time", 0.0)), outcome))
    return cases


def suite_seconds(path: str) -> float:
    """The run's wall time as pytest recorded it (collection included)."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return float(suite.get("time", 0.0)) if suite is not None else 0.0


def file_seconds(cases: list[Case]) -> dict[str, float]:
    """Seconds per test file (relative to tests/, as tests/order.py names them), slowest first."""
    per: dict[str, float] = defaultdict(float)
    for c in cases:
        per[c.node.split("::")[0].removeprefix("tests/")] += c.seconds
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def report(path: str, top: int) -> str:
    cases = read_cases(path)
    by_tier: dict[str, list[Case]] = defaultdict(list)
    for c in cases:
        by_tier[c.tier].append(c)
    lines = [f"== {os.path.relpath(path, ROOT)}: {len(cases)} tests, {minutes(suite_seconds(path))} wall",
             "", f"{'tier':<12} {'tests':>6} {'passed':>7} {'skipped':>8} {'failed':>7} {'time':>14}"]
    for tier in sorted(by_tier, key=lambda t: -sum(c.seconds for c in by_tier[t])):
        cs = by_tier[tier]
        n = defaultdict(int)
        for c in cs:
            n[c.outcome] += 1
        lines.append(f"{tier:<12} {len(cs):>6} {n['passed']:>7} {n['skipped']:>8} "
                     f"{n['failed'] + n['error']:>7} {minutes(sum(c.seconds for c in cs)):>14}")
    files = file_seconds(cases)
    lines += ["", f"slowest {min(top, len(files))} files (tests/order.py):"]
    lines += [f"{s:8.1f} s  {f}" for f, s in list(files.items())[:top]]
    lines += ["", f"slowest {min(top, len(cases))}:"]
    for c in sorted(cases, key=lambda c: -c.seconds)[:top]:
        lines.append(f"{c.seconds:8.1f} s  {c.node}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="*", help="JUnit XML files (default: build/test-times/*.xml)")
    p.add_argument("--top", type=int, default=30, help="how many of the slowest tests to list (default 30)")
    args = p.parse_args(argv)
    paths = args.reports or sorted(glob.glob(os.path.join(TIMES, "*.xml")))
    if not paths:
        print(f"no test reports in {os.path.relpath(TIMES, ROOT)}/: run make test, make test-lane2 or "
              "make test-fast first", file=sys.stderr)
        return 2
    print("\n\n".join(report(p_, args.top) for p_ in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
