"""``torch.compile(model, backend="apir")``: any PyTorch program as an apir client.

Importing this module registers the backend "apir" with Dynamo. Each graph Dynamo captures
is decomposed by AOTAutograd to core ATen (inference only), lowered to apir graph ops
(``apir.torch.lower``), registered once with an apir backend, and run as one step per call:
parameters and buffers are uploaded once as weights, only inputs and outputs cross.
Nodes without a lowering run in PyTorch on the guest, split out of the graph with a
warning naming the op once.

    import torch, apir.torch
    model = torch.compile(model, backend="apir", options={"backend": "remote",
                                                          "remote": "unix:///run/apir.sock"})
    with torch.no_grad():
        y = model(x)

``options``: ``backend`` (an apir ``Backend``, or ``local`` / ``numpy`` / ``remote``, the
default ``local``), and for a name ``device``, ``remote``, ``token`` and ``arena_size`` (bytes
of shared memory for a step's inputs and outputs; a batch whose step moves more than the
default 256 MiB needs more) as ``apir.backends.create_backend`` takes them; ``keep_outputs``
(default False): float outputs of 1 MiB or more stay on the host as ``HostTensor``s,
read back only when the guest reads them and fed to the next call without crossing (a
transformers KV cache; ``apir.torch.held``). Backends made
from names are shared by every graph compiled with the same options (``keep_outputs``
aside: it is the graph's), so weights are uploaded once per process.

This module is the guest's torch frontend: it imports torch (CPU torch is enough), unlike
the rest of the guest side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

from ..backends import Backend, create_backend
from .held import HostTensor
from .lower import KEEP
from .runtime import Session, compile_graph

__all__ = ["HostTensor", "backend", "session_for"]

OPTIONS = ("backend", "device", "remote", "token", "arena_size", "keep_outputs")
_sessions: dict[object, Session] = {}

DECOMPOSITIONS = {op: fn for op, fn in core_aten_decompositions().items() if op not in KEEP}


def session_for(options: Mapping[str, object] | None = None) -> Session:
    """The session (apir backend and its uploaded weights) that ``options`` name."""
    options = dict(options or {})
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown apir options {sorted(unknown)}: use {', '.join(OPTIONS)}")
    be = options.get("backend", "local")
    keep = options.pop("keep_outputs", False)  # a graph's (compile_graph), not the session's
    if not isinstance(keep, bool):
        raise ValueError(f"keep_outputs must be True or False, got {keep!r}")
    key = id(be) if isinstance(be, Backend) else tuple(sorted(options.items()))
    if key not in _sessions:
        if not isinstance(be, Backend):
            arena = options.get("arena_size")
            be = create_backend(str(be), device=options.get("device"), remote=options.get("remote"),
                                token=str(options.get("token") or ""),
                                arena_size=None if arena is None else int(arena))
        _sessions[key] = Session(be)
    return _sessions[key]


def _is_static(node: torch.fx.Node, value: object) -> bool:
    """A parameter, or a module buffer (Dynamo's source for the placeholder says which)."""
    if isinstance(value, torch.nn.Parameter):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", "")
    return isinstance(value, torch.Tensor) and "._buffers[" in (name() if callable(name) else str(name))


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[object],
            options: Mapping[str, object] | None = None):
    """The Dynamo backend "apir" (see the module docstring for ``options``)."""
    session = session_for(options)
    keep = bool((options or {}).get("keep_outputs", False))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("apir.torch runs inference only: call the compiled model under "
                           "torch.no_grad() or torch.inference_mode()")
    for node, value in zip(placeholders, example_inputs):
        if _is_static(node, value):
            session.mark_static(value)
    return aot_autograd(fw_compiler=lambda g, _: compile_graph(session, g, keep_outputs=keep),
                        decompositions=DECOMPOSITIONS)(gm, example_inputs)


if "apir" not in _COMPILER_FNS:
    register_backend(backend, name="apir")
