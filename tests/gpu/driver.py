"""Run several pretrain_rl.py command lines in one process, one after the other (saves start-up time).

    python -m tests.gpu.driver RUNS.json RESULTS.json

RUNS.json maps a name to pretrain_rl.py arguments. Each run is `pretrain_rl.main(args)` (it sets up
and tears down torch.distributed itself) on a fresh MASTER_PORT; RESULTS.json maps each name to
null, or to the text of a run that failed: its exit code, the tail of what it wrote to stderr
(with --debug, the traceback) and its run_dir/error-rank0.log, so the failure explains itself in
the test's output (the run directory stays on the machine that ran it). A failed run does not stop
the others. The dense test reward of tests/golden.py is registered first, so runs may use it.
"""
from __future__ import annotations

import io
import json
import os
import sys
import traceback

STDERR_TAIL = 4000


class _Tee(io.TextIOBase):
    """stderr that also keeps a copy (what a run prints there goes to both); file descriptor,
    encoding and tty questions go to the real stderr (code that writes to the descriptor itself,
    e.g. a compile worker's, is not copied)."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text):
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def fileno(self):
        return self.stream.fileno()

    def isatty(self):
        return self.stream.isatty()

    @property
    def encoding(self):
        return self.stream.encoding

    @property
    def errors(self):
        return self.stream.errors


def run_dir_of(args: list[str]) -> str | None:
    """The train.run_dir=... override of a pretrain_rl.py command line (the last one), or None."""
    dirs = [a.split("=", 1)[1] for a in args if a.startswith("train.run_dir=")]
    return dirs[-1] if dirs else None


def failure_text(rc: int, stderr: str, run_dir: str | None) -> str:
    """What the test shows of a failed run: the exit code, stderr's tail and the error log."""
    parts = [f"pretrain_rl.main returned {rc}"]
    if stderr.strip():
        parts.append(f"stderr (last {STDERR_TAIL} characters):\n{stderr[-STDERR_TAIL:]}")
    log = os.path.join(run_dir, "error-rank0.log") if run_dir else None
    if log and os.path.exists(log):
        with open(log) as f:
            trace = f.read()
        if trace.strip() not in stderr:   # --debug printed it already
            parts.append(f"{log}:\n{trace}")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    spec_file, result_file = argv
    with open(spec_file) as f:
        runs = json.load(f)
    import pretrain_rl
    from tests.golden import register_reward
    from tests.spawn import free_port

    register_reward()   # runs may name the dense test reward (tests.gpu.runs.DENSE_REWARD)

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    results = {}
    for name, args in runs.items():
        os.environ["MASTER_PORT"] = str(free_port())
        tee = _Tee(sys.stderr)
        sys.stderr, rc = tee, None
        try:
            rc = pretrain_rl.main(args)
            results[name] = None if rc == 0 else failure_text(rc, tee.copy.getvalue(), run_dir_of(args))
        except KeyboardInterrupt:
            rc, results[name] = 130, "stopped by SIGINT (Ctrl-C or the part's time limit)"
        except BaseException:  # noqa: BLE001 - recorded for the test to report
            results[name] = traceback.format_exc()
            from megatron_rl.parallel import destroy_parallel

            try:  # best effort before the next run
                destroy_parallel()
            except Exception as e:  # noqa: BLE001
                print(f"driver: {name}: teardown failed too: {type(e).__name__}: {e}", flush=True)
        finally:
            sys.stderr = tee.stream
        print(f"driver: {name}: {'ok' if results[name] is None else 'FAILED'}", flush=True)
        if results[name] is not None:
            print(results[name], file=sys.stderr, flush=True)
        if rc in (130, 143):   # SIGINT / SIGTERM: stopped from outside, the remaining runs too
            results.update({other: f"not run: the driver was stopped (exit {rc} of {name})"
                            for other in runs if other not in results})
            break
    with open(result_file, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
