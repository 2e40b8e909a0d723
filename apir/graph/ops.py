"""The op table: the closed set of operations a graph may contain.

Opcodes are pinned (they travel over the wire). Each op has one ``OpSpec``: its arity,
its attributes (name and kind, in wire order), its shape rule, and the facts the guest,
the executors and the memory accounting all read (aliasing, quantized operands, index
operands, shared per-run work, scratch). Shape rules run when a graph is built on the
guest *and* again when the host validates a registered graph, so a bad graph is rejected
before anything executes.

Shapes are tuples of ints in numpy order (outermost first). ``T`` (= -1) is the one
symbolic dimension: the number of tokens in this step, bound when the graph is computed.

Semantics, per op (``x`` etc. are inputs in order):
  INPUT      ()                 a value bound at compute time by name
  WEIGHT     ()                 read-only tensor at (buffer, offset); may be quantized
  STATE      ()                 read-write tensor at (buffer, offset), e.g. a KV cache
  GET_ROWS   (table, ids)       table[ids] as f32; table (N, K) any dtype, ids (...,) i32
  SET_ROWS   (dst, src, ids)    dst[ids[t]] = src[t]; returns dst (orders later reads)
  MATMUL     (x, w)             x @ w.T: x (..., K) float, w (N, K) any dtype -> (..., N) f32
  ADD, MUL   (a, b)             elementwise with numpy broadcasting
  SCALE      (x)                x * scale
  SILU, GELU (x)                silu; gelu with the tanh approximation
  SWIGLU     (gate, up)         silu(gate) * up
  GEGLU      (gate, up)         gelu(gate) * up
  RMS_NORM   (x)                x / sqrt(mean(x^2, -1) + eps)
  SOFTMAX    (x)                softmax over the last axis
  ROPE       (x, pos)           rotate the first n_dims of x (T, H, D) by position pos (T,):
                                 theta_i = pos * freq_scale * base^(-2i/n_dims); pairs are
                                 (2i, 2i+1) in "normal" mode, (i, i+n_dims/2) in NEOX mode
  ATTENTION  (q, k, v, pos)     q (T, Hq, D), k (S, Hkv, D), v (S, Hkv, Dv), pos (T,) i32.
                                 Key j sits at position j; query t sees key j iff
                                 j <= pos[t] and (window == 0 or pos[t] - j < window).
                                 Scores are q.k * scale, then softcap*tanh(s/softcap) when
                                 softcap > 0. Grouped-query: Hq // Hkv queries share a key
                                 head. -> (T, Hq, Dv) f32
  ATTENTION_SEQ (q, k, v, pos, seq)
                                ATTENTION over a cache of S sequence slots: k (S, N, Hkv, D),
                                 v (S, N, Hkv, Dv), pos and seq (T,) i32. Query t sees key
                                 (s, j) iff s == seq[t], j <= pos[t] and (window == 0 or
                                 pos[t] - j < window): the tokens of several sequences share
                                 one step, each attending only to its own slot
  RESHAPE    (x)                to shape (same element count; T stays T)
  PERMUTE    (x)                axes permutation
  TRANSPOSE  (x)                swap two axes
  VIEW       (x)                x[start:start+length] along axis; start < 0 counts from the end
  CONTIGUOUS (x)                a dense copy (no-op in value)
  CONCAT     (a, b)             along axis
  ARGMAX     (x)                index of the first maximum over the last axis -> i32
  SAMPLE     (logits, params)   one token per row; params is a packed ``SampleArgs``, or
                                 one per row (rows of logits, PARAMS_SIZE)
                                 (apir.graph.sampling: temperature, top_k, top_p, min_p and
                                 u, a uniform draw in [0, 1) from the guest's seeded RNG).
                                 temperature <= 0 is argmax. Otherwise: scale by
                                 1/temperature, sort descending (ties: lower id first), keep
                                 top_k (if > 0), softmax, keep the shortest prefix whose mass
                                 reaches top_p (if < 1), drop p < min_p * p_max (if > 0),
                                 and return the first sorted id whose cumulative mass exceeds
                                 u * (kept mass) -> i32. A row of all -inf gives 0
  PENALIZE   (logits, scale, bias, mask)
                                logits (..., V) float; scale, bias (V,) F32; mask (ceil(V/32),)
                                 I32 -> (..., V) F32: x / scale where x > 0 else x * scale
                                 (llama.cpp's repetition penalty: 1 keeps x), plus bias
                                 (logit_bias, presence/frequency penalties), then -inf where
                                 bit v % 32 of mask[v // 32] is 0 (a grammar's forbidden tokens)
  LOGPROBS   (logits, token)    logits (..., V) float, token (...) I32 -> (..., k+1, 2) F32:
                                 row 0 is (log-softmax at token, token), rows 1..k the k
                                 largest (log-softmax, id), descending, ties lower id first.
                                 Ids travel as F32 (exact: V <= 2^24); a token outside
                                 [0, V) is clamped into it

General tensor programs (apir.torch lowers PyTorch's ATen graphs to these and the above):
  SUB, DIV   (a, b)             a - b, a / b, elementwise with numpy broadcasting
  UNARY      (x)                fn(x) elementwise; fn is a ``Fn`` (exp, log, sqrt, rsqrt,
                                 sin, cos, tanh, sigmoid, relu, abs), IEEE results for bad inputs
  REDUCE     (x)                fn over the last axis, kept as size 1: (..., N) -> (..., 1);
                                 fn is a ``Reduce`` (sum, mean, max)
  BMM        (a, b)             batched product a (B, M, K) @ b (B, K, N) -> (B, M, N) f32
  CAST       (x)                to F32 (I32 exactly up to 2^24; float values unchanged)
  CONV2D     (x, w)             x (N, C, H, W), w (O, C/groups, kh, kw) -> (N, O, Ho, Wo) f32:
                                 PyTorch's conv2d without bias; stride >= 1, dilation >= 1,
                                 0 <= padding < kernel (zeros), groups divide C and O;
                                 Ho = (H + 2 pad - dil (kh - 1) - 1) // stride + 1 >= 1
  POOL2D     (x)                x (N, C, H, W) -> (N, C, Ho, Wo) f32, fn a ``Pool``: the max
                                 (padding -inf) or the average (padding zeros, counted) of
                                 each kernel window; kernel <= (H, W), padding <= kernel // 2
  SOFTMAX gives 0, not NaN, on a row whose every entry is -inf (PyTorch's safe softmax,
  what a fully masked attention row gets)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .dtypes import COMPUTE_DTYPES, DType
from .sampling import PARAMS_SIZE

T = -1  # the symbolic token-count dimension
FLOAT_DTYPES = (DType.F32, DType.F16, DType.BF16)


class GraphError(ValueError):
    """A graph that breaks an op's rules; the message names the op and the tensor."""


