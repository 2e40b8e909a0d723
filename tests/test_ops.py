"""Every op in the op table, run through both executors on the same random inputs.

Each case is a tiny graph built with ``GraphBuilder``; it runs on the numpy reference and
on the torch ("local", cpu) executor, the two results are compared with each other, and
most cases are also checked against an independent formula or loop written here.

``CASES`` maps every op to the test functions exercising it; ``test_every_op_is_covered``
fails when an op is added to ``Op`` without kernels in both executors or a case here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import astuple

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from apir.backends import create_backend, numpy_ref  # noqa: E402
from apir.backends.base import Backend, BackendError, ExecutorConfig  # noqa: E402
from apir.backends.local import kernels as local_kernels  # noqa: E402
from apir.graph import OPS, Alias, DType, GraphBuilder, Op, SampleArgs, T, Value  # noqa: E402
from apir.graph.dtypes import NUMPY_DTYPES  # noqa: E402
from apir.graph.ops import LEAVES, Fn, GraphError, Pool, Reduce, infer  # noqa: E402
from apir.graph.sampling import GREEDY, PARAMS_SIZE  # noqa: E402

BACKENDS = ("numpy", "local")
N_TOK = 5  # what T is bound to unless a test says otherwise

# op -> the test functions that exercise it (filled in by @covers)
CASES: dict[Op, list[Callable]] = {}


def covers(*ops: Op) -> Callable:
    def mark(fn: Callable) -> Callable:
        for op in ops:
            CASES.setdefault(op, []).append(fn)
        return fn

    return mark


# ---------------------------------------------------------------- running graphs


def make_backend(name: str) -> Backend:
    return create_backend("numpy") if name == "numpy" else create_backend("local", device="cpu")


def raw_bytes(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def run_on(
    name: str,
    build: Callable[..., Value | Sequence[Value]],
    inputs: dict | None = None,
    blobs: Sequence[np.ndarray] = (),
) -> tuple[Backend, list[int], list[np.ndarray]]:
    """Put each blob in its own buffer, build the graph with their handles, compute once."""
    be = make_backend(name)
    handles = []
    for blob in blobs:
        raw = raw_bytes(blob)
        h = be.alloc_buffer(max(raw.nbytes, 1))
        be.set_tensor(h, 0, raw)
        handles.append(h)
    g = GraphBuilder()
    outs = build(g, *handles)
    outs = (outs,) if isinstance(outs, Value) else tuple(outs)
    gid = be.register_graph(g.build(*outs))
    return be, handles, be.compute(gid, dict(inputs or {}))


def run_both(build, inputs=None, blobs=()) -> dict[str, list[np.ndarray]]:
    return {name: run_on(name, build, inputs, blobs)[2] for name in BACKENDS}


def assert_same(a: np.ndarray, b: np.ndarray, rtol: float, atol: float, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    assert a.dtype == b.dtype, f"{what}: dtypes {a.dtype} vs {b.dtype}"
    if rtol == 0 and atol == 0:
        np.testing.assert_array_equal(a, b, err_msg=what)
    else:
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)


def check(build, inputs=None, blobs=(), rtol=1e-5, atol=1e-5) -> list[np.ndarray]:
    """Run on both backends; outputs must agree in shape, dtype and value. Returns numpy's."""
    res = run_both(build, inputs, blobs)
    for i, (a, b) in enumerate(zip(res["numpy"], res["local"], strict=True)):
        assert_same(b, a, rtol, atol, f"output {i}: local vs numpy")
    return res["numpy"]


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def ids_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


# ---------------------------------------------------------------- weight bytes

QTYPE = {d: gguf.GGMLQuantizationType(int(d)) for d in DType if d.is_quantized}
GGUF_QUANTIZABLE = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0)
F16_FIELDS = {DType.Q4_K: (0, 2), DType.Q5_K: (0, 2), DType.Q6_K: (208,)}


