"""decode_attention (each query reads its own slot's visible keys, split along the keys)
against the masked dense form it replaces on a GPU (kernels.attention_seq's fallback).

The Triton kernel runs on a CPU under Triton's interpreter: with triton installed,
TRITON_INTERPRET=1 pytest tests/test_decode_attention.py (without triton: skipped).
"""

from __future__ import annotations

import os

import pytest
import torch

from apir.backends.local import decode_attention as da
from apir.backends.local import kernels

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and da.triton is not None
needs_triton = pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1")


def test_splits_fill_the_gpu_only_where_the_queries_do_not():
    assert da.splits(1, 8, 4096, sms=132) == (32, 128)  # one query: split the keys
    assert da.splits(1, 8, 16384, sms=132) == (128, 128)  # 8 programs a multiprocessor
    assert da.splits(1, 8, 300, sms=132) == (3, 100)  # at least SPLIT_KEYS a split, rounded evenly
    assert da.splits(16, 8, 4096, sms=132) == (9, 456)  # 128 programs: 9 splits make 8 an SM
    assert da.splits(64, 8, 4096, sms=132) == (1, 4096)  # 512 programs fill it alone
    assert da.splits(2, 2, 40, sms=132) == (1, 40)
    assert da.splits(1, 1, 1 << 20, sms=132)[0] == da.MAX_SPLITS


def dense(q, k, v, pos, seq, scale, window, softcap):
    # the masked form over every slot's every row (kernels.attention_seq off CUDA: what a
    # GPU ran before)
    assert not q.is_cuda
    return kernels.attention_seq(q, k, v, pos, seq, scale, window, softcap)


# an f16 cache is multiplied in f16 on the tensor cores (q and the probabilities rounded to
# f16, as fused attention kernels do); an f32 one in f32
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}

CASES = [
    (3, 40, 0, 0.0, torch.float32),  # several slots, one split
    (2, 600, 0, 0.0, torch.float16),  # keys split 3 ways, an f16 cache
    (3, 40, 7, 0.0, torch.float32),  # a sliding window
    (1, 300, 50, 30.0, torch.float32),  # softcap and window across splits
]


@needs_triton
@pytest.mark.parametrize(("slots", "keys", "window", "softcap", "dtype"), CASES)
def test_matches_the_masked_dense_form(slots, keys, window, softcap, dtype):
    q, k, v, pos, seq = case(slots, keys, dtype)
    got = da._attend(q, k, v, pos, seq, 0.25, window, softcap)
    want = dense(q, k.float(), v.float(), pos, seq, 0.25, window, softcap)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or da.triton is None, reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize(("slots", "keys", "window", "softcap", "dtype"), CASES)
def test_cuda_slotted_attention_reads_the_visible_keys_only(slots, keys, window, softcap, dtype):
    # the device kernel table's ATTENTION_SEQ on CUDA takes this path
    q, k, v, pos, seq = case(slots, keys, dtype)
    cuda = [t.cuda() for t in (q, k, v, pos, seq)]
    assert da.usable(*cuda[:3])
    got = kernels.attention_seq(*cuda, 0.25, window, softcap).cpu()
    torch.testing.assert_close(got, dense(q, k.float(), v.float(), pos, seq, 0.25, window, softcap),
                               **TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or da.triton is None, reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("keys", [1524, 200])
def test_cuda_decode_reads_the_filled_part(keys):
    # ATTENTION of one decode token over a cache split along its keys, and over one read by
    # a single split: rows past its position are NaN (never written), and must not be read
    q, k, v, pos, _ = case(1, keys, torch.float16)
    at = min(700, keys - 1)
    q, pos = q[:1], torch.tensor([at], dtype=torch.int32)
    k, v = k[0], v[0]
    k[at + 1:], v[at + 1:] = float("nan"), float("nan")
    got = kernels.attention(q.cuda(), k.cuda(), v.cuda(), pos.cuda(), 0.25, 0, 0.0).cpu()
    want = kernels.attention(q, k[:at + 1].float(), v[:at + 1].float(), pos, 0.25, 0, 0.0)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float16])