class Op(enum.IntEnum):
    # leaves
    INPUT = 1
    WEIGHT = 2
    STATE = 3
    # indexing
    GET_ROWS = 10
    SET_ROWS = 11
    # linear algebra
    MATMUL = 20
    # elementwise
    ADD = 30
    MUL = 31
    SCALE = 32
    SILU = 33
    GELU = 34
    SWIGLU = 35
    GEGLU = 36
    # normalisation
    RMS_NORM = 40
    SOFTMAX = 41
    # position and attention
    ROPE = 50
    ATTENTION = 51
    ATTENTION_SEQ = 52
    # layout
    RESHAPE = 60
    PERMUTE = 61
    TRANSPOSE = 62
    VIEW = 63
    CONTIGUOUS = 64
    CONCAT = 65
    # selection
    ARGMAX = 70
    SAMPLE = 71
    PENALIZE = 72
    LOGPROBS = 73
    # general tensor programs (apir.torch)
    SUB = 80
    DIV = 81
    UNARY = 82
    REDUCE = 83
    BMM = 84
    CAST = 85
    CONV2D = 86
    POOL2D = 87


class Fn(enum.IntEnum):
    """UNARY's functions (its ``fn`` attribute)."""

    EXP = 0
    LOG = 1
    SQRT = 2
    RSQRT = 3
    SIN = 4
    COS = 5
    TANH = 6
    SIGMOID = 7
    RELU = 8
    ABS = 9


class Reduce(enum.IntEnum):
    """REDUCE's reductions (its ``fn`` attribute)."""

    SUM = 0
    MEAN = 1
    MAX = 2


class Pool(enum.IntEnum):
    """POOL2D's pooling (its ``fn`` attribute)."""

    MAX = 0
    AVG = 1


