"""``--max-memory`` against guests that try to make the worker hold more than it charges
(issue 22, case 1): one raw-guest test per way around the accounting, each asserting the
QUOTA error that now stops it before the memory is held.

The daemon runs with a 64 MiB per-session limit; each bypass would otherwise have held
several times that.
"""

from __future__ import annotations

import numpy as np
import pytest
from hosts import start_host
from rawguest import RawGuest
from test_hostile import expect, graph, leaf, step, x_input

from apir.graph import DType, Node, Op, T
from apir.protocol import messages as m

E = m.ErrorCode
MAX_MEMORY = 64 << 20


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    # with the f32 dequantized cache (APIR_DEQUANT_CACHE=1, read at the daemon's start):
    # the form that multiplies a weight's bytes the most
    with pytest.MonkeyPatch.context() as env:
        env.setenv("APIR_DEQUANT_CACHE", "1")
        h = start_host(tmp_path_factory.mktemp("quota"), "--max-memory", "64M", "--max-message", "16M")
    yield h
    h.stop()


@pytest.fixture(autouse=True)
def released(host):
    yield
    assert host.proc.poll() is None, "the daemon died"
    assert host.wait_idle().sessions == ()


def test_fused_products_of_one_weight_are_charged(host):
    """MATMULs sharing an activation are fused. A CPU host's dequantized cache (an
    opt-in) concatenates their weights' f32 forms: one 2 MiB F16 weight listed 20 times
    would be an uncharged 80 MiB copy. An F32 weight is never copied: read in place."""
    with RawGuest(host.unix) as g:
        g.ok(m.AllocBuffer(1, 4 << 20, 0))
        x = x_input((T, 1024))
        w = leaf(Op.WEIGHT, (1, 0), (1024, 1024), DType.F16)
        mm = Node(Op.MATMUL, (0, 1), (), (T, 1024), DType.F32)
        expect(g.error(m.RegisterGraph(2, graph(x, w, *[mm] * 20))), E.QUOTA,
               "would exceed this session's memory limit", f"of {MAX_MEMORY} bytes")
        g.ok(m.RegisterGraph(3, graph(x, w, *[mm] * 4)))  # 16 MiB of copies fit
        out = g.ok(step(3, np.ones((2, 1024), np.float32)))
        assert out.data.size == 2 * 1024 * 4
        f32 = leaf(Op.WEIGHT, (1, 0), (1024, 1024))
        g.ok(m.RegisterGraph(4, graph(x, f32, *[mm] * 20)))  # in place: nothing to charge
        assert g.ok(step(4, np.ones((2, 1024), np.float32))).data.size == 2 * 1024 * 4


def test_reshapes_of_transposed_values_are_charged(host):
    """Reshaping a transposed value copies it; 100 of them live until the compute ends."""
    nodes = [x_input((1024, 1024))]
    for _ in range(100):
        nodes.append(Node(Op.TRANSPOSE, (len(nodes) - 1,), (0, 1), (1024, 1024), DType.F32))
        nodes.append(Node(Op.RESHAPE, (len(nodes) - 1,), ((1024, 1024),), (1024, 1024), DType.F32))
    with RawGuest(host.unix) as g:
        g.ok(m.RegisterGraph(1, graph(*nodes, outputs=(1,))))
        x = np.ones((1024, 1024), np.float32)
        expect(g.error(step(1, x, n_tokens=0)), E.QUOTA, "computing graph 1",
               "would exceed this session's memory limit")
        g.ok(m.RegisterGraph(2, graph(*nodes[:11], outputs=(1,))))  # 5 copies fit
        assert g.ok(step(2, x, n_tokens=0)).data.size == x.nbytes


def test_graph_labels_and_names_are_charged_by_size(host):
    """Labels and input names of up to 64 KiB each: 240 a graph is ~15 MB held, not 120 KB."""
    def labelled(i: int) -> m.RegisterGraph:
        big = "n" * 60_000
        nodes = [Node(Op.INPUT, (), (f"{i}{big}",), (1,), DType.F32, big)]
        nodes += [Node(Op.SCALE, (k,), (1.0,), (1,), DType.F32, big) for k in range(239)]
        return m.RegisterGraph(i, graph(*nodes))

    with RawGuest(host.unix) as g:
        g.ok(labelled(1))
        replies = [g.call(labelled(i)) for i in range(2, 6)]  # 5 x 14.4 MB > 64 MiB
        errors = [r for r in replies if isinstance(r, m.Error)]
        assert errors, "five graphs of 240 60-KB labels were all registered"
        expect(errors[0], E.QUOTA, "registering a graph of 240 nodes", "would exceed")


def test_outputs_are_charged_per_listing(host):
    """One 2 MiB output listed 40 times is an 80 MiB reply: refused before it is built."""
    x = x_input((T, 1024))
    y = Node(Op.ADD, (0, 0), (), (T, 1024), DType.F32)
    with RawGuest(host.unix) as g:
        g.ok(m.RegisterGraph(1, graph(x, y, outputs=(1,) * 40)))
        expect(g.error(step(1, np.ones((512, 1024), np.float32))), E.QUOTA, "computing graph 1 with T=512",
               "would exceed this session's memory limit")
        reply = g.ok(step(1, np.ones((64, 1024), np.float32)))  # 10 MiB of reply fits
        out = np.frombuffer(reply.data.inline, np.float32).reshape(40, 64, 1024)
        assert (out == 2).all()


def test_output_listings_are_charged_as_metadata(host):
    """Each listing costs the host a layout slot and a place in each cached placement
    (one per T computed): 60000 listings of one node would hold ~240 MB, not 512 B."""
    with RawGuest(host.unix) as g:
        expect(g.error(m.RegisterGraph(1, graph(x_input((T, 1)), outputs=(0,) * 60000))), E.QUOTA,
               "registering a graph of 1 nodes", "would exceed")
        g.ok(m.RegisterGraph(2, graph(x_input((T, 1)), outputs=(0,) * 1000)))


def test_buffers_are_charged_their_own_overhead(host):
    """65536 one-byte buffers hold ~40 MiB of tensors and bookkeeping, not 64 KiB."""
    with RawGuest(host.unix) as g:
        for h in range(1, 65537):
            g.post(m.AllocBuffer(h, 1, 0))
        expect(g.error(m.Synchronize()), E.QUOTA, "an earlier AllocBuffer failed: allocating 1 bytes "
               "would exceed this session's memory limit")


def test_a_copy_that_needs_room_of_its_own_is_charged(host):
    """An overlapping CopyTensor inside one buffer takes a temporary copy of its bytes:
    with 48 MiB of buffers held, one of 20 MiB would pass the 64 MiB limit. A copy between
    two buffers takes none and goes through (the error names the second copy)."""
    with RawGuest(host.unix) as g:
        g.post(m.AllocBuffer(1, 24 << 20, 0))
        g.post(m.AllocBuffer(2, 24 << 20, 0))
        g.post(m.CopyTensor(1, 0, 2, 0, 16 << 20))  # failing, it would name 16777216 bytes
        g.post(m.CopyTensor(1, 0, 1, 1 << 20, 20 << 20))
        expect(g.error(m.Synchronize()), E.QUOTA, "an earlier CopyTensor failed: copying 20971520 bytes "
               "would exceed this session's memory limit")
