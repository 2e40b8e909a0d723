"""Products with weights kept as their GGUF blocks: the raw bytes are the only copy.

    y (M, N) f32 = qmatmul(x (M, K), raw, qtype, n=N, k=K)
    y (M, N1 + N2 ..) f32 = qmatmul_stacked(x, [(raw1, qtype1, N1), (raw2, qtype2, N2) ..], k=K)

``raw`` is 1-D uint8 holding W (N, K) exactly as in the file: N rows of K / block_size
blocks (see qkernels for the layouts). Two paths, chosen by the rows of x and the device:

- M <= FUSED_ROWS on CUDA: one Triton kernel reads every weight byte once and dequantizes
  in registers (``qkernels._qgemv_kernel``). No memory beyond the (M, N) result.
- otherwise (prefill, or a CPU host): W is dequantized a tile of rows at a time into a
  scratch of at most SCRATCH_BYTES (f16 by a Triton kernel on CUDA, f32 by the torch
  decoders of ``dequant`` on a CPU) and multiplied densely; the scratch is freed after.

Block choices are a fixed function of the type and shape, so every process computes the
same bits. Triton comes with CUDA builds of PyTorch; without it only the CPU path exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from apir.graph.dtypes import DType

from . import dequant

try:
    import triton

    from . import qkernels
except ImportError:  # CPU-only PyTorch
    triton = qkernels = None

# x with at most this many rows is multiplied by the fused kernel (a decode step's rows)
FUSED_ROWS = 8
# dequantized rows of one tile of the prefill path, in bytes
SCRATCH_BYTES = 64 << 20

# ggml type id -> (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES
_SIZES: dict[int, tuple[int, int]] = (
    {q: lay[:2] for q, lay in qkernels.LAYOUTS.items()} if qkernels is not None
    else {int(d): (d.block_size, d.type_size) for d in dequant.SUPPORTED if d.is_quantized})
# types the CPU path decodes: those with a torch decoder in ``dequant``
_TORCH = {int(d) for d in dequant.SUPPORTED if d.is_quantized}


def fused_blocks(qtype: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, NB blocks per step, num_warps) of the fused kernel for a (n, k) weight.

    NB is the largest power of two up to 128 dividing the row's blocks (no step half past
    the end); then rows for about 128 values a thread, and at least one (row, block) pair
    for each thread (fewer warps where a row has few blocks). From the sm_90 builds (Triton
    3.6 and 3.9): 7 to 9 instructions a value, 32 to 96 registers, no spills;
    bench/probes/qgemv.py --sweep times the alternatives.
    """
    bs = qkernels.LAYOUTS[qtype][0]
    nblk = k // bs
    nb = 128
    while nb > 1 and nblk % nb:
        nb //= 2
    block_n = max(1, min(32, max(16384 // (nb * bs), 128 // nb)))
    return block_n, nb, max(1, min(4, block_n * nb // 32))


if qkernels is not None:

    def _launch_gemv(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int,
                     y: torch.Tensor | None = None) -> torch.Tensor:
        # x (M, K) f32 contiguous -> y (M, N) f32, written into ``y`` (rows unit-strided)
        bs, ts, nsub, a, b = qkernels.LAYOUTS[qtype]
        if y is None:
            y = torch.empty((x.shape[0], n), device=x.device, dtype=torch.float32)
        block_n, nb, warps = fused_blocks(qtype, n, k)
        qkernels._qgemv_kernel[(x.shape[0], triton.cdiv(n, block_n))](
            x, raw, y, n, k, y.stride(0), QT=qtype, BS=bs, TS=ts, NSUB=nsub, A=a, B=b,
            MIN=qtype in qkernels.MINS, ASM=qkernels.ASM, BLOCK_N=block_n, NB=nb,
            num_warps=warps)
        return y

    def _launch_dequant(raw: torch.Tensor, qtype: int, n: int, k: int,
                        dtype: torch.dtype) -> torch.Tensor:
        # raw: the bytes of n whole rows -> (n, k) of dtype
        bs, ts, nsub, a, b = qkernels.LAYOUTS[qtype]
        out = torch.empty((n, k), device=raw.device, dtype=dtype)
        block_n, nb = 2, 64
        qkernels._dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // bs, nb))](
            raw, out, n, k, QT=qtype, BS=bs, TS=ts, NSUB=nsub, A=a, B=b,
            MIN=qtype in qkernels.MINS, ASM=qkernels.ASM, BLOCK_N=block_n, NB=nb,
            num_warps=4, enable_fp_fusion=False)  # d*q - m rounded twice, as gguf-py does
        return out

    # Opaque custom ops, not triton_ops, for the reason gemv.py gives (Inductor compiles a
    # triton_op's kernel per call site while tracing); the launches are recorded into a
    # step's CUDA graph like any other.
    @torch.library.custom_op("apir::qgemv", mutates_args=())
    def _qgemv(x: torch.Tensor, raws: list[torch.Tensor], qtypes: list[int], ns: list[int],
               k: int) -> torch.Tensor:
        # the weights stacked along N: one launch each, into its columns of one result
        y = torch.empty((x.shape[0], sum(ns)), device=x.device, dtype=torch.float32)
        off = 0
        for raw, qtype, n in zip(raws, qtypes, ns):
            _launch_gemv(x, raw, qtype, n, k, y[:, off : off + n])
            off += n
        return y

    @_qgemv.register_fake
    def _(x: torch.Tensor, raws: list[torch.Tensor], qtypes: list[int], ns: list[int],
          k: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], sum(ns)), dtype=torch.float32)

    @torch.library.custom_op("apir::qdequant", mutates_args=())
    def _qdequant(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
        return _launch_dequant(raw, qtype, n, k, torch.float16)

    @_qdequant.register_fake
    def _(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
        return raw.new_empty((n, k), dtype=torch.float16)


def _check(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int) -> str | None:
    """Why ``qmatmul`` cannot take these arguments, or None."""
    if qtype not in _SIZES:
        return f"type {qtype} is not a supported block type"
    if not x.is_cuda and (qtype not in _TORCH or not x.is_floating_point()):
        return f"type {qtype} has no CPU decoder"
    bs, ts = _SIZES[qtype]
    if n <= 0 or k <= 0 or k % bs:
        return f"K={k} must be a positive multiple of {bs}"
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != n * (k // bs) * ts:
        return f"raw must be 1-D uint8 of {n * (k // bs) * ts} bytes, got {raw.dtype} {tuple(raw.shape)}"
    if x.dim() != 2 or x.shape[1] != k or x.device != raw.device:
        return f"x must be (M, {k}) on {raw.device}, got {tuple(x.shape)} on {x.device}"
    if raw.is_cuda and (qkernels is None or raw.data_ptr() % 4):
        return "raw must start 4-byte aligned on a CUDA device with Triton"
    return None


def usable(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int) -> bool:
    """Whether ``qmatmul(x, raw, qtype, n, k)`` applies."""
    return _check(x, raw, int(qtype), n, k) is None


def qmatmul(x: torch.Tensor, raw: torch.Tensor, qtype: int | DType, n: int, k: int) -> torch.Tensor:
    """x (M, K) @ W.T in f32 for W (N, K) held as GGUF blocks of ggml type ``qtype`` in ``raw``.

    Raises ValueError where ``usable`` is False.
    """
    return qmatmul_stacked(x, [(raw, qtype, n)], k)


def qmatmul_stacked(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int | DType, int]],
                    k: int) -> torch.Tensor:
    """x (M, K) @ W.T in f32 for W the weights ``parts`` = [(raw, qtype, N_i)] stacked along
    N (a fused q/k/v or gate/up product), each kept where it is, in its own type: (M, sum N_i).

    Raises ValueError where ``usable`` is False for a part.
    """
    parts = [(raw, int(qtype), n) for raw, qtype, n in parts]
    for raw, qtype, n in parts:
        why = _check(x, raw, qtype, n, k)
        if why is not None:
            raise ValueError(f"qmatmul: {why}")
    if x.is_cuda and x.shape[0] <= FUSED_ROWS:
        return _qgemv(x.float().contiguous(), *map(list, zip(*parts)), k)
    wdtype = torch.float16 if x.is_cuda else torch.float32
    rows = max(1, SCRATCH_BYTES // (k * wdtype.itemsize))
    xs = x.to(wdtype)  # rounded as the dense path rounds x to its f16 weights
    y = torch.empty((x.shape[0], sum(n for _, _, n in parts)), device=x.device, dtype=torch.float32)
    off = 0
    for raw, qtype, n in parts:
        ts = _SIZES[qtype][1] * (k // _SIZES[qtype][0])  # bytes per row
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            tile = raw[r0 * ts : r1 * ts]
            if x.is_cuda:
                w = _qdequant(tile, qtype, r1 - r0, k)
            else:
                w = dequant.dequantize(tile, DType(qtype), (r1 - r0, k))
            y[:, off + r0 : off + r1] = torch.matmul(xs, w.T)
        off += n
    return y
