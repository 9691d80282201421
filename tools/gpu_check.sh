#!/usr/bin/env bash
# The GPU lane's one-command check. Run ON the GPU machine, from the repository root, with the
# wheels that `make gpu-wheels` downloaded into .whl/ (no network needed):
#
#   bash tools/gpu_check.sh            # or: make gpu-check
#   bash tools/gpu_check.sh --plan     # print what would run, run nothing (no GPU needed)
#
# Parts (PARTS, default "gpu bench logprobs"), in this order:
#   unit      pytest tests/unit -m "not vllm" (the CPU lane's unit tier, here beside CUDA)   per version
#   gpu       pytest tests/gpu (RL runs per dtype, every recipe, R2/R3, SFT, resume, kernels)   per version
#   bench     benchmarks/rl_step_gpu.py (phase times, ratio to a plain megatron LM step)      per version
#   logprobs  benchmarks/logprobs.py --device cuda (the log-prob kernel table, with Liger and
#             verl from .whl/peers/ when present); it does not use megatron-core, so it runs once
# For each megatron-core in .whl/mcore-*/ (or MCORE="0.19.2 0.16.1", in that order): install it and
# .whl/common/ into /tmp/site-<version> (pip --no-index --no-deps --target: the machine's torch,
# triton and transformers are used as they are), print the versions and the GPUs, then run the
# per-version parts. Logs go to ${OUT:-benchmarks/results}, named by date, device and megatron-core
# version. Exits non-zero if any install, part or benchmark failed or ran out of time.
#
# A device session with a per-command time limit runs the parts in several calls, e.g.
#   MCORE=0.19.2 PARTS=gpu, then MCORE=0.19.2 PARTS="bench logprobs", then MCORE=0.16.1 PARTS=gpu;
# PART_TIMEOUT (seconds, 0 = none) stops a part that overruns so the next one and the logs survive.
#
# Environment: WHL (wheel folder, default .whl), PYTHON (default python3), OUT (log folder),
# MCORE, PARTS, PART_TIMEOUT, PYTEST_ARGS (extra pytest arguments), BENCH_ARGS (extra
# benchmarks/rl_step_gpu.py arguments).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

# the Makefile switches torch.compile off for the CPU lane; a GPU run compiles (megatron's fusions,
# the log-prob chunk math), so the check does too
unset TORCHDYNAMO_DISABLE
WHL=${WHL:-.whl}
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/results}
PARTS=${PARTS:-gpu bench logprobs}
PART_TIMEOUT=${PART_TIMEOUT:-0}
KNOWN_PARTS=(unit gpu bench logprobs)
plan=0
case "${1:-}" in
    --plan) plan=1 ;;
    "") ;;
    *) echo "gpu_check: unknown argument '$1' (the only one is --plan)" >&2; exit 2 ;;
esac

die() { echo "gpu_check: $*" >&2; exit 2; }
wants() { [[ " $PARTS " == *" $1 "* ]]; }

for part in $PARTS; do
    [[ " ${KNOWN_PARTS[*]} " == *" $part "* ]] || die "PARTS has '$part'; choose from: ${KNOWN_PARTS[*]}"
done
[[ "$PART_TIMEOUT" =~ ^[0-9]+$ ]] || die "PART_TIMEOUT='$PART_TIMEOUT' is not a whole number of seconds (0 = no limit)"

shopt -s nullglob
available=()
for dir in "$WHL"/mcore-*/; do
    dir=${dir%/}
    available+=("${dir##*/mcore-}")
done
if [ -n "${MCORE:-}" ]; then
    read -r -a versions <<< "$MCORE"
    for v in "${versions[@]}"; do
        [ -d "$WHL/mcore-$v" ] || die "MCORE has $v but there is no $WHL/mcore-$v/ (there: ${available[*]:-none}); run 'make gpu-wheels'"
    done
else
    versions=("${available[@]}")