# Attribute kinds, as they are encoded on the wire.
INT, FLOAT, INTS, STR = "int", "float", "ints", "str"

Spec = tuple[tuple[int, ...], DType]  # (shape, dtype) of a value
Attrs = tuple[Any, ...]  # a node's attribute values, of the kinds its OpSpec.attrs names
ShapeRule = Callable[[Sequence[Spec], Attrs], Spec]
# input shapes -> what the op needs besides its result while it runs: (shape, bytes per element)
Scratch = tuple[tuple[tuple[int, ...], int], ...]
ScratchRule = Callable[[Sequence[tuple[int, ...]]], Scratch]


class Alias(enum.Enum):
    """Whether an op's result shares memory with its first input in the executors."""

    NONE = 0  # a fresh value
    ALWAYS = 1  # a view of the input, or the input itself (SET_ROWS writes it and returns it)
    MAYBE = 2  # the input itself where its layout allows (a contiguous input), else a copy


@dataclass(frozen=True)
class OpSpec:
    """Everything the guest, the executors and the accounting know about one op."""

    arity: int
    attrs: tuple[tuple[str, str], ...]  # (name, kind) in wire order
    rule: ShapeRule
    # Alias.NONE is the only one a write through the result cannot reach the input by, and
    # Alias.ALWAYS the only one that never allocates
    alias: Alias = Alias.NONE
    quantized: bool = False  # takes a quantized WEIGHT (where its shape rule allows one)
    # (index operand, indexed operand, what): values the executors bounds-check against
    # the indexed operand's first dim
    index: tuple[tuple[int, int, str], ...] = ()
    # its kernels share work that depends only on the last operand (positions, or slots and
    # the positions beside them)
    memo: bool = False
    scratch: ScratchRule | None = None


# ---------------------------------------------------------------- shape helpers


def numel_static(shape: Sequence[int]) -> tuple[int, int]:
    """(product of the static dims, how many dims are T)."""
    n, t = 1, 0
    for d in shape:
        if d == T:
            t += 1
        else:
            n *= d
    return n, t


def fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join("T" if d == T else str(d) for d in shape) + ")"


def _float(spec: Spec, what: str) -> None:
    if spec[1] not in FLOAT_DTYPES:
        raise GraphError(f"{what} must be a float tensor, got {spec[1].name}")


def _i32(spec: Spec, what: str) -> None:
    if spec[1] is not DType.I32:
        raise GraphError(f"{what} must be I32, got {spec[1].name}")


def _rank(spec: Spec, n: int, what: str) -> None:
    if len(spec[0]) != n:
        raise GraphError(f"{what} must have {n} dims, got {fmt_shape(spec[0])}")


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise GraphError(f"axis {axis} out of range for rank {rank}")
    return axis % rank


def broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise GraphError(f"shapes {fmt_shape(a)} and {fmt_shape(b)} do not broadcast")
    return tuple(reversed(out))


# ---------------------------------------------------------------- shape rules


def _leaf(ins: Sequence[Spec], attrs: Attrs) -> Spec:  # leaves carry their own spec; the builder fills it in
    raise GraphError("leaves (INPUT, WEIGHT, STATE) have no inputs to infer from")  # never an assert


