"""A compute holds only the values still to be read: each executor drops a value after its
last reader (``graph.releases``), and the quota's estimate of a compute (``Scratch``) is
the peak of what is live, not the sum over every node."""

from __future__ import annotations

import dataclasses
import tracemalloc
import weakref

import numpy as np
import pytest

from apir.backends import Limits, QuotaError
from apir.backends.accounting import Scratch
from apir.graph import GraphBuilder, Op, T, last_reads, releases

ROW = 1024  # f32 elements a token: 4 KiB


def chain(n: int):
    """x -> n ADDs, each of the previous value and x: x is read to the end, and each
    intermediate once, by the next ADD."""
    g = GraphBuilder()
    x = g.input("x", (T, ROW))
    y = x
    for _ in range(n):
        y = g.add(y, x)
    return g.build(y)


def test_releases_name_each_value_at_its_last_reader():
    g = GraphBuilder()
    x = g.input("x", (T, 4))
    a = g.silu(x)
    b = g.add(a, x)
    unread = g.gelu(b)
    out = g.mul(b, b)
    graph = g.build(out)
    assert last_reads(graph) == (b.id, b.id, out.id, unread.id, len(graph.nodes))
    # after b: x and a; after the unread gelu: itself; after out: b; the output never
    assert releases(graph) == ((), (), (x.id, a.id), (unread.id,), (b.id,))


def test_the_estimate_is_the_peak_of_live_values_not_their_sum():
    graph = chain(20)
    # at any node: x, the value it reads and the one it makes (a chain of 21 values)
    assert Scratch.of(graph).peaks == ({1: 3 * 4 * ROW},)
    # a view (TRANSPOSE) keeps what it views alive until the view's last reader
    g = GraphBuilder()
    x = g.input("x", (T, ROW))
    y = g.silu(x)
    v = g.transpose(y, 0, 1)
    z = g.gelu(x)  # y is still live here: v is read below
    w = g.contiguous(v)
    # x, y and z at the GELU, y, z and w at the CONTIGUOUS (were y dropped after the
    # TRANSPOSE, its last reader, two values at most)
    assert Scratch.of(g.build(z, w)).peaks == ({1: 3 * 4 * ROW},)


def test_a_long_chain_fits_a_quota_that_its_sum_of_values_would_not():
    from apir.backends.numpy_ref import NumpyBackend

    t = 64
    sum_of_values = 21 * t * ROW * 4
    be = NumpyBackend(limits=Limits(max_memory=sum_of_values // 2))
    gid = be.register_graph(chain(20))
    x = np.ones((t, ROW), np.float32)
    assert float(be.compute(gid, {"x": x})[0][0, 0]) == 21.0
    # 64 times the tokens would not fit even as a peak: the estimate still refuses it
    with pytest.raises(QuotaError, match=f"computing graph {gid} with T={64 * t}"):
        be.compute(gid, {"x": np.ones((64 * t, ROW), np.float32)})


def test_the_numpy_reference_frees_intermediates_as_it_goes():
    from apir.backends.numpy_ref import NumpyBackend

    be = NumpyBackend()
    gid = be.register_graph(chain(40))
    x = np.ones((256, ROW), np.float32)  # 1 MiB a value: 41 MiB if all were kept
    tracemalloc.start()
    try:
        out = be.compute(gid, {"x": x})[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert float(out[0, 0]) == 41.0
    assert peak < 8 << 20, f"the walk peaked at {peak} bytes"


def test_the_torch_executor_drops_each_value_after_its_last_reader():
    pytest.importorskip("torch")
    from apir.backends.local import LocalBackend

    be = LocalBackend(device="cpu")
    graph = chain(6)
    gid = be.register_graph(graph)
    prog = be._graphs[gid].program
    made: list[weakref.ref] = []  # each ADD's value, as it is made
    live_at_last: list[int] = []

    def watched(kernel, last: bool):
        def run(*args, **kw):
            if last:  # the ADDs before the previous one have been dropped by now
                live_at_last.append(sum(r() is not None for r in made))
            out = kernel(*args, **kw)
            made.append(weakref.ref(out))
            return out
        return run

    adds = [i for i, n in enumerate(graph.nodes) if n.op is Op.ADD]
    for i in adds:
        prog.steps[i] = dataclasses.replace(prog.steps[i], kernel=watched(prog.steps[i].kernel, i == adds[-1]))
    out = be.compute(gid, {"x": np.ones((3, ROW), np.float32)})[0]
    assert float(out[0, 0]) == 7.0
    assert live_at_last == [1]  # of the five ADDs before it, only the one it reads
    be.close()
