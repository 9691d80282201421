"""The GPU check imports nothing its machine lacks.

The GPU machine has torch, triton, transformers and pytest (and what they require); everything
else comes from the wheels `make gpu-wheels` carries (tools/gpu_wheels.sh: megatron-core and the
COMMON list). A module-level import of anything beyond that (TensorBoard, vLLM, TE, a new
dependency) would stop tools/gpu_check.py on its first GPU minute. So a fresh process blocks
every installed top-level module outside that set and imports every module the check runs:
the package, tests/gpu and the GPU benchmarks.

(A rehearsal of the whole lane in such an environment, Python 3.12 with transformers 5.17 and
the carried wheels installed as gpu_check.sh did, passed tests/e2e/test_gpu_lane_on_cpu.py on
both megatron-core versions on 2026-11-24; this test keeps the import half of it in CI.)
"""
import re
import subprocess
import sys
from importlib.metadata import distributions, packages_distributions

import pytest
from packaging.requirements import Requirement

from tests.gpu.runs import ROOT

DEVICE_HAS = ("torch", "triton", "transformers", "pytest")
OURS = {"megatron_rl", "tests", "benchmarks", "tools"}
CHECKED = ("megatron_rl", "tests.gpu", "tests.golden", "tests.spawn", "tools.gpu_check",
           "benchmarks.rl_step_gpu", "benchmarks.logprobs", "benchmarks.logprobs_cuda", "benchmarks.weight_sync",
           "benchmarks.weight_sync_runs")


def carried() -> list[str]:
    """Distribution names tools/gpu_wheels.sh downloads for the trainer (not the peers)."""
    script = (ROOT / "tools" / "gpu_wheels.sh").read_text()
    common = re.search(r"^COMMON=\((.*?)\)", script, re.DOTALL | re.MULTILINE)
    assert common, "tools/gpu_wheels.sh has no COMMON=(...) list"
    return ["megatron-core", *common.group(1).split()]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names) -> set[str]:
    """The installed distributions `names` need, transitively (markers evaluated here, no extras)."""
    installed = {_norm(d.metadata["Name"]): d for d in distributions()}
    seen, todo = set(), [_norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name not in installed:
            continue
        seen.add(name)
        for line in installed[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen


def blocked_modules() -> set[str]:
    """Installed top-level modules that the GPU machine would not have."""
    allowed = closure(DEVICE_HAS) | {_norm(n) for n in carried()}
    return {module for module, dists in packages_distributions().items()
            if module not in OURS and not module.startswith("_") and not {_norm(d) for d in dists} & allowed}


CHILD = r"""
import importlib, importlib.abc, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))
# modules that run inside the vLLM server's interpreter (its own environment, loaded there under
# their own top-level names), never in the trainer's: the GPU check's trainer does not import them
SERVER_SIDE = "megatron_rl.rollout.vllm.server_plugin."

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)

sys.meta_path.insert(0, Block())
failed = []

def load(name):
    try:
        return importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")

for top in sys.argv[2:]:
    mod = load(top)
    for m in pkgutil.walk_packages(getattr(mod, "__path__", []), top + "."):
        if not m.name.startswith(SERVER_SIDE):
            load(m.name)
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_the_carried_wheels_cover_what_the_gpu_check_imports():
    blocked = blocked_modules()
    # what the machine is known to lack is blocked where it is installed (lane 1 has TensorBoard)
    assert {"tensorboard"} & set(packages_distributions()) <= blocked, sorted(blocked)
    proc = subprocess.run([sys.executable, "-c", CHILD, ",".join(sorted(blocked)), *CHECKED], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (f"imports that need a package the GPU machine lacks (add its wheel to "
                                  f"tools/gpu_wheels.sh or import it where it is used):\n{proc.stdout}{proc.stderr[-3000:]}")


def test_a_module_level_import_of_a_missing_package_is_reported(tmp_path):
    """The negative control: a package whose submodule imports TensorBoard at module level."""
    blocked = blocked_modules()
    if "tensorboard" not in blocked:
        pytest.skip("TensorBoard is not installed here")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "ok.py").write_text("import torch\n")
    (tmp_path / "pkg" / "sink.py").write_text("import tensorboard\n")
    proc = subprocess.run([sys.executable, "-c", CHILD, ",".join(sorted(blocked)), "pkg"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == [
        "pkg.sink: ModuleNotFoundError: No module named 'tensorboard' (not on the GPU machine)"]
