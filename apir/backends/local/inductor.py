"""Compiling a step with Inductor, without Dynamo, and keeping the result on disk.

The executor's walk over a program (``LocalBackend._execute``) is plain Python over torch
ops with no data-dependent control flow on the paths it compiles, so ``make_fx`` traces it
on fake tensors into an FX graph of ATen ops, and Inductor compiles that graph. Dynamo
would trace the same walk by interpreting its bytecode: seconds for a 30-layer model, in
every session again, since nothing it does outlives the process.

What survives the session is the compiled program itself (``standalone_compile``'s
artifact: the generated wrapper and its kernels' binaries), saved in a ``StepStore`` under
a digest of everything the trace depends on: the program's description (the registered
graph, the step's kind, the executor's settings, the device, torch, Triton and apir's own
source; given by the executor), plus, per argument of the call, a tensor's shape, strides,
dtype, device and 16-byte alignment, or a plain value, and the arguments' structure
(including each weight's block type and shape). A later session of the same model neither
traces nor compiles: it loads the artifact. Only the host writes the store (a directory
private to its user): a guest sends graphs, never code, and a graph of its own is compiled
by the host like any other.

While a walk is traced, ``tracing()`` is True: kernels that would pick a library call
for eager work (fused attention) take the form Inductor fuses instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.utils._pytree as pytree

log = logging.getLogger("apir.local")
_tracing = False
STORE_MAX_BYTES = 4 << 30  # a tiny test model's step is ~0.4 MB; a real model's, more kernels
PLAIN = (int, float, bool, str, type(None))  # argument values a step's digest and check compare
# what compiled steps did in this process: "compiled" (traced and compiled), "loaded" (from
# the store), "saved" (into it); the host's counters, and the tests'
STATS: Counter[str] = Counter()


def _forget_compile_threads() -> None:
    """In a forked child: drop the parent's Inductor compile-thread pool. Its threads are
    not in the child, so a compile would wait forever on futures they never run (torch
    resets its process pool at fork, not this one)."""
    compile_async = sys.modules.get("torch._inductor.async_compile")
    if compile_async is not None:
        compile_async.AsyncCompile.pool.cache_clear()


os.register_at_fork(after_in_child=_forget_compile_threads)


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


class StepStore:
    """Compiled steps on disk, one file per digest (see the module's doc), at most
    ``max_bytes`` of them: past that, the steps least recently saved or loaded go first."""

    def __init__(self, directory: str | Path, max_bytes: int = STORE_MAX_BYTES) -> None:
        self.dir, self.max_bytes = Path(directory), max_bytes
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.dir / f"{digest}.step"

    def load(self, digest: str) -> Callable | None:
        """The artifact saved under ``digest``, or None (none, or unreadable: compiled again)."""
        path = self.path(digest)
        if not path.is_file():
            return None
        from torch._inductor import CompiledArtifact

        try:
            artifact = CompiledArtifact.load(path=str(path), format="binary")
        except Exception:  # noqa: BLE001 - a torn or stale file costs a compile, not the step
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used: the last to be trimmed
        return artifact

    def save(self, digest: str, artifact) -> None:
        """Atomically: a concurrent session either finds the whole file or none. Then the
        oldest other steps go while the store holds more than ``max_bytes``."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".part")
        os.close(fd)
        try:
            artifact.save(path=tmp, format="binary")
            os.replace(tmp, self.path(digest))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._trim(keep=self.path(digest))

    def _trim(self, keep: Path) -> None:
        steps = []
        for p in self.dir.glob("*.step"):
            with contextlib.suppress(FileNotFoundError):  # another session may trim too
                st = p.stat()
                steps.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in steps)
        for _, size, p in sorted(steps):
            if total <= self.max_bytes:
                break
            if p != keep:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                total -= size


class Compiled:
    """``run`` compiled on its first call: the tensors among its arguments (nested in
    dicts, lists, tuples and registered pytree nodes) become the compiled program's inputs,
    everything else is fixed at that call. A later call must bind the same structure and
    non-tensor values (one ``Compiled`` per program, step length and sampling kind).

    With a ``store``, ``description`` must name everything about ``run`` that its arguments
    do not show (see the module's doc): the program is then loaded from the store when a
    session compiled it before, and saved there when compiled. ``announce`` is called
    before a real compile only."""

    def __init__(self, run: Callable[..., list[torch.Tensor]], store: StepStore | None = None,
                 description: str = "", announce: Callable[[], None] = lambda: None) -> None:
        self.run, self.store, self.description, self.announce = run, store, description, announce
        self._program: Callable | None = None
        self._spec: pytree.TreeSpec | None = None
        self._fixed: list = []

    def __call__(self, *args) -> list[torch.Tensor]:
        leaves, spec = pytree.tree_flatten(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if self._program is None:
            self._program = self._load_or_compile(leaves, spec, tensors)
            self._spec, self._fixed = spec, [x for x in leaves if not isinstance(x, torch.Tensor)]
        elif spec != self._spec or not all(map(_same, (x for x in leaves if not isinstance(x, torch.Tensor)),
                                                self._fixed)):
            raise ValueError("a compiled step was called with other arguments than it was compiled for")
        return list(self._program(*tensors))

    def _load_or_compile(self, leaves: list, spec: pytree.TreeSpec, tensors: list[torch.Tensor]) -> Callable:
        digest = self._digest(leaves, spec) if self.store is not None else None
        if digest is not None:
            program = self.store.load(digest)
            if program is not None:
                STATS["loaded"] += 1
                return program
        self.announce()
        program = self._compile(leaves, spec, tensors)
        STATS["compiled"] += 1
        if digest is not None:
            try:
                self.store.save(digest, program)
                STATS["saved"] += 1
            except OSError as e:  # a full disk costs later sessions a compile, not this step
                log.warning("could not keep a compiled step in %s: %s", self.store.dir, e)
        return program

    def _digest(self, leaves: list, spec: pytree.TreeSpec) -> str:
        h = hashlib.sha256(self.description.encode())
        h.update(repr(spec).encode())  # the structure, with each Blocks' type and shape
        for x in leaves:
            if isinstance(x, torch.Tensor):
                h.update(repr((tuple(x.shape), x.stride(), x.dtype, x.device.type, x.storage_offset(),
                               x.data_ptr() % 16)).encode())
            elif type(x) in PLAIN:
                h.update(repr(x).encode())
            else:  # an object fixed in the trace: its content is in the description
                h.update(type(x).__qualname__.encode())
        return h.hexdigest()

    def _compile(self, leaves: list, spec: pytree.TreeSpec, tensors: list[torch.Tensor]) -> Callable:
        from torch.fx.experimental.proxy_tensor import make_fx

        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def flat(*ts: torch.Tensor) -> list[torch.Tensor]:
            full = list(leaves)
            for i, t in zip(where, ts):
                full[i] = t
            return self.run(*pytree.tree_unflatten(full, spec))

        with _traced():
            graph = make_fx(flat, tracing_mode="fake")(*tensors)
        # static shapes, from the real inputs (Inductor's caches key on them)
        return torch._inductor.standalone_compile(graph, tensors, dynamic_shapes="from_example_inputs")


def _same(a: object, b: object) -> bool:
    """A fixed argument unchanged: the same object, or an equal plain value."""
    return a is b or (type(a) in PLAIN and type(a) is type(b) and a == b)