def case(slots: int, keys: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(keys + slots)
    n_tok, heads_kv, group, dim = 5, 2, 3, 16  # a group of 3 heads: padded to 4 in the kernel
    q = torch.randn(n_tok, heads_kv * group, dim, generator=g)
    k = torch.randn(slots, keys, heads_kv, dim, generator=g).to(dtype)
    v = torch.randn(slots, keys, heads_kv, 24, generator=g).to(dtype)  # Dv != D
    pos = torch.randint(0, keys, (n_tok,), generator=g, dtype=torch.int32)
    pos[0] = keys - 1  # the last row of the cache
    seq = torch.randint(0, slots, (n_tok,), generator=g, dtype=torch.int32)
    return q, k, v, pos, seq


@needs_triton
def test_a_query_never_reads_another_slot_or_a_later_row():
    # poison every row a query must not see: the result stays finite and equal
    keys, dim = 300, 8
    q = torch.randn(2, 2, dim)
    k = torch.randn(2, keys, 1, dim)
    v = torch.randn(2, keys, 1, dim)
    pos, seq = torch.tensor([10, 280], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    want = da._attend(q, k, v, pos, seq, 0.3, 0, 0.0)
    k[0, :, :] = float("nan")  # query 0 sees slot 1 only
    v[0, :, :] = float("nan")
    k[1, 11:], v[1, 11:] = float("nan"), float("nan")
    k2, v2 = k.clone(), v.clone()
    k2[0], v2[0] = torch.randn(keys, 1, dim), torch.randn(keys, 1, dim)  # query 1 reads slot 0 rows <= 280
    k2[0, 281:], v2[0, 281:] = float("nan"), float("nan")
    got0 = da._attend(q, k, v, pos, seq, 0.3, 0, 0.0)[0]
    torch.testing.assert_close(got0, want[0])
    got1 = da._attend(q, k2, v2, pos, seq, 0.3, 0, 0.0)[1]
    assert torch.isfinite(got1).all()
    torch.testing.assert_close(got1, dense(q, k2.nan_to_num(), v2.nan_to_num(), pos, seq, 0.3, 0, 0.0)[1])


@pytest.mark.skipif(da.triton is None or INTERPRET, reason="needs triton, not its interpreter")
@pytest.mark.parametrize(("group", "dim", "cache"), [(3, 64, "fp16"), (4, 128, "fp16"), (8, 128, "fp32"), (1, 256, "fp16")])
def test_kernel_compiles_for_sm90(group, dim, cache):
    """Through Triton's real compiler (ptxas included), no GPU needed: the shapes of
    SmolLM2, llama 8B, a wide group, Gemma's 256-wide heads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gp, dp, _, block, warps = da.tiles(group, dim, dim)
    sig = {"q_ptr": "*fp32", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "pos_ptr": "*i32", "seq_ptr": "*i32",
           "m_ptr": "*fp32", "l_ptr": "*fp32", "o_ptr": "*fp32", "out_ptr": "*fp32", "done_ptr": "*i32",
           "cos_ptr": "*fp32", "sin_ptr": "*fp32", "KEYS": "i32", "HQ": "i32", "HKV": "i32", "K_SLOT": "i32", "K_ROW": "i32", "V_SLOT": "i32",
           "V_ROW": "i32", "scale": "fp32", "softcap": "fp32", "window": "i32"}
    # one split, its own result, or split, the last combining; q as given, or rotated (all
    # features or the first half, NEOX pairs or not) as it is loaded
    for split, rope, neox in ((False, 0, False), (True, dim, True), (False, dim // 2, False)):
        consts = dict(G=group, GP=gp, D=dim, DP=dp, DV=dim, DVP=dp, BLOCK=block, SOFTCAP=True, WINDOW=True,
                      F32=cache == "fp32", SPLIT=split, ROPE=rope, NEOX=neox)
        src = ASTSource(fn=da._attend_kernel, signature=sig | {c: "constexpr" for c in consts}, constexprs=consts)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
        assert ("atom.global.gpu.acq_rel.add" in kernel.asm["ptx"]) == split, split


@needs_triton
@pytest.mark.parametrize(("n_dims", "neox"), [(16, 0), (16, 1), (8, 0), (8, 1)])
def test_queries_rotated_as_loaded_equal_their_rope_first(n_dims, neox):
    # the ROPE of q left to the kernel (kernels.Roped): every or only the first n_dims
    # features turned, in pairs (2i, 2i+1) or (i, i + n_dims/2), by each query's angles
    q, k, v, pos, seq = case(2, 300, torch.float32)
    cos, sin = kernels.rope_angles(pos, n_dims, 10000.0, 1.0)
    want = da._attend(kernels.rope_apply(q, cos, sin, n_dims, neox), k, v, pos, seq, 0.25, 0, 0.0)
    got = da.attend_visible(q, k, v, pos, seq, 0.25, 0, 0.0, (cos, sin, n_dims, neox))
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@needs_triton
@pytest.mark.parametrize(("seq", "rows"), [(False, 3), (True, 3), (False, kernels.SMALL_ROWS + 1)])
def test_an_attention_of_roped_queries_takes_the_kernel_that_rotates_them(monkeypatch, seq, rows):
    # kernels.attention / attention_seq as a CUDA step runs them, on the CPU under the
    # interpreter: the ROPE of q left to them (program.deferred) gives what ROPE then the
    # attention give, in the kernel for a decode step's few rows, made first for more
    monkeypatch.setattr(da, "usable", lambda q, k, v: True)
    q, k, v, pos, slots = case(2, 64, torch.float32)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, *q.shape[1:], generator=g)
    pos = torch.randint(0, k.shape[1], (rows,), generator=g, dtype=torch.int32)
    slots = torch.randint(0, k.shape[0], (rows,), generator=g, dtype=torch.int32)
    cos, sin = kernels.rope_angles(pos, 16, 10000.0, 1.0)
    roped = kernels.Roped(q, cos, sin, 16, 1)
    if seq:
        got = kernels.attention_seq(roped, k, v, pos, slots, 0.25, 0, 0.0)
        want = da._attend(kernels.made(roped), k, v, pos, slots, 0.25, 0, 0.0)
    else:
        got = kernels.attention(roped, k[0], v[0], pos, 0.25, 0, 0.0)
        want = kernels.attention_filled(kernels.made(roped), k[0], v[0], pos, 0.25, 0, 0.0)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
