#!/usr/bin/env bash
# apir against an earlier apir: `apir bench ARGS` on another tree's `apir` package (BASE),
# then on this checkout's, each with a compile cache of its own, then `apir bench compare`
# of the two (t/s and new ÷ base per model, backend and test). For a kernel change measured
# on a GPU host that has no git history (the device machine): make BASE here with --ref and
# carry it there, or pass --ref where git is at hand.
#   scripts/bench-ab.sh (--ref REV | --base DIR [--base DIR2 ..]) [--out DIR] [--] ARGS...
#   scripts/bench-ab.sh --ref main -- -p 64 -n 128 -r 3 --backends native --device cuda \
#       --synthetic llama-8b:q4_0,llama-1b:q4_0
#   scripts/bench-ab.sh --ref main --base-only .device-run/base   # write BASE, run nothing
# BASE is a directory holding the `apir` package (a copy of another revision's apir/). Several
# --base: each run and compared with this checkout, in the order given (the steps of a series
# of changes, in one call), each named by its directory's name.
# OUT (default a temporary directory) gets NAME.json (base.json with --ref), new.json and the
# runs' logs.
set -uo pipefail
cd "$(dirname "$0")/.."
die() { echo "bench-ab: $*" >&2; exit 2; }
ref= out= base_only=
bases=()
while [ $# -gt 0 ]; do
  case $1 in
    --ref) [ $# -ge 2 ] || die "--ref needs a revision"; ref=$2; shift 2 ;;
    --base) [ $# -ge 2 ] || die "--base needs a directory"; bases+=("$2"); shift 2 ;;
    --base-only) [ $# -ge 2 ] || die "--base-only needs a directory"; base_only=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; out=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
py=${PYTHON:-python3}
if [ -n "$base_only" ]; then  # it writes BASE and runs nothing: nothing else may be asked of it
  [ -n "$ref" ] || die "--base-only needs --ref (the revision to write)"
  [ -z "$out" ] && [ $# -eq 0 ] || die "--base-only runs nothing: no --out or bench arguments with it"
fi
if [ -n "$ref" ]; then
  [ ${#bases[@]} -eq 0 ] || die "give --ref or --base, not both"
  git rev-parse --verify -q "$ref^{commit}" >/dev/null || die "no such revision here: $ref"
  if [ -n "$base_only" ]; then
    base=$base_only
  else
    base=$(mktemp -d /tmp/apir-ab-base.XXXXXX) && trap 'rm -rf "$base"' EXIT
  fi
  mkdir -p "$base" && rm -rf "$base/apir" && git archive "$ref" apir | tar -x -C "$base" \
    || die "cannot write $ref's apir/ into $base"
  echo "bench-ab: base is $ref ($(git rev-parse --short "$ref")) in $base"
  [ -z "$base_only" ] || exit 0
fi
[ -n "$ref" ] || [ ${#bases[@]} -gt 0 ] || die "give --ref REV or --base DIR (see --help)"
names=()
if [ -n "$ref" ]; then
  names=(base) bases=("$base")
else
  for b in "${bases[@]}"; do
    [ -f "$b/apir/__init__.py" ] || die "$b holds no apir package (apir/__init__.py)"
    name=$(basename "$(cd "$b" && pwd)")
    [ "$name" != new ] || die "a base may not be named new (this checkout's run): $b"
    for n in ${names[@]+"${names[@]}"}; do [ "$n" != "$name" ] || die "two bases named $name"; done
    names+=("$name")
  done
fi
[ $# -gt 0 ] || die "no apir bench arguments given (e.g. -p 64 -n 128 --synthetic llama-1b:q4_0)"
out=${out:-$(mktemp -d /tmp/apir-ab.XXXXXX)}
mkdir -p "$out"
bench() {  # name, PYTHONPATH, then the bench arguments
  local name=$1 path=$2 start=$SECONDS
  shift 2
  # -P: the working directory (this checkout) is not put before PYTHONPATH's tree
  APIR_COMPILE_CACHE="$out/cache-$name" PYTHONPATH="$path" "$py" -P -c \
    'import sys; from apir.cli import main; sys.exit(main())' bench "$@" -o json --no-history \
    >"$out/$name.json" 2>"$out/$name.log"
  local rc=$?
  echo "bench-ab: $name: exit $rc after $((SECONDS - start)) s (log $out/$name.log)"
  return $rc
}
for i in "${!names[@]}"; do
  name=${names[$i]}
  bench "$name" "$(cd "${bases[$i]}" && pwd)" "$@" || die "the $name run failed: $(tail -3 "$out/$name.log")"
done
bench new "$PWD" "$@" || die "the new run failed: $(tail -3 "$out/new.log")"
for name in "${names[@]}"; do
  echo "bench-ab: $name -> new"
  "$py" -c 'import sys; from apir.cli import main; sys.exit(main())' bench compare "$out/$name.json" "$out/new.json"
  rc=$?
  [ $rc -le 1 ] || exit $rc
done
exit 0  # compare's 1 (a regression) is in its table; this script reports, it does not gate
