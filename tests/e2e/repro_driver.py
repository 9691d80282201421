"""Run several examples/repro scripts in one interpreter, one after the other (saves each script's
interpreter start and its imports: the config package, torch, matplotlib).

    python -m tests.e2e.repro_driver RUNS.json RESULTS.json

RUNS.json maps a script's name (examples/repro/<name>.py) to its command-line arguments. Each script
runs as `python examples/repro/<name>.py ARGS` would run it: as `__main__` (runpy), its folder first
on sys.path, its arguments in sys.argv. RESULTS.json maps each name to {"code": its exit status,
"stdout": what it printed, "stderr": ...}; a script that fails does not stop the others. The runs a
script starts (pretrain_rl.py) stay processes of their own.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

REPRO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "repro")


def run_script(name: str, args: list[str]) -> dict:
    """One script as `__main__`: its exit status and output, as its own process would report them."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = sys.argv
    sys.argv = [os.path.join(REPRO, f"{name}.py"), *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:  # what the interpreter does with it: a message goes to stderr, status 1
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - reported as the script's failure
            traceback.print_exc()
            code = 1
        finally:
            sys.argv = argv
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main(argv: list[str]) -> int:
    spec_file, result_file = argv
    with open(spec_file) as f:
        runs = json.load(f)
    sys.path.insert(0, REPRO)  # `import common`, as the scripts' own processes find it
    results = {}
    for name, args in runs.items():
        results[name] = run_script(name, args)
        print(f"repro_driver: {name}: exit {results[name]['code']}", flush=True)
    with open(result_file, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
