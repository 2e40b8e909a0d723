"""Probe: what running constrained or penalized requests unpipelined costs (README, "The
HTTP API"). Decodes 64 greedy tokens of SmolLM2 per case, locally and through a host over
shm, best of three:

    PYTHONPATH=. OMP_NUM_THREADS=1 python tests/pipeline_probe.py
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hosts import start_host  # noqa: E402

from apir.engine import SamplingParams, load  # noqa: E402


def rate(m, params, constraint=None, n=3):
    ids = m.tokenize("Once upon a time, in a land far away, there lived a dragon who")
    best = 0
    for _ in range(n):
        c = constraint() if constraint else None
        t = time.perf_counter()
        k = sum(1 for _ in m.generate_tokens(ids, params, c))
        best = max(best, k / (time.perf_counter() - t))
    return best, k

N = 64
cases = {
    "plain (pipelined)": (SamplingParams(temperature=0, max_tokens=N), None),
    "logit_bias (penalized graph, pipelined)": (SamplingParams(temperature=0, max_tokens=N, logit_bias=((42, -1.0),)), None),
    "repeat_penalty (unpipelined)": (SamplingParams(temperature=0, max_tokens=N, repeat_penalty=1.0001), None),
    "regex mask (unpipelined + llguidance)": (SamplingParams(temperature=0, max_tokens=N), "regex"),
}
host = start_host(Path(tempfile.mkdtemp()))
try:
    for name, opts in (("local", dict(backend="local", device="cpu")), ("remote-unix", dict(backend="remote", remote=host.unix))):
        m = load("smollm2-135m", n_ctx=512, **opts)
        m.warm_up()
        for case, (p, c) in cases.items():
            mk = (lambda model=m: model.constraint("regex", r"[^#]*")) if c else None
            r, k = rate(m, p, mk)
            print(f"{name:12s} {case:42s} {r:6.1f} tok/s ({k} tokens)", flush=True)
        m.close()
finally:
    host.stop()