fi
per_version=0
for part in unit gpu bench; do wants "$part" && per_version=1; done
if [ "$per_version" -eq 1 ] && [ ${#versions[@]} -eq 0 ]; then
    die "no $WHL/mcore-*/ folders; run 'make gpu-wheels' on a machine with a package index"
fi
[ "$per_version" -eq 1 ] || versions=()
common=("$WHL"/common/*.whl)
peers=("$WHL"/peers/*.whl)

# part_cmd PART TAG: the command line of a part into CMD (TAG names its output files)
part_cmd() {
    # shellcheck disable=SC2206  # PYTEST_ARGS / BENCH_ARGS are split into words on purpose
    case $1 in
        unit) CMD=("$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 tests/unit -m "not vllm" ${PYTEST_ARGS:-}) ;;
        gpu) CMD=("$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 tests/gpu -m "not vllm" ${PYTEST_ARGS:-}) ;;
        bench) CMD=("$PYTHON" benchmarks/rl_step_gpu.py --json "$OUT_DIR/rl_step_gpu_$2.json" ${BENCH_ARGS:-}) ;;
        logprobs) CMD=("$PYTHON" benchmarks/logprobs.py --device cuda --out "$OUT_DIR/logprobs_gpu_$2.md") ;;
    esac
}

if [ "$plan" -eq 1 ]; then
    echo "gpu_check plan: parts: $PARTS; megatron-core: ${versions[*]:-none}; part time limit: ${PART_TIMEOUT}s (0 = none)"
    for v in "${versions[@]}"; do
        echo "megatron-core $v: install $WHL/mcore-$v/*.whl and ${#common[@]} common wheels into /tmp/site-$v"
        for part in unit gpu bench; do
            wants "$part" && part_cmd "$part" "<date>_<device>_mcore-$v" && echo "  $part: $(printf '%q ' "${CMD[@]}")"
        done
    done
    if wants logprobs; then
        part_cmd logprobs "<date>_<device>"
        echo "logprobs: install ${#peers[@]} peer wheels into /tmp/site-peers; $(printf '%q ' "${CMD[@]}")"
    fi
    exit 0
fi

if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
    die "no NVIDIA GPU here (nvidia-smi -L failed); run this on the GPU machine (or --plan)"
fi
if [ -f "$WHL/SHA256SUMS" ] && ! (cd "$WHL" && sha256sum --quiet -c --ignore-missing SHA256SUMS); then
    die "$WHL/SHA256SUMS does not match the wheels; download them again"
fi
mkdir -p "$OUT_DIR"

stamp=$(date -u +%Y%m%dT%H%M%SZ)
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -cs 'A-Za-z0-9.' '-' | sed 's/-*$//')
failures=()

run_part() {  # run_part NAME LOG COMMAND...: run under the part time limit, output appended to LOG
    local name=$1 log=$2 rc
    shift 2
    echo "--- $name: $*" | tee -a "$log"
    local start=$SECONDS
    timeout --kill-after=30 "$PART_TIMEOUT" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if [ "$PART_TIMEOUT" -gt 0 ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
        echo "--- $name: stopped at the part time limit (${PART_TIMEOUT}s)" | tee -a "$log"
        failures+=("$name (time limit)")
    elif [ "$rc" -ne 0 ]; then
        failures+=("$name")
    fi
    echo "--- $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
}

for version in "${versions[@]}"; do
    site=/tmp/site-$version
    tag="${stamp}_${device}_mcore-${version}"
    log="$OUT_DIR/gpu_check_${tag}.log"
    echo "=== megatron-core $version: log $log"
    rm -rf "$site"
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
            "$WHL/mcore-$version"/*.whl "${common[@]}" > "$log" 2>&1; then
        cat "$log"
        failures+=("install mcore-$version")
        continue
    fi
    export PYTHONPATH="$site:$PWD"
    {
        echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)  parts: $PARTS"
        "$PYTHON" - <<'EOF'
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
EOF
        status=$?
        nvidia-smi -L
        exit $status
    } 2>&1 | tee -a "$log"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        failures+=("environment mcore-$version")
        continue
    fi

    for part in unit gpu bench; do
        wants "$part" && part_cmd "$part" "$tag" && run_part "$part mcore-$version" "$log" "${CMD[@]}"
    done
done

# the fused log-prob kernel against the straightforward path and the peers: one table, the same under
# every megatron-core (it does not use megatron), so run once, with the peers in their own target
if wants logprobs; then
    log="$OUT_DIR/logprobs_gpu_${stamp}_${device}.log"
    : > "$log"
    site=/tmp/site-peers
    rm -rf "$site"
    mkdir -p "$site"
    if [ ${#peers[@]} -gt 0 ] && ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
            "${peers[@]}" >> "$log" 2>&1; then
        echo "gpu_check: the peer wheels did not install (see $log); the table goes on without them" | tee -a "$log"
        rm -rf "$site"
    fi
    export PYTHONPATH="$site:$PWD"
    part_cmd logprobs "${stamp}_${device}"
    run_part logprobs "$log" "${CMD[@]}"
fi

echo
if [ ${#failures[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failures[*]} (logs in $OUT_DIR)"
    exit 1
fi
echo "gpu_check: all passed (parts: $PARTS; megatron-core: ${versions[*]:-none}; logs in $OUT_DIR)"
