"""What a host executor really holds, against what its ledger charges: the fuzzers'
memory property (tests/test_fuzz.py, fuzz/fuzz_protocol.py)."""

from __future__ import annotations

import sys

from apir.backends.accounting import graph_nbytes
from apir.backends.executor import Executor


def uncharged(backend: Executor) -> str | None:
    """None when every byte the executor holds is charged and the charges are within its
    limit; else what is not."""
    ledger = backend.ledger
    storages = {_storage(b.storage) for b in backend._buffers.values()}
    for key, (_, form) in backend._weights.items():
        # a tensor form may view a buffer; a compact one (int4cpu.Int4, int8cpu.Int8) says
        # what it holds beyond the buffers
        in_buffers = hasattr(form, "untyped_storage") and _storage(form) in storages
        held = 0 if in_buffers else form.nbytes
        if held > ledger.forms.get(key, 0):
            return f"a cached weight form of {held} bytes is charged {ledger.forms.get(key, 0)}"
    for gid, reg in backend._graphs.items():
        strings = sum(sys.getsizeof(s) for n in reg.graph.nodes
                      for s in (n.label, *[a for a in n.attrs if isinstance(a, str)]))
        if strings > graph_nbytes(reg.graph):
            return f"graph {gid}'s strings take {strings} bytes, charged {graph_nbytes(reg.graph)}"
    used, limit = ledger.buffers + ledger.extra, backend.limits.max_memory
    if limit and used > limit:
        return f"{used} bytes charged, over the limit of {limit}"
    return None


def _storage(t) -> int:
    """The address of the memory a torch tensor views."""
    return t.untyped_storage().data_ptr()
