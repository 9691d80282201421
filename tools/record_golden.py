"""Record the golden numbers that tests/e2e/test_golden.py compares against.

Runs the 3-step CPU RL cases of tests/golden.py (every loss recipe, GRPO with R2 / R3, ...) in one
fresh single-rank process and writes them to tests/assets/golden/rl_3step.json as the record of this
CPU's numerics (tests/golden.py: one record per CPU, since AVX2 and AVX-512 kernels round
differently), then prints the table.

    python tools/record_golden.py                      # every case; drops the other CPUs' records
    python tools/record_golden.py --cases grpo,p3o     # only these; the other cases keep their values
    python tools/record_golden.py --add-cpu            # this CPU's record beside the others
    python tools/record_golden.py --check              # compare with this CPU's record, write nothing

Rewrite the file only when the math is meant to change (say why in the commit), on the stack
recorded in its "versions": the other CPUs' records are stale then and are dropped. --add-cpu is
for a CPU that has no record yet (or a refresh) with the math unchanged: check first that the
records there still pass on their own CPUs.
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
    p.add_argument("--add-cpu", action="store_true",
                   help="keep the other CPUs' records (the math unchanged); default: drop them")
    p.add_argument("--output", default=None, help="write here instead of tests/assets/golden/rl_3step.json")
    args = p.parse_args(argv)

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as tests/conftest.py: megatron's jit_fuser
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.golden import (
        GOLDEN_PATH,
        cases,
        compare,
        find_record,
        load_golden,
        run_fresh,
        sanity,
        table,
        write_golden,
    )

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
    values = got["values"]
    print(f"ran {len(values)} case(s) in {time.perf_counter() - t0:.0f}s; CPU numerics {got['numerics']}")
    print(table(values))
    bad = sanity(values)
    if bad:
        print("degenerate run, nothing written:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    record = find_record(load_golden(path), got["numerics"]) if os.path.exists(path) else None
    if args.check:
        from tests.e2e.test_golden import ATOL, RTOL

        if record is None:
            print(f"no record for this CPU's numerics in {os.path.relpath(path)}")
            return 1
        moved = compare({k: v for k, v in record["values"].items() if k in values}, values, rtol=RTOL, atol=ATOL)
        print("\n".join(moved) if moved else "all values match this CPU's record")
        return 1 if moved else 0
    if args.cases and record is not None:
        old = record["values"]
        values = {name: values[name] if name in values else old[name] for name in every if name in values or name in old}
    write_golden({"numerics": got["numerics"], "values": values}, path, keep_other_cpus=args.add_cpu)
    print(f"wrote {os.path.relpath(path)}" + ("" if args.add_cpu else " (this CPU's record only)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
