"""What the first steps of any model pay once per process on a GPU, paid ahead: a warm
worker (``apir host --warm-workers``) calls ``warm_device`` before its guest arrives.

A profile of a session on a warm H200 worker (py-spy, 2026-12-02; the session's worker
spent 2.0 s in its first two steps) put most of it here, not in the model: Triton hashing
its own sources and its 500 MB libtriton before its first kernel (~0.5 s), CUDA loading
the modules of cuBLAS, fused attention and each elementwise kernel at their first launch,
Triton building the launchers of its kernels, and Inductor hashing torch's sources before
it loads a compiled step. None of it depends on the model: a few tiny calls make each
happen. What does depend on it (a kernel specialised to a weight's shape) is loaded from
Triton's and apir's caches at the first step.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from . import decode_attention, gemv, qmatmul, qpack

log = logging.getLogger("apir.local")
# block types a decode step's products most often read (Q4_K_M's mix, Q4_0, Q8_0)
TYPES = (2, 8, 12, 14)


def warm_device(dev: torch.device, compiles: bool) -> None:
    """Run each kind of kernel a step launches once, on tiny tensors, on ``dev`` (CUDA);
    ``compiles``: the worker will load or compile its decode step (Inductor)."""
    for dtype in (torch.float16, torch.float32):  # cuBLAS and cuBLASLt handles, their modules
        a = torch.ones(64, 64, device=dev, dtype=dtype)
        F.linear(a, a)
        torch.bmm(a[None], a[None])
    q = torch.ones(1, 2, 16, 64, device=dev, dtype=torch.float16)
    mask = torch.ones(16, 16, device=dev, dtype=torch.bool).tril()
    F.scaled_dot_product_attention(q, q, q, attn_mask=mask)  # fused attention (prefill)
    x = torch.linspace(-1, 1, 256, device=dev)[None]
    # the elementwise, reduction and indexing kernels of norms, RoPE and sampling
    (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).softmax(-1).argmax(-1)
    torch.sort(x, descending=True)
    torch.cumsum(x, -1)
    torch.multinomial(x.softmax(-1), 1)
    torch.cat([torch.cos(x), torch.sin(x)], -1).index_select(0, torch.zeros(1, dtype=torch.long, device=dev))
    _warm_triton(dev, x)
    torch.cuda.synchronize(dev)
    if compiles:
        with contextlib.suppress(Exception):  # a torch without Inductor compiles nothing
            from torch._inductor.codecache import torch_key

            torch_key()


def _warm_triton(dev: torch.device, x: torch.Tensor) -> None:
    # the first launch of any Triton kernel hashes Triton itself and builds the launcher;
    # decode attention, the f16 product and the block-type products are apir's kernels
    try:
        q = torch.ones(1, 2, 16, device=dev)
        kv = torch.ones(1, 16, 1, 16, device=dev, dtype=torch.float16)
        if decode_attention.usable(q, kv, kv):
            pos = torch.zeros(1, device=dev, dtype=torch.int32)
            decode_attention.attend_visible(q, kv, kv, pos, pos, 1.0, 0, 0.0)
        w16 = torch.ones(64, 256, device=dev, dtype=torch.float16)
        if gemv.usable(x.half(), w16):
            gemv.gemv(x.half(), w16)
        if qmatmul.packs(dev):
            for qtype in TYPES:
                n, k = 64, 256
                raw = torch.zeros(qpack.geometry(qtype, n, k).nbytes, device=dev, dtype=torch.uint8)
                qmatmul.qmatmul(x, qpack.pack(raw, qtype, n, k), qtype, n, k)
    except Exception as e:  # noqa: BLE001 - warming is an optimisation: the step pays it instead
        log.warning("warming the GPU's kernels failed (%s); the first step will pay for it", e)
