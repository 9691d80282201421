#!/usr/bin/env python3
"""The GPU check: the GPU evidence of one short device session, most important result first.

Run ON the GPU machine, from the repository root, with the wheels `make gpu-wheels` put in .whl/
(the machine needs Python 3.12, a CUDA torch, triton, transformers and pytest, no package index):

    make gpu-check                       # = python3 tools/gpu_check.py quick   (<= 8 min, megatron-core 0.19.2)
    make gpu-check-more                  # = python3 tools/gpu_check.py more    (<= 6 min, megatron-core 0.16.1)
    python3 tools/gpu_check.py --plan    # both profiles: parts, commands, estimates; runs nothing, no GPU needed
    python3 tools/gpu_check.py quick --parts bench,logprobs --mcore 0.16.1    # some parts, another release

PROFILES below is the one list of what runs: per profile a megatron-core release, a hard stop and
its parts in order of importance, each with a time estimate. tests/tools/test_gpu_check_script.py
reads it: the quick profile's estimate stays under 8 minutes and the other's under 4, and every
test of tests/gpu is in exactly one profile.

A call (one profile):
  1. checks .whl/SHA256SUMS; installs .whl/mcore-<version>/ and .whl/common/ into
     $SITE_ROOT/site-<version> (pip --no-index --no-deps --target: the machine's torch, triton and
     transformers are used as they are; kept for a later call with the same wheels); prints the
     versions, the GPU and the free disk. This is the `setup` row of the plan, counted in the total;
  2. runs the parts one after another, each under a time limit of 2 x its estimate + 60 s, cut
     to what is left before the profile's hard stop less 25 s (SIGINT first, so pytest prints its
     summary and the benchmarks write their files, SIGKILL 20 s later; then 5 s for the summary).
     A part with under 20 s left is not started. The hard stop counts from the call's start;
  3. writes each part's results to OUT (default benchmarks/results/) as soon as the part ends:
     its log (written as it runs), its JUnit XML / benchmark JSON / Markdown table, and the call's
     summary JSON, rewritten after every part, so a call stopped from outside leaves what finished;
  4. prints one line per part (outcome, seconds against the estimate, and its headline: pytest's
     counts, or the benchmark's `summary:` line), and exits 1 if a part failed, overran or did not
     start (2: it could not start: no GPU, no wheels, a bad argument).
Files are named <part>_<date>_<device>_mcore-<version>.<ext>, the call's gpu_check_<profile>_....

torch.compile's first compiles count in the estimates. Inductor's and Triton's caches live on
disk in COMPILE_CACHE (default /tmp/gpu_check-compile-cache), shared by every part, and by both
profiles on one machine: a part reuses the kernels an earlier one compiled.

Environment: WHL (wheel folder, default .whl), OUT (results folder, default benchmarks/results;
both relative to the repository root), PYTHON (the parts' interpreter, default this one),
COMPILE_CACHE, SITE_ROOT (where the site-<version> folders go, default /tmp).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Part:
    """One step of a profile. kind "pytest": `args` are pytest node ids, the result is a JUnit
    XML; kind "script": `args` are a script and its arguments, "{result}" standing for the file
    it writes (ext: its extension). peers: the part also sees .whl/peers/ (Liger, verl)."""

    name: str
    shows: str
    estimate_s: int
    kind: str
    args: tuple[str, ...]
    ext: str = "xml"
    peers: bool = False

    @property
    def limit_s(self) -> int:
        return 2 * self.estimate_s + 60


@dataclass(frozen=True)
class Profile:
    name: str
    make: str
    mcore: str
    stop_s: int  # the hard stop: the call ends within it (see the docstring, step 2)
    setup_estimate_s: int
    parts: tuple[Part, ...]

    @property
    def estimate_s(self) -> int:
        return self.setup_estimate_s + sum(p.estimate_s for p in self.parts)


RL = "tests/gpu/test_rl_gpu.py"

# ESTIMATES, in seconds on one H200, are what each part took there on 2026-11-30 (torch 2.11+cu130,
# no Transformer Engine; benchmarks/results/gpu_check_2026-11-30_H200.md), rounded up to 5 s:
# setup 24 s (quick) and 16 s (more, on the same machine), demo_bf16 49, r3 40, bench 154,
# logprobs 85, resume 102, recipes 54, weight_sync 0 (`not run: no vllm`), demo_fp32_fp16 76. Two
# are still guesses: `kernels` was stopped at 64 s after 16 of its tests (57 s of them), and
# `r2_sft` has not run (R3's one step took 40 s; SFT alone is a shorter run). A part's time is
# mostly start-up: a pytest or pretrain_rl process imports torch and megatron-core, builds the model
# and compiles (Inductor's and Triton's caches on disk, shared by the parts, make later compiles
# cheaper).
#   weight_sync: the device machine has no vLLM wheel (too large to carry), so the part prints
#   `not run: no vllm` and exits 0 before importing torch. It also needs two GPUs (NCCL refuses the
#   trainer and the server's worker on one device). ON A MACHINE WITH vLLM AND 2 GPUs it measures,
#   guessed at ~6 min (~40 s a vLLM server start, 7 starts with the restarts, disk syncs writing
#   1-3.5 GiB): then it needs a profile of its own.
# The two profiles do not fit one 15-minute device session together (8 + 6 minutes and two machine
# starts): a session runs `quick` first, and `more` where time is left, cut with --stop (the parts
# are in order of importance, so the hard stop cuts the least important).
QUICK = Profile(
    name="quick", make="make gpu-check", mcore="0.19.2", stop_s=480, setup_estimate_s=25, parts=(
        Part("demo_bf16", "the demo config in bf16, short SFT + 3 RL steps: the loop runs on a GPU at all",
             50, "pytest", (f"{RL}::test_demo_short[bf16]",)),
        Part("r3", "router replay R3, one step", 40, "pytest", (f"{RL}::test_router_replay[r3]",)),
        Part("bench", "benchmarks/rl_step_gpu.py, qwen3-1.7b cut to 4 layers and qwen3-moe-30b-a3b to 2: phase "
             "times, train pass vs the plain megatron LM step (>= 0.85x), non-model share (<= 15%)",
             155, "script", ("benchmarks/rl_step_gpu.py", "--preset", "qwen3-1.7b", "--preset", "qwen3-moe-30b-a3b",
                             "--dense-layers", "4", "--moe-layers", "2", "--warmup", "1", "--repeats", "2",
                             "--json", "{result}"), ext="json"),
        Part("logprobs", "the log-prob kernel table at T=16k and 64k, H=4096, V=151,936: ours vs the straightforward "
             "path (and Liger, verl from .whl/peers/): time, peak beyond inputs, error vs float64 "
             "(<= 0.45 s, <= 1 GiB, <= 2e-5 at 64k)",
             85, "script", ("benchmarks/logprobs.py", "--device", "cuda", "--gpu-tokens", "16384", "65536",
                            "--out", "{result}"), ext="md", peers=True),
        Part("resume", "resume equals the uninterrupted run (3 runs: 3 steps; 2 steps, then resumed to 3)",
             100, "pytest", (f"{RL}::test_resume_continues_like_the_uninterrupted_run",)),
    ))
MORE = Profile(
    name="more", make="make gpu-check-more", mcore="0.16.1", stop_s=360, setup_estimate_s=20, parts=(
        Part("kernels", "the fused log-prob kernel (compiled and eager) against float64, the embedded engine on the "
             "GPU, the model against Hugging Face's and the converter (CP: skipped, it needs 2 GPUs and TE)",
             110, "pytest", ("tests/gpu/test_logprobs_gpu.py", "tests/gpu/test_embedded_engine_gpu.py",
                            "tests/gpu/test_model_gpu.py", "tests/gpu/test_context_parallel_loop.py")),
        Part("demo_fp32_fp16", "the demo in fp32 and in fp16 (dynamic loss scaling), on the older megatron-core",
             80, "pytest", (f"{RL}::test_demo_short[fp32]", f"{RL}::test_demo_short[fp16]")),
        Part("r2_sft", "router replay R2, one step; SFT alone", 50, "pytest",
             (f"{RL}::test_router_replay[r2]", f"{RL}::test_sft_only")),
        Part("recipes", "every loss recipe, one step each (14 runs in one process)",
             55, "pytest", (f"{RL}::test_every_recipe_one_step",)),
        Part("weight_sync", "benchmarks/weight_sync.py --device cuda: in-memory weight sync into vLLM over NCCL "
             "(rollout.weight_sync=memory with CUDA) vs disk reload and restart, qwen3-1.7b cut to 4 layers and "
             "qwen3-moe-30b-a3b to 2 (s per sync, peak extra trainer GPU memory; the server on a second GPU); "
             "`not run: no vllm` where vLLM is not installed (the device machine today)",
             5, "script", ("benchmarks/weight_sync.py", "--device", "cuda", "--out", "{result}"), ext="md"),
    ))
PROFILES = {p.name: p for p in (QUICK, MORE)}

RESERVE_S = 25  # kept before the hard stop: SIGINT's grace (KILL_AFTER_S) and the summary
KILL_AFTER_S = 20
MIN_START_S = 20
PYTEST_COUNTS = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b")


class StartError(Exception):
    """The check cannot start (exit 2)."""


# ------------------------------------------------------------------------------------ the plan


def command(part: Part, python: str, result: str) -> list[str]:
    if part.kind == "pytest":
        return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", "--junitxml", result,
                *part.args]
    return [python, *(a.replace("{result}", result) for a in part.args)]


def result_path(out: str, part: Part, tag: str, ext: str | None = None) -> str:
    return os.path.join(out, f"{part.name}_{tag}.{ext or part.ext}")


def select(profile: Profile, names: list[str] | None) -> list[Part]:
    """The profile's parts, or the named ones (in the profile's order)."""
    if not names:
        return list(profile.parts)
    known = [p.name for p in profile.parts]
    for n in names:
        if n not in known:
            raise StartError(f"--parts has '{n}'; profile {profile.name} has: {', '.join(known)}")
    return [p for p in profile.parts if p.name in names]


def _shown(path: str) -> str:
    """path relative to the repository root when it is inside it (the parts run from there)."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


