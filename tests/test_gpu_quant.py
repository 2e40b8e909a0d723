"""Products from GGUF blocks on CUDA (run on a GPU host: pytest -m gpu tests/test_gpu_quant.py):
the fused decode kernel and the dequantize-then-matmul path of qmatmul against gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from test_qmatmul import INT8_X, SCALES, check_products, check_stacked, random_weight

from apir.backends.local import qmatmul as qm
from apir.backends.local import qpack

pytestmark = pytest.mark.gpu
TYPES = list(SCALES)


def _cuda(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).cuda()


def _packed(raw: np.ndarray, qtype, n: int, k: int) -> torch.Tensor:
    return qpack.pack(_cuda(raw), int(qtype), n, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fused_decode_rows_match_gguf(qtype):
    def product(x, raw, n, k):
        assert x.shape[0] <= qm.FUSED_ROWS  # the fused kernel's path
        return qm.qmatmul(_cuda(x), _packed(raw, qtype, n, k), qtype, n, k)
    # x rounded to int8 per group of 32 in the kernel (dp4a), as llama.cpp's q8_1 x
    check_products(qtype, product, rel=INT8_X, rows=(1, 3, qm.FUSED_ROWS))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_batched_decode_rows_match_gguf(qtype, monkeypatch):
    monkeypatch.setattr(qm, "BATCH_MIN_VALUES", 0)  # these small weights through the batched kernel

    def product(x, raw, n, k):
        # the batched kernel's path (K of 64 to 512 too), called directly for Q6_K, which
        # qmatmul dequantizes at these rows
        assert qm.batched(x.shape[0], int(qtype), n, k) == (qtype != Q.Q6_K)
        if qtype == Q.Q6_K:
            return qm._launch_mm(qm.slot_order(_cuda(x), int(qtype)), [_packed(raw, qtype, n, k)], int(qtype), [n], k).sum(0)
        return qm.qmatmul(_cuda(x), _packed(raw, qtype, n, k), qtype, n, k)
    # x and W are rounded to f16 before the tensor cores multiply them
    check_products(qtype, product, rel=2e-3, rows=(qm.FUSED_ROWS + 1, 13, 16, 17, 40, qm.BATCH_ROWS))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prefill_rows_match_gguf(qtype, monkeypatch):
    # BATCH_ROWS + 1 rows take the dequantize + matmul path; a scratch of 192 B makes it tile N (1 to 3 rows)
    monkeypatch.setattr(qm, "SCRATCH_BYTES", 3 * 64 * 2)
    def product(x, raw, n, k):
        return qm.qmatmul(_cuda(x), _packed(raw, qtype, n, k), qtype, n, k)
    # x and W are rounded to f16 before cuBLAS multiplies them
    check_products(qtype, product, rel=2e-3, rows=(qm.BATCH_ROWS + 1,))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequant_kernel_is_bit_exact_on_cuda(qtype):
    for n, k in [(13, 96), (5, 768)] if quants.GGML_QUANT_SIZES[qtype][0] == 32 else [(13, 256), (5, 768)]:
        raw = random_weight(qtype, n, k, seed=n)
        got = qm._launch_dequant(_packed(raw, qtype, n, k), int(qtype), n, k, torch.float32)
        np.testing.assert_array_equal(got.cpu().numpy(), quants.dequantize(raw.reshape(n, -1), qtype))


@pytest.mark.parametrize("m", [1, 13, 40, 65])
def test_stacked_weights_of_mixed_types_on_cuda(m, monkeypatch):
    monkeypatch.setattr(qm, "BATCH_MIN_VALUES", 0)  # 13 and 40 rows through the batched kernel

    def product(x, parts):
        return qm.qmatmul_stacked(_cuda(x), [(_packed(r, t, n, 512), t, n) for r, t, n in parts], 512)
    check_stacked(product, m, rel=INT8_X if m <= qm.FUSED_ROWS else 2e-3)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_that_make_their_activation_and_add_a_residual_match_gguf(qtype):
    # kernels.qproduct as a decode step calls it: x left to make (the halves of a fused
    # gate/up product, strided views; a norm times its weight) and a residual or bias added
    # by the product's own kernel; against gguf-py over the activation made in numpy
    from test_qmatmul import check

    from apir.backends.local import kernels

    bs = quants.GGML_QUANT_SIZES[qtype][0]
    for i, (n, k) in enumerate([(13, 8 * bs if bs == 32 else 512), (1024, 4096)]):
        raw = random_weight(qtype, n, k, seed=i)
        w = kernels.Blocks(_packed(raw, qtype, n, k), int(qtype), (n, k))
        rng = np.random.default_rng(i)
        for m in (1, 3, qm.FUSED_ROWS):
            both = rng.standard_normal((m, 2 * k)).astype(np.float32)
            gate, up = both[:, :k], both[:, k:]
            r = rng.standard_normal((m, n)).astype(np.float32)
            t = _cuda(both)
            y = kernels.qproduct(kernels.Glu(t[:, :k], t[:, k:]), (w,), _cuda(r))
            check((y.cpu() - torch.from_numpy(r)), gate / (1 + np.exp(-gate)) * up, raw, qtype, n, k, rel=INT8_X)
            x = 2 * rng.standard_normal((m, k)).astype(np.float32)
            nw = rng.standard_normal(k).astype(np.float32)
            bias = rng.standard_normal(n).astype(np.float32)
            y = kernels.qproduct(kernels.Normed(_cuda(x), 1e-6, _cuda(nw)), (w,), _cuda(bias))
            normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * nw
            check(y.cpu() - torch.from_numpy(bias), normed.astype(np.float32), raw, qtype, n, k, rel=INT8_X)
            # off the fused kernel's path (the same value made by torch, then the product)
            made = kernels.qproduct(kernels.made(kernels.Normed(_cuda(x), 1e-6, _cuda(nw))), (w,))
            torch.testing.assert_close(y - _cuda(bias), made, rtol=0, atol=float(made.abs().max()) * 2e-2)


def test_8b_shapes_are_deterministic_and_graph_capturable():
    for qtype in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K):
        n, k = 4096, 14336
        raw = _cuda(random_weight(qtype, n, k, seed=1))
        w = qpack.pack(raw, int(qtype), n, k)
        x = torch.randn(1, k, device="cuda")
        first = qm.qmatmul(x, w, qtype, n, k)
        out = torch.empty_like(first)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            qm.qmatmul(x, w, qtype, n, k)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out.copy_(qm.qmatmul(x, w, qtype, n, k))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, out), qtype.name
        w = torch.from_numpy(quants.dequantize(raw.cpu().numpy().reshape(n, -1), qtype)).cuda()
        want = x.double() @ w.double().T
        bound = x.double().abs() @ w.double().abs().T  # as check(): int8 x
        assert ((first.double() - want).abs() <= INT8_X * bound).all(), qtype.name


def test_misaligned_weight_is_refused_on_cuda():
    buf = torch.zeros(4 + 4 * 18 * 2, dtype=torch.uint8, device="cuda")
    raw = buf[4:]  # 4-byte aligned only
    x = torch.zeros(1, 64, device="cuda")
    assert not qm.usable(x, raw, Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        qm.qmatmul(x, raw, Q.Q4_0, 4, 64)
