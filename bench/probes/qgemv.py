"""Decode products from packed GGUF blocks on a GPU: apir's fused kernel (qmatmul, M=1)
against the f16 gemv of gemv.py on the same shape, against dequantizing (torch decoders of
dequant.py from the file's blocks, or apir's Triton dequantize kernel from the packed form)
into an f16 scratch then a matmul. Each call reads a different
weight copy (as a decode step's layers do), inside one CUDA graph. Prints µs per call and the
effective read rate: the weight's bytes in its own format (GGUF blocks, or f16) per second.

    python3 bench/probes/qgemv.py [Q4_0 Q8_0 ...] [--rows M] [--sweep] [--big | --shapes NxK,..]
                                  [--configs BNxNGxWARPSxSTAGES,..] [--split PER_SMxMIN_STEPS] [--no-torch]

--rows M (M > 1) times the batched kernel too (a batched decode step's M rows).

--sweep also times the fused kernel over a grid of (BN, NG groups of 32 a K-step, warps,
stages), and with --rows the batched one over (BN, NG, warps, stages), and prints the best
next to the ones apir.backends.local.qmatmul picks. --configs BNxNGxWARPSxSTAGES,.. times
the batched kernel's (or with --rows 1 the fused kernel's) given tiles instead.
"""

import sys

import torch
import triton
from gemv import time_us  # bench/probes/gemv.py, beside this file
from gguf import GGMLQuantizationType as Q
from gguf import quants

from apir.backends.local import dequant, qkernels, qpack
from apir.backends.local.gemv import _gemv_kernel, blocks
from apir.backends.local.qmatmul import (
    _launch_dequant,
    _launch_gemv,
    _launch_mm,
    _stack,
    quantize_x,
    slot_order,
    tiles,
)
from apir.graph.dtypes import DType

# (N, K) of an 8B llama's decode products: q/o, gate/up, down, output; and a 135M vocabulary
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (49152, 576)]
if "--big" in sys.argv:  # the 8B decode's largest products only
    SHAPES = [(14336, 4096), (4096, 14336)]
if "--shapes" in sys.argv:  # NxK,NxK...
    SHAPES = [tuple(map(int, s.split("x"))) for s in sys.argv[sys.argv.index("--shapes") + 1].split(",")]
# the (BN, NG, warps, stages) the sweep tries: --configs A,B.. with each as
# BNxNGxWARPSxSTAGES[xWT], or a grid (the batched kernel's; the fused kernel's below)
CONFIGS = ([tuple(map(int, c.split("x"))) for c in sys.argv[sys.argv.index("--configs") + 1].split(",")]
           if "--configs" in sys.argv else
           [(bn, ng, wp, st) for bn in (32, 64, 128) for ng in (2, 4, 8) for wp in (4, 8) for st in (1, 2, 3)])
