"""The reference executor: plain numpy, float32, written to be read.

It defines what every op means in code (see ``apir.graph.ops`` for the prose). Other
executors are tested against it. It needs no torch, so a guest without a GPU or torch
can still run a model on its own CPU ("guest-cpu").
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np

from ..graph import OPS, DType, Graph, Op, SampleArgs, releases
from ..graph.dtypes import NUMPY_DTYPES
from ..graph.ops import Fn, Pool, Reduce
from .base import BackendError, DeviceInfo
from .executor import Buffer, Executor, Registered, check_indices, check_positions, fits


def to_f32(arr: np.ndarray, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    """Raw stored values of ``dtype`` -> float32 of ``shape`` (quantized via gguf-py)."""
    if dtype is DType.F32:
        return arr.view(np.float32).reshape(shape)
    if dtype is DType.F16:
        return arr.view(np.float16).astype(np.float32).reshape(shape)
    if dtype is DType.BF16:
        return (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if dtype is DType.I32:
        return arr.view(np.int32).reshape(shape)
    rows = arr.reshape(-1, dtype.nbytes((shape[-1],)))
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(dtype))).reshape(shape)


def from_f32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 -> stored representation of a plain ``dtype`` (BF16 rounds to nearest even)."""
    if dtype is DType.F32:
        return x.astype(np.float32)
    if dtype is DType.F16:
        return x.astype(np.float16)
    if dtype is DType.BF16:
        bits = x.astype(np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(np.int32)


# ---------------------------------------------------------------- kernels


def gelu(x: np.ndarray) -> np.ndarray:
    # x**3 overflows to +-inf for |x| > ~7e12; tanh then saturates to the right limit
    with np.errstate(over="ignore"):
        return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < ~-88 (f32); x / inf = -0, the right limit
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def safe_softmax(x: np.ndarray) -> np.ndarray:
    """softmax, 0 on a row of all -inf (PyTorch's _safe_softmax; the plain one gives NaN)."""
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isneginf(m), np.float32(0), m))
    s = e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isneginf(m), np.float32(0), e / s).astype(np.float32)


def rope(x: np.ndarray, pos: np.ndarray, n_dims: int, base: float, neox: int, freq_scale: float):
    # x (T, H, D); only the first n_dims of D rotate.
    half = n_dims // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2 / n_dims)
    theta = (pos.astype(np.float64)[:, None] * freq_scale * inv_freq[None, :]).astype(np.float32)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # (T, 1, half)
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_dims]
        out[..., :half], out[..., half:n_dims] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2], out[..., 1:n_dims:2] = a * cos - b * sin, a * sin + b * cos
    return out


def attention_mask(pos: np.ndarray, n_kv: int, window: int) -> np.ndarray:
    """(T, n_kv) bool: may query t see key j?"""
    j = np.arange(n_kv)[None, :]
    p = pos[:, None]
    visible = j <= p
    if window:
        visible &= p - j < window
    return visible


