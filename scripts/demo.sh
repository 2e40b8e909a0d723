#!/usr/bin/env bash
# Set up and answer one prompt with the default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
apir run --chat -p "${1:-What is the capital of France? Answer in one sentence.}" -n 64 --temp 0
