"""The decode kernels' inner loop, compiled for sm_90 on a machine without a GPU: the
instructions they spend per weight value, per type, from the SASS of Triton's own ptxas and
cuobjdump (they come with the triton wheel). Costs no device time; the counts explain the
H200 timings of bench/probes/qgemv.py (16-byte loads or not, scales loaded per value or per
slot, integer and f32 work per value, register spills).

    python3 bench/probes/qkernel_sass.py [Q4_0 Q4_K ...] [--k 4096] [--batched] [--show]

--batched: the batched kernel (16 rows of x a program) instead of the fused one (one row).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from gguf import GGMLQuantizationType as Q
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from apir.backends.local import qkernels, qmatmul

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


KINDS = ("fused", "batched", "dequant", "quantize")


def _signature(qtype: int, kind: str) -> dict[str, str]:
    high = "*i32"
    scales = {2: "fp16", 3: "fp16", 6: "fp16", 7: "fp16", 8: "fp16"}.get(qtype)
    ps = [f"*{scales}"] * 3 if scales else {10: ["*u8", "*fp16", "*fp16"], 11: ["*u8", "*fp16", "*u8"],
                                             12: ["*u8"] * 3, 13: ["*u8"] * 3, 14: ["*i8", "*fp16", "*i8"]}[qtype]
    types = ["*i32", high, *ps]  # low, high, then the three scale planes
    if kind == "dequant":
        sig = dict(zip(("low_ptr", "high_ptr", "p0", "p1", "p2"), types))
        sig |= {"out_ptr": "*fp16", "R0": "i32", "R1": "i32", "K": "i32"}
    else:  # the planes of three stacked weights (qkernels._part)
        planes = {f"{plane}{i}": t for i in range(3) for plane, t in zip("LHABC", types)}
        x = {"xq_ptr": "*i32", "xs_ptr": "*fp32"} if kind == "fused" else {"x_ptr": "*fp16"}
        sig = {**x, **planes, "y_ptr": "*fp32", **({"r_ptr": "*fp32"} if kind == "fused" else {}),
               **({"M": "i32"} if kind == "batched" else {}),
               "N0": "i32", "N1": "i32", "N2": "i32", "T0": "i32", "T1": "i32", "K": "i32", "LDY": "i32",
               **({"LDR": "i32"} if kind == "fused" else {}),
               **({"SPLIT_GROUPS": "i32", "SPLIT_STRIDE": "i32"} if kind == "batched" else {})}
    consts = ("QT", "LB", "HB", "OFF", "MIN", *(("ASM",) if kind != "dequant" else ()),
              *(("P",) if kind != "dequant" else ()), *(("BM", "WT") if kind == "batched" else ()), "BN", "NG",
              *(("ADD", "PDL") if kind == "fused" else ()))
    return sig | {name: "constexpr" for name in consts}


def compile_kernel(qtype: int, n: int, k: int, kind: str = "fused", parts: int = 1, tile=None,
                   bm: int = 16, wt: bool | None = None, act: int = 0, add: bool = False,
                   pdl: bool = False):
    """The kernel of ``kind`` for a packed (n, k) weight (``parts`` of them stacked, the
    decode kernels), compiled for sm_90 with the tiles the host would launch it with, as
    Triton specializes at run time (aligned pointers, K and LDY multiples of 16). Returns
    (compiled kernel, BN, NG, num_warps). ``tile`` (BN, NG, warps, stages) overrides the
    decode kernel's; the batched one's are those for ``bm`` rows of x, ``wt`` overriding its
    WT; ``act`` is the quantize kernel's ACT, ``add`` the fused kernel's ADD, ``pdl`` both decode
    kernels' PDL."""
    if kind == "quantize":  # x rounded to int8 for the fused kernel (no weight type)
        src = ASTSource(fn=qkernels._quantize_x_kernel, constexprs={"BG": 32, "LB": 4, "ACT": act, "PDL": pdl},
                        signature={"x_ptr": "*fp32", "u_ptr": "*fp32", "xq_ptr": "*i32", "xs_ptr": "*fp32",
                                   "K": "i32", "LDX": "i32", "LDU": "i32", "eps": "fp32",
                                   "LB": "constexpr", "ACT": "constexpr", "BG": "constexpr", "PDL": "constexpr"},
                        attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}), 0, 0, 4
    lb, hb, off, mins = qkernels.TYPES[qtype]
    consts = dict(QT=qtype, LB=lb, HB=hb, OFF=off, MIN=mins)
    if kind == "batched":
        bm, bn, nc, warps, stages, wt0 = qmatmul.batch_tiles(qtype, n, k, bm)
        if tile:
            bn, nc, warps, stages = tile
        consts |= dict(BM=bm, ASM=True, WT=wt0 if wt is None else wt)
        fn, options, ints = qkernels._qmm_kernel, {"num_stages": stages}, (23, 24)  # K, LDY
    elif kind == "fused":
        bn, nc, warps = qmatmul.tiles(qtype, n, k, fused=True)
        stages = 2
        if tile:
            bn, nc, warps, stages = tile
        consts |= dict(ASM=True, ADD=add, PDL=pdl)
        fn, options, ints = qkernels._qgemv_kernel, {"num_stages": stages}, (24, 25)  # K, LDY
    else:
        bn, nc, warps = qmatmul.tiles(qtype, n, k, fused=False)
        fn, options, ints = qkernels._dequant_kernel, {"enable_fp_fusion": False}, (8,)
    consts |= dict(BN=bn, NG=nc) | ({} if kind == "dequant" else dict(P=parts))
    pointers = range(6 if kind == "dequant" else 19 if kind == "fused" else 17)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*pointers, *ints)}
    src = ASTSource(fn=fn, signature=_signature(qtype, kind), constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **options})
    return kernel, bn, nc, warps


