#!/usr/bin/env bash
# The peer run of issue 18: llama.cpp's llama-bench and apir bench on the very same GGUF
# files, back to back, then apir ÷ llama.cpp per test and what each holds in memory.
# For a GPU host with nvcc, CMake and ninja but no internet: llama.cpp is built from a
# source tarball once (llama-bench and llama-batched-bench; the build directory is reused
# when both binaries are there). The GGUF files are the --synthetic models, written by
# `apir bench --write-gguf` one at a time into BUILD/gguf and deleted after their run
# (--keep-gguf keeps them): an 8B F16 is 15 GiB, a 70B Q4_K_M 40 GiB. OUT gets, per model,
# llama.cpp-NAME.json and .log (its -v log holds its model, KV and compute buffer sizes),
# apir-NAME.json and .log, and peer.md, the table printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2  # relative paths below are the repository root's

SPECS_DEFAULT="llama-135m:f16 llama-1b:f16 llama-1b:q4_0 llama-1b:q4_k llama-8b:f16 llama-8b:q4_0 llama-8b:q4_k llama-8b:q8_0"
usage() {
  cat <<EOF
usage: scripts/bench-llamacpp.sh [options] [SPEC...]

  SPEC            --synthetic models to write and measure, e.g. llama-8b:q4_0 (default:
                  $SPECS_DEFAULT)
  --tarball FILE  the llama.cpp source tarball (default: \$LLAMACPP_TARBALL, else
                  .device-llamacpp/llama.cpp.tar.gz)
  --build DIR     where llama.cpp is built (default: \$APIR_LLAMACPP_BUILD, else /tmp/apir-llamacpp)
  --out DIR       results and logs (default: bench/results/peer)
  --build-only    build llama.cpp and stop
  --keep-gguf     keep the GGUF files in BUILD/gguf (a file already there is reused)
  --arch ARCHS    CMAKE_CUDA_ARCHITECTURES (default: native, the GPU of this host)
  --cpu           build llama.cpp without CUDA and run both on the CPU
  -p N  -n N      prompt and generated tokens (default 512 and 128, llama-bench's)
  -d LIST         depths, comma-separated (default 0; e.g. 0,4096)
  -r N            repetitions (default 5)
  --backends L    apir's backends (default native,remote-shm)
  --concurrency L also many streams at once, per model: llama-batched-bench -npl L beside
                  apir bench serve --concurrency L (-p and -n per stream); e.g. 1,4,16,64
  --only-serve    with --concurrency: skip llama-bench and apir bench (the single-stream tests)
  --shared-prefix N  with --concurrency: apir bench serve also times prefix reuse (N tokens)
  -h, --help      this text
EOF
}
die() { echo "bench-llamacpp: $*" >&2; exit 2; }

tarball=${LLAMACPP_TARBALL:-.device-llamacpp/llama.cpp.tar.gz}
build=${APIR_LLAMACPP_BUILD:-/tmp/apir-llamacpp}
out=bench/results/peer arch=native cpu=0 n_prompt=512 n_gen=128 depth=0 reps=5 build_only=0 keep=0
backends=native,remote-shm concurrency="" only_serve=0 shared_prefix=0
specs=()
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --tarball|--build|--out|--arch|-p|-n|-d|-r|--backends|--concurrency|--shared-prefix)
      [ $# -ge 2 ] || die "$1 needs a value (see --help)"
      case $1 in
        --tarball) tarball=$2 ;; --build) build=$2 ;; --out) out=$2 ;; --arch) arch=$2 ;;
        -p) n_prompt=$2 ;; -n) n_gen=$2 ;; -d) depth=$2 ;; -r) reps=$2 ;; --backends) backends=$2 ;;
        --concurrency) concurrency=$2 ;; --shared-prefix) shared_prefix=$2 ;;
      esac
      shift 2 ;;
    --cpu) cpu=1; shift ;;
    --build-only) build_only=1; shift ;;
    --keep-gguf) keep=1; shift ;;
    --only-serve) only_serve=1; shift ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) specs+=("$1"); shift ;;
  esac
