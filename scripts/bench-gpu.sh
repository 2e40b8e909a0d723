#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md (issue 6): synthetic 135M, 1B and 8B llama shapes and the
# real SmolLM2 GGUF, native side by side with remote unix (shared memory) and remote tcp,
# and for the 135M models the guest computing alone on its CPU (guest-cpu: the numpy executor),
# in a run of its own beside native: seconds of numpy work on every core between the remote
# repetitions made remote prefill 1.7-4.2x slower and erratic (H200 host, 2026-11-30).
# Remote runs take 10 repetitions (8B: 5): a pp512 repetition is ~6 ms, and with 3 the
# remote/native prefill ratio moved by ±3% between runs (compiling, not repeating, is what
# takes a run's minutes). One JSON result file and one log per model in OUT (default
# bench/results/gpu).
#   scripts/bench-gpu.sh [OUT [135m 135m-q8_0 1b 1b-q8_0 1b-guest-cpu 8b smollm2]]
set -uo pipefail
out=${1:-bench/results/gpu}
mkdir -p "$out"
shift || true
models=${*:-135m 135m-q8_0 1b 1b-q8_0 8b smollm2}
bench() {
  local name=$1 start=$SECONDS
  shift
  timeout "${BENCH_TIMEOUT:-400}" apir bench "$@" --device cuda -o json --no-history \
    >"$out/$name.json" 2>"$out/$name.log"
  echo "$name: exit $? after $((SECONDS - start)) s"
}
for m in $models; do
  case $m in
    135m) bench llama-135m --synthetic llama-135m -p 512 -n 128 -r 10 --backends native,remote-shm,remote-tcp
          bench llama-135m-guest-cpu --synthetic llama-135m -p 512 -n 128 -r 3 --backends native,guest-cpu ;;
    135m-q8_0) bench llama-135m-q8_0 --synthetic llama-135m:q8_0 -p 512 -n 128 -r 10 --backends native,remote-shm,remote-tcp ;;
    1b) bench llama-1b --synthetic llama-1b -p 512 -n 128 -r 10 --backends native,remote-shm,remote-tcp ;;
    1b-q8_0) bench llama-1b-q8_0 --synthetic llama-1b:q8_0 -p 512 -n 128 -r 10 --backends native,remote-shm,remote-tcp ;;
    # The numpy executor takes ~15 s per 1B repetition (pp512 + tg128) on the H200 host's 16 cores.
    1b-guest-cpu) bench llama-1b-guest-cpu --synthetic llama-1b -p 512 -n 128 -r 3 --backends native,guest-cpu ;;
    8b) bench llama-8b --synthetic llama-8b -p 512 -n 128 -r 5 --backends native,remote-shm,remote-tcp ;;
    smollm2) bench smollm2-135m -m smollm2-135m -p 512 -n 128 -r 10 --backends native,remote-shm,remote-tcp
             bench smollm2-135m-guest-cpu -m smollm2-135m -p 512 -n 128 -r 3 --backends native,guest-cpu ;;
    *) echo "unknown model $m (135m, 135m-q8_0, 1b, 1b-q8_0, 1b-guest-cpu, 8b, smollm2)" >&2; exit 2 ;;
  esac
done