def loop_sass(qtype: int, n: int, k: int, batched: bool = False, parts: int = 1,
              tile=None, bm: int = 16, wt: bool | None = None) -> tuple[list[str], int]:
    """The SASS lines of the kernel's main loop for a (n, k) weight, and the values a
    thread takes per iteration."""
    kernel, bn, ng, warps = compile_kernel(qtype, n, k, "batched" if batched else "fused", parts, tile, bm, wt)
    print(f"  (BN {bn}, NG {ng}, {warps} warps; {kernel.metadata.shared} bytes shared)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout.splitlines()
    code = [line for line in sass if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    # the loop: from the target of the backward branch to that branch
    for i, line in enumerate(code):
        m = re.search(r"BRA 0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) < int(re.match(r"\s*/\*([0-9a-f]+)\*/", line).group(1), 16):
            start = next(j for j, c in enumerate(code) if int(re.match(r"\s*/\*([0-9a-f]+)\*/", c).group(1), 16)
                         == int(m.group(1), 16))
            values = bn * ng * 32 // (32 * warps)
            return code[start : i + 1], values
    raise RuntimeError("no loop found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", default=[t.name for t in qkernels_types()])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--batched", action="store_true", help="the batched kernel (16 rows of x)")
    ap.add_argument("--parts", type=int, default=1, help="weights stacked in one launch (1-3)")
    ap.add_argument("--show", action="store_true", help="print the loop")
    ap.add_argument("--tile", help="the decode kernel's BNxNGxWARPSxSTAGES")
    ap.add_argument("--bm", type=int, default=16, help="the batched kernel's rows of x (16, 32, 64)")
    ap.add_argument("--wt", type=int, choices=(0, 1), help="the batched kernel's WT (W x.T)")
    args = ap.parse_args()
    for name in args.types:
        qtype = int(Q[name])
        tile = tuple(map(int, args.tile.split("x"))) if args.tile else None
        wt = None if args.wt is None else bool(args.wt)
        loop, values = loop_sass(qtype, 4096, args.k, args.batched, args.parts, tile, args.bm, wt)
        ops = collections.Counter(re.match(r"\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line).group(1)
                                  for line in loop)
        loads = collections.Counter(m.group(0) for line in loop
                                    for m in [re.search(r"LDG\S*|STL|LDL", line)] if m)
        print(f"{name}: {len(loop)} instructions per iteration, {values} values a thread: "
              f"{len(loop) / values:.1f} a value; loads {dict(loads)}")
        print("   " + " ".join(f"{op}:{count}" for op, count in ops.most_common(12)))
        if args.show:
            print("\n".join(loop))


def qkernels_types() -> list[Q]:
    return [Q(t) for t in qkernels.TYPES]


if __name__ == "__main__":
    main()