def attention(q, k, v, pos, scale: float, window: int, softcap: float) -> np.ndarray:
    # q (T, Hq, D), k (S, Hkv, D), v (S, Hkv, Dv): keys past the last position are unused.
    n_kv = int(pos.max()) + 1
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k[:n_kv], group, axis=1)  # (n_kv, Hq, D)
    v = np.repeat(v[:n_kv], group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * np.float32(scale)  # (Hq, T, n_kv)
    if softcap:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    scores = np.where(attention_mask(pos, n_kv, window)[None], scores, -np.inf)
    return np.einsum("hts,shd->thd", softmax(scores), v).astype(np.float32)


def attention_seq(q, k, v, pos, seq, scale: float, window: int, softcap: float) -> np.ndarray:
    # k (S, N, Hkv, D): each query row attends, as ATTENTION does, to its own slot's keys
    check_positions(pos, k.shape[1])
    out = np.empty((q.shape[0], q.shape[1], v.shape[-1]), np.float32)
    for s in np.unique(seq):
        rows = seq == s
        out[rows] = attention(q[rows], k[s], v[s], pos[rows], scale, window, softcap)
    return out


def sample(logits: np.ndarray, params: np.ndarray) -> np.ndarray:
    rows = logits.reshape(-1, logits.shape[-1])
    draws = np.broadcast_to(params.reshape(-1, params.shape[-1]), (len(rows), params.shape[-1]))
    out = np.empty(len(rows), np.int32)
    for r, row in enumerate(rows):
        a = SampleArgs(*draws[r].tolist())
        if a.greedy:
            out[r] = row.argmax()
            continue
        if np.isneginf(row).all():  # every token forbidden (a grammar and a ban): id 0, as torch
            out[r] = 0
            continue
        order = np.argsort(-row, kind="stable")
        scaled = row[order].astype(np.float32) / np.float32(a.temperature)
        keep = len(order) if a.top_k <= 0 else int(min(a.top_k, len(order)))  # inf: all; nan: ValueError
        p = softmax(scaled[:keep])
        if a.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(p), np.float32(a.top_p))) + 1)
        if a.min_p > 0.0:
            keep = min(keep, int((p >= np.float32(a.min_p) * p[0]).sum()))
        cdf = np.cumsum(p[:keep])
        out[r] = order[min(int(np.searchsorted(cdf, np.float32(a.u) * cdf[-1], side="right")), keep - 1)]
    return out.reshape(logits.shape[:-1])


def penalize(logits, scale, bias, mask) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(logits > 0, logits / scale, logits * scale).astype(np.float32) + bias
    v = np.arange(x.shape[-1])
    allowed = (mask[v // 32] >> (v % 32).astype(np.int32)) & 1
    return np.where(allowed == 1, x, -np.inf).astype(np.float32)


def logprobs(logits, token, k: int) -> np.ndarray:
    v = logits.shape[-1]
    rows = logits.reshape(-1, v).astype(np.float32)
    m = rows.max(-1, keepdims=True)
    lp = rows - (m + np.log(np.exp(rows - m).sum(-1, keepdims=True)))
    tok = np.clip(token.reshape(-1, 1).astype(np.int64), 0, v - 1)
    top = np.argsort(-rows, axis=-1, kind="stable")[:, :k]  # by logit: the same order on every backend
    ids = np.concatenate([tok, top], -1)
    out = np.stack([np.take_along_axis(lp, ids, -1), ids.astype(np.float32)], -1)
    return out.astype(np.float32).reshape(*logits.shape[:-1], k + 1, 2)


def _view(x, axis, start, length):
    # a basic slice, so a VIEW of a STATE is a window on it (SET_ROWS writes through)
    n = x.shape[axis]
    if not -n <= start < n:  # on the T axis only known now; must not wrap around
        raise BackendError(f"VIEW start {start} outside axis of size {n}")
    start = start % n
    if start + length > n:
        raise BackendError(f"VIEW [{start}:{start + length}] outside axis of size {n}")
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + length)
    return x[tuple(index)]


def _set_rows(dst, src, ids):
    dst[ids] = src.astype(dst.dtype)
    return dst


# op -> f(*inputs, *attrs). Float inputs arrive as f32 (STATE as a live f32 or f16 view);
# index operands (OpSpec.index) are checked before the kernel runs.
KERNELS = {
    Op.GET_ROWS: lambda table, ids: table[ids].astype(np.float32, copy=False),
    Op.SET_ROWS: _set_rows,
    Op.MATMUL: lambda x, w: np.matmul(x, w.T),
    Op.ADD: lambda a, b: a + b,
    Op.MUL: lambda a, b: a * b,
    Op.SCALE: lambda x, s: x * np.float32(s),
    Op.SILU: silu,
    Op.GELU: gelu,
    Op.SWIGLU: lambda g, u: silu(g) * u,
    Op.GEGLU: lambda g, u: gelu(g) * u,
    Op.RMS_NORM: lambda x, eps: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)),
    Op.SOFTMAX: safe_softmax,
    Op.ROPE: rope,
    Op.ATTENTION: attention,
    Op.ATTENTION_SEQ: attention_seq,
    Op.RESHAPE: lambda x, shape: x.reshape([-1 if d == -1 else d for d in shape]),
    Op.PERMUTE: lambda x, axes: x.transpose(axes),
    Op.TRANSPOSE: lambda x, a, b: np.swapaxes(x, a, b),
    Op.VIEW: _view,
    Op.CONTIGUOUS: lambda x: np.ascontiguousarray(x),
    Op.CONCAT: lambda a, b, axis: np.concatenate([a, b], axis=axis),
    Op.ARGMAX: lambda x: x.argmax(axis=-1).astype(np.int32),
    Op.SAMPLE: sample,
    Op.PENALIZE: penalize,
    Op.LOGPROBS: logprobs,
}


