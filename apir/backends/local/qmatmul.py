"""Products with quantized weights: the weight's bytes are its only copy.

    y (M, N) f32 = qmatmul(x (M, K), w, qtype, n=N, k=K)
    y (M, N1 + N2 ..) f32 = qmatmul_stacked(x, [(w1, qtype1, N1), (w2, qtype2, N2) ..], k=K)

``w`` is 1-D uint8 holding W (N, K): on a device where ``packs`` is true (CUDA with
Triton) in ``qpack``'s packed form, elsewhere as GGUF blocks, exactly as in the file.
Three paths, chosen by the rows of x, the device and (for Q6_K) the type:

- M <= FUSED_ROWS on CUDA: x is rounded to int8 per group of 32, then one Triton kernel
  reads every weight byte once and multiplies in integers (``qkernels._qgemv_kernel``).
  No memory beyond the (M, N) result and int8 x. ``decode_product`` also makes x from
  the op before it (a SwiGLU, a norm times its weight) as it rounds it, and adds a
  residual or bias as it writes y: a decode step's launches for those ops are gone.
- M <= BATCH_ROWS on CUDA (a batched decode step), a weight not Q6_K of at least
  BATCH_MIN_VALUES values (``batched``): a Triton kernel dequantizes each weight tile once,
  to f16, and multiplies it with a tile of 16 to 64 rows on the tensor cores
  (``qkernels._qmm_kernel``; above 16 rows as W x.T), in parts along K that the caller
  sums. No memory beyond those parts.
  Both decode kernels take up to MAX_PARTS stacked weights of one type in one launch.
- otherwise (prefill, or a CPU host): W is dequantized a tile of rows at a time into a
  scratch of at most SCRATCH_BYTES (f16 by a Triton kernel on CUDA, f32 by the torch
  decoders of ``dequant`` on a CPU) and multiplied densely; the scratch is freed after.

Block choices are a fixed function of the type and shape, so every process computes the
same bits. Triton comes with CUDA builds of PyTorch; without it only the CPU path exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from apir.graph.dtypes import DType

from . import dequant, qpack

try:
    import triton

    from . import qkernels
except ImportError:  # CPU-only PyTorch
    triton = qkernels = None

# x with at most this many rows is multiplied by the fused kernel (a decode step's rows).
# Its time grows with the rows (each reads the weight's words again from cache), the
# batched kernel's not below 16: on an H200 at 4 rows they were level on Q4_0 (45.9 against
# 44.2 us, an 8B's 14336 x 4096), the fused one 1.3x slower on Q8_0 and Q4_K, 0.6x on Q6_K;
# at 8 rows 1.1-2.5x slower on all four (bench/probes/qgemv.py --rows 4|8, 2026-12-04)
FUSED_ROWS = 4
# ... and with at most this many by the batched kernel (a batched decode step's rows): one
# tile of x's rows, 16, 32 or 64. Above 16 the product is taken as W x.T, whose tile Hopper's
# wgmma reads from registers, and a 64-row tile reads the weight once: on an H200 at 64
# rows it took 0.66-0.80 of the time of dequantizing and a matmul, where four 16-row tiles
# (the kernel before) took 1.4-4.2x (bench/probes/qgemv.py --rows 64, 2026-12-04: an 8B's
# 14336 x 4096, Q4_0 61.0 against 81.7 us, Q8_0 59.4 against 94.1, Q4_K 74.6 against 90.0)
BATCH_ROWS = 64
# ... and only for a product of at least this many weight values (a run of stacked weights
# together): below it a K of 2,048 gives too few programs to fill the GPU, and dequantizing
# then a matmul was faster (an H200 at 16 rows: a 1B's q, k, v of 3072 x 2048 in Q4_0 took
# 12.5 against at best 14.2 us, its 2048 x 2048 output 11.1 against 13.9; at 64 rows 12.9
# against 17.9; the 16384 x 2048 gate and up 27.3 against 46.4, 38.8 against 48.3)
BATCH_MIN_VALUES = 1 << 24
# weights of one type one decode launch takes (stacked along N: q, k, v)
MAX_PARTS = 3
# dequantized rows of one tile of the prefill path, in bytes
SCRATCH_BYTES = 64 << 20
# ... on a CPU, where a tile that stays in the cache between being written and multiplied
# is what makes it cheap: SmolLM2's Q8_0 output (49152 x 576) in one decode step, 1 thread,
# took 13.4 ms in 2.3 MB tiles, 19.9 in 9.2 MB, 20.0 in 0.6 MB (the f32 copy: 7.5 ms)
CPU_SCRATCH_BYTES = 2 << 20
# ... and x padded to a multiple of this many rows: the CPU's f32 product (MKL, torch 2.13)
# takes another kernel for 1 to 3 rows, and with 2 threads for a part of 1 to 3 rows, so a
# row's result depended on the rows beside it; a greedy request then gave other tokens in
# a batched step than alone (SmolLM2, "The color of the rainbow" against "... the most").
# From 4 rows on, a row's bits are the same whatever rows are beside it
# (tests/test_batch_invariance.py); the padding costs a decode step's products of one row
# the time of four (0.07 against 0.18 ms for 1536 x 576, 1 thread).
CPU_ROW_QUANTUM = 4

# types the CPU path decodes: those with a torch decoder in ``dequant``
_TORCH = {int(d) for d in dequant.SUPPORTED if d.is_quantized}


# what the fused decode kernel makes of its x as it rounds it (quantize_x): x itself, the
# gated activation silu(x) * u, or x normalized, rms_norm(x, eps) * u
PLAIN, GLU, NORM = 0, 1, 2


def packs(device: torch.device) -> bool:
    """Whether quantized weights on ``device`` are held packed (and computed by Triton)."""
    return device.type == "cuda" and qkernels is not None


def _groups_a_step(qtype: int, k: int, most: int) -> int:
    """NG, the groups of 32 a program's K-step takes: a power of two up to ``most``, the
    largest whose steps cover the row's groups with at most an eighth of them masked."""
    groups = k // 32
    ng = 1
    while 2 * ng <= most and -(-groups // (2 * ng)) * 2 * ng * 8 <= groups * 9:
        ng *= 2
    return ng


def tiles(qtype: int, n: int, k: int, fused: bool) -> tuple[int, int, int]:
    """(BN rows, NG groups of 32 a K-step, num_warps) of a program for a packed (n, k)
    weight. The fused kernel: 2 rows, a step of up to 32 groups, 2 warps, every type. On an
    H100 (bench/probes/qgemv.py --configs, 2026-12-07, once the kernel loaded a step ahead)
    that tile took an 8B's Q4_0 products in 59.1 us a layer (q/k/v 8.92, o 7.35, gate/up
    26.57, down 16.26) and its output in 101.8, against 71.2 and 133.6 for the tile before
    (4 rows, 16 groups, 4 warps, chosen on an H200 for the kernel that waited on each
    step's loads; with the loads ahead that tile gained nothing); Q4_K 64.9 against 70.7
    (its tile before: 4 rows, 32 groups, 2 warps), its output 114.6 against 142.6. Of seven
    tiles it was the fastest on the 8B's larger products, within 2.5% on the smaller ones.
    The dequantize kernel: 8 groups a row step, 4,096 values a program, 4 warps."""
    if fused:
        return min(2, 1 << (n - 1).bit_length()), _groups_a_step(qtype, k, 32), 2
    ng = _groups_a_step(qtype, k, 8)
    return max(1, 4096 // (32 * ng)), ng, 4


def batch_tiles(qtype: int, n: int, k: int, m: int) -> tuple[int, int, int, int, int, bool]:
    """(BM rows of x, BN rows of W, NG groups of 32 a K-step, num_warps, num_stages, WT) of
    the batched kernel for x of ``m`` rows, WT: the product taken as W x.T (see
    ``BATCH_ROWS``). Never under 16 words a step: a slot's product is a tensor-core dot,
    whose K must be 16 or more (the masks take the groups past a short row's end).
    Up to 16 rows: the 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) 16 x 128 in 4 warps,
    4 groups a step (16 low words; Q8_0 32), two stages; Q4_K and Q5_K 16 x 128 in 4 warps,
    8 groups, one stage; Q2_K and Q3_K 16 x 256 in 8 warps, 8 groups (16 words). On an H100
    (bench/probes/batched_tiles.sh and qgemv.py --rows 16 --configs, 2026-12-06, seven
    products of a 1B and an 8B, x in slot order, K split as ``k_splits`` does) those took,
    in all: Q4_0 183 us (the 16 x 256/512 tiles in 8 warps before: 256; 13 tiles tried),
    Q8_0 214 (252), Q5_0 282 (423), Q4_1 205 (its tile before: the same), Q4_K 257
    (276), Q5_K 390 (460). The wide tiles held 196-255 registers a thread, one program a
    multiprocessor, and were latency-bound (ncu on an H200, 2026-12-04). Q5_1 is taken
    with Q5_0 and Q2_K, Q3_K are kept as they were, unmeasured. Above 16 rows: 32 or 64 x
    128 in 4 warps, 8 groups a step, as W x.T; at 64 rows the fastest of seven tiles on the
    H100 too (Q4_0 213 us in all, Q4_K 246). 16 groups of a 2-bit type spill registers
    (bench/probes/qkernel_sass.py --batched)."""
    low = qpack.low_bits(qtype)
    least = 16 // low  # groups that make 16 words
    if m > 16:
        return 32 if m <= 32 else 64, 128, max(least, _groups_a_step(qtype, k, 8)), 4, 1, True
    if qpack.block_size(qtype) == 32:
        return 16, 128, max(least, _groups_a_step(qtype, k, 4)), 4, 2, False
    ng = max(least, _groups_a_step(qtype, k, 8))
    if qtype in (12, 13):  # Q4_K, Q5_K
        return 16, 128, ng, 4, 1, False
    return 16, 256, ng, 8, 1, False


def slot_order(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """x (M, K) as the batched kernel reads it: f16 (M, S, K / 32, LB) for a type whose low
    words are LB to a group and hold S = 32 / LB values each, [m, s, g, w] = x[m, 32 g + S w
    + s]. A slot's x values are then one contiguous run a row, as its weight values are; read
    in K's order, each load was LB strided f32 values a group (at 128 rows a tile, about as
    many bytes as the weights')."""
    m, k = x.shape
    low = qpack.low_bits(qtype)
    out = torch.empty((m, 32 // low, k // 32, low), device=x.device, dtype=torch.float16)
    return out.copy_(x.reshape(m, k // 32, low, 32 // low).permute(0, 3, 1, 2))  # one copy, eager too


def k_splits(qtype: int, m: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """(parts, groups a part) the batched kernel splits K into for x of ``m`` rows: enough
    programs for 4 a multiprocessor (``sms`` of them), each part at least 2 steps and whole
    steps. Without a split an 8B's 4096 x 14336 product at 16 rows was 64 programs of 4
    warps (64-row tiles) on an H200's 132 multiprocessors: 0.24 TB/s
    (bench/probes/qgemv.py --rows 16). The parts are summed in a fixed order: a shape
    always gives the same result."""
    bm, bn, ng, *_ = batch_tiles(qtype, n, k, m)
    programs = -(-m // bm) * -(-n // bn)
    steps = -(-(k // 32) // ng)
    want = max(1, min(steps // 2, -(-4 * sms // programs)))
    per = -(-steps // want) * ng
    return -(-(k // 32) // per), per


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors, which kernels size their grids by; 132 (an H200's) off
    CUDA, under Triton's interpreter, so tests split work as the H200 does."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def runs(qtypes: Sequence[int]) -> list[tuple[int, int]]:
    """The [a, b) runs of consecutive weights of one type, at most MAX_PARTS long, that a
    stacked product launches one decode kernel for (q, k, v of one type: one launch)."""
    out: list[tuple[int, int]] = []
    for i, qtype in enumerate(qtypes):
        if out and qtypes[out[-1][0]] == qtype and i - out[-1][0] < MAX_PARTS:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def batched(m: int, qtype: int, n: int, k: int) -> bool:
    """Whether x of ``m`` rows times a packed (n, k) weight of ``qtype`` (or a run of
    stacked ones, n rows in all) takes the batched kernel (see BATCH_MIN_VALUES). Not Q6_K:
    its two high bits a value cost the kernel more than dequantizing the weight once and a
    matmul (on an H200, an 8B's 14336 x 4096 product: 108-113 against 92-97 us at 5 to 16
    rows, 128 against 93 at 64; bench/probes/qgemv.py --rows 4|8|16|64, 2026-12-04)."""
    return FUSED_ROWS < m <= BATCH_ROWS and qtype != 14 and n * k >= BATCH_MIN_VALUES


if qkernels is not None:

    def _planes(w: torch.Tensor, qtype: int, n: int, k: int) -> list[torch.Tensor]:
        # the packed weight's planes as the kernels read them: low and high words (int32;
        # the low plane again where there is no high one), then up to three scale planes
        g = qpack.geometry(qtype, n, k)
        views = [w[off : off + per * n] for off, per in g.planes]
        low = views[0].view(torch.int32)
        rest = views[1:]
        high = low
        if g.hb:
            high = rest[0].view(torch.int32)
            rest = rest[1:]
        if qtype in (2, 3, 6, 7, 8):
            scales = [v.view(torch.float16) for v in rest]
        elif qtype == 10:
            scales = [rest[0], rest[1].view(torch.float16), rest[2].view(torch.float16)]
        elif qtype == 11:
            scales = [rest[0], rest[1].view(torch.float16)]
        elif qtype in (12, 13):
            scales = [rest[0]]
        else:  # Q6_K
            scales = [rest[0].view(torch.int8), rest[1].view(torch.float16)]
        scales += [scales[0]] * (3 - len(scales))
        return [low, high, *scales]

    def _meta(qtype: int) -> dict:
        lb, hb, off, mins = qkernels.TYPES[qtype]
        return dict(QT=qtype, LB=lb, HB=hb, OFF=off, MIN=mins)

    def _stack(ws: Sequence[torch.Tensor], qtype: int, ns: Sequence[int], k: int,
               bn: int) -> tuple[list, dict, int]:
        # a launch's arguments for up to MAX_PARTS weights of one type stacked along N: every
        # weight's planes (the first's again for absent ones), their rows and row tiles; and
        # the launch's row tiles in all
        planes = [p for w, n in zip(ws, ns) for p in _planes(w, qtype, n, k)]
        planes += planes[:5] * (MAX_PARTS - len(ws))
        counts = [triton.cdiv(n, bn) for n in ns] + [0] * (MAX_PARTS - len(ns))
        rows = list(ns) + [0] * (MAX_PARTS - len(ns))
        return planes, dict(N0=rows[0], N1=rows[1], N2=rows[2], T0=counts[0], T1=counts[1], P=len(ws),
                            **_meta(qtype)), sum(counts)

    def quantize_x(x: torch.Tensor, qtype: int, act: int = PLAIN, u: torch.Tensor | None = None,
                   eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The activation v (M, K) rounded to int8 per group of 32 for the fused kernel and
        weights of ``qtype``: (xq (M, K/32, 8) int32, four values a word in the order of
        the type's low words; xs (M, K/32, 4) f32: the scale, the sums of each half's int8
        values, 0). v is x (PLAIN), silu(x) * u (GLU, u of x's shape) or rms_norm(x, eps) *
        u (NORM, u the norm's weight (K,)), made as it is rounded; x and u have unit-strided
        rows."""
        m, k = x.shape
        u = x if u is None else u
        pdl = qkernels.dependent_launches(x.device)
        xq = torch.empty((m, k // 32, 8), device=x.device, dtype=torch.int32)
        xs = torch.empty((m, k // 32, 4), device=x.device, dtype=torch.float32)
        qkernels._quantize_x_kernel[(m, triton.cdiv(k // 32, 32))](
            x, u, xq, xs, k, x.stride(0), u.stride(0) if u.dim() == 2 else 0, eps,
            LB=qpack.low_bits(qtype), ACT=act, BG=32, PDL=pdl, num_warps=4, launch_pdl=pdl)
        return xq, xs

    def _launch_gemv(xq: tuple[torch.Tensor, torch.Tensor], ws: Sequence[torch.Tensor], qtype: int,
                     ns: Sequence[int], k: int, y: torch.Tensor | None = None,
                     r: torch.Tensor | None = None) -> torch.Tensor:
        # quantize_x's x (M rows) -> y (M, sum ns) f32, written into ``y`` (rows unit-strided);
        # plus r (M, sum ns), unit-strided rows, where given (rows 0 apart: a bias)
        m = xq[0].shape[0]
        if y is None:
            y = torch.empty((m, sum(ns)), device=xq[0].device, dtype=torch.float32)
        bn, ng, warps = tiles(qtype, ns[0], k, fused=True)
        planes, args, tiles_n = _stack(ws, qtype, ns, k, bn)
        pdl = qkernels.dependent_launches(y.device)
        qkernels._qgemv_kernel[(m, tiles_n)](
            *xq, *planes, y, y if r is None else r, K=k, LDY=y.stride(0),
            LDR=0 if r is None else r.stride(0), **args, ASM=qkernels.ASM, BN=bn, NG=ng,
            ADD=r is not None, PDL=pdl, num_warps=warps, num_stages=2, launch_pdl=pdl)
        return y

    def _launch_mm(xs: torch.Tensor, ws: Sequence[torch.Tensor], qtype: int, ns: Sequence[int],
                   k: int) -> torch.Tensor:
        # x (M, K) in ``slot_order`` -> (splits, M, sum ns) f32: the product split along K in
        # ``k_splits`` parts, which the caller sums (in a compiled step, into the kernel that
        # reads the result)
        m, n = xs.shape[0], sum(ns)
        xs = xs.contiguous()  # as slot_order makes it: a no-op unless a caller's layout differs
        bm, bn, ng, warps, stages, wt = batch_tiles(qtype, n, k, m)
        splits, per = k_splits(qtype, m, n, k, multiprocessors(xs.device))
        out = torch.empty((splits, m, n), device=xs.device, dtype=torch.float32)
        planes, args, tiles_n = _stack(ws, qtype, ns, k, bn)
        qkernels._qmm_kernel[(triton.cdiv(m, bm), tiles_n, splits)](
            xs, *planes, out, M=m, K=k, LDY=out.stride(-2), SPLIT_GROUPS=per, SPLIT_STRIDE=m * n,
            **args, ASM=qkernels.ASM, BM=bm, BN=bn, NG=ng, WT=wt, num_warps=warps, num_stages=stages)
        return out

    def _launch_dequant(w: torch.Tensor, qtype: int, n: int, k: int, dtype: torch.dtype,
                        r0: int = 0, r1: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        # rows r0..r1 of a packed (n, k) weight -> (r1 - r0, k) of dtype, written into ``out``
        # (contiguous) where given
        r1 = n if r1 is None else r1
        if out is None:
            out = torch.empty((r1 - r0, k), device=w.device, dtype=dtype)
        bn, ng, warps = tiles(qtype, n, k, fused=False)
        qkernels._dequant_kernel[(triton.cdiv(r1 - r0, bn), triton.cdiv(k // 32, ng))](
            *_planes(w, qtype, n, k), out, r0, r1, k, **_meta(qtype), BN=bn, NG=ng,
            num_warps=warps, enable_fp_fusion=False)  # d*q + m rounded twice, as gguf-py does
        return out

    def _rows(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    # Opaque custom ops, not triton_ops, for the reason gemv.py gives (Inductor compiles a
    # triton_op's kernel per call site while tracing); the launches are recorded into a
    # step's CUDA graph like any other.
    @torch.library.custom_op("apir::qgemv", mutates_args=())
    def _qgemv(x: torch.Tensor, u: torch.Tensor | None, r: torch.Tensor | None, act: int, eps: float,
               ws: list[torch.Tensor], qtypes: list[int], ns: list[int], k: int) -> torch.Tensor:
        # act(x, u) (quantize_x) @ the weights stacked along N, plus r (broadcast to the
        # result: a residual, a bias) where given: one launch a run of one type, into its
        # columns of y. x, u and r may be views with strided rows (the halves of a fused
        # gate/up product), read in place
        m, n = x.shape[0], sum(ns)
        x, u = _rows(x), None if u is None else _rows(u)
        r = None if r is None else _rows(r.expand(m, n))
        y = torch.empty((m, n), device=x.device, dtype=torch.float32)
        xqs = {}  # x rounded once for every run whose type has as many low words a group
        off = 0
        for a, b in runs(qtypes):
            width = sum(ns[a:b])
            low = qpack.low_bits(qtypes[a])
            if low not in xqs:
                xqs[low] = quantize_x(x, qtypes[a], act, u, eps)
            _launch_gemv(xqs[low], ws[a:b], qtypes[a], ns[a:b], k, y[:, off : off + width],
                         None if r is None else r[:, off : off + width])
            off += width
        return y

    @_qgemv.register_fake
    def _(x: torch.Tensor, u: torch.Tensor | None, r: torch.Tensor | None, act: int, eps: float,
          ws: list[torch.Tensor], qtypes: list[int], ns: list[int], k: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], sum(ns)), dtype=torch.float32)

    @torch.library.custom_op("apir::qmm", mutates_args=())
    def _qmm(xs: torch.Tensor, ws: list[torch.Tensor], qtype: int, ns: list[int], k: int) -> torch.Tensor:
        return _launch_mm(xs, ws, qtype, ns, k)

    @_qmm.register_fake
    def _(xs: torch.Tensor, ws: list[torch.Tensor], qtype: int, ns: list[int], k: int) -> torch.Tensor:
        splits = k_splits(qtype, xs.shape[0], sum(ns), k, multiprocessors(xs.device))[0]
        return xs.new_empty((splits, xs.shape[0], sum(ns)), dtype=torch.float32)

    @torch.library.custom_op("apir::qdequant", mutates_args=())
    def _qdequant(w: torch.Tensor, qtype: int, n: int, k: int, r0: int, r1: int) -> torch.Tensor:
        return _launch_dequant(w, qtype, n, k, torch.float16, r0, r1)

    @_qdequant.register_fake
    def _(w: torch.Tensor, qtype: int, n: int, k: int, r0: int, r1: int) -> torch.Tensor:
        return w.new_empty((r1 - r0, k), dtype=torch.float16)

    @torch.library.custom_op("apir::qdequant_stacked", mutates_args=())
    def _qdequant_stacked(ws: list[torch.Tensor], qtypes: list[int], ns: list[int], k: int) -> torch.Tensor:
        # whole weights stacked along N (q, k, v) -> one (sum ns, k) f16 scratch, each part
        # in its own type: one matmul reads them all
        out = torch.empty((sum(ns), k), device=ws[0].device, dtype=torch.float16)
        off = 0
        for w, qtype, n in zip(ws, qtypes, ns):
            _launch_dequant(w, qtype, n, k, torch.float16, out=out[off : off + n])
            off += n
        return out

    @_qdequant_stacked.register_fake
    def _(ws: list[torch.Tensor], qtypes: list[int], ns: list[int], k: int) -> torch.Tensor:
        return ws[0].new_empty((sum(ns), k), dtype=torch.float16)

    @torch.library.custom_op("apir::qrows", mutates_args=())
    def _qrows(w: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        return _launch_dequant(qpack.gather_rows(w, qtype, n, k, ids), qtype, ids.numel(), k,
                               torch.float32)

    @_qrows.register_fake
    def _(w: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        return w.new_empty((ids.numel(), k), dtype=torch.float32)


def cpu_tiles(x: torch.Tensor, n: int, k: int, values: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x (..., K) @ W.T in f32 for W (N, K) whose rows r0..r1 ``values(r0, r1)`` makes in
    f32, CPU_SCRATCH_BYTES of them at a time: each tile is multiplied while it is in the
    cache (a whole f32 copy would be written to memory and read back)."""
    x2 = x.reshape(-1, k).float()
    m = x2.shape[0]
    x2 = cpu_rows(x2)
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    step = max(1, CPU_SCRATCH_BYTES // (4 * k))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        torch.matmul(x2, values(r0, r1).T, out=y[:, r0:r1])
    return y[:m].reshape(*x.shape[:-1], n)


def cpu_rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) with zero rows added up to a multiple of CPU_ROW_QUANTUM (see there)."""
    pad = -x.shape[0] % CPU_ROW_QUANTUM
    return torch.cat([x, x.new_zeros((pad, x.shape[1]))]) if pad else x


def dequantize(w: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """W (n, k) as f32, bit-exact with gguf-py."""
    if packs(w.device):
        return _launch_dequant(w, qtype, n, k, torch.float32)
    return dequant.dequantize(w, DType(qtype), (n, k))


def get_rows(w: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of W (n, k) as f32 (*ids.shape, k), bit-exact with gguf-py:
    only the gathered rows are decoded."""
    flat = ids.long().reshape(-1)
    if packs(w.device):
        out = _qrows(w, qtype, n, k, flat)
    else:
        out = dequant.dequantize(w.view(n, -1)[flat].reshape(-1), DType(qtype), (flat.numel(), k))
    return out.reshape(*ids.shape, k)


def _check(x: torch.Tensor, w: torch.Tensor, qtype: int, n: int, k: int) -> str | None:
    """Why ``qmatmul`` cannot take these arguments, or None."""
    if qtype not in qpack.TYPES:
        return f"type {qtype} is not a supported block type"
    packed = packs(w.device)
    if not packed and (qtype not in _TORCH or not x.is_floating_point()):
        return f"type {qtype} has no decoder on {w.device}"
    bs = qpack.block_size(qtype)
    if n <= 0 or k <= 0 or k % bs:
        return f"K={k} must be a positive multiple of {bs}"
    size = qpack.geometry(qtype, n, k).nbytes
    if w.dtype != torch.uint8 or w.dim() != 1 or w.numel() != size:
        return f"the weight must be 1-D uint8 of {size} bytes, got {w.dtype} {tuple(w.shape)}"
    if x.dim() != 2 or x.shape[1] != k or x.device != w.device:
        return f"x must be (M, {k}) on {w.device}, got {tuple(x.shape)} on {x.device}"
    if packed and w.data_ptr() % 16:
        return "a packed weight must start 16-byte aligned"
    return None


def usable(x: torch.Tensor, w: torch.Tensor, qtype: int, n: int, k: int) -> bool:
    """Whether ``qmatmul(x, w, qtype, n, k)`` applies."""
    return _check(x, w, int(qtype), n, k) is None


def qmatmul(x: torch.Tensor, w: torch.Tensor, qtype: int | DType, n: int, k: int) -> torch.Tensor:
    """x (M, K) @ W.T in f32 for W (N, K) of ggml type ``qtype`` held in ``w`` (packed where
    ``packs``, else GGUF blocks).

    Raises ValueError where ``usable`` is False.
    """
    return qmatmul_stacked(x, [(w, qtype, n)], k)


def qmatmul_stacked(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int | DType, int]],
                    k: int) -> torch.Tensor:
    """x (M, K) @ W.T in f32 for W the weights ``parts`` = [(w, qtype, N_i)] stacked along
    N (a fused q/k/v or gate/up product), each kept where it is, in its own type: (M, sum N_i).

    Raises ValueError where ``usable`` is False for a part.
    """
    parts = [(w, int(qtype), n) for w, qtype, n in parts]
    for w, qtype, n in parts:
        why = _check(x, w, qtype, n, k)
        if why is not None:
            raise ValueError(f"qmatmul: {why}")
    return stacked_product(x, parts, k)


def stacked_product(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int, int]], k: int) -> torch.Tensor:
    """``qmatmul_stacked`` for arguments known to pass its checks (int qtypes): torch ops
    and apir's custom ops only, so a step that calls it can be traced and compiled."""
    ws, qtypes, ns = [w for w, _, _ in parts], [q for _, q, _ in parts], [n for _, _, n in parts]
    m, packed = x.shape[0], packs(x.device)
    if packed and m <= FUSED_ROWS:
        return _qgemv(x.float(), None, None, PLAIN, 0.0, ws, qtypes, ns, k)
    takes = [(a, b, packed and batched(m, qtypes[a], sum(ns[a:b]), k)) for a, b in runs(qtypes)]
    if not any(t for _, _, t in takes):
        return _dequantized_product(x, parts, k)
    # a batched decode step: each run of one type through the batched kernel, or (Q6_K, a
    # small product) dequantized and multiplied. x's slot order is made here, by torch ops,
    # not inside the kernel's op: in a compiled step Inductor writes it from the kernel that
    # makes x (a norm, silu * up), where the op's own copy was a launch of its own a product
    # (33 of a 1B's 16-stream step on an H200, 73 of its 1,673 us in kernels, 2026-12-04)
    ys = [_qmm(slot_order(x, qtypes[a]), ws[a:b], qtypes[a], ns[a:b], k).sum(0) if t
          else _dequantized_product(x, parts[a:b], k) for a, b, t in takes]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)


def fuses(x: torch.Tensor, k: int) -> bool:
    """Whether a product whose x (..., K) is made from ``x`` takes the fused decode kernel,
    which can make x itself (``decode_product``): few rows, a device where weights pack."""
    return packs(x.device) and x.numel() <= FUSED_ROWS * k


def decode_product(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int, int]], k: int,
                   act: int = PLAIN, u: torch.Tensor | None = None, eps: float = 0.0,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x, u) (M, K) @ W.T (+ residual) in f32 through the fused decode kernel, for
    arguments known to pass ``qmatmul_stacked``'s checks where ``fuses``: the activation
    (see PLAIN, GLU, NORM) made as x is rounded, the residual added as y is written, so
    neither is a launch of its own. ``residual`` broadcasts to (M, sum N_i)."""
    ws, qtypes, ns = [w for w, _, _ in parts], [q for _, q, _ in parts], [n for _, _, n in parts]
    x2 = x.reshape(-1, k)
    if u is not None and act == GLU:
        u = u.reshape(-1, k)
    r = None if residual is None else residual.reshape(-1, residual.shape[-1])
    return _qgemv(x2, u, r, act, eps, ws, qtypes, ns, k)


def _dequantized_product(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int, int]], k: int) -> torch.Tensor:
    # x (M, K) @ the stacked weights -> (M, sum N_i) f32: each weight dequantized a tile of
    # rows at a time into a scratch of at most SCRATCH_BYTES (CPU_SCRATCH_BYTES), then cuBLAS
    # (or the CPU's matmul); the scratch is freed after
    packed = packs(x.device)
    wdtype = torch.float16 if packed else torch.float32
    rows = max(1, (SCRATCH_BYTES if packed else CPU_SCRATCH_BYTES) // (k * wdtype.itemsize))
    xs = x.to(wdtype)  # rounded as the dense path rounds x to its f16 weights
    m = x.shape[0]
    n_all = sum(n for _, _, n in parts)
    if packed and len(parts) > 1 and n_all <= rows:
        # stacked weights that fit one scratch: one matmul for them all, not one a part (a
        # 1B's q, k and v at 16 rows: three cuBLAS launches of ~5 us each, H200 2026-12-04)
        tile = _qdequant_stacked([w for w, _, _ in parts], [q for _, q, _ in parts],
                                 [n for _, _, n in parts], k)
        return torch.matmul(xs, tile.T).float()
    if not packed:
        xs = cpu_rows(xs)
    y = torch.empty((xs.shape[0], n_all), device=x.device, dtype=torch.float32)
    off = 0
    for w, qtype, n in parts:
        per_row = qpack.geometry(qtype, 1, k).nbytes
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            if packed:
                tile = _qdequant(w, qtype, n, k, r0, r1)
            else:
                tile = dequant.dequantize(w[r0 * per_row : r1 * per_row], DType(qtype), (r1 - r0, k))
            y[:, off + r0 : off + r1] = torch.matmul(xs, tile.T)
        off += n
    return y[:m]