FUSED_CONFIGS = [(bn, ng, wp, st) for ng in (16, 32) for bn in (4, 8, 16, 32) for wp in (4, 8)
                 for st in (1, 2) if 1 <= bn * ng // (32 * wp) <= 16]  # groups a thread
# the sweep's K-split (qmatmul.k_splits' rule): parts for PER_SM programs a multiprocessor,
# each of at least MIN_STEPS K-steps (--split PER_SMxMIN_STEPS; qmatmul's is 4x2)
PER_SM, MIN_STEPS = (map(int, sys.argv[sys.argv.index("--split") + 1].split("x")) if "--split" in sys.argv
                     else (4, 2))
TYPES = [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q2_K, Q.Q3_K]
# byte offsets of each type's f16 scales (kept finite so the products can be compared)
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
          Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_raw(qtype, n, k):
    bs, ts = quants.GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n * k // bs, ts), dtype=torch.uint8, device="cuda")
    for off in SCALES[qtype]:
        raw[:, off:off + 2] = (torch.rand(raw.shape[0], 1, device="cuda") * 0.02 - 0.01).half().view(torch.uint8)
    return raw.reshape(-1)


def fused(qtype, n, k, cfg=None):
    if cfg is None:
        return lambda x, raw: _launch_gemv(quantize_x(x, int(qtype)), [raw], int(qtype), [n], k)
    bn, ng, warps, stages = cfg

    def run(x, w):
        y = torch.empty((x.shape[0], n), device="cuda", dtype=torch.float32)
        planes, args, _ = _stack([w], int(qtype), [n], k, bn)
        qkernels._qgemv_kernel[(x.shape[0], triton.cdiv(n, bn))](
            *quantize_x(x, int(qtype)), *planes, y, y, K=k, LDY=n, LDR=0, **args, ASM=qkernels.ASM, BN=bn, NG=ng,
            ADD=False, PDL=False, num_warps=warps, num_stages=stages)
        return y
    return run


def gemv16(n, k):
    bn, bk, wp, st = blocks(n, k)

    def run(x, w):
        y = torch.empty(n, device="cuda", dtype=torch.float32)
        _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
        return y
    return run


def batched(qtype, n, k, cfg=None):
    # the batched decode kernel (qmatmul's path for FUSED_ROWS < M <= BATCH_ROWS, Q6_K aside), its
    # splits summed; cfg (BN, NG, warps, stages) for the sweep
    if cfg is None:
        return lambda x, w: _launch_mm(slot_order(x, int(qtype)), [w], int(qtype), [n], k).sum(0)
    bn, ng, warps, stages, *wt = cfg  # a fifth field 1: the product as W x.T (WT)
    groups = k // 32

    def run(x, w):
        bm = 16 if x.shape[0] <= 16 else 32 if x.shape[0] <= 32 else 64
        tiles_n = triton.cdiv(n, bn)
        steps = -(-groups // ng)
        want = max(1, min(steps // MIN_STEPS, -(-PER_SM * 132 // (tiles_n * triton.cdiv(x.shape[0], bm)))))
        per = -(-steps // want) * ng
        splits = -(-groups // per)
        out = torch.empty((splits, x.shape[0], n), device="cuda", dtype=torch.float32)
        planes, args, _ = _stack([w], int(qtype), [n], k, bn)
        qkernels._qmm_kernel[(triton.cdiv(x.shape[0], bm), tiles_n, splits)](
            slot_order(x, int(qtype)), *planes, out, M=x.shape[0], K=k, LDY=n, SPLIT_GROUPS=per, SPLIT_STRIDE=x.shape[0] * n,
            **args, ASM=qkernels.ASM, BM=bm, BN=bn, NG=ng, WT=bool(wt and wt[0]), num_warps=warps,
            num_stages=stages)
        return out.sum(0)
    return run


def triton_dq_mm(qtype, n, k):
    # the prefill path at M rows: Triton dequantize to an f16 scratch, then cuBLAS
    return lambda x, raw: torch.matmul(x.half(), _launch_dequant(raw, int(qtype), n, k, torch.float16).T)


def torch_dq_mm(qtype, n, k):
    # today's executor: dequant.py's torch decoders, then cuBLAS
    return lambda x, raw: torch.matmul(x.half(), dequant.dequantize(raw, DType(int(qtype)), (n, k)).half().T)


def main(types, rows, sweep):
    torch.manual_seed(0)
    for n, k in SHAPES:
        f16_ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(max(2, min(64, (512 << 20) // (n * k * 2))))]
        x16 = torch.randn(k, device="cuda", dtype=torch.float16)
        us = time_us(gemv16(n, k), x16, f16_ws)
        print(f"N={n} K={k} f16 gemv {us:.2f} µs {n * k * 2 / us / 1e6:.2f} TB/s", flush=True)
        del f16_ws
        for qtype in types:
            bs, ts = quants.GGML_QUANT_SIZES[qtype]
            if k % bs:
                continue
            nbytes = n * k // bs * ts
            raws = [random_raw(qtype, n, k) for _ in range(max(2, min(64, (512 << 20) // nbytes)))]
            ws = [qpack.pack(r, int(qtype), n, k) for r in raws]
            x = torch.randn(rows, k, device="cuda")
            want = x.double() @ dequant.dequantize(raws[0], DType(int(qtype)), (n, k)).double().T \
                if int(qtype) in {int(d) for d in dequant.SUPPORTED} else None
            got = fused(qtype, n, k)(x, ws[0])
            if want is not None:
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                assert err < 2e-2, (qtype.name, n, k, err)  # x rounded to int8 per group
            res = {f"fused{tiles(int(qtype), n, k, True)}": time_us(fused(qtype, n, k), x, ws)}
            if rows == 1 and (sweep or "--configs" in sys.argv):
                best = None
                for cfg in CONFIGS if "--configs" in sys.argv else FUSED_CONFIGS:
                    if cfg[1] > k // 32:
                        continue
                    try:
                        other = fused(qtype, n, k, cfg)(x, ws[0])  # the default tile's products
                        assert torch.allclose(other, got, rtol=1e-4, atol=1e-4 * got.abs().max().item()), cfg
                        t = time_us(fused(qtype, n, k, cfg), x, ws, reps=10)
                    except Exception as e:  # noqa: BLE001 - out of resources: skip the config
                        print(f"    {cfg}: {type(e).__name__}", flush=True)
                        continue
                    if "--configs" in sys.argv:
                        res[f"fused{cfg}"] = t
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best is not None:  # None: no config compiled
                    res[f"best{best[1]}"] = best[0]
            if rows > 1:
                res["batched"] = time_us(batched(qtype, n, k), x, ws)
                if want is not None:
                    got = batched(qtype, n, k)(x, ws[0])
                    err = ((got.double() - want).abs().max() / want.abs().max()).item()
                    assert err < 1e-2, (qtype.name, n, k, err)
                if sweep or "--configs" in sys.argv:
                    best = None
                    for cfg in [c for c in CONFIGS if c[1] <= k // 32]:
                        try:
                            t = time_us(batched(qtype, n, k, cfg), x, ws, reps=10)
                        except Exception as e:  # noqa: BLE001 - out of resources: skip the config
                            print(f"    {cfg}: {type(e).__name__}", flush=True)
                            continue
                        if "--configs" in sys.argv:
                            res[f"batched{cfg}"] = t
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    if best is not None:  # None: no config compiled (a 64-row tile, 2026-12-04)
                        res[f"batched-best{best[1]}"] = best[0]
            res["triton-dq+mm"] = time_us(triton_dq_mm(qtype, n, k), x, ws[:2])
            if want is not None and "--no-torch" not in sys.argv:
                res["torch-dq+mm"] = time_us(torch_dq_mm(qtype, n, k), x, raws[:2])
            line = " | ".join(f"{name} {t:.2f} µs {nbytes / t / 1e6:.2f} TB/s" for name, t in res.items())
            print(f"  {qtype.name} M={rows} ({nbytes / 1e6:.1f} MB): {line}", flush=True)
            del ws


if __name__ == "__main__":
    args = sys.argv[1:]
    rows = int(args[args.index("--rows") + 1]) if "--rows" in args else 1
    chosen = [t for t in TYPES if t.name in args] or TYPES
    main(chosen, rows, "--sweep" in args)
