"""Compiling a step with Inductor, without Dynamo.

The executor's walk over a program (``LocalBackend._execute``) is plain Python over torch
ops with no data-dependent control flow on the paths it compiles, so ``make_fx`` traces it
on fake tensors into an FX graph of ATen ops, and Inductor compiles that graph. Dynamo
would trace the same walk by interpreting its bytecode: seconds for a 30-layer model, in
every session again, since nothing it does outlives the process. The FX graph is instead
the key of Inductor's on-disk cache (its ops, shapes, dtypes and strides; the weights and
caches are inputs, so their values are not part of it): a later session of the same
model traces in a tenth of a second and loads the program compiled before.

While a walk is traced, ``tracing()`` is True: kernels that would pick a library call
for eager work (fused attention) take the form Inductor fuses instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.utils._pytree as pytree

_tracing = False


def tracing() -> bool:
    """Whether the executor's walk is being traced for Inductor (see the module's doc)."""
    return _tracing


@contextlib.contextmanager
def _traced() -> Iterator[None]:
    global _tracing
    _tracing = True
    try:
        yield
    finally:
        _tracing = False


class Compiled:
    """``run`` compiled on its first call: the tensors among its arguments (nested in
    dicts, lists, tuples and registered pytree nodes) become the compiled program's inputs,
    everything else is fixed at that call. A later call must bind the same structure and
    non-tensor values (one ``Compiled`` per program, step length and sampling kind)."""

    def __init__(self, run: Callable[..., list[torch.Tensor]]) -> None:
        self.run = run
        self._program: Callable | None = None
        self._spec: pytree.TreeSpec | None = None
        self._fixed: list = []

    def __call__(self, *args) -> list[torch.Tensor]:
        leaves, spec = pytree.tree_flatten(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if self._program is None:
            self._compile(leaves, spec, tensors)
        elif spec != self._spec or not all(map(_same, (x for x in leaves if not isinstance(x, torch.Tensor)),
                                                self._fixed)):
            raise ValueError("a compiled step was called with other arguments than it was compiled for")
        return list(self._program(*tensors))

    def _compile(self, leaves: list, spec: pytree.TreeSpec, tensors: list[torch.Tensor]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def flat(*ts: torch.Tensor) -> list[torch.Tensor]:
            full = list(leaves)
            for i, t in zip(where, ts):
                full[i] = t
            return self.run(*pytree.tree_unflatten(full, spec))

        with _traced():
            graph = make_fx(flat, tracing_mode="fake")(*tensors)
        # Inductor's FX graph cache keys on guards, which need a shape environment: fake
        # inputs of static shapes from a mode that has one (real ones would bypass the cache)
        mode = FakeTensorMode(shape_env=ShapeEnv())
        self._program = torch._inductor.compile(graph, [mode.from_tensor(t, static_shapes=True) for t in tensors])
        self._spec, self._fixed = spec, [x for x in leaves if not isinstance(x, torch.Tensor)]


def _same(a: object, b: object) -> bool:
    """A fixed argument unchanged: the same object, or an equal plain value."""
    return a is b or (type(a) in (int, float, bool, str, type(None)) and type(a) is type(b) and a == b)
