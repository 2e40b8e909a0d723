"""``apir bench profile``: where a native step's time goes, from the PyTorch profiler.

Runs a few warm decode steps (and optionally one prefill chunk, and decode steps of several
streams at once as the continuous-batching scheduler runs them) on the local executor and
prints, per step: wall time, GPU busy time (the sum of kernel durations), the number of
kernels, and the kernels that took the most time. Launch-bound steps show up as many
short kernels and a GPU busy time well under the wall time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from ..backends.base import ExecutorConfig
from ..engine import Model

TOP = 30  # kernels listed per step, the longest first


@dataclass(frozen=True)
class Profile:
    what: str
    steps: int
    wall_us: float  # per step
    gpu_us: float  # per step: sum of kernel durations
    kernels: float  # per step
    top: tuple[tuple[str, float, float], ...]  # (kernel, µs per step, launches per step)


def _kernels(prof) -> list:
    events = []
    for e in prof.events():
        kind = getattr(e, "device_type", None)
        if kind is not None and str(kind).endswith("CUDA") and getattr(e, "device_time", 0):
            events.append(e)
    return events


def profile(model: Model, what: str, steps: int, run) -> Profile:
    """Profile ``run()`` (``steps`` steps of work) after one unprofiled warm-up call."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run()
    model.backend.synchronize()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        model.backend.synchronize()
        wall = time.perf_counter() - t0
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in _kernels(prof):
        per_name[e.name][0] += e.device_time
        per_name[e.name][1] += 1
    total = sum(v[0] for v in per_name.values())
    count = sum(v[1] for v in per_name.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    return Profile(
        what, steps, 1e6 * wall / steps, total / steps, count / steps,
        tuple((name[:90], t / steps, n / steps) for name, (t, n) in top),
    )


def render(p: Profile) -> str:
    if not p.kernels:  # a CPU run: the profiler records no device kernels
        return f"## {p.what}: {p.wall_us:,.1f} µs/step wall (no GPU kernels to list)\n"
    lines = [
        f"## {p.what}: {p.wall_us:,.1f} µs/step wall, {p.gpu_us:,.1f} µs/step in kernels "
        f"({100 * p.gpu_us / p.wall_us:.0f}% busy), {p.kernels:,.1f} kernels/step",
        "",
        "| kernel | µs/step | launches/step |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| `{name}` | {us:,.1f} | {n:,.1f} |" for name, us, n in p.top]
    return "\n".join(lines) + "\n"


def batched_decode(model: Model, streams: int, n_gen: int):
    """``n_gen`` decode steps of ``streams`` sequences in one batch (engine.batch, the
    scheduler's steps), each after a 4-token prompt; every call runs the same positions.
    Only the step lengths measured are recorded or compiled (not ``Batch.warm_up``'s every
    length, which for 64 slots took 5 minutes on an H200)."""
    from ..engine.batch import Batch, Chunk
    from ..graph.sampling import GREEDY

    batch = Batch(model, streams)
    first = batch.step([Chunk(s, [1, 2, 3, 4], 0, GREEDY) for s in range(streams)])

    def run() -> None:
        tokens = first
        for i in range(n_gen):
            tokens = batch.step([Chunk(s, [tokens[s]], 4 + i, GREEDY) for s in range(streams)])
    return run


def run(spec: str, device: str | None, n_gen: int, n_prompt: int, executor: ExecutorConfig,
        streams: int = 0) -> str:
    """Profile decode (and a prefill of ``n_prompt`` tokens, and decode of ``streams``
    sequences at once) of a synthetic model natively."""
    from ..backends.local import LocalBackend
    from .synthetic import SyntheticFile

    f = SyntheticFile.from_spec(spec)
    out = []
    with Model(f, LocalBackend(device, config=executor), n_ctx=max(n_prompt, 8) + n_gen + 8) as model:
        token = model.prefill([1, 2, 3, 4])
        out.append(render(profile(model, f"{spec} decode", n_gen,
                                  lambda: model.decode_steps(token, 4, n_gen))))
        if n_prompt:
            ids = list(range(n_prompt))
            out.append(render(profile(model, f"{spec} prefill of {n_prompt}", 1,
                                      lambda: model.prefill(ids))))
        if streams:
            out.append(render(profile(model, f"{spec} decode of {streams} streams at once", n_gen,
                                      batched_decode(model, streams, n_gen))))
    return "\n".join(out)
