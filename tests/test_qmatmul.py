"""Products from GGUF blocks (apir.backends.local.qmatmul) against gguf.quants.dequantize
followed by a float64 numpy product, on random blocks and odd shapes; the packed form the
GPU kernels read (qpack) against the blocks it is made from.

The Triton kernels run on a CPU under Triton's interpreter: with triton installed,
TRITON_INTERPRET=1 pytest tests/test_qmatmul.py (the shared venv has no triton: skipped).
Without TRITON_INTERPRET, where triton is installed, every kernel is compiled for sm_90
instead (no GPU needed): best with the GPU host's Triton version, whose compiler is the one
that must accept them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from apir.backends.local import qmatmul as qm
from apir.backends.local import qpack

# byte offsets of the f16 scales (d, m, dmin) in each type's block
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
          Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
TORCH_TYPES = [t for t in SCALES if int(t) in qm._TORCH]
# Triton 3.6's interpreter needs numpy < 2.3 (it reads 1-element arrays as ints), e.g.
# PYTHONPATH=<numpy 2.2 dir>:<triton dir> TRITON_INTERPRET=1 pytest tests/test_qmatmul.py
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and qm.qkernels is not None
# the fused kernel's bound on |error| / (|x| @ |W|): x rounded to int8 per group of 32 moves
# each x by at most 1/254 of its group's largest |x| (on these normal x the worst is 3.5e-3)
INT8_X = 1e-2
needs_triton = pytest.mark.skipif(
    not INTERPRET, reason="needs triton and TRITON_INTERPRET=1 to run the kernels on a CPU")


def random_weight(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """(n, k) of qtype as raw bytes: random quants, finite f16 scales in [-0.1, 0.1)."""
    bs, ts = quants.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    for off in SCALES[qtype]:
        blocks[:, off : off + 2] = rng.uniform(-0.1, 0.1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def reference(x: np.ndarray, raw: np.ndarray, qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """x @ W.T in float64 and the bound |x| @ |W|.T that scales the allowed error."""
    w = quants.dequantize(raw.reshape(n, -1), qtype).astype(np.float64)
    return x.astype(np.float64) @ w.T, np.abs(x.astype(np.float64)) @ np.abs(w).T


def check(y: torch.Tensor, x: np.ndarray, raw: np.ndarray, qtype: Q, n: int, k: int, rel: float):
    want, scale = reference(x, raw, qtype, n, k)
    assert y.dtype == torch.float32 and tuple(y.shape) == want.shape
    err = np.abs(y.numpy().astype(np.float64) - want)
    assert (err <= rel * scale + 1e-6).all(), (qtype.name, float((err / (scale + 1e-30)).max()))


# K a multiple of the block but not of 256 (32-element types), N not a multiple of a row tile
SHAPES_32 = [(1, 13, 96), (3, 9, 64), (17, 5, 160)]
SHAPES_256 = [(1, 13, 256), (3, 9, 512), (17, 5, 768)]


def check_products(qtype: Q, product, rel: float, rows: tuple[int, ...] = ()):
    """``product(x, raw, n, k)`` (numpy in, a tensor (M, N) out) against gguf-py over the
    type's shapes, with their M or each of ``rows``."""
    shapes = SHAPES_32 if quants.GGML_QUANT_SIZES[qtype][0] == 32 else SHAPES_256
    for i, (m, n, k) in enumerate(shapes):
        raw = random_weight(qtype, n, k, seed=i)
        for mm in rows or (m,):
            x = np.random.default_rng(100 + i).standard_normal((mm, k)).astype(np.float32)
            check(product(x, raw, n, k).cpu(), x, raw, qtype, n, k, rel)


@pytest.mark.parametrize("qtype", TORCH_TYPES, ids=lambda t: t.name)
def test_cpu_path_matches_gguf(qtype):
    def product(x, raw, n, k):
        return qm.qmatmul(torch.from_numpy(x), torch.from_numpy(raw), qtype, n, k)
    check_products(qtype, product, rel=1e-5)


