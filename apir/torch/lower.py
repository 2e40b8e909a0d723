"""ATen FX graph -> apir ``Graph``, for one binding of its inputs.

A graph from AOTAutograd (core ATen, functional: no op writes its inputs) is interpreted
node by node. Every value is one of:
  - an apir ``Value``: it depends on a runtime input, so the host computes it;
  - a ``Known`` tensor: a weight, a constant of the graph, or anything computed from those
    and from shapes alone (rotary tables of fixed positions, causal masks). The guest folds
    these with PyTorch while lowering; a ``Known`` becomes a WEIGHT leaf where an apir op
    reads it (``Lowering.leaf``);
  - a plain Python value (ints of shapes, scalars, lists).
Shapes are concrete: the runtime lowers again for each new binding of input shapes
(``apir.torch.runtime``), so Dynamo's symbolic sizes are plain ints here.

``LOWER`` maps each ATen op that has an apir lowering to it; ``supported`` says, before
any input is seen, whether a node can be lowered (the rest of the graph is split around
those that cannot: ``apir.torch.runtime.partition``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from ..graph import DType, GraphBuilder, Op, Value
from ..graph.ops import Fn, Pool, Reduce
from .held import HELD

aten = torch.ops.aten


class Unsupported(Exception):
    """A node this lowering cannot express in apir ops; the message names the op."""


@dataclass(frozen=True)
class Known:
    """A tensor the guest holds: a weight, a constant, or folded from those and shapes."""

    tensor: torch.Tensor


# ---------------------------------------------------------------- the interpreter


class Lowering:
    """One FX graph lowered for one binding; ``leaf`` is how a Known tensor reaches apir."""

    def __init__(self, leaf: Callable[[GraphBuilder, torch.Tensor], Value]) -> None:
        self.g = GraphBuilder()
        self._leaf = leaf
        # layout -> (the tensor, kept so its memory is not reused while lowering; its leaf)
        self._leaves: dict[tuple, tuple[torch.Tensor, Value]] = {}
        self.transposed: dict[int, Value] = {}  # node id of a 2-D transpose -> its operand
        self._scalars: dict[float, Value] = {}

    def leaf(self, t: torch.Tensor) -> Value:
        """One leaf per tensor layout: a weight read by several ops (or as ``w`` and as
        ``permute(w).t()``) is one WEIGHT node."""
        key = layout(t)
        if key not in self._leaves:
            self._leaves[key] = (t, self._leaf(self.g, t))
        return self._leaves[key][1]

    def val(self, x) -> Value:
        """An operand as an apir value: Known tensors and Python scalars become leaves."""
        if isinstance(x, Value):
            return x
        if isinstance(x, Known):
            return self.leaf(x.tensor)
        if isinstance(x, (bool, int, float)):  # one leaf per distinct scalar (every norm's eps)
            if float(x) not in self._scalars:
                self._scalars[float(x)] = self.leaf(torch.tensor(float(x), dtype=torch.float32))
            return self._scalars[float(x)]
        raise Unsupported(f"operand {x!r} is not a tensor")

    def run(self, gm: torch.fx.GraphModule, bind: Callable[[int, torch.fx.Node], object]):
        """Interpret ``gm``; ``bind(i, placeholder)`` gives input i's value. Returns what
        the graph returns (Values, Known tensors, Python values, as the graph nests them)."""
        env: dict[torch.fx.Node, object] = {}
        n_in = 0
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = bind(n_in, node)
                n_in += 1
            elif node.op == "get_attr":
                env[node] = _known(_attr(gm, node.target))
            elif node.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = self.call(node.target, args, kwargs)
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], env.__getitem__)
            else:
                raise Unsupported(f"FX node kind {node.op}")
        raise Unsupported("graph without an output")

    def call(self, target, args: tuple, kwargs: dict):
        if is_random(target):  # never folded: a draw made once would be every call's
            raise Unsupported(op_name(target))
        if not _any_value((args, kwargs)):  # fold: every operand is known on the guest
            return _known(target(*_unwrap(args), **_unwrap(kwargs)))
        fn = LOWER.get(target)
        if fn is None:
            raise Unsupported(op_name(target))
        return fn(self, *args, **kwargs)


def layout(t: torch.Tensor) -> tuple:
    """What identifies a tensor's bytes: two views with the same layout are one value."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def is_random(target) -> bool:
    """Whether ``target`` draws from PyTorch's generator (randn, rand, randint, dropout...):
    it must run at each call, in PyTorch, even where no operand depends on an input."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def op_name(target) -> str:
    return str(getattr(target, "__name__", target)) if not isinstance(target, torch._ops.OpOverload) \
        else str(target)


def _attr(gm: torch.nn.Module, path: str):
    for part in path.split("."):
        gm = getattr(gm, part)
    return gm


def _any_value(tree) -> bool:
    if isinstance(tree, Value):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_any_value(x) for x in tree)
    if isinstance(tree, dict):
        return any(_any_value(x) for x in tree.values())
    return False


def _unwrap(tree):
    if isinstance(tree, Known):
        return tree.tensor
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unwrap(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _unwrap(v) for k, v in tree.items()}
    return tree


def _known(tree):
    if isinstance(tree, torch.Tensor):
        return Known(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_known(x) for x in tree)
    return tree


def shape_of(x) -> tuple[int, ...]:
    if isinstance(x, Value):
        return x.shape
    if isinstance(x, Known):
        return tuple(x.tensor.shape)
    return ()


def _meta_shape(op, shape: Sequence[int], *args) -> tuple[int, ...]:
    """The shape ``op`` gives a tensor of ``shape`` (run on a meta tensor: no data)."""
    return tuple(op(torch.empty(tuple(shape), device="meta"), *args).shape)


# ---------------------------------------------------------------- lowerings


def _reshape(c: Lowering, x, shape=None, *rest, op=aten.view.default):
    x = c.val(x)
    if op is aten.view.default and -1 not in shape:  # the common case, without PyTorch
        out = tuple(shape)
    else:
        out = _meta_shape(op, x.shape, *(() if shape is None else (shape,)), *rest)
    return x if out == x.shape else c.g.reshape(x, out)


def _shaped(op):
    return lambda c, x, *args: _reshape(c, x, *args, op=op)


def _permute(c: Lowering, x, dims):
    x = c.val(x)
    axes = tuple(d % len(x.shape) for d in dims)
    if axes == tuple(range(len(axes))):
        return x
    out = c.g.permute(x, axes)
    if axes == (1, 0):
        c.transposed[out.id] = x
    return out


def _transpose(c: Lowering, x, a: int = 0, b: int = 1):
    x = c.val(x)
    if not x.shape:  # PyTorch's transpose and t() of a 0-d tensor: itself
        return x
    a, b = a % len(x.shape), b % len(x.shape)
    return _permute(c, x, [b if i == a else a if i == b else i for i in range(len(x.shape))])


def _transposed(c: Lowering, b) -> Value:
    """b.T for MATMUL's weight operand (it computes x @ w.T): a weight's own leaf where b
    is a transposed weight (ATen writes ``linear`` as ``mm(x, permute(w, [1, 0]))``)."""
    if isinstance(b, Known):
        return c.leaf(b.tensor.t())
    return c.transposed.get(b.id) or c.g.transpose(b, 0, 1)


def _mm(c: Lowering, a, b):
    return c.g.matmul(c.val(a), _transposed(c, b))


def _addmm(c: Lowering, bias, a, b, *, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise Unsupported("aten.addmm with beta or alpha")
    return c.g.add(_mm(c, a, b), c.val(bias))


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _float(c: Lowering, x) -> Value:
    """An operand of an op whose result is a float: an integer or bool one promoted, as
    PyTorch does (``x * mask``, ``x + torch.arange(n)``, ``ids * 0.5``); the apir ops take
    floats only."""
    if isinstance(x, Known) and not x.tensor.is_floating_point():
        return c.leaf(x.tensor.to(torch.float32))
    x = c.val(x)
    return c.g.op(Op.CAST, x) if x.dtype is DType.I32 else x


def _add(c: Lowering, a, b, *, alpha=1):
    if alpha != 1:
        b = _mul(c, b, alpha)
    return c.g.add(_float(c, a), _float(c, b))


def _sub(c: Lowering, a, b, *, alpha=1):
    if alpha != 1:
        b = _mul(c, b, alpha)
    return c.g.op(Op.SUB, _float(c, a), _float(c, b))


def _rsub(c: Lowering, a, b, *, alpha=1):
    return _sub(c, b, a if alpha == 1 else _mul(c, a, alpha))


def _mul(c: Lowering, a, b):
    if _scalar(b):
        return c.g.scale(_float(c, a), b)
    if _scalar(a):
        return c.g.scale(_float(c, b), a)
    return c.g.mul(_float(c, a), _float(c, b))


def _div(c: Lowering, a, b):
    if _scalar(b):
        return c.g.scale(_float(c, a), 1.0 / b)
    return c.g.op(Op.DIV, _float(c, a), _float(c, b))


def _unary(fn: Fn):
    return lambda c, x: c.g.op(Op.UNARY, _float(c, x), attrs=(int(fn),))


POWERS = {
    1.0: lambda c, x: x,
    2.0: lambda c, x: c.g.mul(x, x),
    3.0: lambda c, x: c.g.mul(c.g.mul(x, x), x),
    0.5: lambda c, x: c.g.op(Op.UNARY, x, attrs=(int(Fn.SQRT),)),
    -0.5: lambda c, x: c.g.op(Op.UNARY, x, attrs=(int(Fn.RSQRT),)),
    -1.0: lambda c, x: c.g.op(Op.DIV, c.val(1.0), x),
}


def _pow(c: Lowering, x, e):
    if float(e) not in POWERS:
        raise Unsupported(f"aten.pow with exponent {e}")
    return POWERS[float(e)](c, _float(c, x))


def _to_last(c: Lowering, x: Value, dims: Sequence[int]) -> tuple[Value, tuple[int, ...]]:
    """``x`` with axes ``dims`` moved last, in order; also the permutation used."""
    rank = len(x.shape)
    dims = sorted(d % rank for d in dims)
    order = tuple([a for a in range(rank) if a not in dims] + dims)
    return (x if order == tuple(range(rank)) else c.g.permute(x, order)), order


def _reduce(fn: Reduce):
    def lower(c: Lowering, x, dims=None, keepdim=False, *, dtype=None):
        x = _float(c, x)  # an integer sum with dtype=float
        rank = len(x.shape)
        if rank == 0:  # a 0-d tensor's sum, mean or max (over dim 0 or -1, as PyTorch allows)
            return x
        dims = list(range(rank)) if not dims else [d % rank for d in dims]
        moved, _ = _to_last(c, x, dims)
        kept = moved.shape[: rank - len(dims)]
        flat = moved if len(dims) == 1 else c.g.reshape(moved, (*kept, math.prod(moved.shape[len(kept):])))
        out = c.g.op(Op.REDUCE, flat, attrs=(int(fn),))
        want = tuple(1 if a in dims else n for a, n in enumerate(x.shape)) if keepdim else kept
        return out if out.shape == want else c.g.reshape(out, want)
    return lower


def _softmax(c: Lowering, x, dim: int, *rest, **kwargs):
    x = c.val(x)
    if not x.shape:  # a 0-d tensor (dim 0 or -1): softmax over its one element
        return c.g.reshape(c.g.softmax(c.g.reshape(x, (1,))), ())
    moved, order = _to_last(c, x, [dim])
    out = c.g.softmax(moved)
    back = tuple(order.index(a) for a in range(len(order)))
    return out if moved is x else c.g.permute(out, back)


def _layer_norm(c: Lowering, x, normalized, w=None, b=None, eps=1e-5):
    if len(normalized) != 1:
        raise Unsupported("aten.native_layer_norm over more than the last axis")
    x = c.val(x)
    mean = c.g.op(Op.REDUCE, x, attrs=(int(Reduce.MEAN),))
    xc = c.g.op(Op.SUB, x, mean)
    var = c.g.op(Op.REDUCE, c.g.mul(xc, xc), attrs=(int(Reduce.MEAN),))
    rstd = c.g.op(Op.UNARY, c.g.add(var, c.val(float(eps))), attrs=(int(Fn.RSQRT),))
    out = c.g.mul(xc, rstd)
    if w is not None:
        out = c.g.mul(out, c.val(w))
    if b is not None:
        out = c.g.add(out, c.val(b))
    return out, mean, rstd


def _expand(c: Lowering, x, size, *, implicit=False):
    x = c.val(x)
    out = _meta_shape(aten.expand.default, x.shape, size)
    if len(out) != len(x.shape):
        x = c.g.reshape(x, (1,) * (len(out) - len(x.shape)) + x.shape)
    for axis, (have, want) in enumerate(zip(x.shape, out)):
        if have != want:  # a size-1 axis repeated: doublings then the rest, by CONCAT
            if want > 4096:
                raise Unsupported(f"aten.expand to {want} along one axis")
            parts, piece = [], x
            n = want
            while n:
                if n & 1:
                    parts.append(piece)
                n >>= 1
                if n:
                    piece = c.g.concat(piece, piece, axis)
            x = parts[0]
            for p in parts[1:]:
                x = c.g.concat(x, p, axis)
    return x


def _slice(c: Lowering, x, dim=0, start=None, end=None, step=1):
    x = c.val(x)
    dim %= len(x.shape)
    n = x.shape[dim]
    begin, stop, stride = slice(start, end, step).indices(n)
    if stride != 1:
        raise Unsupported("aten.slice with a step")
    if stop - begin == n:
        return x
    if stop <= begin:
        raise Unsupported("aten.slice to an empty tensor")
    return c.g.view(x, dim, begin, stop - begin)


def _select(c: Lowering, x, dim: int, index: int):
    x = c.val(x)
    dim %= len(x.shape)
    one = c.g.view(x, dim, index % x.shape[dim], 1)
    out = x.shape[:dim] + x.shape[dim + 1 :]
    return c.g.reshape(one, out)


def _cat(c: Lowering, tensors, dim=0):
    parts = [t for t in tensors if math.prod(shape_of(t)) > 0]  # an empty cache is no operand
    out = c.val(parts[0])
    for t in parts[1:]:
        out = c.g.concat(out, c.val(t), dim % len(out.shape))
    return out


def _to_copy(c: Lowering, x, *, dtype=None, **kwargs):
    x = c.val(x)
    if dtype is None:
        return x
    if not dtype.is_floating_point:
        raise Unsupported(f"aten._to_copy to {dtype}")
    return c.g.op(Op.CAST, x) if x.dtype is DType.I32 else x  # floats compute as f32 anyway


def _embedding(c: Lowering, weight, ids, *rest):
    return c.g.get_rows(c.val(weight), c.val(ids))


def _gelu(c: Lowering, x, *, approximate="none"):
    if approximate != "tanh":
        raise Unsupported("aten.gelu without approximate='tanh'")
    return c.g.gelu(c.val(x))


def _conv(c: Lowering, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed or len(stride) != 2:
        raise Unsupported("aten.convolution other than 2-D and not transposed")
    out = c.g.op(Op.CONV2D, c.val(x), c.val(w), attrs=(tuple(stride), tuple(padding), tuple(dilation), groups))
    if bias is None:
        return out
    b = c.val(bias)
    return c.g.add(out, c.g.reshape(b, (b.shape[0], 1, 1)))


def _batch_norm(c: Lowering, x, w, b, mean, var, momentum, eps):
    """Inference batch norm: one scale and one shift per channel, folded on the guest."""
    if not all(isinstance(t, Known) for t in (mean, var)) or \
            not all(t is None or isinstance(t, Known) for t in (w, b)):
        raise Unsupported("aten._native_batch_norm_legit_no_training with computed statistics")
    x = c.val(x)
    scale = torch.rsqrt(var.tensor + eps)  # w and b are None where BatchNorm has affine=False
    scale = scale if w is None else w.tensor * scale
    shift = -mean.tensor * scale if b is None else b.tensor - mean.tensor * scale
    per_channel = (-1,) + (1,) * (len(x.shape) - 2)  # (C, 1, 1) for (N, C, H, W)
    out = c.g.add(c.g.mul(x, c.leaf(scale.reshape(per_channel))), c.leaf(shift.reshape(per_channel)))
    return out, None, None


def _max_pool(c: Lowering, x, kernel, stride=(), padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    if ceil_mode or tuple(dilation) not in ((1, 1), (1,)):
        raise Unsupported("aten.max_pool2d_with_indices with ceil_mode or dilation")
    return _pool(c, Pool.MAX, x, kernel, stride, padding), None  # no indices: inference


def _avg_pool(c: Lowering, x, kernel, stride=(), padding=(0, 0), ceil_mode=False,
              count_include_pad=True, divisor_override=None):
    if ceil_mode or not count_include_pad or divisor_override is not None:
        raise Unsupported("aten.avg_pool2d with ceil_mode, count_include_pad=False or a divisor")
    return _pool(c, Pool.AVG, x, kernel, stride, padding)


def _pool(c: Lowering, fn: Pool, x, kernel, stride, padding):
    pair = lambda v: (tuple(v) * 2)[:2]  # noqa: E731 - PyTorch's one int for both axes
    attrs = (int(fn), pair(kernel), pair(stride or kernel), pair(padding))
    return c.g.op(Op.POOL2D, c.val(x), attrs=attrs)


def _adaptive_avg_pool(c: Lowering, x, size):
    x = c.val(x)
    (h, w), (oh, ow) = x.shape[2:], size
    if h % oh or w % ow:
        raise Unsupported("aten._adaptive_avg_pool2d to a size that does not divide the input")
    return _pool(c, Pool.AVG, x, (h // oh, w // ow), (h // oh, w // ow), (0, 0))


def _same(c: Lowering, x, *args, **kwargs):
    return c.val(x)


LOWER: dict = {
    HELD: _same,  # a HostTensor's value: the STATE leaf its key is bound to (apir.torch.runtime)
    aten.embedding.default: _embedding,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: lambda c, a, b: c.g.op(Op.BMM, c.val(a), c.val(b)),
    aten.view.default: _shaped(aten.view.default),
    aten._unsafe_view.default: _shaped(aten.view.default),
    aten.reshape.default: _shaped(aten.reshape.default),
    aten.unsqueeze.default: _shaped(aten.unsqueeze.default),
    aten.squeeze.dim: _shaped(aten.squeeze.dim),
    aten.squeeze.dims: _shaped(aten.squeeze.dims),
    aten.permute.default: _permute,
    aten.transpose.int: _transpose,
    aten.t.default: _transpose,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.cat.default: _cat,
    aten.clone.default: _same,
    aten.alias.default: _same,
    aten.lift_fresh_copy.default: _same,
    aten._to_copy.default: _to_copy,
    aten.add.Tensor: _add,
    aten.add.Scalar: _add,
    aten.sub.Tensor: _sub,
    aten.sub.Scalar: _sub,
    aten.rsub.Scalar: _rsub,
    aten.mul.Tensor: _mul,
    aten.mul.Scalar: _mul,
    aten.div.Tensor: _div,
    aten.div.Scalar: _div,
    aten.neg.default: lambda c, x: c.g.scale(c.val(x), -1.0),
    aten.pow.Tensor_Scalar: _pow,
    aten.exp.default: _unary(Fn.EXP),
    aten.log.default: _unary(Fn.LOG),
    aten.sqrt.default: _unary(Fn.SQRT),
    aten.rsqrt.default: _unary(Fn.RSQRT),
    aten.sin.default: _unary(Fn.SIN),
    aten.cos.default: _unary(Fn.COS),
    aten.tanh.default: _unary(Fn.TANH),
    aten.sigmoid.default: _unary(Fn.SIGMOID),
    aten.relu.default: _unary(Fn.RELU),
    aten.abs.default: _unary(Fn.ABS),
    aten.silu.default: lambda c, x: c.g.silu(c.val(x)),
    aten.gelu.default: _gelu,
    aten._softmax.default: _softmax,
    aten._safe_softmax.default: _softmax,
    aten.mean.dim: _reduce(Reduce.MEAN),
    aten.mean.default: _reduce(Reduce.MEAN),
    aten.sum.dim_IntList: _reduce(Reduce.SUM),
    aten.sum.default: _reduce(Reduce.SUM),
    aten.amax.default: _reduce(Reduce.MAX),
    aten.native_layer_norm.default: _layer_norm,
    aten.convolution.default: _conv,
    aten._native_batch_norm_legit_no_training.default: _batch_norm,
    aten.max_pool2d_with_indices.default: _max_pool,
    aten.avg_pool2d.default: _avg_pool,
    aten._adaptive_avg_pool2d.default: _adaptive_avg_pool,
    operator.getitem: lambda c, xs, i: xs[i],
    aten.sym_size.int: lambda c, x, d: shape_of(x)[d],
}

# ATen ops PyTorch would decompose that apir runs as one op (core_aten_decompositions
# writes them as several, or as ops without a lowering here)
KEEP = (aten._safe_softmax.default, aten.silu.default)


# Ops that keep their operand's dtype: the only ones an integer (I32) value may pass through;
# every other apir op computes in float (integer arithmetic stays in PyTorch)
KEEPS_DTYPE = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.cat.default, aten.clone.default,
    aten.alias.default, aten.lift_fresh_copy.default, operator.getitem, aten.sym_size.int,
}


def supported(node: torch.fx.Node) -> bool:
    """Whether ``node`` has a lowering (whatever shapes it will see)."""
    if node.op != "call_function":
        return node.op in ("placeholder", "get_attr", "output")
    if node.target not in LOWER:
        return False
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) and val else val
    if isinstance(val, torch.Tensor) and not val.is_floating_point() and node.target not in KEEPS_DTYPE:
        return False
    args, kwargs = node.args, node.kwargs
    if node.target is aten.pow.Tensor_Scalar:
        return float(args[1]) in POWERS
    if node.target is aten.gelu.default:
        return kwargs.get("approximate", "none") == "tanh"
    if node.target is aten.slice.Tensor:
        return (args[4] if len(args) > 4 else kwargs.get("step", 1)) == 1
    if node.target is aten._to_copy.default:
        dtype = kwargs.get("dtype")
        return dtype is None or dtype.is_floating_point
    if node.target is aten.native_layer_norm.default:
        return len(args[1]) == 1
    if node.target is aten.convolution.default:
        return not args[6] and len(args[3]) == 2
    # what the arguments alone rule out is a graph break around the node, not the whole
    # graph falling back to PyTorch when it is lowered (Compiled._lower)
    if node.target is aten.addmm.default:
        return kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1
    if node.target is aten.max_pool2d_with_indices.default:
        return tuple(_arg(node, 4, "dilation", (1, 1))) in ((1, 1), (1,)) and \
            not _arg(node, 5, "ceil_mode", False)
    if node.target is aten.avg_pool2d.default:
        return not _arg(node, 4, "ceil_mode", False) and _arg(node, 5, "count_include_pad", True) \
            and _arg(node, 6, "divisor_override", None) is None
    return True


def _arg(node: torch.fx.Node, i: int, name: str, default):
    """Argument ``i`` (keyword ``name``) of ``node``, or its default."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
