#!/usr/bin/env bash
# Download (here, with a package index) the wheels that tools/gpu_check.py installs on a GPU machine
# that has no package index. `make gpu-wheels` runs it.
#
# The GPU machine is assumed to have Python 3.12, a CUDA torch, triton, transformers (and with it
# numpy, packaging, pyyaml, tqdm, safetensors, tokenizers, regex, huggingface_hub) and pytest.
# Everything else the project and its tests import comes from here, for CPython 3.12 on
# manylinux x86_64:
#   .whl/mcore-<version>/   megatron-core, one folder per version (0.16.1 and the newest 0.19.x)
#   .whl/common/            math-verify and its parser (latex2sympy2_extended, antlr4 runtime),
#                           psutil (megatron's checkpoint writer), hypothesis (unit tests),
#                           matplotlib and its dependencies (mismatch figures, a unit test)
#   .whl/peers/             the log-prob benchmark's peers, Liger and verl (pure-Python wheels with
#                           Triton kernels; installed apart, for benchmarks/logprobs.py only)
#   .whl/SHA256SUMS         checksums, verified by gpu_check.py
# Versions other than megatron-core's are the CPU lane's pins (constraints/cpu-py311.txt).
# TensorBoard is left out (about 20 MB with grpcio): the GPU tests run with log.tensorboard=false.
#
#   bash tools/gpu_wheels.sh            # DEST=.whl PYTHON=python3 MCORE_SPECS="megatron-core==0.16.1;megatron-core>=0.19,<0.20"
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${DEST:-.whl}
PYTHON=${PYTHON:-python3}
MCORE_SPECS=${MCORE_SPECS:-"megatron-core==0.16.1;megatron-core>=0.19,<0.20"}
PINS=constraints/cpu-py311.txt
# the versions issue 13's table was measured with; verl's package needs Ray, which is not carried:
# benchmarks/logprobs_cuda.py loads its kernel module without the package's __init__
PEERS=("liger-kernel==0.8.5" "verl==0.9.1")
COMMON=(math-verify latex2sympy2_extended antlr4-python3-runtime psutil hypothesis sortedcontainers
        matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil tzdata)

download() {  # download DIR REQUIREMENT: one wheel, no dependencies, for CPython 3.12 manylinux x86_64
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$1" "$2"
}

pin() {  # pin NAME: NAME==VERSION from the CPU lane's lock, else NAME (the newest)
    local line
    line=$(grep -i -E "^${1//[-_]/[-_]}==" "$PINS" | head -n 1 || true)
    echo "${line:-$1}"
}

mkdir -p "$DEST/common"
IFS=';' read -r -a specs <<< "$MCORE_SPECS"
for spec in "${specs[@]}"; do
    tmp=$(mktemp -d)
    download "$tmp" "$spec"
    wheel=$(ls "$tmp"/megatron_core-*.whl)
    version=$(basename "$wheel" | cut -d- -f2)
    mkdir -p "$DEST/mcore-$version"
    rm -f "$DEST/mcore-$version"/megatron_core-*.whl
    mv "$wheel" "$DEST/mcore-$version/"
    rm -rf "$tmp"
    echo "megatron-core $version ($spec) -> $DEST/mcore-$version/"
done

for name in "${COMMON[@]}"; do
    req=$(pin "$name")
    if [ "$req" = "$name" ]; then
        echo "note: $name is not pinned in $PINS; taking the newest"
    fi
    download "$DEST/common" "$req"
done

mkdir -p "$DEST/peers"
for req in "${PEERS[@]}"; do
    download "$DEST/peers" "$req"
done

(cd "$DEST" && find . -name '*.whl' | sort | xargs sha256sum > SHA256SUMS)
echo
echo "wheels in $DEST:"
(cd "$DEST" && find . -name '*.whl' -printf '%8k KiB  %p\n' | sort -k3)
echo "total: $(du -sh --apparent-size "$DEST" | cut -f1)"
