"""Coverage-guided fuzz target (atheris/libFuzzer) for everything a guest controls.

Each input is a stream of frames, fed exactly as the host reads them: header decode,
body decode, then ``Session.dispatch`` on a real host executor (PyTorch on the CPU, with
per-session limits). A finding is any exception other than the protocol's own refusals,
and any refusal the host would report as its own INTERNAL error.

    pip install atheris
    python fuzz/fuzz_protocol.py --seed-corpus fuzz/corpus           # write the seeds once
    python fuzz/fuzz_protocol.py fuzz/corpus -max_total_time=3600 -rss_limit_mb=4096 \
        -max_len=65536 -timeout=20 -jobs=2 -workers=2                # a one-hour campaign

libFuzzer writes crashing inputs as ``crash-*`` in the working directory; replay one with
``python fuzz/fuzz_protocol.py crash-<hash>``. The CI counterpart (bounded, hypothesis)
is tests/test_fuzz.py; figures from campaigns are in SECURITY.md.
"""

from __future__ import annotations

import os
import sys

import atheris
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

with atheris.instrument_imports(include=["apir"]):
    from apir.backends.base import Limits
    from apir.backends.local import LocalBackend
    from apir.graph import DType, GraphBuilder, Op, T
    from apir.graph.ops import Fn, Reduce
    from apir.host.session import InFlight, Session, SessionConfig, error_for
    from apir.protocol import ProtocolError
    from apir.protocol import messages as m
    from apir.protocol.step import StepLayout
from held import uncharged  # noqa: E402 - from tests/, put on the path above

LIMITS = Limits(max_memory=16 << 20, max_handles=128, max_graph_nodes=512)
MAX_FRAMES = 32


class Finding(Exception):
    """The host would have reported an internal error for this input."""


def serve(data: bytes) -> None:
    """What ``Session.serve`` does with a byte stream, minus the socket."""
    backend = LocalBackend("cpu", limits=LIMITS)
    session = Session(None, backend, None, SessionConfig("cpu", LIMITS, 0, 1, "fuzz"))
    pos = 0
    try:
        for _ in range(MAX_FRAMES):
            if len(data) - pos < m.HEADER.size:
                return
            try:
                header = m.decode_header(data[pos : pos + m.HEADER.size], 1 << 20)
                body = data[pos + m.HEADER.size : pos + m.HEADER.size + header.length]
                if len(body) < header.length:
                    return  # the host would wait for the rest
                msg = m.parse_step(body) if header.opcode == m.STEP_OPCODE else m.decode_body(header.opcode, body)
            except ProtocolError:
                return  # the host answers PROTOCOL and ends the session
            pos += m.HEADER.size + header.length
            if isinstance(msg, m.Goodbye):
                return
            try:
                reply = session.dispatch(msg)
                if isinstance(reply, InFlight):  # a Step, run to completion
                    reply.finish()
            except Exception as e:  # noqa: BLE001 - exactly what Session.serve does
                err = error_for(e)
                if err.code == m.ErrorCode.INTERNAL:
                    raise Finding(f"{type(msg).__name__}: {type(e).__name__}: {e}") from e
            why = uncharged(backend)  # what the executor holds is charged, and within the limit
            if why is not None:
                raise Finding(f"after {type(msg).__name__}: {why}")
    finally:
        backend.close()


def test_one_input(data: bytes) -> None:
    serve(data)


def seeds() -> list[bytes]:
    """Well-formed sessions for the fuzzer to start from."""
    g = GraphBuilder()
    x = g.input("x", (T, 32))
    w = g.weight(1, 0, (8, 32), DType.F32)
    ids = g.input("ids", (T,), DType.I32)
    x = g.add(x, g.get_rows(w, ids))  # (T, 32)
    h = g.rms_norm(g.matmul(x, w), 1e-5)  # (T, 8)
    kv = g.set_rows(g.state(2, 0, (16, 8), DType.F32), h, ids)
    out = g.sample(g.softmax(h), g.input("params", (5,)))
    graph = g.build(out, kv)

    n, payload = StepLayout.of(graph).pack_inputs({
        "x": np.ones((2, 32), np.float32), "ids": np.array([1, 3], np.int32),
        "params": np.array([0.8, 4, 0.9, 0.05, 0.5], np.float32)})
    session = [
        m.AllocBuffer(1, 4096, 0), m.SetTensor(1, 0, m.Blob(bytes(range(256)) * 4, -1, 1024)),
        m.AllocBuffer(2, 512, 1), m.RegisterGraph(3, graph),
        m.Step(3, n, -1, 0, m.Blob(payload, -1, len(payload))),
        m.GetTensor(2, 0, 64, -1), m.CopyTensor(1, 0, 2, 32, 32), m.FreeGraph(3), m.FreeBuffer(1),
    ]
    full = b"".join(m.encode(msg, i, m.WANT_REPLY) for i, msg in enumerate(session))
    # graph metadata and outputs lists: long labels and names, one output listed many
    # times, MATMULs sharing an activation (fused), one weight listed in several of them
    g = GraphBuilder()
    x = g.input("é" * 300, (T, 32))  # its label is its name
    w = g.weight(1, 0, (8, 32), DType.F32, label="w" * 1000)
    y = g.add(g.matmul(x, w), g.matmul(x, w))
    listed = g.build(*[y] * 40)
    n, payload = StepLayout.of(listed).pack_inputs({"é" * 300: np.ones((4, 32), np.float32)})
    metadata = [session[0], session[1], m.RegisterGraph(4, listed),
                m.Step(4, n, -1, 0, m.Blob(payload, -1, len(payload)))]
    # the general ops apir.torch lowers PyTorch programs to
    g = GraphBuilder()
    a, ids = g.input("a", (2, T, 8)), g.input("ids", (4,), DType.I32)
    b = g.op(Op.UNARY, g.weight(1, 0, (2, 8, 4), DType.F32), attrs=(int(Fn.TANH),))
    p = g.op(Op.DIV, g.op(Op.SUB, g.op(Op.BMM, a, b), g.op(Op.CAST, ids)), g.input("d", (4,)))
    general = g.build(g.op(Op.REDUCE, p, attrs=(int(Reduce.MEAN),)))
    n, payload = StepLayout.of(general).pack_inputs({
        "a": np.ones((2, 3, 8), np.float32), "ids": np.array([1, 2, 3, 4], np.int32),
        "d": np.array([1, 0, -1, 2], np.float32)})
    torchish = [session[0], session[1], m.RegisterGraph(5, general),
                m.Step(5, n, -1, 0, m.Blob(payload, -1, len(payload)))]
    return [full, b"".join(m.encode(msg, 1) for msg in session[:3]), m.encode(m.GetDevices(), 1, 1),
            b"".join(m.encode(msg, i, m.WANT_REPLY) for i, msg in enumerate(metadata)),
            b"".join(m.encode(msg, i, m.WANT_REPLY) for i, msg in enumerate(torchish))]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--seed-corpus":
        os.makedirs(sys.argv[2], exist_ok=True)
        for i, seed in enumerate(seeds()):
            with open(os.path.join(sys.argv[2], f"seed-{i}"), "wb") as f:
                f.write(seed)
        return
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
