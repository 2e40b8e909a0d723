#!/usr/bin/env bash
# Issue 19's session-start table on a GPU host: the whole-process wall time of one-shot
# `apir run` sessions against a running `apir host` (warm pool) and natively, on a
# SmolLM2-135M-shaped llama GGUF (30 layers, 576 wide; the tests' byte-level vocabulary)
# written by tests/tiny_models.py. Run from the repo root; prints one line per run.
#   bench/probes/session_start.sh [DEVICE [HOST FLAGS...]]   e.g. cuda --compile-cache /tmp/cc
# NATIVE_RUNS=N sets how many native runs follow the three remote ones (default 2).
set -uo pipefail
dev=${1:-cuda}
shift || true
tmp=$(mktemp -d)
# Python's own bytecode caches, as a pip-installed torch has them: a host that sets
# PYTHONDONTWRITEBYTECODE (the CI GPU host does) would compile torch's sources to bytecode
# in every process (~10 s). The host's start fills this cache; every later process reads it.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$tmp/pycache}
python3 - "$tmp/m.gguf" <<'PY'
import sys
sys.path.insert(0, "tests")
from tiny_models import TinyConfig, write_tiny_gguf
write_tiny_gguf(sys.argv[1], TinyConfig(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, head_dim=64,
                                        n_ff=1536, context_length=2048))
PY
python3 -m apir.cli host --listen "unix://$tmp/apir.sock" --device "$dev" "$@" >"$tmp/host.log" 2>&1 &
host=$!
for _ in $(seq 600); do python3 -m apir.cli host status --listen "unix://$tmp/apir.sock" >/dev/null 2>&1 && break; sleep 0.1; done
sleep 8  # let the pool's first worker finish warming up, as on a host that has been running
run() {  # label, then apir run's flags
  local label=$1 t0 t1; shift
  t0=$(date +%s.%N)
  python3 -m apir.cli run -m "$tmp/m.gguf" -p "Hello there, how are" -n 32 --temp 0 "$@" >/dev/null 2>"$tmp/run.log"
  local rc=$?; t1=$(date +%s.%N)
  echo "$label: exit $rc, $(python3 -c "print(f'{$t1 - $t0:.2f}')") s wall; $(grep -v '^host compiling' "$tmp/run.log" | tail -1)"
  grep '^host compiling' "$tmp/run.log" | sed "s/^/  $label: /"
}
for i in 1 2 3; do run "remote session $i" --remote "unix://$tmp/apir.sock"; done
for i in $(seq "${NATIVE_RUNS:-2}"); do run "native $i" --device "$dev"; done
python3 -m apir.cli host status --listen "unix://$tmp/apir.sock"
kill "$host"; wait "$host" 2>/dev/null
rm -rf "$tmp"