def _small_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 scales of moderate size and either sign, so dot products stay tame."""
    mag = rng.uniform(1e-3, 2e-2, n)
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)


def weight_bytes(dtype: DType, shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF bytes, the float32 values they dequantize to) for a random (N, K) weight."""
    rng = np.random.default_rng(seed)
    w = randn(rng, *shape)
    if dtype is DType.F32:
        return raw_bytes(w), w
    if dtype is DType.F16:
        w16 = w.astype(np.float16)
        return raw_bytes(w16), w16.astype(np.float32)
    if dtype is DType.BF16:
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        return raw_bytes(bits), (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype in GGUF_QUANTIZABLE:
        raw = gguf.quants.quantize(w, QTYPE[dtype])
    else:  # gguf-py cannot quantize K-quants: random blocks with finite f16 scale fields
        blocks = rng.integers(0, 256, (w.size // dtype.block_size, dtype.type_size), np.uint8)
        for off in F16_FIELDS[dtype]:
            blocks[:, off : off + 2] = _small_f16(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
        raw = blocks
    raw = raw_bytes(raw)
    assert raw.nbytes == dtype.nbytes(shape)
    deq = gguf.quants.dequantize(raw.reshape(shape[0], -1), QTYPE[dtype])
    return raw, np.asarray(deq, dtype=np.float32).reshape(shape)


# ---------------------------------------------------------------- meta


def test_every_op_is_covered() -> None:
    ops = set(Op) - set(LEAVES)
    assert ops - set(numpy_ref.KERNELS) == set(), "ops without a numpy kernel"
    assert ops - set(local_kernels.KERNELS) == set(), "ops without a torch kernel"
    missing = sorted(op.name for op in ops if not CASES.get(op))
    assert not missing, f"ops without a test case in {__name__}: {missing}"
    assert not set(CASES) & set(LEAVES)


def test_op_facts_name_real_operands() -> None:
    """OpSpec's facts point at operands the op has (the executors index them blindly)."""
    for op, spec in OPS.items():
        assert all(max(i, target) < spec.arity for i, target, _ in spec.index), op.name
        assert spec.alias is Alias.NONE or spec.arity >= 1, op.name
        # their pos (ATTENTION_SEQ: its seq, beside the pos) is the last operand
        assert not spec.memo or op in (Op.ROPE, Op.ATTENTION, Op.ATTENTION_SEQ), op.name
    assert [op for op in OPS if OPS[op].quantized] == [Op.WEIGHT, Op.GET_ROWS, Op.MATMUL]


# ---------------------------------------------------------------- aliasing


def _call(kernels: dict, op: Op, x):
    """Run ``op``'s kernel with ``x`` (2-D, shape (a, b), a >= 3) as its first input."""
    a, b = x.shape
    if op is Op.SET_ROWS:
        src, ids = np.ones((1, b), np.float32), np.zeros(1, np.int32)
        if kernels is local_kernels.KERNELS:
            src, ids = torch.from_numpy(src), torch.from_numpy(ids)
        return kernels[op](x, src, ids)
    rest = {Op.RESHAPE: ((a * b,),), Op.PERMUTE: ((1, 0),), Op.TRANSPOSE: (0, 1),
            Op.VIEW: (0, 1, 2), Op.SCALE: (2.0,), Op.ADD: (x,), Op.CONCAT: (x, 0)}
    return kernels[op](x, *rest.get(op, ()))


def _shares(out, x) -> bool:
    if isinstance(x, np.ndarray):
        return np.shares_memory(out, x)
    return out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


@pytest.mark.parametrize("kernels", [numpy_ref.KERNELS, local_kernels.KERNELS], ids=["numpy", "local"])
def test_alias_facts_match_the_kernels(kernels: dict) -> None:
    """OpSpec.alias is what the executors do: graph validation trusts it to find writes into
    a WEIGHT (a CONTIGUOUS of a contiguous value is that value), the scratch estimate to
    charge every op that may allocate (a CONTIGUOUS or RESHAPE of a transposed value copies)."""
    aliasing = [op for op in Op if OPS[op].alias is not Alias.NONE]
    plain = [Op.SCALE, Op.ADD, Op.SOFTMAX, Op.CONCAT, Op.SILU]
    for op in aliasing + plain:
        for transposed in (False, True):
            x = np.arange(24, dtype=np.float32).reshape((6, 4) if transposed else (4, 6))
            if kernels is local_kernels.KERNELS:
                x = torch.from_numpy(x)
            x = x.T if transposed else x  # (4, 6) either way; the transposed one is a view
            shares = _shares(_call(kernels, op, x), x)
            want = OPS[op].alias is Alias.ALWAYS or (OPS[op].alias is Alias.MAYBE and not transposed)
            assert shares == want, f"{op.name} on a {'transposed' if transposed else 'contiguous'} input"
    assert {Op.CONTIGUOUS, Op.RESHAPE} <= {op for op in aliasing if OPS[op].alias is Alias.MAYBE}


@pytest.mark.parametrize("name", [*BACKENDS, "local-cache"])
def test_rewritten_weights_are_read_again(name: str) -> None:
    """The executors cache weights dequantized (numpy; local with its dequant cache, an
    opt-in, and then two products' weights concatenated; without it, the default, local
    reads the buffer's 16-bit bytes); a write to their buffer makes the next compute read
    them again."""
    cache = ExecutorConfig(dequant_cache=True)
    be = create_backend("local", device="cpu", config=cache) if name == "local-cache" else make_backend(name)
    h = be.alloc_buffer(2 * 64)  # two F16 (4, 8) weights
    g = GraphBuilder()
    x = g.input("x", (T, 8))
    w1, w2 = g.weight(h, 0, (4, 8), DType.F16), g.weight(h, 64, (4, 8), DType.F16)
    gid = be.register_graph(g.build(g.matmul(x, w1), g.matmul(x, w2)))
    for value in (1.0, 2.0):
        be.set_tensor(h, 0, np.full((2, 4, 8), value, np.float16))
        for out in be.compute(gid, {"x": np.ones((1, 8), np.float32)}):
            np.testing.assert_array_equal(out, np.full((1, 4), 8 * value, np.float32))
    assert bool(be._weights) == (name != "local")
    be.free_buffer(h)
    assert be._weights == {}  # freed with their buffer


# ---------------------------------------------------------------- GET_ROWS


@covers(Op.GET_ROWS)
@pytest.mark.parametrize(
    "dtype",
    [DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_K],
    ids=lambda d: d.name,
)
def test_get_rows_from_weight(dtype: DType) -> None:
    shape = (9, 256 if dtype.block_size == 256 else 64)
    raw, table = weight_bytes(dtype, shape, seed=1)
    ids = ids_of(3, 0, 8, 3, 1)

    def build(g, h):
        w = g.weight(h, 0, shape, dtype)
        flat = g.get_rows(w, g.input("ids", (T,), DType.I32))
        grid = g.get_rows(w, g.input("grid", (2, 3), DType.I32))
        return flat, grid

    grid = ids_of(8, 7, 6, 0, 0, 5).reshape(2, 3)
    flat_out, grid_out = check(build, {"ids": ids, "grid": grid}, [raw], rtol=0, atol=0)
    np.testing.assert_array_equal(flat_out, table[ids])
    np.testing.assert_array_equal(grid_out, table[grid])
    assert grid_out.shape == (2, 3, shape[1]) and grid_out.dtype == np.float32


@covers(Op.GET_ROWS)
def test_get_rows_from_input_state_and_i32_weight_ids() -> None:
    rng = np.random.default_rng(2)
    table = randn(rng, 6, 4)
    cache = randn(rng, 7, 3).astype(np.float16)
    ids = ids_of(5, 0, 2)

    def build(g, h_ids, h_cache):
        fixed = g.weight(h_ids, 0, (3,), DType.I32)  # ids stored in a buffer
        a = g.get_rows(g.input("table", (6, 4)), fixed)
        b = g.get_rows(g.state(h_cache, 0, (7, 3), DType.F16), g.input("ids", (T,), DType.I32))
        return a, b

    a, b = check(build, {"table": table, "ids": ids_of(6, 1)}, [ids, cache], rtol=0, atol=0)
    np.testing.assert_array_equal(a, table[ids])
    np.testing.assert_array_equal(b, cache[[6, 1]].astype(np.float32))


# ---------------------------------------------------------------- MATMUL

MATMUL_DTYPES = [
    DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_1,
    DType.Q5_0, DType.Q5_1, DType.Q4_K, DType.Q5_K, DType.Q6_K,
]


def assert_dot_close(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    """Each element within a small multiple of the f32 rounding bound of its dot product."""
    assert got.shape == want.shape, what
    err = np.abs(got.astype(np.float64) - want)
    tol = 1e-5 * bound + 1e-6
    assert np.all(err <= tol), f"{what}: max excess {np.max(err - tol):.3g}"


@covers(Op.MATMUL)
@pytest.mark.parametrize("dtype", MATMUL_DTYPES, ids=lambda d: d.name)
def test_matmul(dtype: DType) -> None:
    n, k = 6, 256
    raw, w = weight_bytes(dtype, (n, k), seed=int(dtype))
    rng = np.random.default_rng(3)
    x2 = randn(rng, N_TOK, k)
    x3 = randn(rng, 2, 3, k)

    def build(g, h):
        wv = g.weight(h, 0, (n, k), dtype)
        return g.matmul(g.input("x", (T, k)), wv), g.matmul(g.input("x3", (2, 3, k)), wv)

    res = run_both(build, {"x": x2, "x3": x3}, [raw])
    w64 = w.astype(np.float64)
    for x, a, b in zip((x2, x3), res["numpy"], res["local"], strict=True):
        assert a.dtype == b.dtype == np.float32
        assert a.shape == b.shape == (*x.shape[:-1], n)
        want = x.astype(np.float64) @ w64.T  # against gguf's own dequantization
        bound = np.abs(x.astype(np.float64)) @ np.abs(w64).T
        assert_dot_close(a, want, bound, f"numpy {dtype.name}")
        assert_dot_close(b, want, bound, f"local {dtype.name}")
        assert_dot_close(b, a.astype(np.float64), bound, f"local vs numpy {dtype.name}")
    assert np.abs(res["numpy"][0]).max() > 0  # not a degenerate all-zero weight


@covers(Op.MATMUL)
def test_matmul_f16_and_bf16_inputs() -> None:
    rng = np.random.default_rng(4)
    x = randn(rng, 3, 32)
    w = randn(rng, 4, 32)
    x16 = x.astype(np.float16)
    xbf = (x.view(np.uint32) >> 16).astype(np.uint16)

    def build(g):
        wv = g.input("w", (4, 32))
        return (
            g.matmul(g.input("a", (T, 32), DType.F16), wv),
            g.matmul(g.input("b", (T, 32), DType.BF16), wv),
        )

    a, b = check(build, {"a": x16, "b": xbf, "w": w})
    np.testing.assert_allclose(a, x16.astype(np.float32) @ w.T, rtol=1e-5, atol=1e-5)
    xb = (xbf.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(b, xb @ w.T, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- elementwise


BROADCASTS = [
    ((T, 3, 4), (4,)),
    ((3, 1, 5), (4, 1)),
    ((1,), (T, 6)),
    ((T, 1, 4), (1, 2, 1)),
]


@covers(Op.ADD, Op.MUL, Op.SUB, Op.DIV)
@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
def test_add_mul_broadcast(shapes) -> None:
    rng = np.random.default_rng(5)
    concrete = [tuple(N_TOK if d == T else d for d in s) for s in shapes]
    a, b = randn(rng, *concrete[0]), randn(rng, *concrete[1])

    def build(g):
        x, y = g.input("a", shapes[0]), g.input("b", shapes[1])
        return g.add(x, y), g.mul(x, y), g.add(y, x), g.op(Op.SUB, x, y), g.op(Op.DIV, x, y)

    s, p, s2, d, q = check(build, {"a": a, "b": b}, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(s, a + b)
    np.testing.assert_array_equal(p, a * b)
    np.testing.assert_array_equal(s2, a + b)
    np.testing.assert_array_equal(d, a - b)
    np.testing.assert_allclose(q, a / b, rtol=1e-6)


@covers(Op.ADD, Op.MUL)
def test_add_mul_weights_and_half_inputs() -> None:
    rng = np.random.default_rng(6)
    x = randn(rng, N_TOK, 8)
    w16 = randn(rng, 8).astype(np.float16)
    bf = (randn(rng, 8).view(np.uint32) >> 16).astype(np.uint16)
    h16 = randn(rng, N_TOK, 8).astype(np.float16)

    def build(g, h):
        w = g.weight(h, 0, (8,), DType.F16)
        xs = g.input("x", (T, 8))
        return (
            g.mul(xs, w),
            g.add(g.input("h", (T, 8), DType.F16), g.input("bf", (8,), DType.BF16)),
        )

    m, s = check(build, {"x": x, "h": h16, "bf": bf}, [w16], rtol=0, atol=0)
    np.testing.assert_array_equal(m, x * w16.astype(np.float32))
    bf32 = (bf.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(s, h16.astype(np.float32) + bf32)


@covers(Op.SCALE)
@pytest.mark.parametrize("s", [0.125, -3.7, 0.0, 1e-3])
def test_scale(s: float) -> None:
    x = randn(np.random.default_rng(7), N_TOK, 3, 4)
    (out,) = check(lambda g: g.scale(g.input("x", (T, 3, 4)), s), {"x": x}, rtol=1e-6, atol=0)
    np.testing.assert_allclose(out, x * np.float32(s), rtol=1e-6)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (1 + np.exp(-x))


def _activation_input(seed: int) -> np.ndarray:
    x = randn(np.random.default_rng(seed), N_TOK, 16, scale=3.0)
    x[0, :6] = [0.0, -0.0, 1.0, -1.0, 20.0, -20.0]
    return x


@covers(Op.SILU, Op.GELU)
def test_silu_gelu() -> None:
    x = _activation_input(8)

    def build(g):
        v = g.input("x", (T, 16))
        return g.silu(v), g.gelu(v)

    s, ge = check(build, {"x": x}, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s, _silu(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ge, _gelu_tanh(x), rtol=1e-5, atol=1e-6)
    # the tanh approximation, not erf: they differ by ~1.5e-4 at x = 1
    assert abs(float(ge[0, 2]) - 0.8411920) < 2e-6


@covers(Op.SWIGLU, Op.GEGLU)
def test_gated() -> None:
    gate = _activation_input(9)
    up = randn(np.random.default_rng(10), N_TOK, 16)

    def build(g):
        a, b = g.input("gate", (T, 16)), g.input("up", (T, 16))
        return g.swiglu(a, b), g.geglu(a, b)

    sw, ge = check(build, {"gate": gate, "up": up}, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sw, _silu(gate) * up, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ge, _gelu_tanh(gate) * up, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- normalisation


@covers(Op.RMS_NORM)
@pytest.mark.parametrize(("shape", "eps"), [((T, 16), 1e-5), ((2, 3, 8), 1e-6), ((T, 64), 0.5)])
def test_rms_norm(shape, eps: float) -> None:
    concrete = tuple(N_TOK if d == T else d for d in shape)
    x = randn(np.random.default_rng(11), *concrete, scale=2.0)
    x.reshape(-1, shape[-1])[0] = 0.0  # an all-zero row stays zero (eps keeps it finite)
    (out,) = check(lambda g: g.rms_norm(g.input("x", shape), eps), {"x": x}, rtol=1e-5, atol=1e-6)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + eps)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert not np.any(out.reshape(-1, shape[-1])[0])


@covers(Op.SOFTMAX)
def test_softmax() -> None:
    rng = np.random.default_rng(12)
    x = randn(rng, N_TOK, 7, scale=4.0)
    x[1] += 1000.0  # large logits must not overflow
    x[2] = 3.0  # uniform row
    x[3, 2] = -np.inf  # a masked entry gets probability 0
    (out,) = check(lambda g: g.softmax(g.input("x", (T, 7))), {"x": x}, rtol=1e-5, atol=1e-7)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-6)
    assert out[3, 2] == 0.0
    (out3,) = check(lambda g: g.softmax(g.input("x", (2, 3, 5))), {"x": randn(rng, 2, 3, 5)})
    np.testing.assert_allclose(out3.sum(-1), 1.0, rtol=1e-6)


# ---------------------------------------------------------------- ROPE


def rope_ref(x, pos, n_dims, base, neox, freq_scale) -> np.ndarray:
    """Pair by pair, as the op table says. Angles are rounded to f32 like both executors
    do (otherwise a position in the thousands alone gives errors of ~1e-4)."""
    out = x.astype(np.float64)
    half = n_dims // 2
    for t in range(x.shape[0]):
        for i in range(half):
            theta = float(np.float32(pos[t] * freq_scale * base ** (-2 * i / n_dims)))
            c, s = math.cos(theta), math.sin(theta)
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            xa, xb = x[t, :, a].astype(np.float64), x[t, :, b].astype(np.float64)
            out[t, :, a], out[t, :, b] = xa * c - xb * s, xa * s + xb * c
    return out


@covers(Op.ROPE)
@pytest.mark.parametrize("neox", [0, 1], ids=["normal", "neox"])
@pytest.mark.parametrize("n_dims", [12, 8, 2], ids=lambda n: f"n_dims={n}")
@pytest.mark.parametrize(("base", "freq_scale"), [(10000.0, 1.0), (500000.0, 0.25)])
def test_rope(neox: int, n_dims: int, base: float, freq_scale: float) -> None:
    head = 12
    rng = np.random.default_rng(13)
    x = randn(rng, N_TOK, 3, head)
    pos = ids_of(0, 1, 7, 100, 4095)

    def build(g):
        return g.rope(
            g.input("x", (T, 3, head)), g.input("pos", (T,), DType.I32), n_dims, base, neox,
            freq_scale,
        )

    (out,) = check(build, {"x": x, "pos": pos}, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, rope_ref(x, pos, n_dims, base, neox, freq_scale), atol=2e-6)
    np.testing.assert_array_equal(out[..., n_dims:], x[..., n_dims:])  # the rest is untouched
    np.testing.assert_array_equal(out[0], x[0])  # position 0 is the identity
    # rotations keep the norm of each rotated pair
    np.testing.assert_allclose(
        np.linalg.norm(out[..., :n_dims], axis=-1), np.linalg.norm(x[..., :n_dims], axis=-1),
        rtol=1e-5,
    )


@covers(Op.ROPE)
def test_rope_modes_differ() -> None:
    x = randn(np.random.default_rng(14), 2, 1, 8)
    pos = ids_of(3, 9)
    res = [
        check(lambda g, m=m: g.rope(g.input("x", (2, 1, 8)), g.input("p", (2,), DType.I32), 8,
                                    10000.0, m), {"x": x, "p": pos})[0]
        for m in (0, 1)
    ]
    assert not np.allclose(res[0], res[1])


# ---------------------------------------------------------------- ATTENTION


def attention_ref(q, k, v, pos, scale, window, softcap) -> np.ndarray:
    """Query by query, head by head, key by key: the op table's definition."""
    n_q, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    group = hq // hkv
    out = np.zeros((n_q, hq, dv))
    for t in range(n_q):
        p = int(pos[t])
        for h in range(hq):
            kh = h // group
            seen, scores = [], []
            for j in range(k.shape[0]):
                if j <= p and (window == 0 or p - j < window):
                    s = float(np.dot(q[t, h].astype(np.float64), k[j, kh].astype(np.float64)))
                    s *= scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    seen.append(j)
                    scores.append(s)
            w = np.exp(np.array(scores) - max(scores))
            w /= w.sum()
            out[t, h] = sum(wi * v[j, kh].astype(np.float64) for wi, j in zip(w, seen, strict=True))
    return out


ATTENTION_CASES = {
    # name: (Hq, Hkv, D, Dv, S, positions, window, softcap, scale)
    "prefill-gqa": (4, 2, 8, 8, 5, [0, 1, 2, 3, 4], 0, 0.0, None),
    "offset-gqa": (4, 2, 8, 8, 12, [6, 7, 8], 0, 0.0, None),
    "decode": (4, 2, 8, 8, 16, [10], 0, 0.0, None),
    "window": (4, 2, 8, 8, 12, [6, 7, 8, 9], 3, 0.0, None),
    "window-prefill": (2, 1, 4, 4, 6, [0, 1, 2, 3, 4, 5], 2, 0.0, None),
    "softcap": (4, 2, 8, 8, 10, [4, 5, 6], 0, 5.0, 2.0),
    "softcap-window": (4, 4, 8, 8, 10, [7, 8, 9], 4, 3.0, 1.0),
    "mha-dv": (3, 3, 8, 5, 7, [2, 3, 4, 5, 6], 0, 0.0, None),
    "mqa": (4, 1, 8, 8, 9, [5, 6, 7, 8], 0, 0.0, None),
}


@covers(Op.ATTENTION)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention(case: str) -> None:
    hq, hkv, d, dv, s, positions, window, softcap, scale = ATTENTION_CASES[case]
    scale = 1 / math.sqrt(d) if scale is None else scale
    rng = np.random.default_rng(15)
    pos = np.array(positions, np.int32)
    q = randn(rng, len(pos), hq, d, scale=1.5)
    k = randn(rng, s, hkv, d, scale=1.5)
    v = randn(rng, s, hkv, dv)
    # keys past the last position are never read: NaN there must not leak into the result
    k[pos.max() + 1 :] = np.nan
    v[pos.max() + 1 :] = np.nan

    def build(g):
        return g.attention(
            g.input("q", (T, hq, d)), g.input("k", (s, hkv, d)), g.input("v", (s, hkv, dv)),
            g.input("pos", (T,), DType.I32), scale, window=window, softcap=softcap,
        )

    (out,) = check(build, {"q": q, "k": k, "v": v, "pos": pos}, rtol=1e-5, atol=1e-5)
    assert out.shape == (len(pos), hq, dv)
    np.testing.assert_allclose(out, attention_ref(q, k, v, pos, scale, window, softcap),
                               rtol=1e-5, atol=1e-5)


@covers(Op.ATTENTION, Op.SET_ROWS)
def test_attention_over_f16_cache_state() -> None:
    """The KV-cache pattern: write this step's rows into F16 STATE, attend over all of it,
    over two computes (the second must see the rows the first wrote)."""
    hq, hkv, d, s = 4, 2, 8, 8
    rng = np.random.default_rng(16)
    cache0 = [randn(rng, s, hkv, d).astype(np.float16) for _ in "kv"]
    steps = []
    for step_pos in ([3, 4], [5]):
        n = len(step_pos)
        steps.append((ids_of(*step_pos), randn(rng, n, hkv, d), randn(rng, n, hkv, d),
                      randn(rng, n, hq, d)))

    def build(g, hk, hv):
        pos = g.input("pos", (T,), DType.I32)
        k = g.set_rows(g.state(hk, 0, (s, hkv, d), DType.F16), g.input("k", (T, hkv, d)), pos)
        v = g.set_rows(g.state(hv, 0, (s, hkv, d), DType.F16), g.input("v", (T, hkv, d)), pos)
        return g.attention(g.input("q", (T, hq, d)), k, v, pos, 0.3)

    results = {}
    for name in BACKENDS:
        be = make_backend(name)
        hk, hv = be.alloc_buffer(cache0[0].nbytes), be.alloc_buffer(cache0[1].nbytes)
        be.set_tensor(hk, 0, cache0[0])
        be.set_tensor(hv, 0, cache0[1])
        g = GraphBuilder()
        gid = be.register_graph(g.build(build(g, hk, hv)))
        ck, cv = cache0[0].copy(), cache0[1].copy()
        results[name] = []
        for pos, new_k, new_v, q in steps:
            ck[pos], cv[pos] = new_k, new_v
            (out,) = be.compute(gid, {"pos": pos, "k": new_k, "v": new_v, "q": q})
            want = attention_ref(q, ck, cv, pos, 0.3, 0, 0.0)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=name)
            results[name].append(out)
        for h, c in ((hk, ck), (hv, cv)):
            stored = np.frombuffer(be.get_tensor(h, 0, c.nbytes), np.float16).reshape(c.shape)
            np.testing.assert_array_equal(stored, c, err_msg=f"{name}: cache after two steps")
    for a, b in zip(results["numpy"], results["local"], strict=True):
        assert_same(b, a, 1e-5, 1e-5)


# ---------------------------------------------------------------- layout


@covers(Op.RESHAPE)
def test_reshape() -> None:
    rng = np.random.default_rng(17)
    x = randn(rng, N_TOK, 12)
    c = randn(rng, 2, 6)

    def build(g):
        v = g.input("x", (T, 12))
        a = g.reshape(v, (T, 3, 4))
        return a, g.reshape(a, (T, 12)), g.reshape(v, (2, T, 6)), g.reshape(g.input("c", (2, 6)),
                                                                           (3, 4))

    a, back, moved, cc = check(build, {"x": x, "c": c}, rtol=0, atol=0)
    np.testing.assert_array_equal(a, x.reshape(N_TOK, 3, 4))
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(moved, x.reshape(2, N_TOK, 6))
    np.testing.assert_array_equal(cc, c.reshape(3, 4))
    # the same graph, a different T
    x1 = randn(rng, 1, 12)
    (a1, *_) = check(build, {"x": x1, "c": c}, rtol=0, atol=0)
    np.testing.assert_array_equal(a1, x1.reshape(1, 3, 4))


@covers(Op.PERMUTE, Op.TRANSPOSE, Op.CONTIGUOUS)
def test_permute_transpose_contiguous() -> None:
    x = randn(np.random.default_rng(18), N_TOK, 3, 4)

    def build(g):
        v = g.input("x", (T, 3, 4))
        p = g.permute(v, (2, 0, 1))
        t = g.transpose(v, 0, 2)
        tn = g.transpose(v, -1, -2)
        # a layout change followed by a reshape needs a dense copy in between
        flat = g.reshape(g.contiguous(g.permute(v, (0, 2, 1))), (T, 12))
        return p, t, tn, g.contiguous(p), flat

    p, t, tn, pc, flat = check(build, {"x": x}, rtol=0, atol=0)
    np.testing.assert_array_equal(p, x.transpose(2, 0, 1))
    np.testing.assert_array_equal(t, np.swapaxes(x, 0, 2))
    np.testing.assert_array_equal(tn, np.swapaxes(x, -1, -2))
    np.testing.assert_array_equal(pc, x.transpose(2, 0, 1))
    np.testing.assert_array_equal(flat, x.transpose(0, 2, 1).reshape(N_TOK, 12))


@covers(Op.VIEW)
def test_view() -> None:
    x = randn(np.random.default_rng(19), N_TOK, 6, 4)

    def build(g):
        v = g.input("x", (T, 6, 4))
        return (
            g.view(v, 1, 2, 3),  # positive start on a static axis
            g.view(v, -1, 1, 3),  # negative axis
            g.view(v, 1, -2, 2),  # negative start on a static axis
            g.view(v, 0, -1, 1),  # the last token
            g.view(v, 0, -3, 2),  # a window counted from the end of T
        )

    a, b, c, last, win = check(build, {"x": x}, rtol=0, atol=0)
    np.testing.assert_array_equal(a, x[:, 2:5])
    np.testing.assert_array_equal(b, x[..., 1:4])
    np.testing.assert_array_equal(c, x[:, 4:6])
    np.testing.assert_array_equal(last, x[-1:])
    np.testing.assert_array_equal(win, x[-3:-1])


@covers(Op.CONCAT)
def test_concat() -> None:
    rng = np.random.default_rng(20)
    a, b = randn(rng, N_TOK, 2, 3), randn(rng, N_TOK, 4, 3)
    i, j = ids_of(1, 2, 3).reshape(1, 3), ids_of(4, 5, 6, 7, 8, 9).reshape(2, 3)

    def build(g):
        x, y = g.input("a", (T, 2, 3)), g.input("b", (T, 4, 3))
        return (
            g.concat(x, y, 1),
            g.concat(x, x, -1),
            g.concat(g.input("i", (1, 3), DType.I32), g.input("j", (2, 3), DType.I32), 0),
        )

    ab, aa, ij = check(build, {"a": a, "b": b, "i": i, "j": j}, rtol=0, atol=0)
    np.testing.assert_array_equal(ab, np.concatenate([a, b], 1))
    np.testing.assert_array_equal(aa, np.concatenate([a, a], -1))
    np.testing.assert_array_equal(ij, np.concatenate([i, j], 0))
    assert ij.dtype == np.int32


@covers(Op.RESHAPE, Op.TRANSPOSE, Op.VIEW, Op.CONCAT)
def test_layout_keeps_declared_dtype() -> None:
    """Layout ops do not change a value's dtype, and outputs come back as that dtype."""
    rng = np.random.default_rng(21)
    h = randn(rng, N_TOK, 4).astype(np.float16)
    bf = (randn(rng, N_TOK, 4).view(np.uint32) >> 16).astype(np.uint16)
    i = rng.integers(-50, 50, (N_TOK, 4)).astype(np.int32)

    def build(g):
        hv = g.input("h", (T, 4), DType.F16)
        bv = g.input("bf", (T, 4), DType.BF16)
        iv = g.input("i", (T, 4), DType.I32)
        return (
            g.reshape(hv, (T, 2, 2)),
            g.transpose(bv, 0, 1),
            g.view(iv, 1, 1, 2),
            g.concat(hv, hv, 1),
        )

    rh, tb, vi, ch = check(build, {"h": h, "bf": bf, "i": i}, rtol=0, atol=0)
    assert (rh.dtype, tb.dtype, vi.dtype, ch.dtype) == (
        NUMPY_DTYPES[DType.F16], NUMPY_DTYPES[DType.BF16], NUMPY_DTYPES[DType.I32],
        NUMPY_DTYPES[DType.F16],
    )
    np.testing.assert_array_equal(rh, h.reshape(N_TOK, 2, 2))
    np.testing.assert_array_equal(tb, bf.T)
    np.testing.assert_array_equal(vi, i[:, 1:3])
    np.testing.assert_array_equal(ch, np.concatenate([h, h], 1))


# ---------------------------------------------------------------- ARGMAX


@covers(Op.ARGMAX)
def test_argmax() -> None:
    rng = np.random.default_rng(22)
    x = randn(rng, N_TOK, 11)
    x[0] = [1, 3, 3, 0, 3, -1, 2, 3, 0, 0, 0]  # ties -> the first index
    x[1] = 5.0  # all equal -> 0
    x[2] = -np.inf
    x[2, 7] = -1e30
    x[3, 10] = 100.0
    y = randn(rng, 2, 3, 4)

    def build(g):
        return g.argmax(g.input("x", (T, 11))), g.argmax(g.input("y", (2, 3, 4)))

    a, b = check(build, {"x": x, "y": y}, rtol=0, atol=0)
    assert a.dtype == np.int32 and a.shape == (N_TOK,)
    np.testing.assert_array_equal(a, x.argmax(-1))
    assert list(a[:4]) == [1, 0, 7, 10]
    np.testing.assert_array_equal(b, y.argmax(-1))


@covers(Op.ATTENTION_SEQ)
@pytest.mark.parametrize("window", [0, 3])
def test_attention_seq_keeps_each_token_to_its_slot(window: int) -> None:
    """Tokens of three sequences in one step (slots 2, 0, 2 and 3, as a batched step
    interleaves them): each attends to its own slot as ATTENTION would over that slot
    alone; the device kernel (whole slots, masked) agrees with the CPU one."""
    rng = np.random.default_rng(16)
    n_slots, n, hq, hkv, d = 4, 10, 4, 2, 8
    seq = np.array([2, 2, 0, 3, 3, 3, 2], np.int32)
    pos = np.array([4, 5, 0, 6, 7, 8, 6], np.int32)
    q = randn(rng, len(pos), hq, d)
    k, v = randn(rng, n_slots, n, hkv, d), randn(rng, n_slots, n, hkv, d)

    def build(g):
        return g.attention(g.input("q", (T, hq, d)), g.input("k", k.shape), g.input("v", v.shape),
                           g.input("pos", (T,), DType.I32), 0.3, window=window,
                           seq=g.input("seq", (T,), DType.I32))

    (out,) = check(build, {"q": q, "k": k, "v": v, "pos": pos, "seq": seq})
    for t in range(len(pos)):
        want = attention_ref(q[t : t + 1], k[seq[t]], v[seq[t]], pos[t : t + 1], 0.3, window, 0.0)
        np.testing.assert_allclose(out[t : t + 1], want, rtol=1e-5, atol=1e-5)
    device = local_kernels.attention_seq(*(torch.from_numpy(a) for a in (q, k, v, pos, seq)), 0.3, window, 0.0)
    np.testing.assert_allclose(device.numpy(), out, rtol=1e-5, atol=1e-5)


def test_attention_seq_refuses_bad_slots_and_positions() -> None:
    g = GraphBuilder()
    q, pos = g.input("q", (T, 4, 8)), g.input("pos", (T,), DType.I32)
    k, v = g.input("k", (2, 6, 2, 8)), g.input("v", (2, 6, 2, 8))
    with pytest.raises(GraphError, match="ATTENTION_SEQ has .* positions but"):
        g.attention(q, k, v, pos, 1.0, seq=g.input("seq", (3,), DType.I32))
    with pytest.raises(GraphError, match="same fixed slots"):
        g.attention(q, k, g.input("v3", (3, 6, 2, 8)), pos, 1.0, seq=g.input("s", (T,), DType.I32))
    inputs = {"q": np.zeros((1, 4, 8), np.float32), "k": np.zeros((2, 6, 2, 8), np.float32),
              "v": np.zeros((2, 6, 2, 8), np.float32)}
    for name in BACKENDS:
        for seq, p, what in ((2, 0, "slot index out of range"), (0, 6, "position index out of range")):
            with pytest.raises(BackendError, match=what):
                run_on(name, lambda g: g.attention(
                    g.input("q", (T, 4, 8)), g.input("k", (2, 6, 2, 8)), g.input("v", (2, 6, 2, 8)),
                    g.input("pos", (T,), DType.I32), 1.0, seq=g.input("seq", (T,), DType.I32)),
                    {**inputs, "pos": ids_of(p), "seq": ids_of(seq)})


# ---------------------------------------------------------------- SAMPLE


class Sampler:
    """One SAMPLE graph registered on both backends; ``draw`` runs it on each."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.runs = []
        for name in BACKENDS:
            be = make_backend(name)
            g = GraphBuilder()
            out = g.sample(g.input("logits", shape), g.input("params", (5,)))
            self.runs.append((name, be, be.register_graph(g.build(out))))

    def draw(self, logits, temperature, top_k=0, top_p=1.0, min_p=0.0, u=0.5) -> dict:
        params = np.array([temperature, top_k, top_p, min_p, u], np.float32)
        return {
            name: be.compute(gid, {"logits": logits, "params": params})[0]
            for name, be, gid in self.runs
        }

    def same(self, logits, *args, **kw) -> np.ndarray:
        got = self.draw(logits, *args, **kw)
        a, b = got["numpy"], got["local"]
        assert a.dtype == b.dtype == np.int32 and a.shape == b.shape
        np.testing.assert_array_equal(b, a, err_msg=f"local vs numpy for {args} {kw}")
        return a


def kept_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The documented SAMPLE distribution over ids (f64): zero outside the kept set."""
    order = np.argsort(-logits, kind="stable")
    z = logits[order].astype(np.float64) / temperature
    keep = len(order) if top_k <= 0 else min(top_k, len(order))
    p = np.exp(z[:keep] - z[0])
    p /= p.sum()
    if top_p < 1.0:
        keep = min(keep, int(np.argmax(np.cumsum(p) >= top_p)) + 1)
    if min_p > 0.0:
        keep = min(keep, int((p >= min_p * p[0]).sum()))
    out = np.zeros(len(logits))
    out[order[:keep]] = p[:keep] / p[:keep].sum()
    return out


def test_sample_args_wire_layout() -> None:
    """The params vector is the fields in declaration order, as Op.SAMPLE documents."""
    args = SampleArgs(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, u=0.25)
    packed = args.pack()
    assert packed.dtype == np.float32 and packed.shape == (PARAMS_SIZE,) == (5,)
    np.testing.assert_array_equal(packed, np.array([0.7, 40, 0.9, 0.05, 0.25], np.float32))
    assert SampleArgs.unpack(packed) == SampleArgs(*(float(np.float32(v)) for v in (0.7, 40, 0.9, 0.05, 0.25)))
    unpacked = SampleArgs.unpack(torch.from_numpy(packed))  # 0-d tensors, read without a sync
    assert float(unpacked.top_p) == float(np.float32(0.9)) and not unpacked.greedy
    assert SampleArgs.unpack(GREEDY.pack()).greedy


@covers(Op.SAMPLE)
def test_sample_with_a_draw_per_row() -> None:
    """params (rows, PARAMS_SIZE): each row sampled with its own knobs and u, as if alone."""
    rng = np.random.default_rng(25)
    logits = randn(rng, 3, 30, scale=2.0)
    rows = [SampleArgs(0.0, 1, 1.0, 0.0, 0.0), SampleArgs(1.0, 0, 1.0, 0.0, 0.7),
            SampleArgs(0.8, 5, 0.9, 0.0, 0.2)]
    params = np.stack([r.pack() for r in rows])

    def build(g):
        return g.sample(g.input("logits", (3, 30)), g.input("params", (3, PARAMS_SIZE)))

    (got,) = check(build, {"logits": logits, "params": params}, rtol=0, atol=0)
    one = Sampler((30,))
    alone = [int(one.same(logits[i], *astuple(r))) for i, r in enumerate(rows)]
    assert got.tolist() == alone and got[0] == logits[0].argmax()
    with pytest.raises(GraphError, match="one per row"):
        g = GraphBuilder()
        g.sample(g.input("logits", (3, 30)), g.input("params", (2, PARAMS_SIZE)))


@covers(Op.SAMPLE)
def test_sample_greedy_is_argmax() -> None:
    rng = np.random.default_rng(23)
    logits = randn(rng, 4, 9)
    logits[1, [2, 6]] = 10.0  # a tie: the lower id
    s = Sampler((4, 9))
    for temp in (0.0, -1.0):
        for u in (0.0, 0.5, 0.999):
            got = s.same(logits, temp, top_k=3, top_p=0.5, u=u)
            np.testing.assert_array_equal(got, logits.argmax(-1))
    assert s.same(logits, 0.0)[1] == 2


@covers(Op.SAMPLE)
def test_sample_backends_agree() -> None:
    rng = np.random.default_rng(24)
    v = 20
    s = Sampler((v,))
    s2 = Sampler((3, v))
    for i in range(300):
        logits = randn(rng, v, scale=float(rng.uniform(0.5, 4.0)))
        if i % 5 == 0:
            logits[rng.integers(0, v, 4)] = logits.max()  # ties in the sort
        params = dict(
            top_k=int(rng.choice([0, 0, 1, 2, 5, 19, 20, 40])),
            top_p=float(rng.choice([1.0, 1.0, 0.9, 0.5, 0.05])),
            min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
            u=float(rng.choice([0.0, rng.random(), rng.random(), 0.9999999])),
        )
        temp = float(rng.choice([0.2, 0.7, 1.0, 1.5]))
        tok = int(s.same(logits, temp, **params))
        dist = {k: v for k, v in params.items() if k != "u"}
        p = kept_distribution(logits, temp, **dist)
        assert p[tok] > 0, f"token {tok} is outside the kept set for {params}"
        if i % 10 == 0:
            rows = randn(rng, 3, v)
            toks = s2.same(rows, temp, **params)
            for r in range(3):
                assert kept_distribution(rows[r], temp, **dist)[toks[r]] > 0


@covers(Op.SAMPLE)
def test_sample_edges() -> None:
    rng = np.random.default_rng(25)
    s = Sampler((12,))
    for _ in range(20):
        logits = randn(rng, 12, scale=2.0)
        order = np.argsort(-logits, kind="stable")
        for u in (0.0, 0.3, 0.9999):
            # top_k = 1 is always the argmax
            assert s.same(logits, float(rng.uniform(0.1, 3)), top_k=1, u=u) == order[0]
        # u = 0: the most likely token (with anything kept)
        for kw in ({}, {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2}):
            assert s.same(logits, 0.8, u=0.0, **kw) == order[0]
        # u just below 1: the least likely kept token
        assert s.same(logits, 0.8, top_k=3, u=0.9999999) == order[2]
        assert s.same(logits, 0.8, u=0.9999999) == order[-1]
    tied = np.array([1.0, 2.0, 2.0, 0.0], np.float32)
    s4 = Sampler((4,))
    assert s4.same(tied, 1.0, top_k=1, u=0.9) == 1  # ties sort lower id first
    forbidden = np.full(4, -np.inf, np.float32)  # a grammar's mask and a ban leave nothing
    for temp, kw in ((0.0, {}), (1.0, {"top_k": 2, "top_p": 0.9, "min_p": 0.1, "u": 0.7}), (0.5, {"u": 0.99})):
        assert s4.same(forbidden, temp, **kw) == 0


STAT_SETTINGS = [
    (0.7, 0, 1.0, 0.0),
    (1.0, 4, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (0.9, 0, 1.0, 0.15),
    (1.0, 5, 0.9, 0.05),
]


@covers(Op.SAMPLE)
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), STAT_SETTINGS)
def test_sample_frequencies(temperature, top_k, top_p, min_p) -> None:
    """u on a uniform grid visits each kept token in proportion to its probability."""
    logits = np.array([2.0, -1.0, 0.5, 1.7, 0.0, -3.0, 1.0, 0.2], np.float32)
    want = kept_distribution(logits, temperature, top_k, top_p, min_p)
    n = 1000
    grid = (np.arange(n) + 0.5) / n
    s = Sampler((len(logits),))
    counts = {name: np.zeros(len(logits)) for name in BACKENDS}
    for u in grid:
        for name, tok in s.draw(logits, temperature, top_k, top_p, min_p, float(u)).items():
            counts[name][int(tok)] += 1
    np.testing.assert_array_equal(counts["local"], counts["numpy"])
    # a uniform grid puts each token's count within one draw of n * p
    np.testing.assert_allclose(counts["numpy"] / n, want, atol=1.5 / n)
    assert set(np.flatnonzero(counts["numpy"])) <= set(np.flatnonzero(want))  # only kept ids


# ---------------------------------------------------------------- SET_ROWS


@covers(Op.SET_ROWS)
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16], ids=lambda d: d.name)
def test_set_rows_state(dtype: DType) -> None:
    rng = np.random.default_rng(26)
    npt = NUMPY_DTYPES[dtype]
    shape = (6, 2, 4)
    before = randn(rng, *shape).astype(npt)
    offset = 64  # the state sits between other bytes that must not change
    size = offset + before.nbytes + 32
    filler = rng.integers(0, 256, size, dtype=np.uint8)
    steps = [(ids_of(4, 0, 2), randn(rng, 3, 2, 4)), (ids_of(5,), randn(rng, 1, 2, 4))]

    for name in BACKENDS:
        be = make_backend(name)
        h = be.alloc_buffer(size)
        be.set_tensor(h, 0, filler)
        be.set_tensor(h, offset, before)
        g = GraphBuilder()
        st = g.state(h, offset, shape, dtype, label="cache")
        written = g.set_rows(st, g.input("src", (T, 2, 4)), g.input("ids", (T,), DType.I32))
        # a later read through the returned value sees the new rows
        back = g.get_rows(g.reshape(written, (6, 8)), g.input("ids2", (T,), DType.I32))
        gid = be.register_graph(g.build(written, back))
        want = before.copy()
        for ids, src in steps:
            out, rows = be.compute(gid, {"src": src, "ids": ids, "ids2": ids})
            want[ids] = src.astype(npt)
            assert out.dtype == npt, name
            np.testing.assert_array_equal(out, want, err_msg=name)
            np.testing.assert_array_equal(rows, want[ids].reshape(-1, 8).astype(np.float32))
            raw = np.frombuffer(be.get_tensor(h, 0, size), np.uint8)
            stored = raw[offset : offset + before.nbytes].view(npt).reshape(shape)
            np.testing.assert_array_equal(stored, want, err_msg=f"{name}: buffer after compute")
            np.testing.assert_array_equal(raw[:offset], filler[:offset])
            np.testing.assert_array_equal(raw[offset + before.nbytes :],
                                          filler[offset + before.nbytes :])
        untouched = [r for r in range(6) if r not in (0, 2, 4, 5)]
        np.testing.assert_array_equal(stored[untouched], before[untouched])


@covers(Op.SET_ROWS, Op.VIEW)
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16], ids=lambda d: d.name)
def test_set_rows_through_view_of_state(dtype: DType) -> None:
    """A K and a V cache side by side in one (S, 2, D) state: writing a VIEW of it writes
    the state (VIEW is a window on its input, as in x[start:start+length])."""
    npt = NUMPY_DTYPES[dtype]
    src = randn(np.random.default_rng(27), 2, 1, 3)
    ids = ids_of(3, 1)
    want = np.zeros((4, 2, 3), npt)
    want[ids, 1:2] = src.astype(npt)
    for name in BACKENDS:
        be = make_backend(name)
        h = be.alloc_buffer(want.nbytes)
        g = GraphBuilder()
        v = g.view(g.state(h, 0, (4, 2, 3), dtype), 1, 1, 1)
        out = g.set_rows(v, g.input("src", (T, 1, 3)), g.input("ids", (T,), DType.I32))
        (got,) = be.compute(be.register_graph(g.build(out)), {"src": src, "ids": ids})
        np.testing.assert_array_equal(got, want[:, 1:2], err_msg=name)
        stored = np.frombuffer(be.get_tensor(h, 0, want.nbytes), npt).reshape(want.shape)
        np.testing.assert_array_equal(stored, want, err_msg=name)


@covers(Op.SET_ROWS)
def test_set_rows_value() -> None:
    """SET_ROWS on a plain computed value (no state) just returns the updated tensor."""
    rng = np.random.default_rng(28)
    base, src = randn(rng, 5, 3), randn(rng, 2, 3)
    ids = ids_of(4, 1)

    def build(g):
        dst = g.scale(g.input("base", (5, 3)), 1.0)
        return g.set_rows(dst, g.input("src", (T, 3)), g.input("ids", (T,), DType.I32))

    (out,) = check(build, {"base": base, "src": src, "ids": ids}, rtol=0, atol=0)
    want = base.copy()
    want[ids] = src
    np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------- PENALIZE, LOGPROBS


@covers(Op.PENALIZE)
def test_penalize() -> None:
    rng = np.random.default_rng(27)
    v = 70  # three mask words, the last one partly used
    x = randn(rng, N_TOK, v, scale=3.0)
    scale = np.ones(v, np.float32)
    scale[[0, 5, 9, 69]] = [1.3, 0.5, 2.0, 1.1]
    bias = np.zeros(v, np.float32)
    bias[[5, 6, 40]] = [-100.0, 2.5, -0.5]
    allowed = rng.random(v) < 0.6
    mask = np.zeros((v + 31) // 32, np.uint32)
    for i in np.flatnonzero(allowed):
        mask[i // 32] |= np.uint32(1 << (i % 32))
    mask = mask.view(np.int32)

    def build(g):
        return g.op(Op.PENALIZE, g.input("x", (T, v)), g.input("scale", (v,)),
                    g.input("bias", (v,)), g.input("mask", (len(mask),), DType.I32))

    (out,) = check(build, {"x": x, "scale": scale, "bias": bias, "mask": mask}, rtol=0, atol=0)
    want = np.where(x > 0, x / scale, x * scale) + bias
    want[:, ~allowed] = -np.inf
    np.testing.assert_array_equal(out, want.astype(np.float32))
    with pytest.raises(GraphError, match="mask must be I32 of shape"):
        g = GraphBuilder()
        g.op(Op.PENALIZE, g.input("x", (1, v)), g.input("s", (v,)), g.input("b", (v,)),
             g.input("m", (2,), DType.I32))


@covers(Op.LOGPROBS)
def test_logprobs() -> None:
    rng = np.random.default_rng(28)
    v, k = 50, 4
    x = randn(rng, N_TOK, v, scale=2.0)
    x[1, [3, 7, 8]] = 9.0  # ties: the lower id first
    token = np.array([0, 7, 49, 60, -3], np.int32)  # out of range: clamped

    def build(g):
        return g.op(Op.LOGPROBS, g.input("x", (T, v)), g.input("token", (T,), DType.I32), attrs=(k,))

    (out,) = check(build, {"x": x, "token": token}, rtol=1e-5, atol=1e-5)
    assert out.shape == (N_TOK, k + 1, 2)
    lp = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    ids = out[..., 1].astype(int)
    np.testing.assert_array_equal(ids[:, 0], np.clip(token, 0, v - 1))
    np.testing.assert_array_equal(ids[1, 1:4], [3, 7, 8])
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-x, axis=-1, kind="stable")[:, :k])
    np.testing.assert_allclose(out[..., 0], np.take_along_axis(lp, ids, -1), atol=1e-5)


# ---------------------------------------------------------------- general programs (apir.torch)


@covers(Op.DIV)
def test_div_by_zero_is_ieee() -> None:
    a, b = np.array([1.0, -1.0, 0.0], np.float32), np.zeros(3, np.float32)
    (q,) = check(lambda g: g.op(Op.DIV, g.input("a", (3,)), g.input("b", (3,))), {"a": a, "b": b},
                 rtol=0, atol=0)
    assert q[0] == np.inf and q[1] == -np.inf and np.isnan(q[2])


UNARY_REF = {
    Fn.EXP: np.exp, Fn.LOG: np.log, Fn.SQRT: np.sqrt, Fn.RSQRT: lambda x: 1 / np.sqrt(x),
    Fn.SIN: np.sin, Fn.COS: np.cos, Fn.TANH: np.tanh, Fn.SIGMOID: lambda x: 1 / (1 + np.exp(-x)),
    Fn.RELU: lambda x: np.maximum(x, 0), Fn.ABS: np.abs,
}


@covers(Op.UNARY)
@pytest.mark.parametrize("fn", list(Fn), ids=lambda f: f.name)
def test_unary(fn) -> None:
    rng = np.random.default_rng(41)
    x = randn(rng, N_TOK, 9, scale=3.0)
    if fn in (Fn.LOG, Fn.SQRT, Fn.RSQRT):
        x = np.abs(x) + np.float32(0.1)
    (out,) = check(lambda g: g.op(Op.UNARY, g.input("x", (T, 9)), attrs=(int(fn),)), {"x": x},
                   rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(out, UNARY_REF[fn](x.astype(np.float64)), rtol=2e-6, atol=1e-6)


@covers(Op.UNARY)
def test_unary_outside_the_domain_is_nan_not_an_error() -> None:
    x = np.array([-1.0, 0.0], np.float32)

    def build(g):
        v = g.input("x", (2,))
        return g.op(Op.UNARY, v, attrs=(int(Fn.LOG),)), g.op(Op.UNARY, v, attrs=(int(Fn.RSQRT),))

    log, rsqrt = check(build, {"x": x}, rtol=0, atol=0)
    assert np.isnan(log[0]) and log[1] == -np.inf and np.isnan(rsqrt[0]) and rsqrt[1] == np.inf


@covers(Op.REDUCE)
@pytest.mark.parametrize("fn", list(Reduce), ids=lambda f: f.name)
def test_reduce(fn) -> None:
    x = randn(np.random.default_rng(42), 2, N_TOK, 7)
    (out,) = check(lambda g: g.op(Op.REDUCE, g.input("x", (2, T, 7)), attrs=(int(fn),)), {"x": x},
                   rtol=1e-6, atol=1e-6)
    want = {Reduce.SUM: x.sum(-1, keepdims=True), Reduce.MEAN: x.mean(-1, keepdims=True),
            Reduce.MAX: x.max(-1, keepdims=True)}[fn]
    assert out.shape == (2, N_TOK, 1)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@covers(Op.BMM)
def test_bmm() -> None:
    rng = np.random.default_rng(43)
    a, b = randn(rng, 3, N_TOK, 4), randn(rng, 3, 4, 6)
    (out,) = check(lambda g: g.op(Op.BMM, g.input("a", (3, T, 4)), g.input("b", (3, 4, 6))),
                   {"a": a, "b": b}, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, np.einsum("bmk,bkn->bmn", a, b), rtol=1e-5, atol=1e-6)


@covers(Op.CAST)
def test_cast() -> None:
    ids = ids_of(0, 7, -3, (1 << 24) - 1, 1 << 24)
    h = randn(np.random.default_rng(44), 4).astype(np.float16)
    i, f = check(lambda g: (g.op(Op.CAST, g.input("i", (5,), DType.I32)),
                            g.op(Op.CAST, g.input("h", (4,), DType.F16))), {"i": ids, "h": h},
                 rtol=0, atol=0)
    np.testing.assert_array_equal(i, ids.astype(np.float32))
    np.testing.assert_array_equal(f, h.astype(np.float32))


@covers(Op.SOFTMAX)
def test_softmax_of_a_fully_masked_row_is_zero() -> None:
    x = randn(np.random.default_rng(45), 3, 5)
    x[1] = -np.inf
    (out,) = check(lambda g: g.softmax(g.input("x", (3, 5))), {"x": x}, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[1], np.zeros(5, np.float32))
    np.testing.assert_allclose(out[[0, 2]].sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("op, ins, attrs, match", [
    (Op.UNARY, [((4,), DType.F32)], (10,), "fn 10 is not one of"),
    (Op.UNARY, [((4,), DType.I32)], (0,), "must be a float"),
    (Op.REDUCE, [((4,), DType.F32)], (3,), "fn 3 is not one of"),
    (Op.REDUCE, [((4, T), DType.F32)], (0,), "fixed last axis"),
    (Op.REDUCE, [((), DType.F32)], (0,), "fixed last axis"),
    (Op.BMM, [((2, 3, 4), DType.F32), ((3, 4, 5), DType.F32)], (), "do not multiply"),
    (Op.BMM, [((2, 3, 4), DType.F32), ((2, 5, 5), DType.F32)], (), "do not multiply"),
    (Op.BMM, [((3, 4), DType.F32), ((4, 5), DType.F32)], (), "must have 3 dims"),
    (Op.CAST, [((4,), DType.Q8_0)], (), "cannot take a quantized"),
    (Op.SUB, [((4,), DType.F32), ((3,), DType.F32)], (), "do not broadcast"),
    (Op.DIV, [((4,), DType.I32), ((4,), DType.F32)], (), "must be a float"),
])
def test_general_ops_refuse_bad_graphs(op, ins, attrs, match) -> None:
    with pytest.raises(GraphError, match=match):
        infer(op, ins, attrs)


@covers(Op.CONV2D)
@pytest.mark.parametrize("stride, padding, dilation, groups", [
    ((1, 1), (0, 0), (1, 1), 1), ((2, 1), (1, 2), (1, 1), 1), ((1, 2), (1, 0), (2, 1), 2), ((2, 2), (2, 2), (1, 1), 4)])
def test_conv2d(stride, padding, dilation, groups) -> None:
    rng = np.random.default_rng(46)
    x, w = randn(rng, 2, 4, 9, 8), randn(rng, 6 if groups != 4 else 8, 4 // groups, 3, 3)
    attrs = (stride, padding, dilation, groups)
    (out,) = check(lambda g, h: g.op(Op.CONV2D, g.input("x", x.shape), g.weight(h, 0, w.shape, DType.F32),
                                     attrs=attrs), {"x": x}, [w], rtol=1e-5, atol=1e-5)
    # a loop over every output element, from the definition
    n, o, ho, wo = out.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    cg, per = 4 // groups, o // groups
    for b, oc, i, j in [(0, 0, 0, 0), (1, o - 1, ho - 1, wo - 1), (1, min(per, o - 2), ho // 2, wo // 2)]:
        gi = oc // per
        ys = i * stride[0] + dilation[0] * np.arange(3)
        xs = j * stride[1] + dilation[1] * np.arange(3)
        want = (xp[b, gi * cg:(gi + 1) * cg][:, ys][:, :, xs] * w[oc]).sum()
        assert abs(out[b, oc, i, j] - want) < 1e-4


@covers(Op.POOL2D)
@pytest.mark.parametrize("fn", list(Pool), ids=lambda f: f.name)
@pytest.mark.parametrize("kernel, stride, padding", [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1)),
                                                     ((3, 2), (1, 2), (1, 0))])
def test_pool2d(fn, kernel, stride, padding) -> None:
    x = randn(np.random.default_rng(47), 2, 3, 7, 6)
    (out,) = check(lambda g: g.op(Op.POOL2D, g.input("x", x.shape), attrs=(int(fn), kernel, stride, padding)),
                   {"x": x}, rtol=1e-6, atol=1e-6)
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2),
                constant_values=-np.inf if fn is Pool.MAX else 0.0)
    i, j = out.shape[2] - 1, out.shape[3] - 1
    window = xp[1, 2, i * stride[0]:i * stride[0] + kernel[0], j * stride[1]:j * stride[1] + kernel[1]]
    want = window.max() if fn is Pool.MAX else window.mean()
    assert abs(out[1, 2, i, j] - want) < 1e-6


@pytest.mark.parametrize("op, ins, attrs, match", [
    (Op.CONV2D, [((1, 4, 8, 8), DType.F32), ((2, 4, 3, 3), DType.F32)], ((1, 1), (3, 0), (1, 1), 1), "less than the kernel"),
    (Op.CONV2D, [((1, 4, 8, 8), DType.F32), ((2, 4, 3, 3), DType.F32)], ((0, 1), (0, 0), (1, 1), 1), "stride must be"),
    (Op.CONV2D, [((1, 4, 8, 8), DType.F32), ((2, 4, 3, 3), DType.F32)], ((1,), (0, 0), (1, 1), 1), "stride must be"),
    (Op.CONV2D, [((1, 4, 8, 8), DType.F32), ((2, 2, 3, 3), DType.F32)], ((1, 1), (0, 0), (1, 1), 3), "groups=3"),
    (Op.CONV2D, [((1, 4, 2, 8), DType.F32), ((2, 4, 3, 3), DType.F32)], ((1, 1), (0, 0), (1, 1), 1), "does not fit"),
    (Op.CONV2D, [((1, 4, 8, T), DType.F32), ((2, 4, 3, 3), DType.F32)], ((1, 1), (0, 0), (1, 1), 1), "does not fit"),
    (Op.POOL2D, [((1, 4, 8, 8), DType.F32)], (2, (2, 2), (2, 2), (0, 0)), "fn 2 is not one of"),
    (Op.POOL2D, [((1, 4, 8, 8), DType.F32)], (0, (2, 2), (2, 2), (2, 0)), "at most half the kernel"),
    (Op.POOL2D, [((1, 4, 8, 8), DType.F32)], (0, (9, 2), (2, 2), (0, 0)), "must fit the input"),
    (Op.POOL2D, [((4, 8, 8), DType.F32)], (0, (2, 2), (2, 2), (0, 0)), "must have 4 dims"),
])
def test_conv_pool_refuse_bad_graphs(op, ins, attrs, match) -> None:
    with pytest.raises(GraphError, match=match):
        infer(op, ins, attrs)
