"""Where does remote prefill lose time to native? Runs pp512 natively, over unix and over
tcp with ./timeline/sitecustomize.py logging clock readings (no synchronize added) in the
bench and in the host's session workers, then prints, per backend, the median of each
interval of a prefill step (µs), the guest's and the host's events merged by time.
    python3 bench/probes/timeline.py [SHAPE [REPS]]     (default llama-1b 8)
    python3 bench/probes/timeline.py --read DIR          (only read /tmp/apir-timeline-*.txt in DIR)"""

import glob
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(shape: str, reps: int) -> None:
    for f in glob.glob("/tmp/apir-timeline-*.txt"):
        os.remove(f)
    env = dict(os.environ, APIR_PROBE="timeline",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "timeline"), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "apir.cli", "bench", "--synthetic", shape, "-p", "512", "-n", "0",
                          "-r", str(reps), "--device", os.environ.get("PROBE_DEVICE", "cuda"), "--no-history",
                          "--backends", "native,remote-shm,remote-tcp"],
                         env=env, capture_output=True, text=True)
    print("\n".join(line for line in out.stdout.splitlines() if "pp512" in line) or out.stderr[-2000:])


def read(folder: str) -> None:
    rows = []
    for f in glob.glob(os.path.join(folder, "apir-timeline-*.txt")):
        for line in open(f):
            side, event, t, *detail = line.split()
            rows.append((int(t), side, event, detail[0] if detail else ""))
    rows.sort()
    # one measure = the guest's rows from measure-start to measure-end, with every host row between
    steps, cur = [], None
    for t, side, event, detail in rows:
        if side == "guest" and event == "measure-start":
            cur = {"backend": detail, "events": []}
        if cur is not None:
            cur["events"].append((t, side, event, detail))
        if side == "guest" and event == "measure-end" and cur is not None:
            steps.append(cur)
            cur = None
    by_backend: dict[str, list[dict]] = {}
    for s in steps:
        by_backend.setdefault(s["backend"], []).append(s)
    for backend, ss in by_backend.items():
        intervals: dict[str, list[float]] = {}
        for s in ss[1:]:  # the first is the warm-up
            ev = s["events"]
            for (t0, side0, e0, _), (t1, side1, e1, _) in zip(ev, ev[1:]):
                intervals.setdefault(f"{side0[0]}:{e0} -> {side1[0]}:{e1}", []).append((t1 - t0) / 1e3)
            intervals.setdefault("TOTAL", []).append((ev[-1][0] - ev[0][0]) / 1e3)
            for _, side, e, d in ev:
                if e == "gpu":
                    intervals.setdefault(f"{side[0]}:gpu (CUDA events)", []).append(float(d))
        print(f"{backend} ({len(ss) - 1} steps), median µs:")
        for k, v in intervals.items():
            print(f"  {k:40s} {statistics.median(v):9.0f}   [{min(v):.0f} .. {max(v):.0f}]")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--read"]:
        read(sys.argv[2])
    else:
        run(sys.argv[1] if len(sys.argv) > 1 else "llama-1b", int(sys.argv[2]) if len(sys.argv) > 2 else 8)
        out = os.environ.get("OUT")
        if out:
            for f in glob.glob("/tmp/apir-timeline-*.txt"):
                shutil.copy(f, out)
        read("/tmp")
