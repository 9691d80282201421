#!/usr/bin/env bash
# Rehearse the GPU check's software on the CPU, before a scarce GPU minute finds what it breaks.
# `make gpu-rehearse` runs it (not part of `make test`: it downloads about 5 GB once).
#
# The GPU machine's Python packages are not the CPU lanes' pins: Python 3.12 with torch 2.11.0,
# triton 3.6.0, transformers 5.17.0 and numpy 2.5.2 (pytest, pytest-xdist and TensorBoard are there
# too), read off the device machines in 2026-11. This builds a venv with those versions, installs
# the wheels `make gpu-wheels` carries the way tools/gpu_check.py installs them (pip --no-index
# --no-deps --target), and for each megatron-core release runs, on the CPU, the tests a GPU run
# goes through: the unit tier, the distributed tier, the GPU lane's RL runs (tests/e2e/
# test_gpu_lane_on_cpu.py), the fault drills, and the scripts' tests (gpu_check, the benchmarks).
# It is not a GPU result: it checks imports, APIs and messages under the machine's versions, not
# kernels, speed or CUDA.
#
# What it found on 2026-11-27: on megatron-core 0.19.2 (the quick profile's release) a failed
# checkpoint save lost its cause (megatron's writer threads; platform/checkpoint_writer.py now names
# it); torch 2.11's message for workaround #8; transformers 5.17 rebuilding LlamaTokenizerFast.
#
#   bash tools/gpu_rehearse.sh        # VENV=.venv-gpu-rehearse MCORE="0.19.2 0.16.1" WHL=.whl
#                                     # TESTS="<paths>" PYTHON312=python3.12 XDIST="-n 2"
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

VENV=${VENV:-.venv-gpu-rehearse}
WHL=${WHL:-.whl}
MCORE=${MCORE:-"0.19.2 0.16.1"}
XDIST=${XDIST:-"-n 2"}
TESTS=${TESTS:-"tests/unit tests/distributed tests/e2e/test_gpu_lane_on_cpu.py tests/e2e/test_drills.py
       tests/e2e/test_drills_round3.py tests/tools"}
MACHINE=("torch==2.11.0" "triton==3.6.0" "transformers==5.17.0" "numpy==2.5.2" pytest pytest-xdist tensorboard)
PYTHON312=${PYTHON312:-$(ls "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -n 1 || true)}
PYTHON312=${PYTHON312:-python3.12}

test -d "$WHL" || { echo "no $WHL/: run \`make gpu-wheels\` first" >&2; exit 2; }
if [ ! -f "$VENV/.machine" ] || [ "$(cat "$VENV/.machine")" != "${MACHINE[*]}" ]; then
    rm -rf "$VENV"
    "$PYTHON312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "${MACHINE[@]}"
    echo "${MACHINE[*]}" > "$VENV/.machine"
fi
PY="$ROOT/$VENV/bin/python"
PTH=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/gpu_rehearse.pth

status=0
for version in $MCORE; do
    site="$ROOT/$VENV/site-$version"
    "$PY" - "$version" "$WHL" "$site" <<'EOF'
import sys
from tools.gpu_check import install, wheels
version, whl, site = sys.argv[1:]
print(install(sys.executable, wheels(f"{whl}/mcore-{version}") + wheels(f"{whl}/common"), site, sys.stdout))
EOF
    # a .pth, not PYTHONPATH: the tests' own child processes (torchrun, the drills' runs) see the wheels too
    printf '%s\n%s\n' "$site" "$ROOT" > "$PTH"
    echo "=== megatron-core $version: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
    # shellcheck disable=SC2086  # XDIST and TESTS are word lists
    PYTHONWARNINGS=ignore::UserWarning "$PY" -m pytest -q -p no:cacheprovider $XDIST $TESTS -m "not vllm and not gpu" \
        || status=1
done
rm -f "$PTH"
exit $status
