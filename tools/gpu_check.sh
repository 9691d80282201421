#!/usr/bin/env bash
# The GPU lane's one-command check. Run ON the GPU machine, from the repository root, with the
# wheels that `make gpu-wheels` downloaded into .whl/ (no network needed):
#
#   bash tools/gpu_check.sh            # or: make gpu-check
#
# For each megatron-core in .whl/mcore-*/: install it and .whl/common/ into /tmp/site-<version>
# (pip --no-index --no-deps --target: the machine's torch, triton and transformers are used as
# they are), print the versions and the GPUs, run the unit and GPU tests (not the vLLM ones),
# then benchmarks/rl_step_gpu.py; once at the end, the log-prob kernel table
# (benchmarks/logprobs.py --device cuda). Logs go to ${OUT:-benchmarks/results}, named by date, device
# and megatron-core version. Exits non-zero if any install, test run or benchmark failed.
#
# Environment: WHL (wheel folder, default .whl), PYTHON (default python3), OUT (log folder),
# PYTEST_ARGS (extra pytest arguments), BENCH_ARGS (extra benchmark arguments).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

# the Makefile switches torch.compile off for the CPU lane; a GPU run compiles (megatron's fusions,
# the log-prob chunk math), so the check does too
unset TORCHDYNAMO_DISABLE
WHL=${WHL:-.whl}
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"

if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed); run this on the GPU machine" >&2
    exit 2
fi
shopt -s nullglob
mcore_dirs=("$WHL"/mcore-*/)
common=("$WHL"/common/*.whl)
if [ ${#mcore_dirs[@]} -eq 0 ]; then
    echo "gpu_check: no $WHL/mcore-*/ folders; run 'make gpu-wheels' on a machine with a package index" >&2
    exit 2
fi
if [ -f "$WHL/SHA256SUMS" ] && ! (cd "$WHL" && sha256sum --quiet -c SHA256SUMS); then
    echo "gpu_check: $WHL/SHA256SUMS does not match the wheels; download them again" >&2
    exit 2
fi

stamp=$(date -u +%Y%m%dT%H%M%SZ)
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -cs 'A-Za-z0-9.' '-' | sed 's/-*$//')
failures=()

for dir in "${mcore_dirs[@]}"; do
    version=$(basename "$dir")
    version=${version#mcore-}
    site=/tmp/site-$version
    tag="${stamp}_${device}_mcore-${version}"
    log="$OUT_DIR/gpu_check_${tag}.log"
    echo "=== megatron-core $version: log $log"
    rm -rf "$site"
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir"/*.whl "${common[@]}" \
            > "$log" 2>&1; then
        cat "$log"
        failures+=("install mcore-$version")
        continue
    fi
    export PYTHONPATH="$site:$PWD"
    {
        echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        "$PYTHON" - <<'EOF'
import platform, torch, megatron.core, transformers
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "absent"
from megatron_rl.platform import capabilities, needed_workarounds
print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
      f"megatron-core {megatron.core.__version__}  transformers {transformers.__version__}  triton {tv}")
print(f"capabilities: {capabilities().describe()}; workarounds needed: {[w.number for w in needed_workarounds()]}")
EOF
        nvidia-smi -L
    } 2>&1 | tee -a "$log"

    echo "--- pytest tests/gpu tests/unit -m 'not vllm'" | tee -a "$log"
    # shellcheck disable=SC2086
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu tests/unit -m "not vllm" ${PYTEST_ARGS:-} 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("pytest mcore-$version")

    echo "--- benchmarks/rl_step_gpu.py" | tee -a "$log"
    # shellcheck disable=SC2086
    "$PYTHON" benchmarks/rl_step_gpu.py --json "$OUT_DIR/rl_step_gpu_${tag}.json" ${BENCH_ARGS:-} 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("benchmark mcore-$version")
done

# the fused log-prob kernel against the straightforward path (and verl/Liger if installed): one
# table, the same under every megatron-core (it does not use megatron)
echo "--- benchmarks/logprobs.py --device cuda"
"$PYTHON" benchmarks/logprobs.py --device cuda --out "$OUT_DIR/logprobs_gpu_${stamp}_${device}.md" 2>&1 \
    | tee "$OUT_DIR/logprobs_gpu_${stamp}_${device}.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("logprobs benchmark")

echo
if [ ${#failures[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failures[*]} (logs in $OUT_DIR)"
    exit 1
fi
echo "gpu_check: all passed (logs in $OUT_DIR)"
