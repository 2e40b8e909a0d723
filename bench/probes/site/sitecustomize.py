"""Probe, not product. With this directory on PYTHONPATH and APIR_PROBE=1, every apir
process (the bench, the host daemon and its session workers) appends to
/tmp/apir-probe-<pid>.txt, per replayed CUDA graph of 64+ tokens (which it synchronizes
at once, so the process blocks instead of polling):
    <guest|host> <n_tokens> gpu <µs, CUDA events> stage <µs> launch <µs> sync <µs>
and per Step a host session answered:
    session start <µs to queue it> wait <µs until its reply began> reply <µs to send it>
Used by bench/probes/prefill_gap.sh to see where remote prefill loses time to native."""

import os
import sys
import time

_out = None


def _log(line: str) -> None:
    global _out
    if _out is None:
        _out = open(f"/tmp/apir-probe-{os.getpid()}.txt", "a", buffering=1)
    _out.write(line + "\n")


def _patch() -> None:
    import torch

    from apir.backends.local import capture
    from apir.host import session

    role = "host" if any("host" == a for a in sys.argv) else "guest"
    call = capture.CapturedStep.__call__

    def timed_call(self, inputs):
        n = next((a.shape[0] for a in inputs.values() if a.ndim), 0)
        if n < 64:
            return call(self, inputs)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        self._stage(inputs)
        t1 = time.perf_counter()
        a.record()
        self.graph.replay()
        b.record()
        t2 = time.perf_counter()
        b.synchronize()
        _log(f"{role} {n} gpu {a.elapsed_time(b) * 1000:.0f} stage {(t1 - t0) * 1e6:.0f} "
             f"launch {(t2 - t1) * 1e6:.0f} sync {(time.perf_counter() - t2) * 1e6:.0f}")
        return self.outputs

    capture.CapturedStep.__call__ = timed_call

    start, reply = session.Session._start_step, session.Session._reply

    def timed_start(self, rid, *fields):
        t0 = time.perf_counter()
        r = start(self, rid, *fields)
        self._probe_t = (t0, time.perf_counter())
        return r

    def timed_reply(self, step):
        t2 = time.perf_counter()
        ok = reply(self, step)
        t0, t1 = getattr(self, "_probe_t", (t2, t2))
        if step.rid:
            _log(f"session start {(t1 - t0) * 1e6:.0f} wait {(t2 - t1) * 1e6:.0f} "
                 f"reply {(time.perf_counter() - t2) * 1e6:.0f}")
        return ok

    session.Session._start_step, session.Session._reply = timed_start, timed_reply


if os.environ.get("APIR_PROBE") == "1":
    try:
        _patch()
    except ImportError:  # not an apir process with torch
        pass
