"""Each platform workaround is still needed (its probe fails without it) and sufficient (passes with
all), wherever its condition holds: a no-CUDA workaround is probed on CPU machines only, a no-TE
one wherever Transformer Engine is absent, GPU included.

When a megatron-core upgrade fixes the patched line, the "needed" case fails here: delete the
workaround. Each case runs in a fresh interpreter because the patches are process-wide; the
interpreter sees this machine as it is (its CUDA devices included).
"""
import os
import subprocess
import sys

import pytest

from megatron_rl.platform import capabilities, workarounds

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ALL = {w.number: w for w in workarounds()}
NUMBERS = sorted(ALL)
# the error each probe raises without its workaround (a substring of the exception text)
EXPECTED = {
    1: "CUDA", 2: "CUDA", 3: "te_general_gemm", 5: "CUDA", 6: "Stream", 7: "sequence parallel",
    8: "all_to_all_single", 9: "CUDA", 10: "CUDA", 11: "Wrapped parameters", 13: "AssertionError", 14: "leaf Variable",
    15: "must be cuda device",
}


def _probe(number: int, without: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.unit.platform.probes", str(number)] + (["--without"] if without else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


def _skip_unless_needed_here(number: int) -> None:
    w, caps = ALL[number], capabilities()
    if not w.needed_when.holds(caps):
        pytest.skip(f"workaround #{number} ({w.name}) is for processes with {w.needed_when.description}; "
                    f"this one has {caps.describe()}")


def test_every_workaround_has_a_probe():
    assert sorted(EXPECTED) == NUMBERS


@pytest.mark.parametrize("number", NUMBERS)
def test_still_needed(number):
    _skip_unless_needed_here(number)
    w = ALL[number]
    if w.defect_present is not None and not w.defect_present():
        pytest.skip(f"the installed megatron-core fixed the defect of workaround #{number} ({w.name}); "
                    "delete the workaround once the oldest supported megatron-core has the fix")
    run = _probe(number, without=True)
    assert run.returncode == 3, f"probe {number} passed without its workaround: upstream fixed it?\n{run.stdout}"
    assert EXPECTED[number] in run.stdout, run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("number", NUMBERS)
def test_sufficient(number):
    _skip_unless_needed_here(number)
    run = _probe(number, without=False)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
