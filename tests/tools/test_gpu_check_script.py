"""tools/gpu_check.py without a GPU. Its profiles (data, read here as the script reads them): the quick
one's estimate stays under 8 minutes and the other's under 6, each within its hard stop, and every
test of tests/gpu is in exactly one profile. `--plan` prints every part with its estimate and
command; bad arguments stop it at start-up naming the fix. And its control flow on a stand-in
machine (nvidia-smi and Python replaced): a part over its time limit gets SIGINT (so pytest prints
its summary), the next parts and the summary still run, each part's results are on disk, the hard
stop leaves out what would not fit, and an install is kept for the next call."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.gpu.runs import ROOT
from tools import gpu_check
from tools.gpu_check import MORE, PROFILES, QUICK, RESERVE_S

SCRIPT = ROOT / "tools" / "gpu_check.py"


def test_the_quick_profile_fits_8_minutes_and_the_other_6():
    """Budgets within one 10-minute device command, the first compiles and the wheel install included;
    quick fits a 15-minute device session with its machine start."""
    assert QUICK.estimate_s <= 8 * 60 and QUICK.stop_s <= 8 * 60
    assert MORE.estimate_s <= 6 * 60 and MORE.stop_s <= 6 * 60
    for prof in PROFILES.values():   # at the estimate, the hard stop cuts nothing
        assert prof.estimate_s + RESERVE_S <= prof.stop_s, prof.name
        assert all(p.estimate_s > 0 for p in prof.parts) and prof.setup_estimate_s > 0
    # most important first: the loop on a GPU at all, on the newest megatron-core
    assert QUICK.mcore == "0.19.2" and MORE.mcore == "0.16.1"
    assert [p.name for p in QUICK.parts] == ["demo_bf16", "r3", "bench", "logprobs", "resume"]


def _collected() -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    ids = [line for line in proc.stdout.splitlines() if line.startswith("tests/gpu/")]
    assert len(ids) > 20, proc.stdout[-2000:] + proc.stderr[-2000:]
    return ids


def _picks(selection: str, node: str) -> bool:
    return node == selection or node.startswith((selection + "::", selection + "["))


def test_every_gpu_test_is_in_exactly_one_profile():
    """A test added to tests/gpu must go into a profile's part, or the GPU check never runs it."""
    selections = {(prof.name, part.name): part.args for prof in PROFILES.values() for part in prof.parts
                  if part.kind == "pytest"}
    ids = _collected()
    for node in ids:
        owners = [owner for owner, sel in selections.items() if any(_picks(s, node) for s in sel)]
        assert len(owners) == 1, (node, owners)
    for owner, sel in selections.items():   # and no selection that matches nothing (a renamed test)
        for s in sel:
            assert any(_picks(s, node) for node in ids), (owner, s)


def test_plan_prints_every_part_with_its_estimate_and_command(capsys, monkeypatch):
    monkeypatch.setenv("OUT", "/out")
    assert gpu_check.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "measured on one H200" in out and "guessed" in out
    assert "quick (make gpu-check): megatron-core 0.19.2 from .whl/mcore-0.19.2/" in out
    assert f"estimate {QUICK.estimate_s} s, hard stop 480 s" in out and f"estimate {MORE.estimate_s} s, hard stop 360 s" in out
    for prof in PROFILES.values():
        for p in prof.parts:
            assert f"{p.estimate_s:>4}s {p.limit_s:>5}s  {p.name}: " in out, p.name
            assert f"/out/{p.name}_<date>_<device>_mcore-{prof.mcore}.{p.ext}" in out, p.name
    assert "--dense-layers 4 --moe-layers 2" in out and "--gpu-tokens 16384 65536" in out
    assert "'tests/gpu/test_rl_gpu.py::test_demo_short[bf16]'" in out
    assert "benchmarks/weight_sync.py --device cuda --out " in out   # no vLLM there: `not run: no vllm`
    assert gpu_check.main(["--plan", "more"]) == 0
    assert "quick" not in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="with vLLM the part measures for minutes")
