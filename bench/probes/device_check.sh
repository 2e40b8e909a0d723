#!/usr/bin/env bash
# The device calls that check and measure the decode kernels, kept here because every
# session starts from a fresh clone and device calls are few (each <= 600 s, a machine warm
# ~30 s after one). Run `prepare` on the development machine, then each stage in its own
# call with carry [".device-wheels", ".device-run"]; `peer` reuses the llama.cpp build that
# `tests` makes beside its tests (in /tmp), so call it while that machine is still warm.
#   bash bench/probes/device_check.sh prepare REV:NAME...   # here: wheels, bases, llama.cpp
#   bash bench/probes/device_check.sh tests                 # GPU tests, attention probe, profile
#   bash bench/probes/device_check.sh ab [MODELS]           # this tree against each base
#   bash bench/probes/device_check.sh peer [SPECS...]       # apir against llama.cpp
#   bash bench/probes/device_check.sh torch [MODELS]        # the torch frontend against Inductor
#   bash bench/probes/device_check.sh model aa|ab           # here: one chunk of SmolLM2 + fixtures
#   bash bench/probes/device_check.sh fixtures              # the llama.cpp fixtures on CUDA
# The fixture check takes two calls in a row (a machine stays warm ~30 s), carry
# [".device-wheels", ".device-model"]: `model aa` then `fixtures`, `model ab` then `fixtures`.
# Logs go to $OUT (the device's returned folder) when set, else /tmp/apir-device-check.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
out=${OUT:-/tmp/apir-device-check}
mkdir -p "$out"
stage=${1:-}
[ $# -gt 0 ] && shift
apir() { python3 -c "import sys; from apir.cli import main; sys.exit(main())" "$@"; }
build=/tmp/w/llama

case $stage in
  prepare)
    [ $# -gt 0 ] || { echo "prepare needs REV:NAME pairs (e.g. c74a9d3:base)" >&2; exit 2; }
    pip download -q --no-deps --only-binary :all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .device-wheels \
      gguf tokenizers jinja2 markupsafe pyyaml tqdm requests urllib3 idna certifi charset-normalizer || exit 1
    mkdir -p .device-run
    for pair in "$@"; do
      bash scripts/bench-ab.sh --ref "${pair%%:*}" --base-only ".device-run/${pair#*:}" || exit 1
    done
    if [ ! -f .device-run/llama.cpp.tar.gz ]; then
      tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
      pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp" || exit 1
      tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" || exit 1
      # without what CMake does not need: ~10 MB where the sdist is 76
      (cd "$tmp"/llama_cpp_python-*/vendor/llama.cpp && rm -rf models docs media benches examples gguf-py tests) || exit 1
      tar -czf .device-run/llama.cpp.tar.gz -C "$tmp"/llama_cpp_python-*/vendor llama.cpp || exit 1
    fi
    du -sh .device-wheels .device-run
    ;;
  tests)
    bash scripts/gpu-host-setup.sh
    mkdir -p "$(dirname "$build")"
    bpid=
    if [ -f .device-run/llama.cpp.tar.gz ]; then  # built while the tests run (~4 min), for `peer`
      bash scripts/bench-llamacpp.sh --tarball .device-run/llama.cpp.tar.gz --build "$build" \
        --arch 90 --build-only > "$out/llama-build.log" 2>&1 < /dev/null &
      bpid=$!
    fi
    nvidia-smi --query-gpu=name,driver_version --format=csv
    python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
    timeout 240 python3 -m pytest -q -m gpu tests/test_decode_attention.py tests/test_gpu_quant.py \
      tests/test_gpu.py -k "attention or activation or fused or 8b_shapes or captured or remote_cuda or matches_cpu or recorded or kept" \
      2>&1 | tail -30
    timeout 60 python3 bench/probes/decode_attention.py --short
    timeout 150 apir bench profile --synthetic llama-8b:q4_0 -n 16 -p 0 --device cuda 2>&1 | tail -40
    [ -z "$bpid" ] || { wait "$bpid"; tail -3 "$out/llama-build.log"; }
    ;;
  ab)
    bash scripts/gpu-host-setup.sh
    bases=()
    for b in .device-run/*/; do [ -f "$b/apir/__init__.py" ] && bases+=(--base "${b%/}"); done
    [ ${#bases[@]} -gt 0 ] || { echo "no bases in .device-run (run prepare)" >&2; exit 2; }
    bash scripts/bench-ab.sh "${bases[@]}" --out "$out/ab" -- -p 64 -n 128 -r 3 --backends native \
      --device cuda --synthetic "${1:-llama-8b:q4_0}"
    ;;
  peer)
    bash scripts/gpu-host-setup.sh
    [ $# -gt 0 ] || set -- llama-8b:q4_0 llama-8b:q4_k llama-1b:q4_0
    bash scripts/bench-llamacpp.sh --tarball .device-run/llama.cpp.tar.gz --build "$build" --arch 90 \
      -r 3 --backends native,remote-shm --out "$out/peer" "$@"
    ;;
  model)  # the GGUF is 94 MiB, a carry 64: one 48 MiB chunk a call (gpu-host-setup.sh joins them)
    case ${1:-} in aa|ab) ;; *) echo "model needs the chunk to carry: aa or ab" >&2; exit 2 ;; esac
    gguf=$(python3 -c "from apir.models.resolve import resolve_model; print(resolve_model('smollm2-135m'))") || exit 1
    rm -rf .device-model && mkdir -p .device-model && cp -r ../shared/fixtures .device-model/fixtures && chmod -R u+w .device-model || exit 1
    tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
    split -b 48M "$gguf" "$tmp/smollm2.part." && mv "$tmp/smollm2.part.$1" .device-model/ || exit 1
    du -sh .device-model
    ;;
  fixtures)
    bash scripts/gpu-host-setup.sh
    if python3 -c "from apir.models.resolve import resolve_model; resolve_model('smollm2-135m')" 2>/dev/null; then
      APIR_FIXTURES=.device-model/fixtures timeout 500 python3 -m pytest -q -m gpu tests/test_fixtures.py 2>&1 | tail -15
    else
      echo "SmolLM2 is not whole on this machine yet: carry the other chunk (model aa|ab) and call again"
    fi
    ;;
  torch)  # the host's transformers and torchvision (the device has both)
    bash scripts/gpu-host-setup.sh
    timeout 570 python3 bench/probes/torch_forward.py --device cuda --batches 32,1 --repeat 10 \
      --models "${1:-smollm2-kept,smollm2,resnet18}" 2>&1 | grep -v Warning
    ;;
  *)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