def test_cpu_path_tiles_rows_within_the_scratch(monkeypatch):
    # a scratch of 3 rows of K=64 f32: the 10 rows go through 4 tiles, same product
    monkeypatch.setattr(qm, "SCRATCH_BYTES", 3 * 64 * 4)
    raw = random_weight(Q.Q8_0, 10, 64, seed=7)
    x = np.random.default_rng(8).standard_normal((2, 64)).astype(np.float32)
    y = qm.qmatmul(torch.from_numpy(x), torch.from_numpy(raw), Q.Q8_0, 10, 64)
    check(y, x, raw, Q.Q8_0, 10, 64, rel=1e-5)


def stacked_case(m: int):
    """x and weights of three types with K=512 (a Q4_K_M q/k/v, then more), and the
    reference product with them stacked along N. The decode kernels launch once a run of
    one type, at most three weights: Q4_K x 2, Q6_K, Q8_0 x 3, Q8_0."""
    parts = [(Q.Q4_K, 7), (Q.Q4_K, 9), (Q.Q6_K, 3), (Q.Q8_0, 37), (Q.Q8_0, 4), (Q.Q8_0, 6), (Q.Q8_0, 2)]
    raws = [random_weight(t, n, 512, seed=n) for t, n in parts]
    x = np.random.default_rng(9).standard_normal((m, 512)).astype(np.float32)
    refs = [reference(x, raw, t, n, 512) for raw, (t, n) in zip(raws, parts)]
    want, scale = (np.concatenate(r, axis=1) for r in zip(*refs))
    return x, [(raw, t, n) for raw, (t, n) in zip(raws, parts)], want, scale


def check_stacked(product, m: int, rel: float):
    x, parts, want, scale = stacked_case(m)
    y = product(x, parts).cpu().numpy().astype(np.float64)
    assert y.shape == want.shape
    assert (np.abs(y - want) <= rel * scale + 1e-6).all()


def test_stacked_weights_of_mixed_types_multiply_as_one():
    def product(x, parts):
        return qm.qmatmul_stacked(torch.from_numpy(x), [(torch.from_numpy(r), t, n) for r, t, n in parts], 512)
    check_stacked(product, 3, rel=1e-5)


def test_bad_arguments_are_refused_with_the_reason():
    raw = torch.from_numpy(random_weight(Q.Q4_0, 4, 64, seed=0))
    x = torch.zeros(1, 64)
    assert qm.usable(x, raw, Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="the weight must be 1-D uint8 of 144 bytes"):
        qm.qmatmul(x, raw[:-1], Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="K=48 must be a positive multiple of 32"):
        qm.qmatmul(torch.zeros(1, 48), raw, Q.Q4_0, 4, 48)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        qm.qmatmul(torch.zeros(1, 32), raw, Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="type 1 is not a supported block type"):
        qm.qmatmul(x, raw, 1, 4, 64)
    assert not qm.usable(x, raw, Q.F16, 4, 64)


def packed(raw: np.ndarray, qtype: Q, n: int, k: int) -> torch.Tensor:
    return qpack.pack(torch.from_numpy(raw), int(qtype), n, k)


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda t: t.name)
def test_packing_moves_every_bit_and_unpacks_exactly(qtype):
    shapes = [(13, 96), (5, 160), (3, 4096), (2, 576)] if quants.GGML_QUANT_SIZES[qtype][0] == 32 \
        else [(13, 256), (5, 768), (2, 14336)]
    for i, (n, k) in enumerate(shapes):
        raw = random_weight(qtype, n, k, seed=i)
        p = packed(raw, qtype, n, k)
        assert p.dtype == torch.uint8 and p.numel() == raw.size  # the same bytes, moved
        assert np.unpackbits(p.numpy()).sum() == np.unpackbits(raw).sum()  # same bits, moved
        np.testing.assert_array_equal(qpack.unpack(p, int(qtype), n, k).numpy(), raw)
        tail = packed(raw.reshape(n, -1)[1:].reshape(-1), qtype, n - 1, k)
        assert torch.equal(qpack.gather_rows(p, int(qtype), n, k, torch.arange(1, n)), tail)