def test_the_weight_sync_part_passes_in_seconds_without_vllm(tmp_path):
    """The device machine has no vLLM: the part says so, writes it as its result and passes."""
    part = next(p for p in MORE.parts if p.name == "weight_sync")
    result = tmp_path / "weight_sync.md"
    r = gpu_check.run(gpu_check.command(part, sys.executable, str(result)), str(tmp_path / "weight_sync.log"),
                      part.limit_s, dict(os.environ))
    assert r["rc"] == 0 and r["seconds"] < part.estimate_s, r
    assert gpu_check.headline(r["tail"]).startswith("not run: no vllm (")
    assert "not run: no vllm (" in result.read_text()


@pytest.fixture
def whl(tmp_path):
    """A wheel folder laid out as `make gpu-wheels` leaves it (empty files: nothing installs them)."""
    for sub in ("mcore-0.16.1", "mcore-0.19.2", "common", "peers"):
        (tmp_path / sub).mkdir()
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["quick", "--parts", "demo_bf16,bench2"], "--parts has 'bench2'; profile quick has: demo_bf16, r3, bench"),
    (["quick", "--mcore", "0.18.0"], "no {whl}/mcore-0.18.0/ (there: mcore-0.16.1, mcore-0.19.2); run 'make gpu-wheels'"),
    ([], "name a profile (quick, more) or --plan"),
])
def test_bad_arguments_stop_at_start_up(whl, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("WHL", str(whl))
    assert gpu_check.main(argv) == 2
    assert message.format(whl=whl) in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine would run the check for real")
def test_without_a_gpu_the_check_refuses_to_run(whl, monkeypatch, capsys):
    monkeypatch.setenv("WHL", str(whl))
    assert gpu_check.main(["more"]) == 2
    assert "no NVIDIA GPU here" in capsys.readouterr().err


FAKE_PYTHON = r"""#!/usr/bin/env bash
# a stand-in for python3: pip installs create the target, the environment check passes, pytest
# sleeps for the demo (until stopped; it says so on SIGINT, as pytest prints its summary), the
# benchmarks print a summary line, and every part says what it was given
echo "env: TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE-unset} INDUCTOR=${TORCHINDUCTOR_CACHE_DIR} PYTHONPATH=${PYTHONPATH}" >&2
case "$1 $2" in
    "-m pip") shift; while [ "$1" != "--target" ]; do shift; done; mkdir -p "$2"; echo "pip install $2" >> "$FAKE_LOG" ;;
    "- ") cat > /dev/null; echo "python 3.12 (stand-in)" ;;
    "-m pytest")
        if [[ "$*" == *test_demo_short* ]]; then
            # the trap first, so a SIGINT that comes before the sleep starts still gets the summary
            trap 'kill $pid 2>/dev/null; echo "1 failed, 3 passed in 2.01s (interrupted)"; exit 2' INT
            sleep 30 &   # in the background (bash starts it with SIGINT ignored): the trap ends it
            pid=$!
            wait $pid
        fi
        echo "4 passed in 0.01s" ;;
    *) echo "ran: $*"; echo "summary: stand-in $1" ;;
esac
"""


def _fake_machine(tmp_path):
    """PATH with an nvidia-smi stand-in, a Python stand-in, a wheel folder; the sites, the compile
    cache and the results in tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/usr/bin/env bash\ncase "$*" in -L) echo "GPU 0: Stand-in H100" ;; *memory*) echo "Stand-in H100, 81559 MiB, 0 MiB" ;;'
                   ' *) echo "Stand-in H100" ;; esac\n')
    python = bin_dir / "python-stand-in"
    python.write_text(FAKE_PYTHON)
    for f in (smi, python):
        f.chmod(0o755)
    whl = tmp_path / "whl"
    for sub, wheel in (("mcore-0.19.2", "megatron_core-x.whl"), ("common", "psutil-x.whl"), ("peers", "liger-x.whl")):
        (whl / sub).mkdir(parents=True)
        (whl / sub / wheel).write_text(sub)
    env = {k: v for k, v in os.environ.items() if k not in ("COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(python), FAKE_LOG=str(tmp_path / "pip.log"),
               WHL=str(whl), OUT=str(tmp_path / "out"), SITE_ROOT=str(tmp_path / "sites"),
               COMPILE_CACHE=str(tmp_path / "cache"), TORCHDYNAMO_DISABLE="1")
    return env


def _check(env, *args, sigint_ignored: bool = False):
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120,
                          check=False, preexec_fn=ignore)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine would run the check for real")
def test_a_part_over_its_time_limit_is_interrupted_and_the_check_goes_on(tmp_path):
    env = _fake_machine(tmp_path)
    out_dir = tmp_path / "out"
    start = time.monotonic()
    # started with SIGINT ignored (as a background job of a script is): the part still gets it
    rc, out = _check(env, "quick", "--parts", "demo_bf16,r3,bench,logprobs", "--part-limit", "2", sigint_ignored=True)
    assert time.monotonic() - start < 25, out   # not the stand-in's 30 s: stopped at 2 s
    assert rc == 1, out
    assert "1 failed, 3 passed in 2.01s (interrupted)" in out   # SIGINT: pytest's summary is printed
    assert "--- demo_bf16: stopped at its time limit after 2 s" in out
    assert "--- r3: passed" in out and "ran: benchmarks/rl_step_gpu.py" in out and "--- logprobs: passed" in out
    # the parts compile (no TORCHDYNAMO_DISABLE) into the shared cache; the table sees the peers
    assert "TORCHDYNAMO_DISABLE=unset" in out and f"INDUCTOR={tmp_path}/cache/inductor" in out
    assert f"PYTHONPATH={tmp_path}/sites/site-peers:{tmp_path}/sites/site-0.19.2:{ROOT}" in out
    # one line per part at the end, with its headline
    lines = out.splitlines()
    end = lines[lines.index("") + 1:] if "" in lines else lines
    summary = [line for line in end if line.split(" ")[0] in ("setup", "demo_bf16", "r3", "bench", "logprobs")]
    assert [line.split()[0] for line in summary] == ["setup", "demo_bf16", "r3", "bench", "logprobs"], out
    assert "stopped at its time limit" in summary[1] and "1 failed, 3 passed in 2.01s (interrupted)" in summary[1]
    assert summary[2].endswith("4 passed in 0.01s") and summary[3].endswith("stand-in benchmarks/rl_step_gpu.py")
    assert "gpu_check quick: FAILED: demo_bf16" in out
    # on disk: a log per part, its result, and the call's summary
    for name in ("demo_bf16", "r3", "bench", "logprobs"):
        log = next(out_dir.glob(f"{name}_*_Stand-in-H100_mcore-0.19.2.log")).read_text()
        assert log.startswith("$ ") and "env: " in log, name
    assert "1 failed, 3 passed" in next(out_dir.glob("demo_bf16_*.log")).read_text()
    record = json.loads(next(out_dir.glob("gpu_check_quick_*_Stand-in-H100_mcore-0.19.2.json")).read_text())
    assert [(r["part"], r["outcome"]) for r in record["parts"]] == [
        ("setup", "passed"), ("demo_bf16", "stopped at its time limit"), ("r3", "passed"), ("bench", "passed"),
        ("logprobs", "passed")]
    assert record["parts"][0]["headline"] == "python 3.12 (stand-in)" and record["estimate_s"] == QUICK.setup_estimate_s + sum(
        p.estimate_s for p in QUICK.parts if p.name in ("demo_bf16", "r3", "bench", "logprobs"))
    assert (tmp_path / "pip.log").read_text().count("pip install") == 2   # megatron-core + common, the peers

    # the next call: the same wheels, so the installs are kept; the hard stop leaves no room for a part
    rc, out = _check(env, "quick", "--parts", "r3,bench", "--stop", "40")
    assert rc == 1, out
    assert "site-0.19.2 is installed from the same wheels; kept" in out
    assert (tmp_path / "pip.log").read_text().count("pip install") == 2
    assert "--- r3: not started" in out and "before the 40 s stop (less its 25 s reserve)" in out
    assert "gpu_check quick: FAILED: r3, bench" in out
