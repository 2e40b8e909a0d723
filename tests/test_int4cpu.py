"""Q4_0, Q4_1 and Q4_K weights on a CPU through torch's int4 product (local.int4cpu): the
repacking is exact (the int4 form's (q - 8) * scale + zero is gguf-py's dequantized weight,
before the scales' bf16 rounding), the product is within bf16's precision of an f64
product with gguf-py's weights on odd shapes, and an executor holds each such weight once
more in 0.625 bytes a value (its ledger), computing what its dequantized f32 path computes
to bf16 precision, GET_ROWS of a tied table included."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gguf import GGMLQuantizationType, quants  # noqa: E402
from tiny_models import TinyConfig, write_tiny_gguf  # noqa: E402

import apir  # noqa: E402
from apir.backends.base import ExecutorConfig  # noqa: E402
from apir.backends.local import LocalBackend, int4cpu  # noqa: E402
from apir.backends.local.int4cpu import _fields  # noqa: E402
from apir.graph import DType  # noqa: E402

F16_FIELDS = {DType.Q4_0: (0,), DType.Q4_1: (0, 2), DType.Q4_K: (0, 2)}
pytestmark = pytest.mark.skipif(not hasattr(torch, "_weight_int4pack_mm_for_cpu"), reason="torch without int4")


def random_raw(dtype: DType, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random blocks for ``shape``, their f16 scale fields finite and small, as a model's."""
    rng = np.random.default_rng(seed)
    n_blocks = shape[0] * shape[1] // dtype.block_size
    blocks = rng.integers(0, 256, (n_blocks, dtype.type_size), dtype=np.uint8)
    for off in F16_FIELDS[dtype]:
        scales = (rng.uniform(0.001, 0.05, n_blocks) * rng.choice([-1, 1], n_blocks)).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference(raw: np.ndarray, dtype: DType, shape: tuple[int, int]) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType(int(dtype))).reshape(shape)


# torch packs rows 16 at a time: N a multiple of 16 (usable says so), K of the block
CASES = [(DType.Q4_0, (16, 96)), (DType.Q4_0, (64, 512)), (DType.Q4_1, (32, 32)), (DType.Q4_1, (80, 288)),
         (DType.Q4_K, (16, 256)), (DType.Q4_K, (48, 768))]


def test_usable_takes_the_three_types_in_torchs_shapes():
    assert int4cpu.usable(DType.Q4_K, (48, 768)) and int4cpu.usable(DType.Q4_1, (16, 32))
    assert not int4cpu.usable(DType.Q4_0, (5, 96))  # N
    assert not int4cpu.usable(DType.Q8_0, (64, 64)) and not int4cpu.usable(DType.Q5_K, (64, 256))
    assert not int4cpu.usable(DType.Q4_0, (2, 16, 64))


@pytest.mark.parametrize("dtype, shape", [*CASES, (DType.Q4_0, (5, 96)), (DType.Q4_1, (3, 64)), (DType.Q4_K, (7, 256))])
def test_the_int4_form_is_the_dequantized_weight(dtype, shape):
    raw = random_raw(dtype, shape, 1)
    q, scale, zero = _fields(torch.from_numpy(raw.copy()).reshape(-1, dtype.type_size), dtype)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    w = ((q.float() - 8) * scale + zero).reshape(shape).numpy()
    want = reference(raw, dtype, shape)
    # Q4_0 exactly; Q4_1 and Q4_K's zero is a sum, rounded once more in f32
    np.testing.assert_allclose(w, want, rtol=0, atol=4e-7 * np.abs(want).max())


@pytest.mark.parametrize("dtype, shape", CASES)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_product_is_within_bf16_of_gguf_py(dtype, shape, rows):
    raw = random_raw(dtype, shape, 2)
    w = int4cpu.pack(torch.from_numpy(raw.copy()), dtype, shape, None)
    assert w.nbytes == int4cpu.nbytes(shape)
    x = np.random.default_rng(3).standard_normal((rows, shape[1])).astype(np.float32)
    got = int4cpu.product(torch.from_numpy(x), w).numpy()
    want = x.astype(np.float64) @ reference(raw, dtype, shape).astype(np.float64).T
    assert got.shape == want.shape and got.dtype == np.float32
    # bf16 activations, scales and zeros: 8 bits of mantissa each
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_get_rows_of_an_int4_weight_decodes_its_blocks():
    from apir.backends.local.kernels import Blocks, get_rows

    raw = random_raw(DType.Q4_K, (32, 512), 4)
    data = torch.from_numpy(raw.copy())
    w = int4cpu.pack(data, DType.Q4_K, (32, 512), Blocks(data, int(DType.Q4_K), (32, 512)))
    ids = torch.tensor([3, 0, 31, 3], dtype=torch.int32)
    np.testing.assert_array_equal(get_rows(w, ids).numpy(), reference(raw, DType.Q4_K, (32, 512))[[3, 0, 31, 3]])


def test_an_executor_holds_q4_weights_as_int4_and_computes_what_f32_does(tmp_path):
    """A tiny Q4_0 model: the int4 path's logits are within bf16 precision of the
    dequantized f32 path's, and its forms take 0.625 bytes a value where the f32 path's
    take 4 (the vocabulary's 261 rows are not a multiple of 16: its table stays f32)."""
    path = str(write_tiny_gguf(tmp_path / "q4.gguf", TinyConfig(n_embd=64, n_ff=128, head_dim=16),
                               "Q4_0", seed=5))
    logits, forms = {}, {}
    for int4 in (False, True):
        backend = LocalBackend("cpu", config=ExecutorConfig(cpu_int4=int4, dequant_cache=True))
        with apir.load(path, backend=backend) as model:
            ids = model.tokenize("hello there")
            logits[int4] = np.asarray(model.logits(ids))
            forms[int4] = dict(backend.ledger.forms)
    scale = np.abs(logits[False]).max()
    assert np.abs(logits[True] - logits[False]).max() <= 3e-2 * scale
    int4_forms = {k: v for k, v in forms[True].items() if k[0][-1] == "int4"}
    assert int4_forms and all(
        size == int4cpu.nbytes(k[0][3]) == k[0][3][0] * k[0][3][1] * 5 // 8 for k, size in int4_forms.items())
    # the weights it holds as int4 took 4 bytes a value as f32 forms: 0.625 / 4 of them
    dense = sum(v for k, v in forms[True].items() if k[0][-1] != "int4")
    assert sum(int4_forms.values()) * 32 == (sum(forms[False].values()) - dense) * 5