def test_packed_words_hold_32_over_b_consecutive_elements():
    # Q4_0, K = 64: two groups of 32, 4 low words each; element i of a word in byte i % 4 at
    # bit 4 (i // 4), so (word >> 4 t) & 0x0F0F0F0F is elements 4t..4t+3, one a byte; d for
    # group g in the scale plane after the low words
    k = 64
    q = (np.arange(k) * 7) % 16
    blocks = np.zeros((k // 32, 18), np.uint8)
    blocks[:, 0:2] = np.array([[1.5], [-2.0]], dtype=np.float16).view(np.uint8)
    qb = q.reshape(2, 32)
    blocks[:, 2:18] = qb[:, :16] | (qb[:, 16:] << 4)
    p = packed(blocks.reshape(-1), Q.Q4_0, 1, k).numpy()
    words = p[:32].view(np.uint32)
    for i in range(k):
        w, e = divmod(i, 8)
        assert (words[w] >> (8 * (e % 4) + 4 * (e // 4))) & 15 == q[i], i
    np.testing.assert_array_equal(p[32:].view(np.float16), np.array([1.5, -2.0], np.float16))
    # Q6_K's two high bits a plane of 2 bits: 16 elements a word
    raw = random_weight(Q.Q6_K, 1, 256, seed=1)
    g = qpack.geometry(int(Q.Q6_K), 1, 256)
    ql, qh = raw[:128], raw[128:192]
    want = np.empty(256, np.int64)  # the 6-bit quants in element order, as ggml lays them
    for h in range(2):
        for j in range(32):
            lo0, lo1 = ql[64 * h + j], ql[64 * h + 32 + j]
            hi = qh[32 * h + j]
            want[128 * h + j] = (lo0 & 15) | ((hi & 3) << 4)
            want[128 * h + 32 + j] = (lo1 & 15) | (((hi >> 2) & 3) << 4)
            want[128 * h + 64 + j] = (lo0 >> 4) | (((hi >> 4) & 3) << 4)
            want[128 * h + 96 + j] = (lo1 >> 4) | (((hi >> 6) & 3) << 4)
    p = packed(raw, Q.Q6_K, 1, 256).numpy()
    lw = p[g.planes[0][0] : g.planes[0][0] + 128].view(np.uint32)
    hw = p[g.planes[1][0] : g.planes[1][0] + 64].view(np.uint32)
    for i in range(256):
        lo = (lw[i // 8] >> (8 * (i % 8 % 4) + 4 * (i % 8 // 4))) & 15
        hi = (hw[i // 16] >> (8 * (i % 16 % 4) + 2 * (i % 16 // 4))) & 3
        assert lo | hi << 4 == want[i], i


@needs_triton
@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda t: t.name)
def test_fused_kernel_matches_gguf(qtype):
    # x rounded to int8 per group of 32 in the kernel, as llama.cpp's q8_1 x: an error of at
    # most half a step of each group's largest |x| / 127, for every value of W
    def product(x, raw, n, k):
        return qm._launch_gemv(qm.quantize_x(torch.from_numpy(x), int(qtype)), [packed(raw, qtype, n, k)], int(qtype), [n], k)
    check_products(qtype, product, rel=INT8_X)


@needs_triton
@pytest.mark.parametrize(("qtype", "k"), [(Q.Q4_0, 4096), (Q.Q8_0, 8192), (Q.Q6_K, 32768)],
                         ids=lambda v: getattr(v, "name", v))
def test_fused_kernel_with_many_groups_a_step_matches_gguf(qtype, k):
    # 8B-sized rows: a program walks many steps of 32 groups
    assert qm.tiles(int(qtype), 3, k, True)[1] == 32
    raw = random_weight(qtype, 3, k, seed=5)
    x = np.random.default_rng(6).standard_normal((2, k)).astype(np.float32)
    y = qm._launch_gemv(qm.quantize_x(torch.from_numpy(x), int(qtype)), [packed(raw, qtype, 3, k)], int(qtype), [3], k)
    check(y, x, raw, qtype, 3, k, rel=INT8_X)


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _decode_cases(qtype: Q, seed: int):
    """(m, n, k, raw, [packed weight], rng) for the type's shapes, at most FUSED_ROWS rows."""
    shapes = SHAPES_32 if quants.GGML_QUANT_SIZES[qtype][0] == 32 else SHAPES_256
    for i, (m, n, k) in enumerate(shapes):
        raw = random_weight(qtype, n, k, seed=i)
        yield min(m, qm.FUSED_ROWS), n, k, raw, [packed(raw, qtype, n, k)], np.random.default_rng(seed + i)


@needs_triton
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_fused_kernel_makes_its_activation_as_it_rounds_x(qtype):
    # GLU: x is a fused gate/up product's two halves, views whose rows are 2K apart, read in
    # place; NORM: x normalized and scaled by the norm's weight (K,). Both against gguf-py
    # over the activation made in numpy
    for m, n, k, raw, w, rng in _decode_cases(qtype, 200):
        both = rng.standard_normal((m, 2 * k)).astype(np.float32)
        g, u = both[:, :k], both[:, k:]
        t = torch.from_numpy(both)
        y = qm._qgemv(t[:, :k], t[:, k:], None, qm.GLU, 0.0, w, [int(qtype)], [n], k)
        check(y, _silu(g) * u, raw, qtype, n, k, rel=INT8_X)
        x = 3 * rng.standard_normal((m, k)).astype(np.float32)
        nw = rng.standard_normal(k).astype(np.float32)
        y = qm._qgemv(torch.from_numpy(x), torch.from_numpy(nw), None, qm.NORM, 1e-5, w, [int(qtype)], [n], k)
        normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * nw
        check(y, normed.astype(np.float32), raw, qtype, n, k, rel=INT8_X)


@needs_triton
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_K], ids=lambda t: t.name)
def test_fused_kernel_adds_a_residual_or_a_bias_as_it_writes_y(qtype):
    # a residual (M, N): the product plus it, added after the sum (a.float() + b.float());
    # a bias (N,): the same row for every row of x. Stacked weights: each run its columns
    for m, n, k, _, w, rng in _decode_cases(qtype, 300):
        x = rng.standard_normal((m, k)).astype(np.float32)
        plain = qm._qgemv(torch.from_numpy(x), None, None, qm.PLAIN, 0.0, w, [int(qtype)], [n], k)
        for r in (rng.standard_normal((m, n)), rng.standard_normal(n)):
            r = torch.from_numpy(r.astype(np.float32))
            y = qm._qgemv(torch.from_numpy(x), None, r, qm.PLAIN, 0.0, w, [int(qtype)], [n], k)
            assert torch.equal(y, plain + r)  # the same sum, then the same one addition
    raw = random_weight(qtype, 9, 256, seed=9)
    w = packed(raw, qtype, 9, 256)
    x = torch.randn(2, 256)
    r = torch.randn(2, 18)
    plain = qm._qgemv(x, None, None, qm.PLAIN, 0.0, [w, w], [int(qtype)] * 2, [9, 9], 256)
    y = qm._qgemv(x, None, r, qm.PLAIN, 0.0, [w, w], [int(qtype)] * 2, [9, 9], 256)
    assert torch.equal(y, plain + r)


@needs_triton
@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda t: t.name)
def test_batched_kernel_matches_gguf(qtype):
    # a batched decode step's rows: each weight tile dequantized once to f16 and multiplied
    # with every row (x rounded to f16 too, as the prefill path does)
    # the third shape is split along K (k_splits: 16 parts for the 32-element types, 8 for
    # the K-quants, summed after); for the 32-element types K = 480 too: 15 groups, steps
    # of 4, one group masked; and K = 96: 3 groups in a step of 4 (a
    # tensor-core dot takes 16 words or more); 33 and 64 rows: one tile of 64 rows, the
    # product as W x.T
    shapes = [(9, 13, 256), (16, 70, 512), (12, 20, 4096), (33, 130, 512), (64, 20, 4096)]
    if qpack.block_size(int(qtype)) == 32:
        shapes += [(10, 129, 480), (9, 7, 96), (40, 129, 480)]
    for i, (m, n, k) in enumerate(shapes):
        raw = random_weight(qtype, n, k, seed=i)
        assert qm.batch_tiles(int(qtype), n, k, m)[2] * qpack.low_bits(int(qtype)) >= 16
        x = np.random.default_rng(i).standard_normal((m, k)).astype(np.float32)
        y = qm._launch_mm(qm.slot_order(torch.from_numpy(x), int(qtype)), [packed(raw, qtype, n, k)], int(qtype), [n], k)
        assert y.shape[0] == qm.k_splits(int(qtype), m, n, k, sms=132)[0]
        check(y.sum(0), x, raw, qtype, n, k, rel=2e-3)


def test_batched_kernel_splits_k_until_the_gpu_is_full():
    # an 8B's down projection at 16 rows: 32 programs of 128 rows unsplit, 4 a
    # multiprocessor wanted (17 parts), 112 steps of 4 groups: 16 parts of 7 steps (28 groups)
    assert qm.k_splits(int(Q.Q4_0), 16, 4096, 14336, sms=132) == (16, 28)
    assert qm.k_splits(int(Q.Q8_0), 16, 4096, 14336, sms=132) == (16, 28)  # 4 groups a step too
    # Q4_K: 8 groups a step, 56 steps, 17 parts wanted: 14 of 4 steps
    assert qm.k_splits(int(Q.Q4_K), 16, 4096, 14336, sms=132) == (14, 32)
    assert qm.k_splits(int(Q.Q4_0), 16, 14336, 4096, sms=132) == (5, 28)
    assert qm.k_splits(int(Q.Q4_0), 12, 20, 4096, sms=132) == (16, 8)  # at least 2 steps a part
    assert qm.k_splits(int(Q.Q4_0), 12, 20, 512, sms=132) == (2, 8)
    assert qm.k_splits(int(Q.Q8_0), 12, 20, 512, sms=132) == (2, 8)  # steps of 4 groups


def test_slot_order_puts_a_slots_values_in_one_run():
    # Q4_0: 4 low words a group, 8 values a word; slot s of word w of group g is element
    # 32 g + 8 w + s, at [s, g, w]
    x = torch.arange(2 * 64, dtype=torch.float32).reshape(2, 64)
    xs = qm.slot_order(x, int(Q.Q4_0))
    assert xs.shape == (2, 8, 2, 4) and xs.dtype == torch.float16
    assert xs[1, 3, 1, 2].item() == 64 + 32 + 8 * 2 + 3
    assert sorted(xs[0].flatten().tolist()) == list(range(64))
    assert qm.slot_order(x, int(Q.Q8_0)).shape == (2, 4, 2, 8)


def test_rows_choose_the_kernel():
    n, k = 4096, 4096  # BATCH_MIN_VALUES: 16M values
    assert not qm.batched(qm.FUSED_ROWS + 1, int(Q.Q6_K), n, k)  # dequantized once, then a matmul
    assert [qm.batched(m, int(Q.Q4_K), n, k) for m in (1, qm.FUSED_ROWS, qm.FUSED_ROWS + 1, 16, 17,
                                                      qm.BATCH_ROWS, qm.BATCH_ROWS + 1)] \
        == [False, False, True, True, True, True, False]
    # a 1B's q, k, v (3072 x 2048) and output (2048 x 2048) are too small to fill the GPU
    assert not qm.batched(16, int(Q.Q4_0), 3072, 2048)
    assert qm.batched(16, int(Q.Q4_0), 2048, 8192) and qm.batched(16, int(Q.Q4_0), 16384, 2048)
    # K = 96: three groups, a step of one (two would mask one of four); K = 4096: steps of
    # 32 groups; never more rows a program than the weight's
    assert qm.tiles(int(Q.Q4_0), 4, 96, True) == (2, 1, 2)
    assert qm.tiles(int(Q.Q4_0), 1, 96, True) == (1, 1, 2)
    assert qm.tiles(int(Q.Q4_0), 4096, 4096, True) == (2, 32, 2)
    assert qm.tiles(int(Q.Q4_K), 4096, 4096, True) == (2, 32, 2)
    # the batched kernel at 16 rows: the 32-element types 128 rows a tile, 4 groups a step
    # (16 low words, Q8_0 32), 4 warps, 2 stages; Q4_K and Q5_K 128 rows, 8 groups, 4 warps;
    # Q2_K, Q3_K (and Q6_K, called directly) 256 rows in 8 warps
    assert qm.batch_tiles(int(Q.Q4_0), 4096, 14336, 16) == (16, 128, 4, 4, 2, False)
    assert qm.batch_tiles(int(Q.Q4_1), 2048, 8192, 16) == (16, 128, 4, 4, 2, False)
    assert qm.batch_tiles(int(Q.Q4_K), 16384, 2048, 16) == (16, 128, 8, 4, 1, False)
    assert qm.batch_tiles(int(Q.Q6_K), 4096, 14336, 16) == (16, 256, 8, 8, 1, False)
    assert qm.batch_tiles(int(Q.Q8_0), 4096, 14336, 16) == (16, 128, 4, 4, 2, False)
    assert qm.batch_tiles(int(Q.Q5_0), 4096, 14336, 16) == (16, 128, 4, 4, 2, False)
    assert qm.batch_tiles(int(Q.Q5_K), 4096, 14336, 16) == (16, 128, 8, 4, 1, False)
    assert qm.batch_tiles(int(Q.Q2_K), 4096, 4096, 16) == (16, 256, 8, 8, 1, False)
    assert qm.batch_tiles(int(Q.Q4_0), 4, 96, 8) == (16, 128, 4, 4, 2, False)  # 16 words, one group masked
    assert qm.batch_tiles(int(Q.Q8_0), 4, 64, 8) == (16, 128, 2, 4, 2, False)
    # above 16 rows: 32 or 64 of them by 128 of W, 8 groups a step (Q8_0 too), as W x.T
    assert qm.batch_tiles(int(Q.Q4_0), 4096, 14336, 17) == (32, 128, 8, 4, 1, True)
    assert qm.batch_tiles(int(Q.Q8_0), 4096, 14336, 64) == (64, 128, 8, 4, 1, True)
    assert qm.batch_tiles(int(Q.Q2_K), 4096, 4096, 33) == (64, 128, 8, 4, 1, True)


@needs_triton
@pytest.mark.parametrize(("m", "rel"), [(2, 1e-2), (11, 2e-3)])
def test_decode_kernels_write_stacked_weights_into_one_result(m, rel, monkeypatch):
    # the fused kernel (x rounded to int8) and the batched one (x and W rounded to f16), one launch a run
    # of weights of one type; at 11 rows the Q6_K run is dequantized and multiplied instead
    assert qm.runs([12, 12, 14, 8, 8, 8, 8]) == [(0, 2), (2, 3), (3, 6), (6, 7)]
    monkeypatch.setattr(qm, "packs", lambda device: True)
    monkeypatch.setattr(qm, "BATCH_MIN_VALUES", 0)  # small weights through the batched kernel

    def product(x, parts):
        return qm.stacked_product(torch.from_numpy(x), [(packed(r, t, n, 512), int(t), n) for r, t, n in parts], 512)
    check_stacked(product, m, rel=rel)


@needs_triton
@pytest.mark.parametrize("scratch_rows", [68, 16], ids=["one-scratch", "tiles"])
def test_prefill_dequantizes_stacked_weights_of_mixed_types(scratch_rows, monkeypatch):
    # 70 rows (prefill): every weight dequantized to f16, then cuBLAS. Where the 68 rows of
    # all seven fit one scratch, one matmul reads them (_qdequant_stacked); else a tile at a time
    monkeypatch.setattr(qm, "packs", lambda device: True)
    monkeypatch.setattr(qm, "SCRATCH_BYTES", scratch_rows * 512 * 2)
    launches = []  # per dequantize launch: whether it wrote into a shared scratch
    launch = qm._launch_dequant
    monkeypatch.setattr(qm, "_launch_dequant", lambda *a, out=None: launches.append(out is not None)
                        or launch(*a, out=out))

    def product(x, parts):
        return qm.stacked_product(torch.from_numpy(x), [(packed(r, t, n, 512), int(t), n) for r, t, n in parts], 512)
    check_stacked(product, 70, rel=2e-3)
    # one scratch: a launch a weight, all into it; tiles of 16 rows: the 37-row Q8_0 in three
    assert launches == [True] * 7 if scratch_rows == 68 else launches == [False] * 9


@needs_triton
@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda t: t.name)
def test_dequant_kernel_is_bit_exact(qtype):
    for n, k in [(13, 96), (5, 768)] if quants.GGML_QUANT_SIZES[qtype][0] == 32 else [(13, 256), (5, 768)]:
        raw = random_weight(qtype, n, k, seed=n)
        w = packed(raw, qtype, n, k)
        want = quants.dequantize(raw.reshape(n, -1), qtype)
        np.testing.assert_array_equal(qm._launch_dequant(w, int(qtype), n, k, torch.float32).numpy(), want)
        # a range of rows, as the prefill path's tiles take them
        got = qm._launch_dequant(w, int(qtype), n, k, torch.float32, 2, n - 1).numpy()
        np.testing.assert_array_equal(got, want[2 : n - 1])


def test_packing_a_few_rows_at_a_time_gives_the_same_bytes(monkeypatch):
    # a large weight is packed and unpacked in steps of rows (bounded temporaries)
    for qtype in (Q.Q4_0, Q.Q5_1, Q.Q3_K, Q.Q6_K):
        raw = random_weight(qtype, 37, 512, seed=3)
        whole = packed(raw, qtype, 37, 512)
        monkeypatch.setattr(qpack, "STEP_ELEMENTS", 5 * 512)  # 5 rows a step, 8 steps
        assert torch.equal(packed(raw, qtype, 37, 512), whole)
        np.testing.assert_array_equal(qpack.unpack(whole, int(qtype), 37, 512).numpy(), raw)
        monkeypatch.undo()


@needs_triton
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_model_computes_from_packed_weights_as_from_the_cache(qtype, monkeypatch, tmp_path):
    """The GPU's whole path on this CPU, under the interpreter: weights packed in place at
    first use, the prompt through the batched kernel, decode steps through the fused one,
    embeddings through the packed row lookup; logits and tokens as the dequantized cache's."""
    from tiny_models import TinyConfig, write_tiny_gguf

    import apir
    from apir.backends.base import ExecutorConfig
    from apir.backends.local import LocalBackend
    from apir.engine import SamplingParams

    path = str(write_tiny_gguf(tmp_path / f"{qtype}.gguf", TinyConfig(n_layer=2, n_embd=128, n_ff=256,
                                                                       head_dim=32), qtype))
    ids = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]  # 14: batched rows
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with apir.load(path, backend=LocalBackend("cpu", config=ExecutorConfig(dequant_cache=True, cpu_int4=False))) as ref:
        want_logits, want = ref.logits(ids), list(ref.generate_ids(ids, greedy))
    monkeypatch.setattr(qm, "packs", lambda device: True)
    monkeypatch.setattr(qm, "BATCH_MIN_VALUES", 0)  # a tiny model's products through the batched kernel
    with apir.load(path, backend=LocalBackend("cpu", config=ExecutorConfig(dequant_cache=False, cpu_int4=False))) as model:
        assert model.backend._packs
        np.testing.assert_allclose(model.logits(ids), want_logits, rtol=2e-2, atol=2e-2)
        assert list(model.generate_ids(ids, greedy)) == want
        assert any(model.backend._packed.values())


def _sass_probe():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "probes" / "qkernel_sass.py"
    spec = importlib.util.spec_from_file_location("qkernel_sass", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(qm.qkernels is None or INTERPRET,
                    reason="needs triton, not its interpreter (its compiler builds for sm_90 without a GPU)")
@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda t: t.name)
def test_every_kernel_compiles_for_sm90(qtype):
    """Each kernel through Triton's real compiler (ptxas included), as the host launches it,
    for a large weight and for the small ones of a tiny model: one chunk a row step is where
    Triton 3.6 failed an assertion on the alignment hints (the H200's version, 2026-12-01)."""
    probe = _sass_probe()
    bs = quants.GGML_QUANT_SIZES[qtype][0]
    for n, k in ((64, 256), (48, 3 * 256), (64, 512), (4096, 4096)):
        if k % bs:
            continue
        for kind in probe.KINDS:
            kernel = probe.compile_kernel(int(qtype), n, k, kind)[0]
            assert kernel.asm["cubin"][:4] == b"\x7fELF", (kind, n, k)
    # the variants a decode step takes: the activation made while rounding x (GLU, NORM),
    # the residual added as y is written, and both kernels launched as dependents (PDL),
    # waiting for the kernel before them where they say so
    for act in (qm.GLU, qm.NORM):
        assert probe.compile_kernel(int(qtype), 64, 4096, "quantize", act=act)[0].asm["cubin"][:4] == b"\x7fELF"
    assert probe.compile_kernel(int(qtype), 4096, 4096, "fused", add=True)[0].asm["cubin"][:4] == b"\x7fELF"
    for kind in ("quantize", "fused"):
        plain = probe.compile_kernel(int(qtype), 4096, 4096, kind)[0].asm["ptx"]
        dependent = probe.compile_kernel(int(qtype), 4096, 4096, kind, pdl=True)[0].asm["ptx"]
        assert "griddepcontrol" not in plain
        assert "griddepcontrol.wait" in dependent and "griddepcontrol.launch_dependents" in dependent, kind
