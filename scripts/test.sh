#!/usr/bin/env bash
# Set up (scripts/setup.sh --test), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
# The suite runs several torch processes at once (pytest, host daemons, their workers) on
# a 2-core CI machine: one OpenMP thread each stops them spinning against each other.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ruff check apir tests fuzz
mypy  # strict on the wire (protocol, transport, graph): [tool.mypy] in pyproject.toml
# No reruns: no test bounds a speed (they wait on events, with tests/hosts.py's WAIT only
# bounding a hang), so a test that fails once is a failure to find.
python -m pytest -q "$@"
