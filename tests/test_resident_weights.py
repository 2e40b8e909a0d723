"""No f32 copy of a weight on the host unless asked for (issue 18): quantized weights are
held as their GGUF blocks plus, on a CPU, a compact form (int8 values and f32 scales, or
torch's int4 weights for Q4 types), 16-bit ones as views of the buffer they were uploaded
to. The dequantized cache exists only as ExecutorConfig.dequant_cache."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hosts import start_host
from tiny_models import TinyConfig, write_tiny_gguf

pytest.importorskip("torch")
import torch  # noqa: E402

import apir  # noqa: E402
from apir.backends.base import BufferPurpose, ExecutorConfig  # noqa: E402
from apir.backends.local import LocalBackend  # noqa: E402
from apir.backends.local.kernels import KERNELS, Blocks  # noqa: E402
from apir.backends.local.program import STORED_OPERANDS, FusedMatmul  # noqa: E402
from apir.engine import SamplingParams  # noqa: E402
from apir.graph import OPS, DType, GraphBuilder, Op, T  # noqa: E402

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
CACHED = ExecutorConfig(dequant_cache=True, cpu_int4=False)  # every weight's f32 copy beside it
BLOCKS = ExecutorConfig(dequant_cache=False, cpu_int4=False)  # blocks, and int8 forms on a CPU
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def int8_forms(path) -> int:
    """The bytes of the int8 forms a CPU session makes for the quantized weights of ``path``
    (Q8_0's: its scales alone, the quants are read from the blocks)."""
    from apir.backends.local import int8cpu

    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        dtype, shape = DType(int(t.tensor_type)), tuple(int(d) for d in reversed(t.shape))
        if int8cpu.usable(dtype, shape):
            total += int8cpu.nbytes(dtype, shape)
    return total


def weight_bytes(backend: LocalBackend) -> int:
    """What the executor holds for weights: their buffers and any derived forms it charged."""
    bufs = sum(b.size for b in backend._buffers.values() if b.purpose is BufferPurpose.WEIGHTS)
    return bufs + sum(backend.ledger.forms.values())


@pytest.fixture(scope="module", params=[("Q4_0", False), ("Q8_0", True)], ids=["q4_0", "q8_0-tied"])
def quantized(request, tmp_path_factory):
    qtype, tied = request.param
    cfg = TinyConfig(n_layer=2, n_embd=128, n_ff=256, head_dim=32, tied=tied)
    return write_tiny_gguf(tmp_path_factory.mktemp("resident") / f"{qtype}.gguf", cfg, qtype)


def test_a_quantized_gguf_is_resident_once_and_computes_as_the_cache_does(quantized):
    want = tensor_bytes(quantized) + int8_forms(quantized)
    with apir.load(str(quantized), backend=LocalBackend("cpu", config=BLOCKS)) as model, \
            apir.load(str(quantized), backend=LocalBackend("cpu", config=CACHED)) as cached:
        logits = model.logits(IDS)
        tokens = list(model.generate_ids(IDS, GREEDY))
        assert want <= weight_bytes(model.backend) <= 1.03 * want
        # its forms are int8 ones (the last field of a form's key), no dequantized copy
        assert {key[0][-1] for key in model.backend.ledger.forms} == {"int8"}
        # the opt-in cache holds (and is charged) the f32 copies beside the blocks
        assert weight_bytes(cached.backend) > 3 * tensor_bytes(quantized) and cached.backend._weights
        np.testing.assert_allclose(logits, cached.logits(IDS), rtol=1e-4, atol=1e-4)
        assert tokens == list(cached.generate_ids(IDS, GREEDY))


def test_the_host_reports_the_weights_once_and_remote_equals_local(quantized, tmp_path, monkeypatch):
    monkeypatch.setenv("APIR_DEQUANT_CACHE", "0")  # the host resolves them once, at its start
    monkeypatch.setenv("APIR_CPU_INT4", "0")
    host = start_host(tmp_path)
    try:
        with apir.load(str(quantized), backend=LocalBackend("cpu", config=BLOCKS)) as local, \
                apir.load(str(quantized), backend="remote", remote=host.unix) as remote:
            assert remote.logits(IDS).tobytes() == local.logits(IDS).tobytes()
            assert list(remote.generate_ids(IDS, GREEDY)) == list(local.generate_ids(IDS, GREEDY))
            other = local.backend.memory()[0] - weight_bytes(local.backend)  # KV, compute
            want = local.backend.memory()[0]  # buffers and forms
            sessions = host.until(lambda st: st.sessions and st.sessions[0].allocated == want,
                                  "the session's bytes published").sessions
            assert sessions[0].allocated - other <= 1.03 * (tensor_bytes(quantized) + int8_forms(quantized))
    finally:
        host.stop()


def test_a_cpu_host_holds_q4_weights_as_int4_by_default_and_reports_them(quantized, tmp_path):
    """The CPU default (cpu_int4): a Q4_0 matrix is held as its blocks plus torch's int4 form
    (0.625 bytes a weight), charged as a form; the host's published bytes include it from
    the first step on, and remote computes what local computes."""
    from apir.backends.base import DEFAULT_EXECUTOR
    from apir.backends.local import int4cpu

    assert DEFAULT_EXECUTOR.cpu_int4
    host = start_host(tmp_path)
    try:
        with apir.load(str(quantized), backend="local", device="cpu") as local, \
                apir.load(str(quantized), backend="remote", remote=host.unix) as remote:
            assert remote.logits(IDS).tobytes() == local.logits(IDS).tobytes()
            forms = local.backend.ledger.forms
            if "Q4_0" in quantized.name:
                int4 = [t for t in gguf.GGUFReader(str(quantized)).tensors
                        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0
                        and int4cpu.usable(DType.Q4_0, tuple(int(d) for d in reversed(t.shape)))]
                # the form's kind is the last field of its key; the rest (261 rows, not a
                # multiple of 16: the vocabulary's tables) are int8 forms
                kinds = [key[0][-1] for key in forms]
                assert int4 and kinds.count("int4") == len(int4)
                assert sum(n for key, n in forms.items() if key[0][-1] == "int4") == sum(
                    int4cpu.nbytes(tuple(int(d) for d in reversed(t.shape))) for t in int4)
            want = local.backend.memory()[0]  # buffers and forms
            assert want > local.backend.allocated_bytes()
            host.until(lambda st: st.sessions and st.sessions[0].allocated == want,
                       "the session's bytes, forms included, published after its steps")
    finally:
        host.stop()


def test_every_op_that_takes_a_quantized_weight_takes_it_as_blocks():
    """The op table's quantized operands are exactly those whose kernels read Blocks."""
    takers = {op for op, spec in OPS.items() if spec.quantized and op is not Op.WEIGHT}
    assert takers == {op for op, _ in STORED_OPERANDS}
    w = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
    blocks = Blocks(torch.from_numpy(raw.reshape(-1).copy()), int(DType.Q5_0), (6, 64))
    ids = torch.tensor([[5, 0], [5, 2]], dtype=torch.int32)
    np.testing.assert_array_equal(KERNELS[Op.GET_ROWS](blocks, ids).numpy(), dense[ids.numpy()])
    x = torch.ones((2, 64))
    np.testing.assert_allclose(KERNELS[Op.MATMUL](x, blocks).numpy(), np.ones((2, 64)) @ dense.T,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adjacent", [True, False])
def test_fused_16_bit_weights_are_one_view_when_adjacent_else_each_in_place(adjacent):
    rng = np.random.default_rng(2)
    ws = [rng.standard_normal((n, 32)).astype(np.float16) for n in (4, 2, 2)]
    with LocalBackend("cpu", config=BLOCKS) as b:
        buf = b.alloc_buffer(4096, BufferPurpose.WEIGHTS)
        offsets = [0, 256, 384] if adjacent else [0, 512, 1024]
        for w, off in zip(ws, offsets):
            b.set_tensor(buf, off, w)
        g = GraphBuilder()
        x = g.input("x", (T, 32))
        leaves = [g.weight(buf, off, w.shape, DType.F16) for w, off in zip(ws, offsets)]
        gid = b.register_graph(g.build(*(g.matmul(x, w) for w in leaves)))
        xs = rng.standard_normal((3, 32)).astype(np.float32)
        for got, w in zip(b.compute(gid, {"x": xs}), ws):
            np.testing.assert_allclose(got, xs @ w.astype(np.float32).T, rtol=1e-5, atol=1e-5)
        prog = b._graphs[gid].program
        fused = b._fused_weight(next(s for s in prog.steps if isinstance(s, FusedMatmul)))
        storage = b._buffers[buf].storage
        if adjacent:
            assert fused.shape == (8, 32) and fused.data_ptr() == storage.data_ptr()
        else:
            assert [p.data_ptr() - storage.data_ptr() for p in fused] == offsets
        assert b._weights == {} and b.ledger.forms == {}


def test_packed_weights_read_and_write_as_their_gguf_bytes():
    """On a GPU a quantized weight is packed in place at its first use (qpack); what the
    guest reads or partly rewrites is still its GGUF bytes. The bookkeeping is torch only,
    so it runs here with packing switched on for the CPU."""
    from types import SimpleNamespace

    from apir.backends.base import BackendError
    from apir.backends.local import qpack

    be = LocalBackend("cpu", config=BLOCKS)
    be._packs = True
    raw = np.random.default_rng(0).integers(0, 256, 4 * 64 // 32 * 18, dtype=np.uint8)
    raw.reshape(-1, 18)[:, 1] = 0  # finite f16 scales
    h = be.alloc_buffer(1024, BufferPurpose.WEIGHTS)
    be.set_tensor(h, 32, raw)
    node = SimpleNamespace(attrs=(h, 32), dtype=DType.Q4_0, shape=(4, 64))
    storage = be._buffers[h].storage

    def packed(b: np.ndarray) -> bytes:
        return qpack.pack(torch.from_numpy(b), 2, 4, 64).numpy().tobytes()

    be._packed_blocks(node)
    assert storage[32 : 32 + raw.size].numpy().tobytes() == packed(raw)  # in place
    assert be.get_tensor(h, 32, raw.size) == raw.tobytes()
    assert be.get_tensor(h, 40, 10) == raw[8:18].tobytes()
    # a write into part of it brings the GGUF bytes back first; the next use packs again
    be.set_tensor(h, 37, np.array([0, 1], np.uint8))
    want = raw.copy()
    want[5:7] = [0, 1]
    assert storage[32 : 32 + raw.size].numpy().tobytes() == want.tobytes()
    assert be.get_tensor(h, 32, raw.size) == want.tobytes()
    be._packed_blocks(node)
    assert storage[32 : 32 + raw.size].numpy().tobytes() == packed(want)
    # the same bytes as another shape would read packed bytes as blocks: refused
    with pytest.raises(BackendError, match="already in use as another quantized weight"):
        be._packed_blocks(SimpleNamespace(attrs=(h, 32), dtype=DType.Q4_0, shape=(2, 128)))
    # a write of the whole span simply replaces it
    be.set_tensor(h, 32, raw)
    assert be.get_tensor(h, 32, raw.size) == raw.tobytes() and not be._packed[id(be._buffers[h])]
    be.close()
