"""Each platform workaround is still needed (its probe fails without it) and sufficient (passes with
all), wherever its condition holds: a no-CUDA workaround is probed on CPU machines only, a no-TE
one wherever Transformer Engine is absent, GPU included.

Per megatron-core release: a workaround whose defect a later release fixed names that release
(`fixed_in`); on it and later ones its probe must pass *without* the workaround
(`test_fixed_upstream`), on older ones it must still fail. Each CI lane runs its own release
(0.16.1 and 0.19.2), so together they say which workarounds each release needs. When an upgrade
fixes a line whose workaround has no `fixed_in`, the "needed" case fails here: record the release
in `fixed_in`, and delete the workaround once the oldest supported release has the fix. Each "needed"
case runs in a process of its own because the patches are process-wide: a child forked, before any
patch, from one interpreter that has imported what the probes use (`probes without`); the
"sufficient" cases then run in that interpreter itself, every workaround applied only after the
forks, each probe in turn. The interpreters
see this machine as it is (its CUDA devices included).
"""
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.platform import capabilities, megatron_core_version, workarounds
from tests.distributed.probes import ALL_MARKER

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# every probe calls a private megatron-core name this project patches: each lane checks its own release
pytestmark = pytest.mark.mcore_api
ALL = {w.number: w for w in workarounds()}
NUMBERS = sorted(ALL)
FIXED_UPSTREAM = sorted(n for n, w in ALL.items() if w.fixed_in is not None)
# the error each probe raises without its workaround (a substring of the exception text)
EXPECTED = {
    1: "CUDA", 2: "CUDA", 3: "te_general_gemm", 5: "CUDA", 6: "Stream", 7: "sequence parallel",
    8: ("all_to_all_single", "alltoall_base"), 9: "CUDA", 10: "CUDA", 11: "Wrapped parameters", 13: "AssertionError", 14: "leaf Variable",
    15: "must be cuda device", 16: "k_channels",
    17: ("isinstance() arg 2", "Unsupported linear_q_down_proj"),  # megatron-core 0.16; 0.17 on
}
# 8: torch 2.13 refuses the numpy split sizes in all_to_all_single, torch 2.11 (the GPU machine's) one call
# deeper, in ProcessGroup.alltoall_base
# The probes that fail inside torch's CUDA calls. A CPU build of torch refuses them itself ("Torch not compiled
# with CUDA enabled", "torch.cuda.Stream requires CUDA support"); a CUDA build on a machine without a GPU (lane 2:
# PyPI has no CPU build of torch for Python 3.12) gets as far as the driver: "Found no NVIDIA driver on your
# system", "CUDA driver version is insufficient for CUDA runtime version" (the Stream of #6), or, in a child
# forked after megatron-core's import tried CUDA's initialisation (probes.py), "Cannot re-initialize CUDA".
TORCH_CUDA_CALLS = (1, 2, 5, 6, 9, 10)
CUDA_BUILD_WITHOUT_DEVICE = torch.version.cuda is not None and not torch.cuda.is_available()
DRIVER_ERRORS = ("NVIDIA driver", "CUDA driver", "CUDA-capable device", "Cannot re-initialize CUDA in forked subprocess")


def _expected(number: int) -> tuple[str, ...]:
    if CUDA_BUILD_WITHOUT_DEVICE and number in TORCH_CUDA_CALLS:
        return DRIVER_ERRORS
    expected = EXPECTED[number]
    return expected if isinstance(expected, tuple) else (expected,)


