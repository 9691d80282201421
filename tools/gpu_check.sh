#!/usr/bin/env bash
# The GPU lane's one-command check. Run ON the GPU machine, from the repository root, with the
# wheels that `make gpu-wheels` downloaded into .whl/ (no network needed):
#
#   bash tools/gpu_check.sh            # or: make gpu-check
#   bash tools/gpu_check.sh --plan     # print what would run, run nothing (no GPU needed)
#
# Parts (PARTS, default "gpu bench logprobs"), in this order:
#   unit      pytest tests/unit -m "not vllm" (the CPU lane's unit tier, here beside CUDA)   per version
#   gpu       pytest tests/gpu, one pytest per group of GPU_TESTS (below)                     per version
#   bench     benchmarks/rl_step_gpu.py (phase times, ratio to a plain megatron LM step)      per version
#   logprobs  benchmarks/logprobs.py --device cuda (the log-prob kernel table, with Liger and
#             verl from .whl/peers/ when present); it does not use megatron-core, so it runs once
# GPU_TESTS (default "rl kernels more"): the groups of tests/gpu the gpu part runs, each its own
# pytest under its own time limit, in the order given (every test of tests/gpu is in exactly one;
# tests/tools/test_gpu_check_script.py checks that). Estimated times on one H100 (never
# measured: each pretrain_rl process takes ~10 s on the CPU lane, mostly start-up; on a GPU add
# CUDA/NCCL set-up and torch.compile's first compiles, cached on disk for the later processes):
#   rl       the first evidence: the demo (SFT + 3 RL steps) in fp32, bf16, fp16; router replay
#            R3; resume vs the uninterrupted run. 7 pretrain_rl processes, ~4-6 min
#   kernels  the fused log-prob kernel (compiled and eager) against float64, the embedded engine
#            on the GPU, the model against Hugging Face's; in-process, ~2-4 min (CP: skipped, it
#            needs 2 GPUs and TE)
#   more     router replay R2, SFT only, every loss recipe one step (14 runs in one process).
#            3 processes, ~2-4 min
# (No pytest-xdist: the GPU machine lacks it and .whl/ does not carry it; tests run one at a time, so
# runs do not share the GPU or their output, and a stopped group has the results of its first tests.)
# For each megatron-core in .whl/mcore-*/ (or MCORE="0.19.2 0.16.1", in that order): install it and
# .whl/common/ into /tmp/site-<version> (pip --no-index --no-deps --target: the machine's torch,
# triton and transformers are used as they are; kept for the next call while its wheels are the
# same), print the versions, the GPUs and the free disk, then run the per-version parts. Logs (and a
# JUnit XML per test group) go to ${OUT:-benchmarks/results}, named by date, device and megatron-core
# version. Exits non-zero if any install, part or benchmark failed or ran out of time.
#
# Time limits. PART_TIMEOUT (seconds, default 540; 0 = none) stops a part (one test group, the
# benchmark, the table) that overruns: SIGINT first, so pytest prints its summary and failures so
# far and the benchmark writes its JSON, SIGKILL 30 s later; the next part and the summary
# still run. BUDGET (seconds for the whole call, default 0 = none) shortens the last parts' limits
# to end the call within it (40 s kept for the stop and the summary), and skips a part with less
# than 60 s left.
#
# A device session of ~30 minutes with at most 600 s a command (the machine's start counts too):
# three calls, back to back, most important evidence first (OUT=$OUT brings the logs back):
#   1. OUT=$OUT BUDGET=570 MCORE=0.19.2 PARTS=gpu GPU_TESTS="rl more" bash tools/gpu_check.sh  ~7-9 min
#   2. OUT=$OUT BUDGET=570 MCORE=0.19.2 PARTS="bench logprobs" bash tools/gpu_check.sh         ~6-8 min
#   3. OUT=$OUT BUDGET=570 MCORE=0.16.1 PARTS=gpu GPU_TESTS="rl kernels" bash tools/gpu_check.sh ~7-9 min
# (kernels does not depend on the megatron-core release but for its model test, so it runs once;
# with time left: MCORE=0.16.1 PARTS=bench, then MCORE=0.19.2 PARTS=gpu GPU_TESTS=kernels).
#
# Environment: WHL (wheel folder, default .whl), PYTHON (default python3), OUT (log folder),
# MCORE, PARTS, GPU_TESTS, PART_TIMEOUT, BUDGET, PYTEST_ARGS (extra pytest arguments), BENCH_ARGS
# (extra benchmarks/rl_step_gpu.py arguments).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

# the Makefile switches torch.compile off for the CPU lane; a GPU run compiles (megatron's fusions,
# the log-prob chunk math), so the check does too
unset TORCHDYNAMO_DISABLE
# every line of a part's output reaches its log (and the device session's output) as it is printed,
# also when the part is stopped at its time limit
export PYTHONUNBUFFERED=1
WHL=${WHL:-.whl}
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/results}
PARTS=${PARTS:-gpu bench logprobs}
GPU_TESTS=${GPU_TESTS:-rl kernels more}
PART_TIMEOUT=${PART_TIMEOUT:-540}
BUDGET=${BUDGET:-0}
KNOWN_PARTS=(unit gpu bench logprobs)
KNOWN_GROUPS=(rl kernels more)

