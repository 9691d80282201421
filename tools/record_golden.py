"""Record the golden numbers that tests/e2e/test_golden.py compares against.

Runs the 3-step CPU RL cases of tests/golden.py (every loss recipe, GRPO with R2 / R3, ...) in one
fresh single-rank process and writes tests/assets/golden/rl_3step.json, then prints the table.

    python tools/record_golden.py                      # every case (rewrites the file)
    python tools/record_golden.py --cases grpo,p3o     # only these; the other cases keep their values
    python tools/record_golden.py --check              # compare with the file, write nothing

Rewrite the file only when the math is meant to change (say why in the commit), on the stack
recorded in its "versions".
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--check", action="store_true", help="compare with the golden file instead of writing it")
    p.add_argument("--output", default=None, help="write here instead of tests/assets/golden/rl_3step.json")
    args = p.parse_args(argv)

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as tests/conftest.py: megatron's jit_fuser
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.golden import GOLDEN_PATH, cases, compare, load_golden, run_fresh, sanity, table, write_golden

    path = args.output or GOLDEN_PATH
    every = cases()
    wanted = every
    if args.cases:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]
        unknown = [n for n in names if n not in every]
        if unknown:
            p.error(f"unknown case(s) {unknown}; available: {sorted(every)}")
        wanted = {n: every[n] for n in names}

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        got = run_fresh(tmp, wanted)
    print(f"ran {len(got)} case(s) in {time.perf_counter() - t0:.0f}s")
    print(table(got))
    bad = sanity(got)
    if bad:
        print("degenerate run, nothing written:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    if args.check:
        from tests.e2e.test_golden import ATOL, RTOL

        golden = load_golden(path)["values"]
        moved = compare({k: v for k, v in golden.items() if k in got}, got, rtol=RTOL, atol=ATOL)
        print("\n".join(moved) if moved else "all values match the golden file")
        return 1 if moved else 0
    values = got
    if args.cases and os.path.exists(path):
        old = load_golden(path)["values"]
        values = {name: got[name] if name in got else old[name] for name in every if name in got or name in old}
    write_golden(values, path)
    print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
