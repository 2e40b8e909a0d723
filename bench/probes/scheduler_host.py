"""The host's own cost of a many-stream decode step: the scheduler, Batch.submit and the
callbacks, with a backend whose submit computes nothing (every step samples token 5).
Issue 20: is a GPU's 64-stream step bound by this, or by the device? Prints ms a step.

    OMP_NUM_THREADS=1 python bench/probes/scheduler_host.py [STREAMS] [-m MODEL]

The model (default smollm2-135m) gives only the shapes; steps are planned as on a GPU
host (padded lengths, chained decode steps), but nothing is recorded or compiled.
"""

import sys
import time

import numpy as np

from apir.backends.base import Pending
from apir.backends.local import LocalBackend
from apir.bench.runner import Source
from apir.bench.serve import run_round
from apir.engine import Model
from apir.engine.scheduler import Scheduler

args = sys.argv[1:]
spec = args.pop(args.index("-m") + 1) if "-m" in args else "smollm2-135m"
streams = int(args[0]) if args else 64
backend = LocalBackend("cpu")
model = Model(Source(spec).open(), backend, n_ctx=300)
model._pad = True  # plan steps as a GPU host does, so decode steps chain
model.tokenizer = None  # no end-of-generation token: every stream makes all its tokens
steps: list[int] = []


def submit(gid, inputs, feed=None):
    steps.append(len(inputs["pos"]))
    return Pending([np.full(len(inputs["last"]), 5, np.int32)])


backend.submit = submit
scheduler = Scheduler(model, streams, max_queue=0)
rng = np.random.default_rng(0)
run_round(scheduler, rng.integers(0, 1000, (streams, 128)).tolist(), 128, "warm-up")
steps.clear()
t0 = time.perf_counter()
run_round(scheduler, rng.integers(0, 1000, (streams, 128)).tolist(), 128, "host")  # new prompts: no prefix reuse
seconds = time.perf_counter() - t0
scheduler.close()
print(f"{streams} streams, 128 prompt + 128 generated tokens each: {len(steps)} steps, "
      f"{seconds * 1e3 / len(steps):.3f} ms a step on the host")
