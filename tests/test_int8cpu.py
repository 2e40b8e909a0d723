"""Quantized weights on a CPU as int8 values and f32 scales (apir.backends.local.int8cpu):
the form's values are gguf.quants.dequantize's to the bit for every type it takes, its
products match the float64 product of those values, and a row lookup decodes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from test_qmatmul import check, random_weight

from apir.backends.local import int8cpu, qmatmul, qpack
from apir.graph.dtypes import DType

TYPES = [Q[t.name] for t in int8cpu.TYPES]


def form(raw: np.ndarray, qtype: Q, n: int, k: int) -> int8cpu.Int8:
    return int8cpu.pack(torch.from_numpy(raw), DType(int(qtype)), (n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_form_holds_gguf_values_to_the_bit(qtype, monkeypatch):
    k = 512
    raw = random_weight(qtype, 37, k, seed=1)
    monkeypatch.setattr(qpack, "STEP_ELEMENTS", 5 * k)  # packed 5 rows at a time
    w = form(raw, qtype, 37, k)
    want = quants.dequantize(raw.reshape(37, -1), qtype)
    np.testing.assert_array_equal(int8cpu.rows(w, torch.arange(37)).numpy().view(np.int32), want.view(np.int32))
    ids = torch.tensor([[3, 3], [36, 0]])
    np.testing.assert_array_equal(int8cpu.rows(w, ids).numpy(), want[ids.numpy()])
    assert w.nbytes == int8cpu.nbytes(DType(int(qtype)), (37, k))
    g = int8cpu.group(DType(int(qtype)))
    assert w.q.dtype == torch.int8 and w.q.shape == (37, k // g, g) and w.scale.shape == (37, k // g)
    # Q8_0's quants are read from the blocks themselves: the form is its scales
    assert (w.q.untyped_storage().data_ptr() == torch.from_numpy(raw).untyped_storage().data_ptr()) == (qtype == Q.Q8_0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_gguf_in_tiles(qtype, monkeypatch):
    monkeypatch.setattr(qmatmul, "CPU_SCRATCH_BYTES", 3 * 512 * 4)  # 3 rows a tile: 13 tiles
    raw = random_weight(qtype, 37, 512, seed=2)
    x = np.random.default_rng(3).standard_normal((2, 3, 512)).astype(np.float32)
    y = int8cpu.product(torch.from_numpy(x), form(raw, qtype, 37, 512))
    assert y.shape == (2, 3, 37)
    check(y.reshape(6, 37), x.reshape(6, 512), raw, qtype, 37, 512, rel=1e-5)
