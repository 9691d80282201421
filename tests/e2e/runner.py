"""`pretrain_rl.py` runs for the e2e drills without paying a new interpreter for each: a worker process
that imported pretrain_rl.py, torch, megatron-core and transformers once runs each command line as
`pretrain_rl.main(argv)`, the way `python pretrain_rl.py ARGV` runs it, and answers with what the
process would have: its exit code, stdout and stderr (captured at the file descriptors, so what
megatron's loggers, C code and forked checkpoint writers print is in them too).

    proc = run_pretrain(["--config", "examples/demo_cpu.yaml", "train.steps=1", ...], env, timeout=600)
    proc.returncode, proc.stdout, proc.stderr      # a subprocess.CompletedProcess

A fresh interpreter costs about 11 s of imports on 2 cores; a tiny run about 5 s after them. The
product supports running again in one process (pretrain_rl.main releases the model, the process
groups and the run directory's lock at the end of each run: tests/gpu/driver.py relies on it), and
between runs the worker puts back the environment variables and the working directory it started
with, so a run sees what a new process would. What only a new process shows (signals, the
children a trainer forks and reaps, a file-size limit set before exec, torchrun) stays with real
`python pretrain_rl.py` processes in the tests that check it.

A run that raises out of main (a real process would print the traceback and exit 1) or hangs
past its timeout ends the worker; the next call starts a new one. One worker per environment per
pytest process, replaced after MAX_RUNS runs so nothing a run leaves behind piles up.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import selectors
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_RUNS = 40
# the drills' environment: one thread (the runs are tiny), torch.compile off as pretrain_rl.py has it
# without CUDA; the tests that pass it share one worker
ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
HANG_GUARD_S = 600  # a deadline against hangs only; no assertion depends on speed
_WORKERS: dict[tuple, _Worker] = {}


class _Worker:
    def __init__(self, env: dict):
        read_fd, self.write_fd = os.pipe()
        self.reply_fd, child_reply = os.pipe()
        env = dict(env, E2E_RUNNER_FDS=f"{read_fd},{child_reply}")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.runner"], cwd=ROOT, env=env,
                                     pass_fds=(read_fd, child_reply), stdin=subprocess.DEVNULL)
        os.close(read_fd)
        os.close(child_reply)
        self.runs = 0
        self.buffer = b""

    def call(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="e2e-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            os.write(self.write_fd, (json.dumps({"argv": argv, "out": out, "err": err}) + "\n").encode())
            self.runs += 1
            reply = self._reply(timeout, argv, out, err)
            stdout, stderr = _read(out), _read(err)
        if reply.get("restart"):
            self.close()
        return subprocess.CompletedProcess([sys.executable, "pretrain_rl.py", *argv], reply["rc"], stdout, stderr)

    def _reply(self, timeout, argv, out, err) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.reply_fd, selectors.EVENT_READ)
        try:
            while b"\n" not in self.buffer:
                if not sel.select(timeout):
                    self.close()
                    raise subprocess.TimeoutExpired(argv, timeout, _tail(out), _tail(err))
                chunk = os.read(self.reply_fd, 65536)
                if not chunk:   # the worker died (a crash a real process would have died of too)
                    rc = self.proc.wait()
                    self.close()
                    return {"rc": rc, "restart": True}   # -N: killed by signal N, as subprocess has it
                self.buffer += chunk
        finally:
            sel.close()
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None and self.runs < MAX_RUNS

    def close(self) -> None:
        for fd in (self.write_fd, self.reply_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.write_fd = self.reply_fd = -1
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _read(path: str) -> str:
    """What a run wrote there; nothing if the worker died before it opened the file."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str) -> str:
    return _read(path)[-6000:]


def run_pretrain(argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python pretrain_rl.py ARGV` in ROOT under `env`, run by a kept worker (see the module's docstring)."""
    key = tuple(sorted(env.items()))
    worker = _WORKERS.get(key)
    if worker is None or not worker.alive():
        if worker is not None:
            worker.close()
        worker = _WORKERS[key] = _Worker(env)
    return worker.call(list(argv), timeout)


@atexit.register
def close_all() -> None:
    while _WORKERS:
        _WORKERS.popitem()[1].close()


# ---- the worker side
def _serve() -> None:
    import traceback

    import pretrain_rl

    requests_fd, reply_fd = (int(x) for x in os.environ.pop("E2E_RUNNER_FDS").split(","))
    env, cwd = dict(os.environ), os.getcwd()
    with os.fdopen(requests_fd, "rb") as requests:
        for line in requests:
            request = json.loads(line)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            with open(request["out"], "wb") as out, open(request["err"], "wb") as err:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                restart = False
                try:
                    rc = pretrain_rl.main(request["argv"])
                except SystemExit as e:   # argparse, or an explicit exit: what the process would exit with
                    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if e.code is not None and not isinstance(e.code, int):
                        print(e.code, file=sys.stderr)
                except BaseException:  # noqa: BLE001 - a real process prints it and exits 1; so does this one
                    traceback.print_exc()
                    rc, restart = 1, True
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
                    os.close(saved[0])
                    os.close(saved[1])
            gc.collect()   # what a failed run's traceback kept alive (its run directory's lock included)
            os.write(reply_fd, (json.dumps({"rc": rc, "restart": restart}) + "\n").encode())
            if restart:
                return


if __name__ == "__main__":
    _serve()