def plan(profiles: list[Profile], whl: str, out: str, python: str) -> str:
    sites = os.environ.get("SITE_ROOT", "/tmp")
    lines = [("gpu_check --plan (nothing runs). Estimates are the times measured on one H200 on 2026-11-30, "
              "two of them guessed (ESTIMATES in tools/gpu_check.py says which).")]
    for prof in profiles:
        missing = "" if os.path.isdir(os.path.join(whl, f"mcore-{prof.mcore}")) else " (missing: make gpu-wheels)"
        folder = f"{_shown(whl)}/mcore-{prof.mcore}/"
        setup = (f"setup: checksums, install {folder} and {_shown(whl)}/common/ into {sites}/site-{prof.mcore}; "
                 "versions, GPU, disk")
        lines += ["", (f"{prof.name} ({prof.make}): megatron-core {prof.mcore} from {folder}{missing}; "
                       f"estimate {prof.estimate_s} s, hard stop {prof.stop_s} s"),
                  f"  {'est':>5} {'limit':>6}  part", f"  {prof.setup_estimate_s:>4}s {'':>6}  {setup}"]
        tag = f"<date>_<device>_mcore-{prof.mcore}"
        for p in prof.parts:
            lines.append(f"  {p.estimate_s:>4}s {p.limit_s:>5}s  {p.name}: {p.shows}")
            lines.append(f"  {'':>13}$ {shlex.join(command(p, python, result_path(_shown(out), p, tag)))}")
        lines.append(f"  {prof.estimate_s:>4}s in all (hard stop {prof.stop_s} s)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- running


def headline(tail) -> str:
    """A part's one-line result: its last `summary: ` line, else pytest's counts line."""
    lines = [line.strip() for line in tail]
    for line in reversed(lines):
        if line.startswith("summary: "):
            return line[len("summary: "):]
    for line in reversed(lines):
        if PYTEST_COUNTS.search(line):
            return line.strip("= ")
    return ""


class Stopped(Exception):
    """SIGTERM to the check itself."""


def _copy(stream, sinks, tail) -> None:
    for line in stream:
        tail.append(line.rstrip("\n"))
        for sink in sinks:
            sink.write(line)
            sink.flush()


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: list[str], log_path: str, limit: float, env: dict) -> dict:
    """Run cmd in its own process group, its output to stdout and appended to log_path, under a
    time limit: SIGINT at the limit (or when this process gets SIGINT / SIGTERM), SIGKILL
    KILL_AFTER_S later. {"rc", "seconds", "stopped": None | "time limit" | "interrupted", "tail"}."""
    start = time.monotonic()
    tail: collections.deque = collections.deque(maxlen=300)
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        reader = threading.Thread(target=_copy, args=(proc.stdout, (sys.stdout, log), tail), daemon=True)
        reader.start()
        stopped = None
        try:
            proc.wait(timeout=max(limit, 0.1))
        except (subprocess.TimeoutExpired, KeyboardInterrupt, Stopped) as e:
            stopped = "time limit" if isinstance(e, subprocess.TimeoutExpired) else "interrupted"
            _signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        finally:
            _signal_group(proc, signal.SIGKILL)  # what the part left behind (compile workers, runs)
        reader.join(timeout=10)
    return {"rc": proc.returncode, "seconds": time.monotonic() - start, "stopped": stopped, "tail": list(tail)}


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({shlex.join(cmd)}: {e})"