# ---------------------------------------------------------------- general programs (apir.torch)


UNARY = {
    Fn.EXP: np.exp,
    Fn.LOG: np.log,
    Fn.SQRT: np.sqrt,
    Fn.RSQRT: lambda x: np.float32(1) / np.sqrt(x),
    Fn.SIN: np.sin,
    Fn.COS: np.cos,
    Fn.TANH: np.tanh,
    Fn.SIGMOID: lambda x: np.float32(1) / (np.float32(1) + np.exp(-x)),
    Fn.RELU: lambda x: np.maximum(x, np.float32(0)),
    Fn.ABS: np.abs,
}
REDUCE = {Reduce.SUM: np.sum, Reduce.MEAN: np.mean, Reduce.MAX: np.max}


def unary(x: np.ndarray, fn: int) -> np.ndarray:
    # IEEE results for inputs outside a function's domain (log(-1) = nan, exp(1e3) = inf)
    with np.errstate(all="ignore"):
        return UNARY[Fn(fn)](x).astype(np.float32)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return a / b


def _windows(x: np.ndarray, kh: int, kw: int, stride, dilation, out_hw):
    """For each kernel offset (i, j): x's strided window under it, (..., Ho, Wo)."""
    (sh, sw), (dh, dw), (ho, wo) = stride, dilation, out_hw
    for i in range(kh):
        for j in range(kw):
            yield i, j, x[..., i * dh : i * dh + sh * (ho - 1) + 1 : sh, j * dw : j * dw + sw * (wo - 1) + 1 : sw]