done
[ ${#specs[@]} -gt 0 ] || read -r -a specs <<<"$SPECS_DEFAULT"
[ $only_serve = 0 ] || [ -n "$concurrency" ] || die "--only-serve needs --concurrency"
[ "$shared_prefix" = 0 ] || [ -n "$concurrency" ] || die "--shared-prefix needs --concurrency"
bin=$build/build/bin
built=0
[ -x "$bin/llama-bench" ] && [ -x "$bin/llama-batched-bench" ] && built=1
if [ $built = 0 ]; then  # every check before minutes of building
  [ -f "$tarball" ] || die "no llama.cpp source tarball at $tarball: pass --tarball FILE or set LLAMACPP_TARBALL"
  for tool in cmake ninja $([ $cpu = 1 ] || echo nvcc); do
    command -v "$tool" >/dev/null || die "$tool is needed to build llama.cpp (nvcc: or pass --cpu)"
  done
fi
# apir: $APIR, else the apir command, else this checkout's package through python3
apir() {
  if [ -n "${APIR:-}" ]; then "$APIR" "$@"
  elif command -v apir >/dev/null; then command apir "$@"
  else "${PYTHON:-python3}" -m apir.cli "$@"; fi
}
[ $build_only = 1 ] || apir bench --help >/dev/null 2>&1 \
  || die "apir does not run here: install it first (bash scripts/gpu-host-setup.sh)"

# ------------------------------------------------------------ llama.cpp, built once
if [ $built = 1 ]; then
  echo "bench-llamacpp: reusing the llama.cpp build in $build"
else
  if [ $cpu = 1 ]; then cuda=OFF; else cuda=ON; fi
  rm -rf "$build/src"
  mkdir -p "$build/src" || die "cannot make $build/src"
  tar -xzf "$tarball" -C "$build/src" --strip-components=1 || die "cannot unpack $tarball"
  echo "bench-llamacpp: building llama.cpp (CUDA $cuda) in $build: minutes; log in $build/build.log"
  start=$SECONDS
  { cmake -S "$build/src" -B "$build/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=$cuda \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && cmake --build "$build/build" --target llama-bench llama-batched-bench; } >"$build/build.log" 2>&1 \
    || { tail -20 "$build/build.log" >&2; die "the llama.cpp build failed (log: $build/build.log)"; }
  echo "bench-llamacpp: built in $((SECONDS - start)) s"
fi
[ $build_only = 1 ] && exit 0

# ------------------------------------------------------------ per model: write, llama.cpp, apir
if [ $cpu = 1 ]; then ngl=0 device=cpu; else ngl=99 device=cuda; fi
mkdir -p "$out" "$build/gguf" || die "cannot make $out and $build/gguf"
llama=() ours=()
for spec in "${specs[@]}"; do
  name=${spec/:/-}
  gguf=$build/gguf/$name.gguf
  if [ $keep = 0 ] || [ ! -f "$gguf" ]; then
    apir bench --write-gguf "$build/gguf" --synthetic "$spec" || die "writing $gguf failed"
  fi
  if [ $only_serve = 0 ]; then
    echo "bench-llamacpp: $name: llama-bench"
    "$bin/llama-bench" -m "$gguf" -ngl $ngl -fa 1 -p "$n_prompt" -n "$n_gen" -d "$depth" -r "$reps" -o json -v \
      >"$out/llama.cpp-$name.json" 2>"$out/llama.cpp-$name.log" && llama+=("$out/llama.cpp-$name.json") \
      || echo "bench-llamacpp: $name: llama-bench failed (see $out/llama.cpp-$name.log)" >&2
    grep -hoE "[A-Za-z0-9_]+ +(model|KV|compute) buffer size = +[0-9.]+ MiB" "$out/llama.cpp-$name.log" \
      | sort -u | sed "s/^/bench-llamacpp: $name: llama.cpp /"
    echo "bench-llamacpp: $name: apir bench"
    apir bench -m "$gguf" -p "$n_prompt" -n "$n_gen" -d "$depth" -r "$reps" --backends "$backends" \
      --device $device -o json --no-history >"$out/apir-$name.json" 2>"$out/apir-$name.log" \
      && ours+=("$out/apir-$name.json") || echo "bench-llamacpp: $name: apir bench failed (see $out/apir-$name.log)" >&2
  fi
  if [ -n "$concurrency" ]; then  # many streams: each tool's own table, one after the other
    max=$(tr , '\n' <<<"$concurrency" | sort -n | tail -1)
    echo "bench-llamacpp: $name: llama-batched-bench -npl $concurrency"
    "$bin/llama-batched-bench" -m "$gguf" -ngl $ngl -fa 1 -c $((max * (n_prompt + n_gen) + 64)) -b 2048 -ub 512 \
      -npp "$n_prompt" -ntg "$n_gen" -npl "$concurrency" >"$out/llama.cpp-batched-$name.md" 2>"$out/llama.cpp-batched-$name.log" \
      || echo "bench-llamacpp: $name: llama-batched-bench failed (see $out/llama.cpp-batched-$name.log)" >&2
    echo "bench-llamacpp: $name: apir bench serve --concurrency $concurrency"
    apir bench serve -m "$gguf" -p "$n_prompt" -n "$n_gen" --concurrency "$concurrency" --backends "$backends" \
      --device $device >"$out/apir-serve-$name.md" 2>"$out/apir-serve-$name.log" \
      || echo "bench-llamacpp: $name: apir bench serve failed (see $out/apir-serve-$name.log)" >&2
    if [ "$shared_prefix" -gt 0 ]; then  # apart: its slots' caches are sized for the prefix
      echo "bench-llamacpp: $name: apir bench serve --shared-prefix $shared_prefix"
      apir bench serve -m "$gguf" -p "$n_prompt" -n 16 --concurrency 1 --backends "$backends" --device $device \
        --shared-prefix "$shared_prefix" 2>>"$out/apir-serve-$name.log" | sed -n '/shared prefix/,$p' \
        >>"$out/apir-serve-$name.md" || echo "bench-llamacpp: $name: prefix reuse failed" >&2
    fi
    { echo "## $name: llama-batched-bench"; grep "^|" "$out/llama.cpp-batched-$name.md"; echo
      echo "## $name: apir bench serve"; cat "$out/apir-serve-$name.md"; echo; } | tee -a "$out/serve.md"
  fi
  [ $keep = 1 ] || rm -f "$gguf"
done
[ $only_serve = 1 ] && exit 0
if [ ${#llama[@]} = 0 ] || [ ${#ours[@]} = 0 ]; then die "nothing to compare: see the logs in $out"; fi
apir bench peer --llamacpp "${llama[@]}" --apir "${ours[@]}" | tee "$out/peer.md"
