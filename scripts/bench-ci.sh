#!/usr/bin/env bash
# A short CPU benchmark, compared with the committed baseline bench/baseline-cpu.json.
#   scripts/bench-ci.sh            warn only: print the comparison, exit 0 even on a regression
#   scripts/bench-ci.sh --strict   exit 1 when a test lost more than APIR_BENCH_MAX_REGRESSION
#                                  percent (default 10)
#   scripts/bench-ci.sh --update   rewrite the baseline from this machine's run
# CPU figures depend on the machine: refresh the baseline (--update) when CI hardware
# changes. Torch runs one thread unless OMP_NUM_THREADS says otherwise: on small shared
# runners multi-threaded CPU timings swing by integer factors from run to run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
mode=warn
case "${1:-}" in
  "") ;;
  --strict) mode=strict ;;
  --update) mode=update ;;
  *) echo "usage: $0 [--strict | --update]" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
baseline=bench/baseline-cpu.json
max=${APIR_BENCH_MAX_REGRESSION:-10}
out=$(mktemp "${TMPDIR:-/tmp}/apir-bench.XXXXXX")
trap 'rm -f "$out"' EXIT

python -m apir.cli bench --synthetic llama-135m -p 64 -n 16 -r 3 \
  --backends native,guest-cpu --device cpu -o json --no-history > "$out"

if [ "$mode" = update ]; then
  mkdir -p "$(dirname "$baseline")"
  cp "$out" "$baseline"
  echo "bench-ci: wrote $baseline" >&2
  exit 0
fi
status=0
python -m apir.cli bench compare "$baseline" "$out" --max-regression "$max" || status=$?
if [ "$status" -eq 1 ] && [ "$mode" = warn ]; then
  echo "bench-ci: warning: slower than $baseline by more than $max% (warn only; --strict fails)" >&2
  exit 0
fi
exit "$status"