def _pad(x: np.ndarray, padding, value: float) -> np.ndarray:
    ph, pw = padding
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def conv2d(x, w, stride, padding, dilation, groups: int) -> np.ndarray:
    # x (N, C, H, W), w (O, C/g, kh, kw): per kernel offset, a product over the channels
    n, o, (cg, kh, kw) = x.shape[0], w.shape[0], w.shape[1:]
    h, wd = x.shape[2:]
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    xg = _pad(x, padding, 0.0).reshape(n, groups, cg, h + 2 * padding[0], wd + 2 * padding[1])
    wg = w.reshape(groups, o // groups, cg, kh, kw)
    out = np.zeros((n, groups, o // groups, ho, wo), np.float32)
    for i, j, patch in _windows(xg, kh, kw, stride, dilation, (ho, wo)):
        out += np.einsum("ngchw,goc->ngohw", patch, wg[..., i, j])
    return out.reshape(n, o, ho, wo)


def pool2d(x, fn: int, kernel, stride, padding) -> np.ndarray:
    (kh, kw), (h, w) = kernel, x.shape[2:]
    ho = (h + 2 * padding[0] - kh) // stride[0] + 1
    wo = (w + 2 * padding[1] - kw) // stride[1] + 1
    biggest = Pool(fn) is Pool.MAX
    xp = _pad(x, padding, -np.inf if biggest else 0.0)
    out = np.full((*x.shape[:2], ho, wo), -np.inf if biggest else 0.0, np.float32)
    for _, _, patch in _windows(xp, kh, kw, stride, (1, 1), (ho, wo)):
        out = np.maximum(out, patch) if biggest else out + patch
    return out if biggest else out / np.float32(kh * kw)


KERNELS.update({
    Op.CONV2D: conv2d,
    Op.POOL2D: pool2d,
    Op.SUB: lambda a, b: a - b,
    Op.DIV: _divide,
    Op.UNARY: unary,
    Op.REDUCE: lambda x, fn: REDUCE[Reduce(fn)](x, axis=-1, keepdims=True).astype(np.float32),
    Op.BMM: lambda a, b: np.matmul(a, b).astype(np.float32),
    Op.CAST: lambda x: x.astype(np.float32),
})


class NumpyBackend(Executor):
    """Buffers are bytearrays; weights are dequantized to f32 once and cached."""

    name = "numpy"

    def device(self) -> DeviceInfo:
        return DeviceInfo.host_cpu()

    def _alloc(self, size: int) -> bytearray:
        return bytearray(size)  # zeroed: a fresh buffer never shows old data

    def _fill(self, buf: Buffer, value: int) -> None:
        np.frombuffer(buf.storage, np.uint8)[:] = value

    def _write(self, buf: Buffer, offset: int, data: np.ndarray) -> None:
        np.frombuffer(buf.storage, np.uint8)[offset : offset + data.nbytes] = data

    def _read(self, buf: Buffer, offset: int, size: int) -> bytes:
        return bytes(buf.storage[offset : offset + size])

    def _compile(self, graph: Graph) -> tuple[tuple[int, ...], ...]:
        # the reference interprets the node list directly: its program is only when each
        # value may be dropped
        return releases(graph)

    def _leaf(self, node) -> np.ndarray:
        handle, offset = node.attrs
        buf = self._buffers[handle]
        raw = np.frombuffer(buf.storage, np.uint8, node.dtype.nbytes(node.shape), offset)
        if node.op is Op.STATE:
            if node.dtype in (DType.F32, DType.F16, DType.I32):
                return raw.view(NUMPY_DTYPES[node.dtype]).reshape(node.shape)  # a live view
            raise BackendError(f"numpy executor keeps STATE in F32/F16/I32, not {node.dtype.name}")
        f32 = node.dtype is not DType.I32  # I32 ids stay a view of the buffer
        return self._cached((node,), lambda: to_f32(raw, node.dtype, node.shape).astype(
            np.float32 if f32 else np.int32, copy=f32))

    def _host_outputs(self, reg: Registered, outputs: list,
                      out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        host = []
        for i, o in enumerate(outputs):  # copies: the originals stay for ``feed``
            dest = out[i] if out is not None else None
            if fits(dest, o.dtype, o.size):
                np.copyto(dest.reshape(o.shape), o)
                host.append(dest)
            else:
                host.append(o.copy())
        return host

    def _run(self, reg: Registered, inputs: dict[str, np.ndarray], bounds: dict) -> list[np.ndarray]:
        values: list[np.ndarray] = []
        for nid, node in enumerate(reg.graph.nodes):
            if node.op is Op.INPUT:
                arr = inputs[node.attrs[0]]
                if node.dtype is DType.BF16:
                    arr = to_f32(arr, DType.BF16, arr.shape)
                values.append(arr.astype(np.float32) if node.dtype is DType.F16 else arr)
            elif node.op in (Op.WEIGHT, Op.STATE):
                values.append(self._leaf(node))
            else:
                args = [values[i] for i in node.inputs]
                if node.dtype is DType.F32 and node.op is not Op.SET_ROWS:
                    # compute ops work in f32; an F16 STATE arrives as a live f16 view
                    args = [a.astype(np.float32) if a.dtype == np.float16 else a for a in args]
                try:
                    check_indices(OPS[node.op].index, args)
                    out = KERNELS[node.op](*args, *node.attrs)
                except BackendError as e:
                    raise BackendError(f"{node.describe(nid)}: {e}") from None
                except (ValueError, IndexError, FloatingPointError) as e:
                    raise BackendError(f"{node.describe(nid)} failed: {e}") from None
                if node.dtype is DType.F32 and out.dtype == np.float16:
                    out = out.astype(np.float32)
                values.append(out)
            for i in reg.program[nid]:
                values[i] = None
        return [_as_declared(values[o], reg.graph.nodes[o].dtype) for o in reg.graph.outputs]


def _as_declared(x: np.ndarray, dtype: DType) -> np.ndarray:
    """A copy of an output in its node's dtype (F16/BF16 values are held here as f32)."""
    want = NUMPY_DTYPES[dtype]
    return np.array(x if x.dtype == want else from_f32(x, dtype), dtype=want, copy=True)