def _probe(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.distributed.probes", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def probed() -> tuple[subprocess.CompletedProcess, str, str]:
    """One fresh process for both halves: every probe whose condition holds here, each without its own
    workaround in a forked child (forked before any patch), then every probe with every workaround
    applied, in the parent: (the run, the children's output, the patched probes' output)."""
    caps = capabilities()
    run = _probe("without", *(str(n) for n in NUMBERS if ALL[n].needed_when.holds(caps)), "all", *map(str, NUMBERS))
    lines = run.stdout.splitlines()
    assert ALL_MARKER in lines, "the forked probes did not finish\n" + run.stdout[-3000:] + run.stderr[-3000:]
    cut = lines.index(ALL_MARKER)
    return run, "\n".join(lines[:cut]), "\n".join(lines[cut + 1:])


@pytest.fixture(scope="module")
def with_all(probed) -> dict[int, str]:
    """Every probe with every workaround applied: probe number -> its output."""
    out: dict[int, str] = {}
    number = None
    for line in probed[2].splitlines():
        if line.startswith("PROBE "):
            number = int(line.split()[1])
            out[number] = ""
        if number is not None:
            out[number] += line + "\n"
    return out


@pytest.fixture(scope="module")
def without(probed) -> tuple[dict[int, tuple[int, str]], str]:
    """Every probe whose condition holds here, each without its own workaround in a forked child:
    (probe number -> (exit code, output), the shared stderr)."""
    run, forks, _ = probed
    out: dict[int, tuple[int, str]] = {}
    number, lines = None, []
    for line in forks.splitlines():
        if line.startswith("FORK "):
            number, lines = int(line.split()[1]), []
        elif line.startswith(f"EXIT {number} "):
            out[number] = (int(line.split()[2]), "\n".join(lines))
        else:
            lines.append(line)
    return out, run.stderr


def _skip_unless_condition_holds(number: int) -> None:
    w, caps = ALL[number], capabilities()
    if not w.needed_when.holds(caps):
        pytest.skip(f"workaround #{number} ({w.name}) is for processes with {w.needed_when.description}; "
                    f"this one has {caps.describe()}")


def _skip_if_fixed_here(number: int) -> None:
    w = ALL[number]
    if not w.has_defect():
        pytest.skip(f"megatron-core {megatron_core_version()} has the fix of workaround #{number} ({w.name}): "
                    f"fixed in {w.fixed_in}, so it is not applied (test_fixed_upstream[{number}] proves it)")


def test_every_workaround_has_a_probe():
    assert sorted(EXPECTED) == NUMBERS


@pytest.mark.parametrize("number", NUMBERS)
def test_still_needed(number, without):
    _skip_unless_condition_holds(number)
    _skip_if_fixed_here(number)
    runs, stderr = without
    assert number in runs, f"probe {number} did not run\n{stderr[-3000:]}"
    code, stdout = runs[number]
    assert code == 3, (f"probe {number} passed without its workaround on megatron-core "
                       f"{megatron_core_version()}: upstream fixed it? (set fixed_in)\n{stdout}")
    assert any(text in stdout for text in _expected(number)), stdout + stderr[-3000:]


@pytest.mark.parametrize("number", NUMBERS)
def test_sufficient(number, with_all):
    _skip_unless_condition_holds(number)
    _skip_if_fixed_here(number)
    assert with_all.get(number, "").startswith(f"PROBE {number} OK"), with_all.get(number, "probe did not run")


@pytest.mark.parametrize("number", FIXED_UPSTREAM)
def test_fixed_upstream(number, without):
    """From the release named in `fixed_in` on, the probe passes without the workaround."""
    _skip_unless_condition_holds(number)
    w = ALL[number]
    if w.has_defect():
        pytest.skip(f"megatron-core {megatron_core_version()} predates {w.fixed_in}, the release that fixed "
                    f"workaround #{number} ({w.name}): test_still_needed[{number}] covers it")
    runs, stderr = without
    assert number in runs, f"probe {number} did not run\n{stderr[-3000:]}"
    code, stdout = runs[number]
    assert code == 0, (f"workaround #{number} ({w.name}) is marked fixed in megatron-core {w.fixed_in}, "
                       f"but its probe fails without it on {megatron_core_version()}:\n" + stdout + stderr[-3000:])