# gpu_group NAME: the pytest node ids of a GPU_TESTS group into GROUP (see the header)
gpu_group() {
    local rl=tests/gpu/test_rl_gpu.py
    case $1 in
        rl) GROUP=("$rl::test_demo_short" "$rl::test_router_replay[r3]"
                   "$rl::test_resume_continues_like_the_uninterrupted_run") ;;
        kernels) GROUP=(tests/gpu/test_logprobs_gpu.py tests/gpu/test_embedded_engine_gpu.py
                        tests/gpu/test_model_gpu.py tests/gpu/test_context_parallel_loop.py) ;;
        more) GROUP=("$rl::test_router_replay[r2]" "$rl::test_sft_only" "$rl::test_every_recipe_one_step") ;;
    esac
}
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
for group in $GPU_TESTS; do
    [[ " ${KNOWN_GROUPS[*]} " == *" $group "* ]] || die "GPU_TESTS has '$group'; choose from: ${KNOWN_GROUPS[*]}"
done
[[ "$PART_TIMEOUT" =~ ^[0-9]+$ ]] || die "PART_TIMEOUT='$PART_TIMEOUT' is not a whole number of seconds (0 = no limit)"
[[ "$BUDGET" =~ ^[0-9]+$ ]] || die "BUDGET='$BUDGET' is not a whole number of seconds (0 = no limit)"

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

# part_cmd PART TAG [GROUP]: the command line of a part into CMD (TAG names its output files; GROUP:
# the GPU_TESTS group of the gpu part)
part_cmd() {
    # shellcheck disable=SC2206  # PYTEST_ARGS / BENCH_ARGS are split into words on purpose
    case $1 in
        unit) CMD=("$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 tests/unit -m "not vllm" ${PYTEST_ARGS:-}) ;;
        gpu) gpu_group "$3"
             CMD=("$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 --junitxml "$OUT_DIR/gpu_$3_$2.xml"
                  -m "not vllm" "${GROUP[@]}" ${PYTEST_ARGS:-}) ;;
        bench) CMD=("$PYTHON" benchmarks/rl_step_gpu.py --json "$OUT_DIR/rl_step_gpu_$2.json" ${BENCH_ARGS:-}) ;;
        logprobs) CMD=("$PYTHON" benchmarks/logprobs.py --device cuda --out "$OUT_DIR/logprobs_gpu_$2.md") ;;
    esac
}

# version_parts: the per-version parts as "part" or "gpu:<group>", in order, into VPARTS
version_parts() {
    VPARTS=()
    wants unit && VPARTS+=(unit)
    if wants gpu; then
        for group in $GPU_TESTS; do VPARTS+=("gpu:$group"); done
    fi
    wants bench && VPARTS+=(bench)
}

if [ "$plan" -eq 1 ]; then
    echo "gpu_check plan: parts: $PARTS; megatron-core: ${versions[*]:-none}; part time limit: ${PART_TIMEOUT}s (0 = none); call budget: ${BUDGET}s (0 = none)"
    wants gpu && echo "gpu test groups: $GPU_TESTS"
    version_parts
    for v in "${versions[@]}"; do
        echo "megatron-core $v: install $WHL/mcore-$v/*.whl and ${#common[@]} common wheels into /tmp/site-$v"
        for item in "${VPARTS[@]}"; do
            part_cmd "${item%%:*}" "<date>_<device>_mcore-$v" "${item#*:}"
            echo "  ${item/:/ }: $(printf '%q ' "${CMD[@]}")"
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
    local name=$1 log=$2 rc limit=$PART_TIMEOUT left
    shift 2
    if [ "$BUDGET" -gt 0 ]; then  # end the call within BUDGET: 40 s for the stop and the summary
        left=$((BUDGET - SECONDS - 40))
        if [ "$left" -lt 60 ]; then
            echo "--- $name: not started: ${left}s left of BUDGET=${BUDGET}s" | tee -a "$log"
            failures+=("$name (not started: budget)")
            return
        fi
        if [ "$limit" -eq 0 ] || [ "$left" -lt "$limit" ]; then limit=$left; fi
    fi
    echo "--- $name (time limit ${limit}s): $*" | tee -a "$log"
    local start=$SECONDS
    # SIGINT first: pytest prints its summary, the benchmark writes its JSON; SIGKILL 30 s later
    timeout -s INT --kill-after=30 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if [ "$limit" -gt 0 ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
        echo "--- $name: stopped at its time limit (${limit}s)" | tee -a "$log"
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
    # the same wheels as a previous call's install (a machine kept warm between calls): keep it
    key=$(sha256sum "$WHL/mcore-$version"/*.whl "${common[@]}" | sha256sum | cut -c1-16)
    if [ -f "$site/.gpu_check-$key" ]; then
        echo "megatron-core $version: $site is installed from the same wheels; kept" > "$log"
    else
        rm -rf "$site"
        if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
                "$WHL/mcore-$version"/*.whl "${common[@]}" > "$log" 2>&1; then
            cat "$log"
            failures+=("install mcore-$version")
            continue
        fi
        touch "$site/.gpu_check-$key"
    fi
    export PYTHONPATH="$site:$PWD"
    {
        echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)  parts: $PARTS;" \
             "gpu tests: $GPU_TESTS; part time limit: ${PART_TIMEOUT}s; budget: ${BUDGET}s (${SECONDS}s used)"
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
        nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
        df -h "${TMPDIR:-/tmp}" "$OUT_DIR" . | awk '!seen[$0]++'   # room for pytest's runs and the logs
        exit $status
    } 2>&1 | tee -a "$log"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        failures+=("environment mcore-$version")
        continue
    fi

    version_parts
    for item in "${VPARTS[@]}"; do
        part_cmd "${item%%:*}" "$tag" "${item#*:}"
        run_part "${item/:/ } mcore-$version" "$log" "${CMD[@]}"
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
echo "gpu_check: all passed (parts: $PARTS; gpu tests: $GPU_TESTS; megatron-core: ${versions[*]:-none}; logs in $OUT_DIR; ${SECONDS}s)"
