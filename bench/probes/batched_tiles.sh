#!/usr/bin/env bash
# The batched decode kernel's tile and K-split (issue 20), on a GPU host, from the repo
# root: what to run after a profile shows the batched product as a many-stream step's cost.
# On an H200 (2026-12-04, bench/results/h200-2026-12-04-s15-callF1-*) the kernel's tiles at
# 16 rows hold 196-255 registers a thread, so a multiprocessor runs one program of 8 warps
# (12.5% occupancy) and issues ~1 instruction a cycle: latency-bound, at 0.5 TB/s. This
# times smaller tiles (fewer registers, more programs) under three K-split rules, on a 1B's
# and an 8B's products, at 16 and at 64 rows; qmatmul.batch_tiles and k_splits take the
# winners. Prints one file a (rows, split) to DIR (default bench-tiles).
#   bench/probes/batched_tiles.sh [DIR]
set -uo pipefail
out=${1:-bench-tiles}
mkdir -p "$out"
cd "$(dirname "$0")"
case $out in /*) ;; *) out=$OLDPWD/$out ;; esac
# BN rows of W x NG groups of 32 a K-step x warps x stages [x 1: the product as W x.T]
c16=256x8x8x1,512x8x8x1,128x8x4x1,128x4x4x1,64x8x4x1,64x4x4x1,64x4x2x1,128x4x8x1,64x8x2x1,128x4x4x2,64x4x4x2,128x8x4x1x1,64x8x4x1x1
c64=128x8x4x1x1,64x8x4x1x1,64x4x4x1x1,128x4x4x1x1,128x8x8x1x1,256x8x8x1x1,64x8x2x1x1
shapes_1b=3072x2048,2048x2048,16384x2048,2048x8192  # q k v, o, gate up, down
shapes_8b=6144x4096,28672x4096,4096x14336
# the split: parts for PER_SM programs a multiprocessor, each of at least MIN_STEPS K-steps
for split in 4x2 8x1 16x1; do
  python3 qgemv.py Q4_0 Q4_K --rows 16 --shapes $shapes_1b,$shapes_8b --no-torch --configs $c16 \
    --split $split > "$out/rows16-$split.txt" 2>&1
done
for split in 4x2 8x1; do
  python3 qgemv.py Q4_0 Q4_K --rows 64 --shapes $shapes_1b,28672x4096 --no-torch --configs $c64 \
    --split $split > "$out/rows64-$split.txt" 2>&1
done
