"""What the bytes of a step cost: one compute that takes a large input and returns a few
bytes, one that takes nothing and returns a large output, and one that does both, timed on
the local backend (in process) and on a remote host (a daemon this script starts, Unix
socket and shared arena), so the difference is what crossing costs. The median of
--repeat calls after two warm-ups that have touched the arena's pages.

    python3 bench/probes/step_bytes.py [--device cuda] [--mb 16,192] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from apir.backends import BufferPurpose, create_backend
from apir.graph import DType, GraphBuilder
from apir.spawn import start_host

WIDTH = 1024  # floats a row


def graphs(b, rows: int) -> dict[str, tuple[int, dict]]:
    """name -> (graph id, its inputs): in (big input, argmax per row out), out (a resident
    weight scaled, out), both (big input scaled, out)."""
    w = b.alloc_buffer(rows * WIDTH * 4, BufferPurpose.WEIGHTS)
    b.set_tensor(w, 0, np.ones((rows, WIDTH), np.float32))
    x = np.full((rows, WIDTH), 0.5, np.float32)
    made = {}
    g = GraphBuilder()
    made["in"] = (b.register_graph(g.build(g.argmax(g.input("x", (rows, WIDTH))))), {"x": x})
    g = GraphBuilder()
    made["out"] = (b.register_graph(g.build(g.scale(g.weight(w, 0, (rows, WIDTH), DType.F32), 2.0))), {})
    g = GraphBuilder()
    made["both"] = (b.register_graph(g.build(g.scale(g.input("x", (rows, WIDTH)), 2.0))), {"x": x})
    return made


def median_ms(b, gid: int, feed: dict, repeat: int) -> float:
    for _ in range(2):
        b.compute(gid, feed)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        b.compute(gid, feed)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mb", default="16,192", help="megabytes of the large tensor, comma-separated")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    sizes = [int(s) for s in args.mb.split(",")]
    arena = max(2 * max(sizes) << 20, 256 << 20) + (64 << 20)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        unix = f"unix://{Path(tmp) / 'apir.sock'}"
        host = start_host([unix], Path(tmp) / "host.log", device=args.device,
                          options=["--max-arena", str(arena)])
        backends = {"local": create_backend("local", device=args.device),
                    "remote": create_backend("remote", remote=unix, arena_size=arena)}
        try:
            for mb in sizes:
                n = (mb << 20) // (4 * WIDTH)
                for name, b in backends.items():
                    for case, (gid, feed) in graphs(b, n).items():
                        rows[(mb, case, name)] = median_ms(b, gid, feed, args.repeat)
        finally:
            for b in backends.values():
                b.close()
            host.stop()
    print(f"| MiB | case | local ms | remote ms | remote - local ms | GB/s of crossing ({args.device}) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for mb in sizes:
        for case in ("in", "out", "both"):
            lo, re = rows[(mb, case, "local")], rows[(mb, case, "remote")]
            crossed = (2 if case == "both" else 1) * (mb << 20)
            rate = crossed / ((re - lo) * 1e6) if re > lo else float("inf")
            print(f"| {mb} | {case} | {lo:.2f} | {re:.2f} | {re - lo:.2f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
