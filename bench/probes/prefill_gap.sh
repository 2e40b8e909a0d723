#!/usr/bin/env bash
# Where does remote prefill lose time to native? Runs pp512 natively and over unix with
# bench/probes/site/sitecustomize.py timing every replayed graph (GPU time by CUDA events,
# CPU staging and launch) in both processes, and the host's per-Step times; prints medians.
#   bench/probes/prefill_gap.sh [SHAPE]    (default llama-1b)
set -uo pipefail
cd "$(dirname "$0")/../.."
rm -f /tmp/apir-probe-*.txt
APIR_PROBE=1 PYTHONPATH="bench/probes/site${PYTHONPATH:+:$PYTHONPATH}" apir bench --synthetic "${1:-llama-1b}" \
  -p 512 -n 0 -r 8 --device cuda --backends native,remote-shm --no-history 2>/dev/null | grep pp
python3 - <<'PY'
import glob, statistics
for f in sorted(glob.glob("/tmp/apir-probe-*.txt")):
    rows = [line.split() for line in open(f)]
    for kind in sorted({r[0] for r in rows}):
        sel = [r for r in rows if r[0] == kind]
        keys = sel[0][1::2] if kind == "session" else sel[0][2::2]
        vals = [r[2::2] if kind == "session" else r[3::2] for r in sel]
        med = {k: statistics.median(float(v[i]) for v in vals) for i, k in enumerate(keys)}
        print(f, kind, len(sel), "medians (µs):", {k: round(v) for k, v in med.items()})
PY
