"""``apir bench transport``: what the transport itself costs, per transport, side by side.

Measures, against a real daemon (started here, or ``--remote`` ones): the null-call round
trip (a Synchronize: frame out, dispatch, frame back), a one-token compute round trip (a
tiny graph, the shape of a decode step's traffic), and bulk upload bandwidth (set_tensor
of a large buffer, then a synchronize so the host has really consumed it).
"""

from __future__ import annotations

import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ApirError
from ..graph import DType, GraphBuilder, T


@dataclass(frozen=True)
class TransportResult:
    transport: str
    null_p50_us: float
    null_p99_us: float
    step_p50_us: float
    step_p99_us: float
    upload_gbps: float


def _percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(url: str, token_file: str | None, calls: int, upload_mb: int) -> TransportResult:
    from ..backends import BufferPurpose
    from ..backends.remote import RemoteBackend

    b = RemoteBackend(url, token_file=token_file)
    try:
        for _ in range(50):  # warm up
            b.synchronize()
        null = []
        for _ in range(calls):
            t = time.perf_counter()
            b.synchronize()
            null.append(time.perf_counter() - t)
        # a decode step's traffic: one token id in, one token id out
        g = GraphBuilder()
        gid = b.register_graph(g.build(g.argmax(g.input("h", (T, 8), DType.F32))))
        inputs = {"h": np.ones((1, 8), np.float32)}
        for _ in range(50):
            b.compute(gid, inputs)
        step = []
        for _ in range(calls):
            t = time.perf_counter()
            b.compute(gid, inputs)
            step.append(time.perf_counter() - t)
        data = np.random.default_rng(0).integers(0, 255, upload_mb << 20, dtype=np.uint8)
        buf = b.alloc_buffer(data.nbytes, BufferPurpose.WEIGHTS)
        b.set_tensor(buf, 0, data)  # first pass touches the host's fresh pages
        b.synchronize()
        t = time.perf_counter()
        b.set_tensor(buf, 0, data)
        b.synchronize()
        upload = data.nbytes / (time.perf_counter() - t) / 1e9
    finally:
        b.close()
    scheme = url.split("://")[0]
    return TransportResult(
        f"{scheme}" + ("-shm" if scheme == "unix" else ""),
        statistics.median(null) * 1e6, _percentile(null, 0.99) * 1e6,
        statistics.median(step) * 1e6, _percentile(step, 0.99) * 1e6, upload,
    )


def run(remotes: list[str] | None, token_file: str | None, calls: int = 2000,
        upload_mb: int = 256, device: str | None = "cpu") -> list[TransportResult]:
    """Start a daemon on unix + tcp (unless ``remotes`` are given) and measure each."""
    if remotes:
        return [measure(u, token_file, calls, upload_mb) for u in remotes]
    from ..backends.remote import host_status
    from ..transport import HostUnreachable

    tmp = Path(tempfile.mkdtemp(prefix="apir-bench-"))
    token = tmp / "token"
    token.write_text(secrets.token_hex(16))
    os.chmod(token, 0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    urls = [f"unix://{tmp}/apir.sock", f"tcp://127.0.0.1:{port}"]
    cmd = [sys.executable, "-m", "apir.cli", "host", "--token-file", str(token)]
    for u in urls:
        cmd += ["--listen", u]
    if device:
        cmd += ["--device", device]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                host_status(urls[0])
                break
            except HostUnreachable:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ApirError("the benchmark's host daemon did not start") from None
                time.sleep(0.1)
        return [measure(u, str(token), calls, upload_mb) for u in urls]
    finally:
        proc.terminate()
        proc.wait(10)


def markdown(results: list[TransportResult]) -> str:
    rows = ["| transport | null call p50 (µs) | p99 (µs) | 1-token step p50 (µs) | p99 (µs) | upload (GB/s) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        rows.append(f"| {r.transport} | {r.null_p50_us:.1f} | {r.null_p99_us:.1f} | {r.step_p50_us:.1f} | "
                    f"{r.step_p99_us:.1f} | {r.upload_gbps:.2f} |")
    return "\n".join(rows)
