"""One-row products (a decode step's matrix-vector products) as a Triton kernel.

A decode step reads every weight once, so its speed is the rate those reads run at. For
one activation row cuBLAS picks GEMM tiles of 8+ rows: on an H200 (4.8 TB/s peak) it reads
a 1B llama's q/k/v, output and down weights at 1.4, 1.0 and 2.1 TB/s; this kernel, which
streams each weight row once, at 2.4, 1.9 and 2.9, and the gate/up and vocabulary weights
at 3.8 and 4.5 against 3.2 and 4.0 (bench/probes/gemv.py; bench/results/*-probes.md).

    x (1, K) in w's dtype (``gemv`` rounds it first, as the cuBLAS path does)
    w (N, K) f16 or bf16, row-major;  y (1, N) f32 = x @ w.T, accumulated in f32

Program i computes outputs [i*BLOCK_N, (i+1)*BLOCK_N): it walks K in BLOCK_K steps,
keeping BLOCK_N x BLOCK_K partial sums, and reduces them at the end. The summation order
depends on K and BLOCK_K only, and the blocks are a fixed function of the shape, so every
process (native, a host's session) computes the same bits.

Triton comes with CUDA builds of PyTorch; without it (CPU wheels) ``usable`` is False.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch: products stay with torch.matmul
    triton = None


def blocks(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a (n, k) weight, chosen from the H200
    sweep over llama shapes (135M to 8B): enough programs to keep every SM reading, wide
    loads along K, and few rows per program where K is long and N short."""
    block_k = 512 if k >= 1536 else 128
    if n >= 12288:
        block_n = 16
    elif n >= 4096:
        block_n = 8
    else:
        block_n = 2 if k >= 2.5 * n else 4
    tile = block_n * block_k
    warps = 8 if tile <= 1024 or tile >= 8192 else 4
    return block_n, block_k, warps, 3


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            # each weight is read once: keep it out of L2's way
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :],
                        mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=rows < N)

    # An opaque custom op, not a triton_op: Inductor traces a triton_op's kernel launches
    # and works out each call site's written arguments by compiling the kernel to TTIR, tens
    # of milliseconds per call site, several times over (pytorch/pytorch#193227), and a
    # 30-layer model has 121 call sites per captured step. It could not fuse anything into
    # this kernel anyway; the launch inside the op is recorded into the step's CUDA graph
    # like any other.
    @torch.library.custom_op("apir::gemv", mutates_args=())
    def _gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        y = torch.empty((1, n), device=w.device, dtype=torch.float32)
        block_n, block_k, warps, stages = blocks(n, k)
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
        return y

    @_gemv.register_fake
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w.new_empty((1, w.shape[0]), dtype=torch.float32)


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv(x, w)`` applies: one row on a CUDA device, a 16-bit row-major weight."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and w.dim() == 2 and w.dtype in (torch.float16, torch.bfloat16) and w.is_contiguous()
            and x.shape[1] == w.shape[1] and x.is_contiguous())


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in f32 for one row (see the module docstring); check ``usable`` first."""
    return _gemv(x.to(w.dtype), w)  # torch rounds x (fused into its producer when compiled)