def _get_rows(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (ts, tt), ids = ins
    _rank((ts, tt), 2, "GET_ROWS table")
    _i32(ids, "GET_ROWS ids")
    return (*ids[0], ts[1]), DType.F32


def _set_rows(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    dst, src, ids = ins
    _float(src, "SET_ROWS src")
    _i32(ids, "SET_ROWS ids")
    _rank(ids, 1, "SET_ROWS ids")
    if not src[0] or not dst[0]:
        raise GraphError("SET_ROWS destination and rows need at least one dim")
    if dst[1].is_quantized:
        raise GraphError("SET_ROWS destination cannot be quantized")
    if len(src[0]) != len(dst[0]) or tuple(src[0][1:]) != tuple(dst[0][1:]):
        raise GraphError(f"SET_ROWS rows {fmt_shape(src[0])} do not fit {fmt_shape(dst[0])}")
    if src[0][0] != ids[0][0]:
        raise GraphError(f"SET_ROWS has {src[0][0]} rows but {ids[0][0]} ids")
    return dst


def _matmul(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    x, w = ins
    _float(x, "MATMUL input")
    _rank(w, 2, "MATMUL weight")
    if not x[0]:
        raise GraphError("MATMUL input needs at least one dim")
    if x[0][-1] != w[0][1]:
        raise GraphError(f"MATMUL inner dims differ: input {fmt_shape(x[0])}, weight {fmt_shape(w[0])}")
    return (*x[0][:-1], w[0][0]), DType.F32


def _binary(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    a, b = ins
    _float(a, "left operand")
    _float(b, "right operand")
    return broadcast(a[0], b[0]), DType.F32


def _unary(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    _float(ins[0], "input")
    return ins[0][0], DType.F32


def _gated(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    gate, up = ins
    _float(gate, "gate")
    _float(up, "up")
    if tuple(gate[0]) != tuple(up[0]):
        raise GraphError(f"gate {fmt_shape(gate[0])} and up {fmt_shape(up[0])} differ")
    return gate[0], DType.F32


def _rms_norm(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (eps,) = attrs
    if not eps > 0:
        raise GraphError(f"eps must be positive, got {eps}")
    return _unary(ins, attrs)


def _rope(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    x, pos = ins
    n_dims, base, neox, freq_scale = attrs
    _float(x, "ROPE input")
    _rank(x, 3, "ROPE input (T, H, D)")
    _i32(pos, "ROPE positions")
    _rank(pos, 1, "ROPE positions")
    if pos[0][0] != x[0][0]:
        raise GraphError(f"ROPE has {x[0][0]} rows but {pos[0][0]} positions")
    if not (0 < n_dims <= x[0][2] and n_dims % 2 == 0):
        raise GraphError(f"ROPE n_dims={n_dims} must be even and within head size {x[0][2]}")
    if not (base > 0 and freq_scale > 0) or neox not in (0, 1):
        raise GraphError(f"ROPE base={base}, freq_scale={freq_scale}, neox={neox} out of range")
    return x[0], DType.F32


def _attention(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    q, k, v, pos = ins
    scale, window, softcap = attrs
    for spec, what in ((q, "query"), (k, "key"), (v, "value")):
        _float(spec, f"ATTENTION {what}")
        _rank(spec, 3, f"ATTENTION {what}")
    _i32(pos, "ATTENTION positions")
    _rank(pos, 1, "ATTENTION positions")
    (tq, hq, d), (s, hk, dk), (sv, hv, dv) = q[0], k[0], v[0]
    if dk != d or sv != s or hv != hk:
        raise GraphError(
            f"ATTENTION shapes disagree: q {fmt_shape(q[0])}, k {fmt_shape(k[0])}, v {fmt_shape(v[0])}"
        )
    if hk <= 0 or hq % hk:
        raise GraphError(f"ATTENTION query heads {hq} not a multiple of key heads {hk}")
    if pos[0][0] != tq:
        raise GraphError(f"ATTENTION has {tq} queries but {pos[0][0]} positions")
    if window < 0 or softcap < 0 or not math.isfinite(scale):
        raise GraphError(f"ATTENTION window={window}, softcap={softcap}, scale={scale} out of range")
    return (tq, hq, dv), DType.F32


def _attention_seq(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    q, k, v, pos, seq = ins
    _rank(k, 4, "ATTENTION_SEQ key (S, N, Hkv, D)")
    _rank(v, 4, "ATTENTION_SEQ value (S, N, Hkv, Dv)")
    if T in k[0] or tuple(k[0][:2]) != tuple(v[0][:2]):
        raise GraphError(f"ATTENTION_SEQ key {fmt_shape(k[0])} and value {fmt_shape(v[0])} "
                         "need the same fixed slots (S, N)")
    _i32(seq, "ATTENTION_SEQ slots")
    if tuple(seq[0]) != tuple(pos[0]):
        raise GraphError(f"ATTENTION_SEQ has {fmt_shape(pos[0])} positions but {fmt_shape(seq[0])} slots")
    rows = k[0][0] * k[0][1]  # the checks of ATTENTION over the slots laid end to end
    return _attention([q, ((rows, *k[0][2:]), k[1]), ((rows, *v[0][2:]), v[1]), pos], attrs)


def _reshape(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (shape,) = attrs
    if any(d < T or d == 0 for d in shape):
        raise GraphError(f"RESHAPE target {fmt_shape(shape)} has a bad dim")
    if numel_static(shape) != numel_static(ins[0][0]):
        raise GraphError(f"RESHAPE {fmt_shape(ins[0][0])} -> {fmt_shape(shape)} changes the size")
    return tuple(shape), ins[0][1]


def _permute(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (axes,) = attrs
    shape = ins[0][0]
    if sorted(axes) != list(range(len(shape))):
        raise GraphError(f"PERMUTE axes {tuple(axes)} are not a permutation of rank {len(shape)}")
    return tuple(shape[a] for a in axes), ins[0][1]


def _transpose(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    shape = list(ins[0][0])
    a, b = (_axis(x, len(shape)) for x in attrs)
    shape[a], shape[b] = shape[b], shape[a]
    return tuple(shape), ins[0][1]


def _view(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    axis, start, length = attrs
    shape = list(ins[0][0])
    axis = _axis(axis, len(shape))
    n = shape[axis]
    if length <= 0:
        raise GraphError(f"VIEW length must be positive, got {length}")
    if n == T:
        # symbolic axis: only a window counted from the end is checkable now
        if not (start < 0 and length <= -start):
            raise GraphError("VIEW on the token axis must count from the end (start < 0)")
    elif not (-n <= start < n and (start % n) + length <= n):
        raise GraphError(f"VIEW [{start}:{start}+{length}] outside axis of size {n}")
    shape[axis] = length
    return tuple(shape), ins[0][1]


def _contiguous(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    return ins[0]


def _concat(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (axis,) = attrs
    (a, ta), (b, tb) = ins
    if len(a) != len(b) or ta != tb:
        raise GraphError(f"CONCAT of {fmt_shape(a)} {ta.name} and {fmt_shape(b)} {tb.name}")
    axis = _axis(axis, len(a))
    if any(x != y for i, (x, y) in enumerate(zip(a, b)) if i != axis):
        raise GraphError(f"CONCAT shapes {fmt_shape(a)}, {fmt_shape(b)} differ off axis {axis}")
    if T in (a[axis], b[axis]):
        raise GraphError("CONCAT along the token axis is not supported")
    return tuple(a[:axis]) + (a[axis] + b[axis],) + tuple(a[axis + 1 :]), ta


def _argmax(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    _float(ins[0], "ARGMAX input")
    return ins[0][0][:-1], DType.I32


def _sample(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    logits, params = ins
    _float(logits, "SAMPLE logits")
    rows = tuple(logits[0][:-1])
    if params[1] is not DType.F32 or tuple(params[0]) not in ((PARAMS_SIZE,), (*rows, PARAMS_SIZE)):
        raise GraphError(f"SAMPLE params must be F32 of shape ({PARAMS_SIZE},) or one per row "
                         f"{fmt_shape((*rows, PARAMS_SIZE))}")
    return logits[0][:-1], DType.I32


MAX_VOCAB = 1 << 24  # LOGPROBS sends ids as F32, exact up to here


def _penalize(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    logits, scale, bias, mask = ins
    _float(logits, "PENALIZE logits")
    v = logits[0][-1] if logits[0] else T
    if v == T:
        raise GraphError("PENALIZE logits need a fixed vocabulary (last) dim")
    for spec, what in ((scale, "scale"), (bias, "bias")):
        if spec[1] is not DType.F32 or tuple(spec[0]) != (v,):
            raise GraphError(f"PENALIZE {what} must be F32 of shape ({v},)")
    if mask[1] is not DType.I32 or tuple(mask[0]) != ((v + 31) // 32,):
        raise GraphError(f"PENALIZE mask must be I32 of shape ({(v + 31) // 32},)")
    return logits[0], DType.F32


def _logprobs(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (k,) = attrs
    logits, token = ins
    _float(logits, "LOGPROBS logits")
    _i32(token, "LOGPROBS token")
    v = logits[0][-1] if logits[0] else T
    if v == T or not 1 <= v <= MAX_VOCAB:
        raise GraphError(f"LOGPROBS logits need a fixed last dim in 1..{MAX_VOCAB}")
    if tuple(token[0]) != tuple(logits[0][:-1]):
        raise GraphError(f"LOGPROBS token {fmt_shape(token[0])} must be the logits' rows "
                         f"{fmt_shape(logits[0][:-1])}")
    if not 0 <= k <= min(v, 1024):
        raise GraphError(f"LOGPROBS k must be in 0..{min(v, 1024)}, got {k}")
    return tuple(logits[0][:-1]) + (k + 1, 2), DType.F32


# ---------------------------------------------------------------- general programs (apir.torch)


def _fn_unary(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (fn,) = attrs
    if fn not in tuple(Fn):
        raise GraphError(f"fn {fn} is not one of {[f'{f.value}={f.name}' for f in Fn]}")
    return _unary(ins, attrs)


def _reduce(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    (fn,) = attrs
    if fn not in tuple(Reduce):
        raise GraphError(f"fn {fn} is not one of {[f'{f.value}={f.name}' for f in Reduce]}")
    _float(ins[0], "REDUCE input")
    shape = ins[0][0]
    if not shape or shape[-1] == T:
        raise GraphError(f"REDUCE needs a fixed last axis, got {fmt_shape(shape)}")
    return (*shape[:-1], 1), DType.F32


def _bmm(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    a, b = ins
    _float(a, "BMM left operand")
    _float(b, "BMM right operand")
    _rank(a, 3, "BMM left operand (B, M, K)")
    _rank(b, 3, "BMM right operand (B, K, N)")
    (n, m, k), (nb, kb, cols) = a[0], b[0]
    if n != nb or k != kb:
        raise GraphError(f"BMM shapes {fmt_shape(a[0])} and {fmt_shape(b[0])} do not multiply")
    return (n, m, cols), DType.F32


def _cast(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    if ins[0][1] not in (DType.I32, *FLOAT_DTYPES):
        raise GraphError(f"CAST takes I32 or a float, got {ins[0][1].name}")
    return ins[0][0], DType.F32


def _pair(values: Sequence[int], what: str, low: int) -> tuple[int, int]:
    if len(values) != 2 or min(values) < low:
        raise GraphError(f"{what} must be two ints >= {low}, got {tuple(values)}")
    return values[0], values[1]


def _window(n: int, k: int, stride: int, pad: int, dil: int) -> int:
    """Output length of a sliding window over n (padded by pad each side)."""
    out = (n + 2 * pad - dil * (k - 1) - 1) // stride + 1
    if n == T or out < 1:
        raise GraphError(f"a window of {k} (dilation {dil}, padding {pad}) does not fit {n}")
    return out


def _conv2d(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    x, w = ins
    stride, padding, dilation, groups = attrs
    _float(x, "CONV2D input")
    _float(w, "CONV2D weight")
    _rank(x, 4, "CONV2D input (N, C, H, W)")
    _rank(w, 4, "CONV2D weight (O, C/groups, kh, kw)")
    (n, c, h, wd), (o, cg, kh, kw) = x[0], w[0]
    sh, sw = _pair(stride, "CONV2D stride", 1)
    ph, pw = _pair(padding, "CONV2D padding", 0)
    dh, dw = _pair(dilation, "CONV2D dilation", 1)
    if groups < 1 or c % groups or o % groups or cg * groups != c:
        raise GraphError(f"CONV2D groups={groups} do not split input {fmt_shape(x[0])} and weight {fmt_shape(w[0])}")
    if ph >= kh or pw >= kw:
        raise GraphError(f"CONV2D padding {(ph, pw)} must be less than the kernel {(kh, kw)}")
    return (n, o, _window(h, kh, sh, ph, dh), _window(wd, kw, sw, pw, dw)), DType.F32


def _pool2d(ins: Sequence[Spec], attrs: Attrs) -> Spec:
    fn, kernel, stride, padding = attrs
    if fn not in tuple(Pool):
        raise GraphError(f"fn {fn} is not one of {[f'{f.value}={f.name}' for f in Pool]}")
    _float(ins[0], "POOL2D input")
    _rank(ins[0], 4, "POOL2D input (N, C, H, W)")
    n, c, h, w = ins[0][0]
    kh, kw = _pair(kernel, "POOL2D kernel", 1)
    sh, sw = _pair(stride, "POOL2D stride", 1)
    ph, pw = _pair(padding, "POOL2D padding", 0)
    if ph > kh // 2 or pw > kw // 2:
        raise GraphError(f"POOL2D padding {(ph, pw)} must be at most half the kernel {(kh, kw)}")
    if T in (h, w) or kh > h or kw > w:  # so a padded copy is at most twice the input
        raise GraphError(f"POOL2D kernel {(kh, kw)} must fit the input {fmt_shape(ins[0][0])}")
    return (n, c, _window(h, kh, sh, ph, 1), _window(w, kw, sw, pw, 1)), DType.F32


def _conv2d_scratch(shapes: Sequence[tuple[int, ...]]) -> Scratch:
    (n, c, h, w), (_, _, kh, kw) = shapes
    # one padded copy of the input and one kernel offset's window of it (padding < kernel)
    return ((n, c, h + 2 * kh, w + 2 * kw), 8), ((n, c, h + 2 * kh, w + 2 * kw), 4)


def _pool2d_scratch(shapes: Sequence[tuple[int, ...]]) -> Scratch:
    n, c, h, w = shapes[0]
    return (((n, c, 2 * h, 2 * w), 8),)  # a padded copy (kernel <= input, padding <= kernel / 2)


def _attention_scratch(shapes: Sequence[tuple[int, ...]]) -> Scratch:
    (tq, hq, d), (s, _, _), (_, _, dv) = shapes[:3]
    # scores and probabilities (Hq, Tq, S), keys and values repeated to Hq heads
    return ((hq, tq, s), 8), ((s, hq, max(d, dv)), 8)


def _attention_seq_scratch(shapes: Sequence[tuple[int, ...]]) -> Scratch:
    q, (s, n, hk, d), v = shapes[:3]
    return _attention_scratch((q, (s * n, hk, d), (s * n, hk, v[3])))


def _sample_scratch(shapes: Sequence[tuple[int, ...]]) -> Scratch:
    return ((shapes[0], 32),)  # sort, softmax, cumsums of the logits


OPS: dict[Op, OpSpec] = {
    Op.INPUT: OpSpec(0, (("name", STR),), _leaf),
    Op.WEIGHT: OpSpec(0, (("buffer", INT), ("offset", INT)), _leaf, quantized=True),
    Op.STATE: OpSpec(0, (("buffer", INT), ("offset", INT)), _leaf),
    Op.GET_ROWS: OpSpec(2, (), _get_rows, quantized=True, index=((1, 0, "GET_ROWS row"),)),
    Op.SET_ROWS: OpSpec(3, (), _set_rows, Alias.ALWAYS, index=((2, 0, "SET_ROWS row"),)),
    Op.MATMUL: OpSpec(2, (), _matmul, quantized=True),
    Op.ADD: OpSpec(2, (), _binary),
    Op.MUL: OpSpec(2, (), _binary),
    Op.SCALE: OpSpec(1, (("scale", FLOAT),), _unary),
    Op.SILU: OpSpec(1, (), _unary),
    Op.GELU: OpSpec(1, (), _unary),
    Op.SWIGLU: OpSpec(2, (), _gated),
    Op.GEGLU: OpSpec(2, (), _gated),
    Op.RMS_NORM: OpSpec(1, (("eps", FLOAT),), _rms_norm),
    Op.SOFTMAX: OpSpec(1, (), _unary),
    Op.ROPE: OpSpec(
        2, (("n_dims", INT), ("base", FLOAT), ("neox", INT), ("freq_scale", FLOAT)), _rope, memo=True
    ),
    Op.ATTENTION: OpSpec(
        4, (("scale", FLOAT), ("window", INT), ("softcap", FLOAT)), _attention,
        index=((3, 1, "ATTENTION position"),), memo=True, scratch=_attention_scratch,
    ),
    Op.ATTENTION_SEQ: OpSpec(
        5, (("scale", FLOAT), ("window", INT), ("softcap", FLOAT)), _attention_seq,
        index=((4, 1, "ATTENTION_SEQ slot"),), memo=True, scratch=_attention_seq_scratch,
    ),
    # a reshape of a permuted value copies (numpy and torch alike)
    Op.RESHAPE: OpSpec(1, (("shape", INTS),), _reshape, Alias.MAYBE),
    Op.PERMUTE: OpSpec(1, (("axes", INTS),), _permute, Alias.ALWAYS),
    Op.TRANSPOSE: OpSpec(1, (("a", INT), ("b", INT)), _transpose, Alias.ALWAYS),
    Op.VIEW: OpSpec(1, (("axis", INT), ("start", INT), ("length", INT)), _view, Alias.ALWAYS),
    Op.CONTIGUOUS: OpSpec(1, (), _contiguous, Alias.MAYBE),
    Op.CONCAT: OpSpec(2, (("axis", INT),), _concat),
    Op.ARGMAX: OpSpec(1, (), _argmax),
    Op.SAMPLE: OpSpec(2, (), _sample, scratch=_sample_scratch),
    Op.PENALIZE: OpSpec(4, (), _penalize, scratch=lambda shapes: ((shapes[0], 8),)),
    Op.LOGPROBS: OpSpec(2, (("k", INT),), _logprobs, scratch=_sample_scratch),
}

OPS.update({
    Op.SUB: OpSpec(2, (), _binary),
    Op.DIV: OpSpec(2, (), _binary),
    Op.UNARY: OpSpec(1, (("fn", INT),), _fn_unary),
    Op.REDUCE: OpSpec(1, (("fn", INT),), _reduce),
    Op.BMM: OpSpec(2, (), _bmm),
    Op.CAST: OpSpec(1, (), _cast),
    Op.CONV2D: OpSpec(2, (("stride", INTS), ("padding", INTS), ("dilation", INTS), ("groups", INT)),
                      _conv2d, scratch=_conv2d_scratch),
    Op.POOL2D: OpSpec(1, (("fn", INT), ("kernel", INTS), ("stride", INTS), ("padding", INTS)), _pool2d,
                      scratch=_pool2d_scratch),
})

LEAVES = (Op.INPUT, Op.WEIGHT, Op.STATE)


def infer(op: Op, inputs: Sequence[Spec], attrs: Attrs) -> Spec:
    """Run ``op``'s shape rule; every failure is a GraphError naming the op."""
    spec = OPS[op]
    if len(inputs) != spec.arity:
        raise GraphError(f"{op.name} takes {spec.arity} inputs, got {len(inputs)}")
    if len(attrs) != len(spec.attrs):
        raise GraphError(f"{op.name} takes attributes {[a for a, _ in spec.attrs]}, got {attrs!r}")
    for value, (name, kind) in zip(attrs, spec.attrs, strict=True):
        ok = {
            INT: lambda v: isinstance(v, int),
            FLOAT: lambda v: isinstance(v, (int, float)) and math.isfinite(v),
            INTS: lambda v: isinstance(v, tuple) and all(isinstance(i, int) for i in v),
            STR: lambda v: isinstance(v, str),
        }[kind](value)
        if not ok:
            raise GraphError(f"{op.name} attribute {name} must be {kind}, got {value!r}")
    for _, dtype in inputs:
        if dtype.is_quantized and not spec.quantized:
            raise GraphError(f"{op.name} cannot take a quantized ({dtype.name}) input")
    try:
        return spec.rule(inputs, attrs)
    except GraphError as e:
        raise GraphError(f"{op.name}: {e}") from None
    except (IndexError, TypeError, ValueError):
        # a rule that forgot a check must still refuse with a GraphError, never raise
        # something the host would report as its own failure
        shapes = ", ".join(f"{fmt_shape(s)} {d.name}" for s, d in inputs)
        raise GraphError(f"{op.name}: inputs {shapes} do not fit the op") from None


def leaf_spec_check(op: Op, shape: tuple[int, ...], dtype: DType) -> None:
    """Leaves: plain dims (T only for inputs), a block-aligned row for quantized types."""
    for d in shape:
        if d == T and op is Op.INPUT:
            continue
        if not isinstance(d, int) or d <= 0:
            raise GraphError(f"{op.name} has a bad dimension in {fmt_shape(shape)}")
    if op is Op.INPUT and dtype not in COMPUTE_DTYPES:
        raise GraphError(f"INPUT dtype must be one of {[d.name for d in COMPUTE_DTYPES]}")
    if op is Op.STATE and dtype.is_quantized:
        raise GraphError("STATE tensors cannot be quantized")
    if dtype.is_quantized and (not shape or shape[-1] % dtype.block_size):
        raise GraphError(
            f"{dtype.name} tensor {fmt_shape(shape)}: rows must be whole {dtype.block_size}-element blocks"
        )