def _commit() -> str:
    """The checkout's commit, or "unknown" (a copy of the working tree without .git)."""
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def wheels(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).glob("*.whl"))


def install(python: str, files: list[str], site: str, log) -> str:
    """pip install the wheel files into site (kept when it holds the same wheels); what happened."""
    key = hashlib.sha256()
    for f in files:
        key.update(Path(f).name.encode())
        key.update(hashlib.sha256(Path(f).read_bytes()).digest())
    stamp = os.path.join(site, f".gpu_check-{key.hexdigest()[:16]}")
    if os.path.exists(stamp):
        return f"{site} is installed from the same wheels; kept"
    shutil.rmtree(site, ignore_errors=True)
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", site, *files], capture_output=True, text=True, timeout=600, check=False)
    log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install into {site} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    Path(stamp).touch()
    return f"installed {len(files)} wheels into {site}"


ENV_CHECK = """
import platform, sys, torch, megatron.core, transformers
if not torch.cuda.is_available():  # else every GPU test would skip and the part would "pass"
    sys.exit(f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)")
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "absent"
from megatron_rl.platform import capabilities, needed_workarounds
print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
      f"megatron-core {megatron.core.__version__}  transformers {transformers.__version__}  triton {tv}")
print(f"capabilities: {capabilities().describe()}; workarounds needed: {[w.number for w in needed_workarounds()]}")
"""


