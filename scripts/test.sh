#!/usr/bin/env bash
# Set up (scripts/setup.sh --test), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
ruff check apir tests
python -m pytest -q "$@"