class Check:
    """One call: a profile's parts under one megatron-core, results to OUT."""

    def __init__(self, profile: Profile, parts: list[Part], version: str, stop_s: int, part_limit: int | None,
                 whl: str, out: str, python: str):
        self.profile, self.parts, self.version, self.stop_s = profile, parts, version, stop_s
        self.part_limit, self.whl, self.out, self.python = part_limit, whl, out, python
        self.estimate_s = profile.setup_estimate_s + sum(p.estimate_s for p in parts)
        self.cache = os.environ.get("COMPILE_CACHE", "/tmp/gpu_check-compile-cache")
        self.site_root = os.environ.get("SITE_ROOT", "/tmp")
        self.start = time.monotonic()
        self.rows: list[dict] = []
        self.commit = _commit()

    def left(self) -> float:
        return self.stop_s - (time.monotonic() - self.start)

    def say(self, text: str, log) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    def environment(self, site: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}  # a GPU run compiles
        env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([site, str(ROOT)]))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(self.cache, "inductor"))
        env.setdefault("TRITON_CACHE_DIR", os.path.join(self.cache, "triton"))
        return env

    def write_summary(self, path: str, tag: str) -> None:
        with open(path, "w") as f:
            json.dump({"profile": self.profile.name, "megatron_core": self.version, "tag": tag,
                       "commit": self.commit,
                       "hard_stop_s": self.stop_s, "estimate_s": self.estimate_s,
                       "elapsed_s": round(time.monotonic() - self.start, 1), "parts": self.rows}, f, indent=1)

    def main(self) -> int:
        os.makedirs(self.out, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        gpu = _sh(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).splitlines()
        device = re.sub(r"[^A-Za-z0-9.]+", "-", gpu[0] if gpu else "unknown").strip("-")
        tag = f"{stamp}_{device}_mcore-{self.version}"
        summary = os.path.join(self.out, f"gpu_check_{self.profile.name}_{tag}.json")
        with open(os.path.join(self.out, f"gpu_check_{self.profile.name}_{tag}.log"), "a") as log:
            self.say(f"=== gpu_check {self.profile.name}: megatron-core {self.version}, parts "
                     f"{' '.join(p.name for p in self.parts)}; hard stop {self.stop_s} s; results in {self.out}", log)
            site = os.path.join(self.site_root, f"site-{self.version}")
            t0, versions = time.monotonic(), ""
            try:
                mcore = wheels(os.path.join(self.whl, f"mcore-{self.version}"))
                self.say(install(self.python, mcore + wheels(os.path.join(self.whl, "common")), site, log), log)
                env = self.environment(site)
                check = subprocess.run([self.python, "-"], input=ENV_CHECK, cwd=ROOT, env=env, capture_output=True,
                                       text=True, timeout=300, check=False)
                versions = check.stdout.strip().splitlines()[0] if check.stdout.strip() else ""
                self.say(f"commit {self.commit}\n{(check.stdout + check.stderr).strip()}", log)
                self.say(_sh(["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader"]),
                         log)
                df = _sh(["df", "-h", os.environ.get("TMPDIR", "/tmp"), self.out, str(ROOT)]).splitlines()
                self.say("\n".join(dict.fromkeys(df)), log)   # room for the runs and the results
                if check.returncode != 0:
                    raise RuntimeError(f"the environment check failed (exit {check.returncode})")
                outcome = "passed"
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                self.say(f"gpu_check: {e}", log)
                outcome = "FAILED"
            except (KeyboardInterrupt, Stopped):
                outcome = "interrupted"
            self.rows.append({"part": "setup", "outcome": outcome, "seconds": round(time.monotonic() - t0, 1),
                              "estimate_s": self.profile.setup_estimate_s, "headline": versions, "files": [log.name]})
            self.write_summary(summary, tag)
            if outcome == "passed":
                try:
                    self.run_parts(env, tag, summary, log)
                except (KeyboardInterrupt, Stopped):   # between two parts
                    self.say("gpu_check: interrupted; the parts after it are not started", log)
            why = "interrupted" if outcome == "passed" else f"setup {outcome}"
            for part in self.parts[len(self.rows) - 1:]:   # after a failed setup or an interrupt
                self.rows.append({"part": part.name, "outcome": f"not started ({why})", "seconds": 0.0,
                                  "estimate_s": part.estimate_s, "headline": "", "files": []})
            self.say("", log)
            for r in self.rows:
                self.say(f"{r['part']:<15} {r['outcome']:<34} {r['seconds']:>6.0f} s (est. {r['estimate_s']:>3} s)  "
                         f"{r['headline']}", log)
            elapsed = time.monotonic() - self.start
            failed = [r["part"] for r in self.rows if r["outcome"] != "passed"]
            self.say(f"gpu_check {self.profile.name}: {'FAILED: ' + ', '.join(failed) if failed else 'all passed'}"
                     f" ({elapsed:.0f} s of the {self.stop_s} s stop, estimate {self.estimate_s} s; "
                     f"results in {self.out}: *_{tag}.*)", log)
        self.write_summary(summary, tag)
        return 1 if failed else 0

    def run_parts(self, env: dict, tag: str, summary: str, log) -> None:
        peers_site = os.path.join(self.site_root, "site-peers")
        for part in self.parts:
            row = {"part": part.name, "outcome": "interrupted", "estimate_s": part.estimate_s, "seconds": 0.0,
                   "headline": "", "files": []}
            self.rows.append(row)
            if self.left() - RESERVE_S < MIN_START_S:
                left = max(self.left() - RESERVE_S, 0)
                row["outcome"] = f"not started ({left:.0f} s left)"
                self.say(f"--- {part.name}: not started: {left:.0f} s left before the {self.stop_s} s stop "
                         f"(less its {RESERVE_S} s reserve)", log)
                self.write_summary(summary, tag)
                continue
            part_env, part_log = env, result_path(self.out, part, tag, "log")
            if part.peers:
                peers = wheels(os.path.join(self.whl, "peers"))
                try:
                    self.say(install(self.python, peers, peers_site, log) if peers else "no peer wheels", log)
                    part_env = {**env, "PYTHONPATH": os.pathsep.join([peers_site, env["PYTHONPATH"]])}
                except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                    self.say(f"gpu_check: the peer wheels did not install, the table goes on without them: {e}", log)
            limit = min(part.limit_s, self.left() - RESERVE_S, self.part_limit or part.limit_s)
            result = result_path(self.out, part, tag)
            cmd = command(part, self.python, result)
            self.say(f"--- {part.name} (estimate {part.estimate_s} s, limit {limit:.0f} s): {shlex.join(cmd)}", log)
            r = run(cmd, part_log, limit, part_env)
            row.update(seconds=round(r["seconds"], 1), headline=headline(r["tail"]), rc=r["rc"],
                       files=[f for f in (part_log, result) if os.path.exists(f)])
            row["outcome"] = ("stopped at its time limit" if r["stopped"] == "time limit"
                              else "interrupted" if r["stopped"] else "passed" if r["rc"] == 0
                              else f"FAILED (exit {r['rc']})")
            self.say(f"--- {part.name}: {row['outcome']} after {r['seconds']:.0f} s", log)
            self.write_summary(summary, tag)
            if r["stopped"] == "interrupted":
                self.say("gpu_check: interrupted; the parts after it are not started", log)
                return


def _stop(signum, frame):
    raise Stopped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", nargs="?", choices=sorted(PROFILES), help="what to run (see --plan)")
    ap.add_argument("--plan", action="store_true", help="print the profiles' parts, commands and estimates; run nothing")
    ap.add_argument("--parts", default=None, help="comma-separated part names of the profile (default: all)")
    ap.add_argument("--mcore", default=None, help="megatron-core version from WHL/mcore-<version>/ (default: the "
                                                  "profile's)")
    ap.add_argument("--stop", type=int, default=None, help="hard stop in seconds (default: the profile's)")
    ap.add_argument("--part-limit", type=int, default=None, help="cap every part's time limit (seconds)")
    args = ap.parse_args(argv)
    # relative to the repository root, wherever this is started from
    whl = os.path.join(ROOT, os.environ.get("WHL", ".whl"))
    out = os.path.join(ROOT, os.environ.get("OUT", "benchmarks/results"))
    python = os.environ.get("PYTHON", sys.executable)
    if args.plan:
        print(plan([PROFILES[args.profile]] if args.profile else list(PROFILES.values()), whl, out, python))
        return 0
    try:
        if args.profile is None:
            raise StartError(f"name a profile ({', '.join(PROFILES)}) or --plan")
        profile = PROFILES[args.profile]
        parts = select(profile, args.parts.split(",") if args.parts else None)
        version = args.mcore or profile.mcore
        if not os.path.isdir(os.path.join(whl, f"mcore-{version}")):
            there = sorted(p.name for p in Path(whl).glob("mcore-*")) if os.path.isdir(whl) else []
            raise StartError(f"no {whl}/mcore-{version}/ (there: {', '.join(there) or 'none'}); run 'make gpu-wheels' "
                             "on a machine with a package index and copy .whl/ over")
        if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                                                check=False).returncode != 0:
            raise StartError("no NVIDIA GPU here (nvidia-smi -L failed); run this on the GPU machine (or --plan)")
        sums = os.path.join(whl, "SHA256SUMS")
        if os.path.exists(sums) and subprocess.run(["sha256sum", "--quiet", "-c", "--ignore-missing", "SHA256SUMS"],
                                                   cwd=whl, check=False).returncode != 0:
            raise StartError(f"{sums} does not match the wheels; download them again")
    except StartError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    # a part must be able to take the SIGINT that ends it at its limit (pytest then prints its
    # summary) even when this process started with SIGINT ignored (nohup, a background job of a
    # script): exec keeps an ignored signal ignored in the child but resets a handled one
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return Check(profile, parts, version, args.stop or profile.stop_s, args.part_limit, whl, out, python).main()


if __name__ == "__main__":
    sys.exit(main())
